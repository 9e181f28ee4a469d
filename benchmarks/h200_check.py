"""The single-GPU acceptance check (issue 42 item 9; ../shared/notes/gpu-path-audit-3.md section 5): one H200, one call.

    python3 benchmarks/h200_check.py --out OUTDIR [--parts p0,p1,p2,p3,p4] [--deadline p2=300 ...]

Each part runs under its own deadline (signal.alarm) in a try/except, and writes OUTDIR/<part>.json as soon as it
ends (status ok / FAILED / timeout, its measurements, the error's traceback tail); OUTDIR/summary.json comes last
and the process ends with os._exit (the first GPU run hung at interpreter exit after a NCCL world of one). The
core parts (p0-p3) are sized to finish in about 6 minutes on an H200; p4 runs only while --budget-s allows.
A failed part is rerun alone with --parts (the JSON files of the other parts stay).

p0  the environment and memory.py's constants: versions (torch, CUDA, cuDNN, driver, sm), the SDPA flags, free
    device memory before CUDA init (nvidia-smi), after the CUDA context plus one cuBLAS GEMM (memory.CUDA_CONTEXT),
    after a NCCL world of one and its first all_reduce (a lower bound for one communicator:
    memory.NCCL_PER_COMMUNICATOR), the host RAM (psutil, the cgroup limit), and 8 GiB of pinned host memory:
    allocated, copied to and from the GPU, freed (the per-step cost of torch_memory_saver's pinned backup, M2).
p1  SDPA at the trainer's head layouts (q/kv heads 8/1 at TP4 and 32/4 at TP1, head dim 128, bf16) at L = 4096
    and 18432, through the project's SDPADotProductAttention with [s, b, h, d] inputs: whether the flash kernel
    takes the call, which kernels ran (torch.profiler), which forced backends accept it (flash / cuDNN /
    memory-efficient), forward and backward seconds, the peak over the inputs; and at L = 2048 the output and
    dq / dk / dv against an fp32 math reference (an explicit causal softmax on the same bf16 inputs), and at 4096
    against megatron's unfused DotProductAttention.
p2  the learner on the 2-layer Qwen3-30B-A3B shape, built as run_context builds it (gpu_memory_timeline.
    build_learner: the real torch_memory_saver regions, init_optimizer_state, TP1, bf16 params + fp32 masters,
    Muon through the torch fallback, W4A16 experts on the reference backend, full recompute, sdpa): the device
    bytes allocated in each region against memory.py's terms, the per-phase peaks at 18,432 tokens (old-logprob,
    train, publish) against memory_timeline, the logits transient (the no-grad forward's peak from the output
    layer on) against memory.py's logits term, the quant cache's bytes and the allocator's slack after train, two
    release / restore cycles (device bytes freed, host RSS taken, seconds, params / fp32 masters / optimizer state
    bitwise, the grad buffer zeroed, one more train step: finite loss and grad norm), the memory saver's singleton
    called again, and, in a child process (a tms exit(1) must not end this one), a region tensor freed outside
    its region followed by torch.cuda.empty_cache().
p3  FP8 block W8A8 without TransformerEngine: the spec's codes (quantize_fp8_block 128x128, quantize_fp8_activation
    1x128) through torch's blockwise _scaled_mm on the 30B GEMM shapes (M 4096), against the exact fp32 product of
    the dequantized operands and the reference backend's bf16 GEMM; which scale layouts cuBLAS takes.
p4  the tiny RL loop for two steps under torchrun --nproc_per_node 1 (NCCL world of one, dispatch, publish,
    optimizer, checkpoint on CUDA), and whether it exits cleanly; its last row's canary/* gap and time/canary_s
    (the refit canary's cost per step on this machine).

Plain-Python dependencies only: torch, megatron-core, transformers, compressed-tensors, torch_memory_saver, psutil
and this package (no SGLang, TransformerEngine, vLLM or pytest). docs/gpu-runs.md says how to carry them.

Without CUDA it exits 2; QARL_GPU_CHECK_ALLOW_CPU=1 runs every part on the CPU with tiny shapes (fp32, the no-op
saver, gloo) to check the script itself: its numbers mean nothing (tests/test_h200_check.py runs it).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
GIB = 1024 ** 3
MIB = 1024 ** 2
PARTS = ("p0", "p1", "p2", "p3", "p4")
# seconds per part on the GPU, and in the CPU mode (tiny shapes, but a shared CI box: p4 alone took 24-99 s there)
DEADLINES = {"p0": 45, "p1": 75, "p2": 210, "p3": 45, "p4": 150}  # p0-p3: 375 s, inside the 400 s budget
CPU_DEADLINES = {"p0": 120, "p1": 120, "p2": 300, "p3": 120, "p4": 400}


class PartTimeout(Exception):
    """A part ran past its deadline (signal.alarm)."""


def log(msg: str) -> None:
    print(f"[h200_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def run_part(name: str, fn, out_dir: Path, deadline: int) -> dict:
    """fn() under `deadline` seconds; its result (or its failure) written to out_dir/<name>.json at once."""
    def on_alarm(signum, frame):
        raise PartTimeout(f"{name} ran past its {deadline} s deadline")

    log(f"{name}: start (deadline {deadline} s)")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(deadline)
    t0 = time.perf_counter()
    result: dict = {}
    try:
        result = {"status": "ok", **(fn() or {})}
    except PartTimeout as err:
        result = {"status": "timeout", "error": str(err), "traceback_tail": traceback.format_exc()[-3000:]}
    except Exception as err:  # noqa: BLE001 - a check script: record the failure, the next part still runs
        result = {"status": "FAILED", "error": f"{type(err).__name__}: {err}"[:2000],
                  "traceback_tail": traceback.format_exc()[-3000:]}
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    result = {"part": name, **result, "wall_s": round(time.perf_counter() - t0, 2)}
    write_json(out_dir / f"{name}.json", result)
    log(f"{name}: {result['status']} in {result['wall_s']} s"
        + (f" -- {result.get('error', '')[:300]}" if result["status"] != "ok" else ""))
    return result


def guarded(out: dict, key: str, fn):
    """out[key] = fn(), or the error in one line: one failed measurement does not lose the part's others."""
    try:
        out[key] = fn()
    except PartTimeout:
        raise
    except Exception as err:  # noqa: BLE001
        out[key] = {"error": f"{type(err).__name__}: {err}"[:1000]}
    return out[key]


# ------------------------------------------------------------------------------------------------ the world

_WORLD: dict = {}


def ensure_world(cuda: bool) -> dict:
    """megatron's world of one (NCCL on CUDA, gloo on CPU), once per process; the free device memory around the
    first collective is recorded the first time (p0 reads it)."""
    if _WORLD:
        return _WORLD
    from megatron_qarl.parallel import ParallelLayout, init_distributed

    if cuda:
        torch.cuda.set_device(0)
        sync(cuda)
    free = (lambda: torch.cuda.mem_get_info()[0]) if cuda else (lambda: 0)
    before = free()
    init_distributed(ParallelLayout(), seed=1234)
    after_init = free()
    import torch.distributed as dist

    x = torch.ones(1 << 20, device="cuda" if cuda else "cpu")
    dist.all_reduce(x)
    sync(cuda)
    after_collective = free()
    _WORLD.update(backend=dist.get_backend(), world_size=dist.get_world_size(),
                  free_before_init=before, free_after_init=after_init, free_after_first_all_reduce=after_collective)
    return _WORLD


# ------------------------------------------------------------------------------------------------ p0

def _nvidia_smi() -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"error": "nvidia-smi not on PATH"}
    q = "name,driver_version,memory.used,memory.total,compute_mode"
    out = subprocess.run([exe, f"--query-gpu={q}", "--format=csv,noheader,nounits"], capture_output=True,
                         text=True, timeout=30)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[:300]}
    fields = [f.strip() for f in out.stdout.strip().splitlines()[0].split(",")]
    return dict(zip(q.split(","), fields))


def versions() -> dict:
    out = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    for mod in ("megatron.core", "transformers", "compressed_tensors", "torch_memory_saver", "psutil",
                "transformer_engine", "sglang"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = getattr(m, "__version__", "imported (no __version__)")
        except Exception as err:  # noqa: BLE001
            out[mod] = f"not importable ({type(err).__name__})"
    try:
        from importlib import metadata

        out["torch_memory_saver_dist"] = metadata.version("torch_memory_saver")
    except Exception:  # noqa: BLE001
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["gpu"] = {"name": p.name, "total_gib": round(p.total_memory / GIB, 2), "sm": f"{p.major}{p.minor}",
                      "sms": p.multi_processor_count}
    return out


def sdpa_flags() -> dict:
    b = torch.backends.cuda
    out = {}
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        fn = getattr(b, name, None)
        out[name] = fn() if fn is not None else "absent in this torch"
    return out


def part_p0(cuda: bool, pin_gib: float) -> dict:
    from megatron_qarl import memory
    from megatron_qarl.memory_saver import HOST_HEADROOM_BYTES, host_available_bytes

    import psutil

    out: dict = {}
    if cuda:  # first: nothing of this process on the device yet (versions() asks torch for the device's properties)
        out["nvidia_smi_before_cuda_init"] = _nvidia_smi()
    out.update(versions=versions(), sdpa_flags=sdpa_flags())
    if cuda:
        torch.cuda.init()
        torch.cuda.set_device(0)
        free0, total = torch.cuda.mem_get_info()
        a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        (a @ a).sum().item()  # one cuBLAS GEMM: its handle and workspace
        sync(cuda)
        free1, _ = torch.cuda.mem_get_info()
        smi = out["nvidia_smi_before_cuda_init"]
        used_before = float(smi["memory.used"]) * MIB if "memory.used" in smi else None
        out["device"] = {
            "total_gib": total / GIB,
            # what the process holds after its context and one GEMM, besides its 2 MiB tensors' pages
            "context_plus_cublas_gib": (total - free1 - (used_before or 0)) / GIB if used_before is not None else None,
            "free_after_context_gib": free0 / GIB, "free_after_first_gemm_gib": free1 / GIB,
            "model_CUDA_CONTEXT_gib": memory.CUDA_CONTEXT / GIB}
    world = ensure_world(cuda)
    out["world"] = {k: (v / GIB if k.startswith("free") and cuda else v) for k, v in world.items()}
    if cuda:
        out["world"]["first_communicator_gib"] = (world["free_after_init"] - world["free_after_first_all_reduce"]) / GIB
        out["world"]["model_NCCL_PER_COMMUNICATOR_gib"] = getattr(memory, "NCCL_PER_COMMUNICATOR", float("nan")) / GIB
    vm = psutil.virtual_memory()
    out["host"] = {"total_gib": vm.total / GIB, "available_gib": vm.available / GIB,
                   "available_to_this_process_gib": host_available_bytes() / GIB,
                   "model_TRAINER_HOST_RSS_gib": getattr(memory, "TRAINER_HOST_RSS", float("nan")) / GIB,
                   "rss_now_gib": psutil.Process().memory_info().rss / GIB}
    nbytes = int(pin_gib * GIB)
    if host_available_bytes() < nbytes + HOST_HEADROOM_BYTES:
        out["pinned"] = {"skipped": f"{pin_gib} GiB + headroom is more than the host has available"}
        return out

    def pinned():
        res = {"gib": pin_gib, "pinned": cuda}
        t0 = time.perf_counter()
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        host[::4096] = 1  # touch every page (a pinned buffer is resident already; a pageable one is not)
        res["alloc_s"] = round(time.perf_counter() - t0, 3)
        if cuda:
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            sync(cuda)
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=False)
            sync(cuda)
            res["h2d_s"] = round(time.perf_counter() - t0, 3)
            t0 = time.perf_counter()
            host.copy_(dev, non_blocking=False)
            sync(cuda)
            res["d2h_s"] = round(time.perf_counter() - t0, 3)
            res["h2d_gib_per_s"] = round(pin_gib / res["h2d_s"], 2) if res["h2d_s"] else None
            del dev
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        del host
        if cuda:  # torch caches freed pinned blocks (CachingHostAllocator): give them back, as tms's cudaFreeHost
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()
        res["free_s"] = round(time.perf_counter() - t0, 3)
        return res

    guarded(out, "pinned", pinned)
    return out


# ------------------------------------------------------------------------------------------------ p1

def _attention(heads: int, groups: int, head_dim: int):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_qarl.models.sdpa_attention import SDPADotProductAttention

    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0,
                               masked_softmax_fusion=False, use_cpu_initialization=True)
    return SDPADotProductAttention(config, 1, AttnMaskType.causal, "self")


def _qkv(L: int, heads: int, groups: int, head_dim: int, dtype, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, 1, heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(L, 1, groups, head_dim, generator=g).to(device, dtype)
    v = torch.randn(L, 1, groups, head_dim, generator=g).to(device, dtype)
    return [t.requires_grad_(True) for t in (q, k, v)]


def math_reference(q, k, v, scale: float):
    """Causal GQA attention written out in fp32 (fp64 on the CPU) on the same inputs: [s, b, h, d] -> [s, b, h*d]."""
    dt = torch.float64 if q.device.type == "cpu" else torch.float32
    q, k, v = (t.detach().to(dt).requires_grad_(True) for t in (q, k, v))
    rep = q.size(2) // k.size(2)
    qh = q.permute(1, 2, 0, 3)
    kh, vh = (t.permute(1, 2, 0, 3).repeat_interleave(rep, dim=1) for t in (k, v))
    scores = (qh @ kh.transpose(-1, -2)) * scale
    L = q.size(0)
    mask = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    out = (probs @ vh).permute(2, 0, 1, 3).reshape(L, q.size(1), -1)
    return out, (q, k, v)


def _kernels(fn) -> list[str]:
    """The attention kernels / ops that ran in fn() (torch.profiler event names that look like attention)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        sync(torch.cuda.is_available())
    keys = ("flash", "fmha", "cudnn", "attention", "efficient", "sdpa", "softmax")
    names = sorted({e.key for e in prof.key_averages() if any(k in e.key.lower() for k in keys)})
    return names[:25]


def part_p1(cuda: bool, lengths: list[int], layouts: list[tuple[int, int]], head_dim: int, ref_len: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_qarl.models.sdpa_attention import _cuda_flash_takes

    ensure_world(cuda)  # the module's tp group
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    out: dict = {"dtype": str(dtype), "head_dim": head_dim, "shapes": {}}
    for heads, groups in layouts:
        attn = _attention(heads, groups, head_dim)
        for L in lengths:
            key = f"q{heads}_kv{groups}_L{L}"
            rec: dict = {}
            out["shapes"][key] = rec
            try:
                q, k, v = _qkv(L, heads, groups, head_dim, dtype, device)
                if cuda:
                    p = [t.permute(1, 2, 0, 3) for t in (q, k, v)]
                    rec["flash_takes_gqa"] = _cuda_flash_takes(*p)
                    sync(cuda)
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                grad = torch.randn(L, 1, heads * head_dim, generator=torch.Generator().manual_seed(1)).to(device, dtype)
                attn(q, k, v, None).backward(grad)  # warm-up (a cuDNN graph per new length)
                for t in (q, k, v):
                    t.grad = None
                sync(cuda)
                t0 = time.perf_counter()
                o = attn(q, k, v, None)
                sync(cuda)
                rec["forward_s"] = round(time.perf_counter() - t0, 4)
                t0 = time.perf_counter()
                o.backward(grad)
                sync(cuda)
                rec["backward_s"] = round(time.perf_counter() - t0, 4)
                if cuda:
                    rec["peak_over_inputs_mib"] = round((torch.cuda.max_memory_allocated() - base) / MIB, 1)
                    # what the unfused attention would keep: the fp32 [b, h, L, L] probabilities
                    rec["unfused_probs_mib"] = round(heads * L * L * 4 / MIB, 1)
                del o
                rec["kernels"] = guarded(rec, "kernels", lambda: _kernels(lambda: attn(q, k, v, None).backward(grad)))
                forced = {}
                for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                    be = getattr(SDPBackend, backend, None)
                    if be is None:
                        forced[backend] = "absent in this torch"
                        continue
                    try:
                        with sdpa_kernel([be]):
                            attn(q, k, v, None).sum().item()
                        forced[backend] = "ok"
                    except Exception as err:  # noqa: BLE001
                        forced[backend] = f"refused: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
                rec["forced_backends"] = forced
                del q, k, v, grad
            except PartTimeout:
                raise
            except Exception as err:  # noqa: BLE001
                rec["error"] = f"{type(err).__name__}: {err}"[:1000]
            if cuda:
                torch.cuda.empty_cache()
        # numerics at ref_len against the explicit math reference, on the same inputs
        key = f"q{heads}_kv{groups}_L{ref_len}_numerics"

        def numerics():
            q, k, v = _qkv(ref_len, heads, groups, head_dim, dtype, device, seed=2)
            grad = torch.randn(ref_len, 1, heads * head_dim, generator=torch.Generator().manual_seed(3)).to(device, dtype)
            o = attn(q, k, v, None)
            o.backward(grad)
            ref, leaves = math_reference(q, k, v, attn.softmax_scale)
            ref.backward(grad.to(ref.dtype))
            res = {"reference_dtype": str(ref.dtype)}
            for name, a, b in (("out", o, ref), ("dq", q.grad, leaves[0].grad), ("dk", k.grad, leaves[1].grad),
                               ("dv", v.grad, leaves[2].grad)):
                err = (a.detach().to(b.dtype) - b.detach()).abs()
                res[name] = {"max_abs_err": float(err.max()), "mean_abs_err": float(err.mean()),
                             "ref_max_abs": float(b.detach().abs().max())}
            return res

        guarded(out["shapes"], key, numerics)

        def vs_megatron():
            """The same call through megatron's unfused DotProductAttention (what model.core_attention=unfused runs;
            O(L^2) memory), output and dq / dk / dv, at the shortest length."""
            from megatron.core.transformer.dot_product_attention import DotProductAttention
            from megatron.core.transformer.enums import AttnMaskType

            L = min(lengths)
            dpa = DotProductAttention(attn.config, 1, AttnMaskType.causal, "self")
            res = {"L": L}
            q, k, v = _qkv(L, heads, groups, head_dim, dtype, device, seed=4)
            grad = torch.randn(L, 1, heads * head_dim, generator=torch.Generator().manual_seed(5)).to(device, dtype)
            runs = []
            for module in (attn, dpa):
                leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
                o = module(*leaves, None)
                o.backward(grad)
                runs.append([o.detach()] + [t.grad for t in leaves])
            for name, a, b in zip(("out", "dq", "dk", "dv"), *runs):
                res[name] = {"max_abs_diff": float((a.float() - b.float()).abs().max()),
                             "ref_max_abs": float(b.float().abs().max())}
            return res

        guarded(out["shapes"], f"q{heads}_kv{groups}_vs_megatron_unfused", vs_megatron)
        if cuda:
            torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------ p2

def part_p2(cuda: bool, preset: str, layers: int, tokens: int, cycles: int, out_dir: Path) -> dict:
    import psutil

    import gpu_memory_timeline as gmt
    from megatron_qarl.memory import memory_timeline
    from megatron_qarl.memory_saver import TrainerMemory, torch_memory_saver_singleton
    from megatron_qarl.models.logprobs import token_logprobs

    ensure_world(cuda)
    out: dict = {"preset": preset, "layers": layers, "tokens": tokens}
    tmp = Path(tempfile.mkdtemp(prefix="h200_p2_", dir=out_dir))
    cfg = gmt._config(preset, layers, tokens, "sdpa", "w4a16", tmp, cuda)
    timeline = memory_timeline(cfg, world_size=1, gpu_gib=(torch.cuda.get_device_properties(0).total_memory / GIB
                                                           if cuda else 79.0))
    out["memory_timeline_rows_gib"] = {r["phase"]: {k: v / GIB for k, v in r["terms"].items()} for r in timeline["rows"]}
    out["host_backup_model_gib"] = timeline["host_backup_per_gpu"] / GIB
    memory = TrainerMemory.for_run(True)  # the process's one: the real torch_memory_saver on CUDA
    out["saver"] = type(memory.saver).__name__
    rss0 = psutil.Process().memory_info().rss
    regions: dict = {}
    t0 = time.perf_counter()
    learner = gmt.build_learner(cfg, memory, cuda, regions)
    sync(cuda)
    out["build_s"] = round(time.perf_counter() - t0, 2)
    out["optimizer_backend"] = learner.opt.backend
    out["params"] = sum(p.numel() for p in learner.model.parameters())
    train_terms = out["memory_timeline_rows_gib"].get("train", {})
    out["resident_by_region"] = {
        "measured_gib": {k: (v / GIB if v is not None else None) for k, v in regions.items()},
        "model_gib": {"model": train_terms.get("params_bf16"), "ddp": train_terms.get("grads_fp32"),
                      "optimizer": (train_terms.get("master_fp32") or 0) + (train_terms.get("optimizer") or 0)}}
    if hasattr(memory.saver, "tag_bytes"):  # GuardedSaver: what each tag's pools hold (what a pause pins, M4)
        from megatron_qarl.memory_saver import REGIONS

        out["tms_pool_gib"] = {tag: memory.saver.tag_bytes(tag) / GIB for tag in REGIONS}
        out["tms_reserved_growth_gib"] = {tag: v / GIB for tag, v in memory.saver.grown.items()}
    write_json(out_dir / "p2.partial.json", out)
    ids = torch.randint(0, learner.hf.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to("cuda" if cuda else "cpu")
    phases = gmt.Phases(cuda)
    allocated = (lambda: torch.cuda.memory_allocated()) if cuda else (lambda: 0)

    def old_logprob():
        before = allocated()
        with torch.no_grad():
            token_logprobs(learner.ddp, ids)
        return {"quant_cache_gib": (allocated() - before) / GIB if cuda else None}  # the cache the forward built

    out["old_logprob"] = phases.run("old-logprob", old_logprob)

    def logits_transient():
        """The no-grad forward's peak from the output layer's input on (the bf16 logits and what token_logprobs
        makes of them: audit-3 M1a) against memory.py's `logits` term for the old-logprob phase."""
        marks = {}

        def pre_hook(module, args):
            sync(cuda)
            if cuda:
                marks["before_output_layer"] = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()

        handle = learner.model.output_layer.register_forward_pre_hook(pre_hook)
        try:
            with torch.no_grad():
                token_logprobs(learner.ddp, ids)
            sync(cuda)
        finally:
            handle.remove()
        res = {"hook_ran": "before_output_layer" in marks or not cuda,
               "model_logits_gib": out["memory_timeline_rows_gib"].get("old-logprob", {}).get("logits")}
        if cuda:
            res["measured_gib"] = (torch.cuda.max_memory_allocated() - marks["before_output_layer"]) / GIB
        return res

    guarded(out, "logits_transient", logits_transient)
    out["first_step"] = phases.run("train", lambda: gmt.train_step(learner, ids))
    if cuda:
        out["allocator_slack_after_train_gib"] = (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / GIB

    def publish():
        sent = 0
        if learner.aligned is not None:
            for name, site in learner.aligned.sites.items():
                sent += sum(t.numel() * t.element_size()
                            for t in learner.aligned.cache.engine_tensors(name, site.weight, name).values())
        bucket = torch.empty(cfg.publish.bucket_mb << 20, dtype=torch.uint8, device=ids.device)
        del bucket
        return sent

    out["published_bytes"] = phases.run("publish", publish)
    out["phase_peaks"] = {p: {**m, "model_gib": sum(v for k, v in out["memory_timeline_rows_gib"].get(p, {}).items()
                                                     if not k.startswith(("engine", "trainer_")))}
                          for p, m in phases.peaks.items()}
    write_json(out_dir / "p2.partial.json", out)
    out["cycles"] = []
    for _ in range(cycles):
        out["cycles"].append(gmt.release_restore_cycle(learner, memory, cuda, ids))
        write_json(out_dir / "p2.partial.json", out)
    out["host_rss_growth_gib"] = (psutil.Process().memory_info().rss - rss0) / GIB
    if cuda:
        again = torch_memory_saver_singleton()
        out["singleton_again_same_object"] = again is memory.saver
        out["tms_free_outside_region"] = _tms_edge_case(out_dir)
    (out_dir / "p2.partial.json").unlink(missing_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


_EDGE = r"""
import torch
from torch_memory_saver import torch_memory_saver as tms
tms.hook_mode = "torch"
with tms.region(tag="edge", enable_cpu_backup=True):
    x = torch.ones(64 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
del x  # freed outside its region: the block goes back to the pool's cache, not to tms_torch_free
torch.cuda.empty_cache()  # outside any region (audit-3 M3: must not reach tms_torch_free's region check)
tms.pause("edge"); tms.resume("edge")
print("survived", flush=True)
"""


def _tms_edge_case(out_dir: Path) -> dict:
    """A region tensor freed outside its region, then empty_cache, in a child process: a tms exit(1) ends only it."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _EDGE], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return {"rc": proc.returncode, "survived": "survived" in proc.stdout, "wall_s": round(time.perf_counter() - t0, 2),
            "output_tail": (proc.stdout + proc.stderr)[-1500:]}


# ------------------------------------------------------------------------------------------------ p3

def _scaled_mm_blockwise(xq, xs, wq, ws):
    """y = x @ w.T with 1x128 activation and 128x128 weight scales through torch's blockwise scaled GEMM
    (pytorch#158037, sm90 + cuBLAS >= 12.9). The shapes torch checks (torch/_meta_registrations.py, 2.13: scale_a
    [M, K/128], scale_b [K/128, N/128], i.e. our [N/128, K/128] scale_inv transposed, for (BlockWise1x128,
    BlockWise128x128)); the strides cuBLAS wants are not in the meta check, so the layouts are tried in turn, through
    torch._scaled_mm and torch.nn.functional.scaled_mm (torch >= 2.10). Returns (a zero-argument GEMM, its label,
    the refusals)."""
    import torch.nn.functional as F

    b = wq.t()  # [K, N], column-major: the layout the second operand must have
    outer = xs.t().contiguous().t()  # [M, K/128] with the M dimension contiguous ("outer-dim-major")
    tries = {}
    for a_label, sa in (("a_outer_major", outer), ("a_row_major", xs.contiguous())):
        for b_label, sb in (("b_t", ws.t()), ("b_t_contig", ws.t().contiguous())):
            tries[f"_scaled_mm {a_label},{b_label}"] = (
                lambda sa=sa, sb=sb: torch._scaled_mm(xq, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
            if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
                st = F.ScalingType
                tries[f"F.scaled_mm {a_label},{b_label}"] = (
                    lambda sa=sa, sb=sb: F.scaled_mm(xq, b, sa, st.BlockWise1x128, sb, st.BlockWise128x128,
                                                     output_dtype=torch.bfloat16))
    errors = {}
    for label, gemm in tries.items():
        try:
            gemm()
            return gemm, label, errors
        except Exception as err:  # noqa: BLE001
            errors[label] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return None, None, errors


def part_p3(cuda: bool, m: int, shapes: list[tuple[int, int, str]]) -> dict:
    from megatron_qarl.quant import (dequantize_fp8_activation, dequantize_fp8_block, quantize_fp8_activation,
                                     quantize_fp8_block)
    from megatron_qarl.quant.backends import get_backend

    device = "cuda" if cuda else "cpu"
    out: dict = {"M": m, "block": 128, "gemms": {}}
    reference = get_backend("reference")
    for k, n, label in shapes:
        rec: dict = {"K": k, "N": n}
        out["gemms"][label] = rec
        try:
            g = torch.Generator().manual_seed(k * 7 + n)
            w = (torch.randn(n, k, generator=g) * 0.02).to(device)
            x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
            wq = quantize_fp8_block(w, 128)
            xq, xs = quantize_fp8_activation(x, 128)
            w_deq = dequantize_fp8_block(wq.qweight, wq.scale_inv, 128, dtype=torch.float32)
            x_deq = dequantize_fp8_activation(xq, xs, 128, dtype=torch.float32)
            exact = x_deq.double() @ w_deq.double().t() if not cuda else x_deq @ w_deq.t()
            rec["ref_max_abs"] = float(exact.abs().max())
            try:  # the reference backend: what the learner's aligned forward computes for this linear
                y_ref = reference.forward(x, wq, None, w_deq.to(torch.bfloat16))
                rec["reference_backend_vs_exact_max_abs"] = float((y_ref.double() - exact.double()).abs().max())
            except Exception as err:  # noqa: BLE001
                rec["reference_backend_error"] = f"{type(err).__name__}: {err}"[:300]
            try:  # torch's own shape rules for the blockwise call, on meta tensors (any device can run them)
                meta = lambda t: t.to("meta")  # noqa: E731
                torch._scaled_mm(meta(xq), meta(wq.qweight).t(), scale_a=meta(xs), scale_b=meta(wq.scale_inv).t(),
                                 out_dtype=torch.bfloat16)
                rec["meta_shapes_accepted"] = True
            except Exception as err:  # noqa: BLE001
                rec["meta_shapes_accepted"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            gemm, layout, errors = _scaled_mm_blockwise(xq, xs, wq.qweight, wq.scale_inv)
            rec["scaled_mm_layout"] = layout
            rec["scaled_mm_refusals"] = errors
            if gemm is not None:
                y = gemm()
                rec["scaled_mm_vs_exact_max_abs"] = float((y.double() - exact.double()).abs().max())
                rec["scaled_mm_vs_exact_mean_abs"] = float((y.double() - exact.double()).abs().mean())
                if "reference_backend_vs_exact_max_abs" in rec:
                    rec["scaled_mm_vs_reference_backend_max_abs"] = float((y.double() - y_ref.double()).abs().max())
                sync(cuda)
                t0 = time.perf_counter()
                for _ in range(10):
                    gemm()
                sync(cuda)
                rec["scaled_mm_ms"] = round((time.perf_counter() - t0) * 100, 3)
        except PartTimeout:
            raise
        except Exception as err:  # noqa: BLE001
            rec["error"] = f"{type(err).__name__}: {err}"[:1000]
    out["supported"] = any(r.get("scaled_mm_layout") for r in out["gemms"].values())
    return out


# ------------------------------------------------------------------------------------------------ p4

def part_p4(cuda: bool, out_dir: Path, timeout: int, overrides: list[str]) -> dict:
    """The tiny RL loop under torchrun --nproc_per_node 1, in its own process (its own world and CUDA context)."""
    run_dir = out_dir / "p4_tiny"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port", str(_free_port()),
            "-m", "megatron_qarl.cli", "--config", str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml"),
            f"logging.out_dir={run_dir}", "logging.wandb.mode=disabled", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    # its own process group, killed whole on any way out (a timeout, this part's alarm): torchrun's workers too
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
        _kill_group(proc)
        text, _ = proc.communicate()
    finally:
        _kill_group(proc)
    out = {"argv": argv[3:], "rc": rc, "wall_s": round(time.perf_counter() - t0, 2), "output_tail": text[-3000:]}
    metrics = sorted(run_dir.glob("**/metrics*.jsonl"))
    if metrics:
        rows = [json.loads(line) for line in metrics[0].read_text().splitlines() if line.strip()]
        out["metrics_rows"] = len(rows)
        out["last_metrics"] = {k: v for k, v in (rows[-1] if rows else {}).items()
                               if isinstance(v, (int, float)) and k.split("/")[0] in ("step", "train", "time", "rollout",
                                                                                    "canary")}
    out["checkpoints"] = sorted(str(p.relative_to(run_dir)) for p in run_dir.glob("**/checkpoints/*") if p.is_dir())
    if rc != 0:
        raise RuntimeError(f"the tiny RL loop ended with {rc}: {text.strip().splitlines()[-1] if text.strip() else ''}")
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _free_port() -> int:
    import socket

    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for <part>.json and summary.json")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma list of p0..p4")
    ap.add_argument("--deadline", action="append", default=[], metavar="PART=SECONDS",
                    help=f"override a part's deadline (defaults {DEADLINES})")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="p4 starts only if its deadline fits in what is left of this budget (GPU 400, CPU 1200)")
    ap.add_argument("--tokens", type=int, default=None, help="p2 micro-batch tokens (GPU 18432)")
    ap.add_argument("--cycles", type=int, default=2, help="p2 release / restore cycles")
    ap.add_argument("--pin-gib", type=float, default=None, help="p0 pinned host buffer (GPU 8)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("QARL_GPU_CHECK_ALLOW_CPU") != "1":
        print("h200_check: no CUDA device (QARL_GPU_CHECK_ALLOW_CPU=1 checks the script on the CPU)", file=sys.stderr)
        return 2
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"h200_check: unknown parts {unknown}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    deadlines = dict(DEADLINES if cuda else CPU_DEADLINES)
    budget = args.budget_s if args.budget_s is not None else (400.0 if cuda else 1200.0)
    for item in args.deadline:
        name, _, seconds = item.partition("=")
        if name not in DEADLINES or not seconds.isdigit():
            print(f"h200_check: --deadline {item!r}: expected PART=SECONDS with PART in {', '.join(PARTS)}",
                  file=sys.stderr)
            return 2
        deadlines[name] = int(seconds)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not cuda:
        log("QARL_GPU_CHECK_ALLOW_CPU=1: CPU run of the script itself (tiny shapes); its numbers mean nothing")
    # the GPU sizes (audit-3 section 5) and the CPU mode's tiny ones
    gpu = dict(pin_gib=8.0, lengths=[4096, 18432], layouts=[(8, 1), (32, 4)], head_dim=128, ref_len=2048,
               preset="qwen3-30b-a3b", layers=2, tokens=18432, m=4096,
               gemms=[(2048, 1536, "fc1 K2048->N1536"), (768, 2048, "fc2 K768->N2048"),
                      (2048, 1280, "qkv TP4 K2048->N1280"), (2048, 2048, "proj K2048->N2048")],
               p4=["train.steps=2"])
    cpu = dict(pin_gib=1 / 16, lengths=[64], layouts=[(8, 1), (32, 4)], head_dim=32, ref_len=48,
               preset="tiny", layers=2, tokens=64, m=128,
               gemms=[(256, 384, "fc1-like K256->N384"), (384, 256, "fc2-like K384->N256")],
               p4=["train.steps=1", "train.prompts_per_step=2", "rollout.n=2", "train.mini_batch_prompts=2",
                   "train.micro_batch_size=2", "rollout.max_new_tokens=4", "checkpoint.every=0", "eval.path=null"])
    size = gpu if cuda else cpu
    pin_gib = args.pin_gib if args.pin_gib is not None else size["pin_gib"]
    tokens = args.tokens if args.tokens is not None else size["tokens"]
    results = {}
    steps = {
        "p0": lambda: part_p0(cuda, pin_gib),
        "p1": lambda: part_p1(cuda, size["lengths"], size["layouts"], size["head_dim"], size["ref_len"]),
        "p2": lambda: part_p2(cuda, size["preset"], size["layers"], tokens, args.cycles, out_dir),
        "p3": lambda: part_p3(cuda, size["m"], size["gemms"]),
        "p4": lambda: part_p4(cuda, out_dir, max(1, deadlines["p4"] - 10), size["p4"]),
    }
    for name in PARTS:
        if name not in parts:
            continue
        left = budget - (time.perf_counter() - started)
        if name == "p4" and left < deadlines["p4"]:
            results[name] = {"part": name, "status": "skipped", "error": f"{left:.0f} s of --budget-s left, "
                             f"p4 needs {deadlines['p4']} s"}
            write_json(out_dir / f"{name}.json", results[name])
            log(f"p4: skipped ({results[name]['error']})")
            continue
        results[name] = run_part(name, steps[name], out_dir, deadlines[name])
        if cuda:
            torch.cuda.empty_cache()
    summary = {"device": "cuda" if cuda else "cpu", "parts": {k: v["status"] for k, v in results.items()},
               "wall_s": round(time.perf_counter() - started, 1)}
    write_json(out_dir / "summary.json", summary)
    log(f"summary: {json.dumps(summary)}")
    return 0 if all(v["status"] in ("ok", "skipped") for v in results.values()) else 1


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # never hang at interpreter exit after the NCCL world (docs/gpu-runs.md F3)
