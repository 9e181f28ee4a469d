"""Measure the trainer's side of memory.memory_timeline on one CUDA GPU (issue 31), phase by phase.

    PYTHONPATH=. python3 benchmarks/gpu_memory_timeline.py [--preset qwen3-30b-a3b --layers 2] [--tokens 18432]
        [--attention sdpa unfused] [--scheme w4a16] [--json out.json]

For each core attention it builds the learner the way run_context does (build_learner: TP1, bf16 params, fp32
masters, the paper's Muon; params / masters / optimizer state in the TRAINER_STATE region, grads in TRAINER_GRADS,
one TrainerMemory for the whole process, as the library's saver is process-wide), then runs the phases of
memory_timeline that the trainer owns and records torch.cuda.max_memory_allocated in each (the peak is reset at
each phase's start): old-logprob (no-grad forward), train (forward + backward + step), publish (the cached engine
tensors of every aligned site, one bucket in flight). It then runs --cycles (2) release / restore cycles through
the real torch_memory_saver (memory_saver.TrainerMemory): the bytes freed on the device (cudaMemGetInfo before /
after), the host RSS it took, the seconds each way, whether every param, fp32 master and optimizer-state tensor is
bitwise the same after, whether the grad buffer zeroes, and one more train step (finite loss and grad norm).
The printed table sets each measured peak beside memory_timeline's trainer terms for the same shape, tokens
and layout (world 1); the engine's terms are not measured here (no SGLang on the lent machine).

Never run on a GPU yet (docs/gpu-runs.md). Without CUDA it exits 2; QARL_GPU_CHECK_ALLOW_CPU=1 runs the same
sequence on the CPU in fp32 with the no-op saver, to check the script itself (its numbers mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GIB = 1024 ** 3


def _config(preset: str, layers: int, tokens: int, attention: str, scheme: str, hf_dir: Path, cuda: bool):
    from megatron_qarl.config import load_config
    from megatron_qarl.models.registry import preset_hf_config

    preset_hf_config(preset, num_hidden_layers=layers).save_pretrained(str(hf_dir))
    return load_config(None, [
        "model.preset=null", f"model.hf_path={hf_dir}", f"model.core_attention={attention}",
        f"model.dtype={'bfloat16' if cuda else 'float32'}", f"train.optim.bf16={str(cuda).lower()}",
        "parallel.tp=1", "parallel.ep=1", "parallel.etp=1", "parallel.sp=false", "train.optim.name=muon",
        "train.micro_batch_size=1", f"data.max_prompt_len={tokens // 2}", f"rollout.max_new_tokens={tokens - tokens // 2}",
        "train.recompute_activations=true", f"quant.scheme={scheme}", "quant.backend=reference",
        "rollout.engine=sglang", "rollout.sglang.mode=colocated", "rollout.engine_tp=1", "publish.bucket_mb=512",
    ])


class Phases:
    """Peak allocated bytes per phase (reset at each phase's start)."""

    def __init__(self, cuda: bool):
        self.cuda, self.peaks = cuda, {}

    def run(self, name: str, fn):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        self.peaks[name] = {"peak_gib": torch.cuda.max_memory_allocated() / GIB if self.cuda else None,
                            "seconds": round(time.perf_counter() - t0, 3)}
        return out


class Learner:
    """The parts of a run's learner the scripts measure."""

    def __init__(self, hf, family, model, aligned, ddp, opt):
        self.hf, self.family, self.model, self.aligned, self.ddp, self.opt = hf, family, model, aligned, ddp, opt


def build_learner(cfg, memory, cuda: bool, regions: dict | None = None) -> Learner:
    """The learner of run_context.build_run_context (megatron_qarl/run_context.py:146-164): the family's build with
    run_context's megatron overrides in TRAINER_STATE, the aligned forward, DDP in TRAINER_GRADS, the optimizer and
    its state made up front in TRAINER_STATE; random init instead of a checkpoint. `regions` (a dict) gets the
    device bytes allocated in each step ({"model": ..., "ddp": ..., "optimizer": ...}; None without CUDA)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_qarl.memory_saver import TRAINER_GRADS, TRAINER_STATE, init_optimizer_state
    from megatron_qarl.models.aligned import apply_aligned_quantization
    from megatron_qarl.models.registry import family_of, resolve_hf_config
    from megatron_qarl.optim import build_optimizer
    from megatron_qarl.parallel import ParallelLayout
    from megatron_qarl.run_context import learner_config_overrides

    regions = {} if regions is None else regions
    allocated = (lambda: torch.cuda.memory_allocated()) if cuda else (lambda: 0)

    def mark(name, before):
        if cuda:
            torch.cuda.synchronize()
        regions[name] = allocated() - before if cuda else None

    hf = resolve_hf_config(cfg.model)
    family = family_of(hf)
    dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32
    before = allocated()
    with memory.region(TRAINER_STATE):
        model = family.build_model(hf, ParallelLayout(), params_dtype=dtype, config_overrides=learner_config_overrides(cfg),
                                   core_attention=cfg.model.core_attention)
    mark("model", before)
    aligned = apply_aligned_quantization(model, cfg.quant) if cfg.quant.scheme != "none" and cfg.quant.learner_aligned \
        else None
    before = allocated()
    with memory.region(TRAINER_GRADS):
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    mark("ddp", before)
    before = allocated()
    with memory.region(TRAINER_STATE):
        opt = build_optimizer(cfg.train.optim, [ddp], family)
        init_optimizer_state(opt)
    mark("optimizer", before)
    return Learner(hf, family, model, aligned, ddp, opt)


def learner_state(learner: Learner) -> dict:
    """Every tensor a release must give back, by name: the model's params (bf16 under mixed precision), each chained
    optimizer's params (the fp32 masters under bf16; the params themselves in fp32) and their state (Adam moments,
    Muon momentum, step counters)."""
    out = {f"param {n}": p for n, p in learner.model.named_parameters()}
    inner = getattr(learner.opt, "optimizer", learner.opt)
    for i, o in enumerate(getattr(inner, "chained_optimizers", [inner])):
        torch_opt = getattr(o, "optimizer", None)
        if torch_opt is None:
            continue
        for g, group in enumerate(torch_opt.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"master {i}.{g}.{j}"] = p
                for k, v in torch_opt.state[p].items():
                    if isinstance(v, torch.Tensor):
                        out[f"state {i}.{g}.{j}.{k}"] = v
    return out


def snapshot(learner: Learner) -> dict:
    return {k: v.detach().to("cpu", copy=True) for k, v in learner_state(learner).items()}


def compare(learner: Learner, before: dict) -> dict:
    """Bitwise comparison of the learner's state with a snapshot: counts per kind and the names that differ."""
    now = learner_state(learner)
    differ = [k for k, v in before.items() if k not in now or not torch.equal(now[k].detach().cpu(), v)]
    kinds = {}
    for k in before:
        kinds[k.split()[0]] = kinds.get(k.split()[0], 0) + 1
    return {"tensors": kinds, "bitwise_same": not differ, "differ": differ[:20]}


def train_step(learner: Learner, ids: torch.Tensor) -> dict:
    """One trainer step on `ids`: forward, backward, finalize_model_grads, optimizer step, quant cache invalidated."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_qarl.models.logprobs import token_logprobs

    learner.ddp.zero_grad_buffer()
    learner.opt.zero_grad()
    loss = -token_logprobs(learner.ddp, ids).mean()
    loss.backward()
    finalize_model_grads([learner.ddp])
    success, grad_norm, _ = learner.opt.step()
    if learner.aligned is not None:
        learner.aligned.invalidate()
    grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    return {"loss": float(loss), "grad_norm": grad_norm, "success": bool(success),
            "finite": bool(torch.isfinite(loss).item() and grad_norm == grad_norm and abs(grad_norm) != float("inf"))}


def release_restore_cycle(learner: Learner, memory, cuda: bool, ids: torch.Tensor) -> dict:
    """One hand-over as the trainer does it: the quant cache dropped, every region released, restored; then every
    state tensor compared bitwise with its snapshot, the grad buffer zeroed and checked, and one more train step."""
    import psutil

    before = snapshot(learner)
    if learner.aligned is not None:
        learner.aligned.cache.clear()
    rss0 = psutil.Process().memory_info().rss
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    t0 = time.perf_counter()
    memory.release()
    t_release = time.perf_counter() - t0
    free1 = torch.cuda.mem_get_info()[0] if cuda else 0
    rss1 = psutil.Process().memory_info().rss
    t0 = time.perf_counter()
    memory.restore()
    if cuda:
        torch.cuda.synchronize()
    t_restore = time.perf_counter() - t0
    state = compare(learner, before)
    learner.ddp.zero_grad_buffer()
    grads_zero = all(bool((b.grad_data == 0).all()) for b in learner.ddp.buffers + learner.ddp.expert_parallel_buffers)
    return {"freed_gib": (free1 - free0) / GIB, "host_rss_delta_gib": (rss1 - rss0) / GIB,
            "release_s": round(t_release, 3), "restore_s": round(t_restore, 3), "state": state,
            "grads_zero_after_zero_grad_buffer": grads_zero, "train_step_after": train_step(learner, ids)}


def measure(cfg, cuda: bool, memory, cycles: int = 2) -> dict:
    """`memory`: the process's one TrainerMemory (the library's saver is process-wide)."""
    from megatron_qarl.memory import memory_timeline
    from megatron_qarl.models.logprobs import token_logprobs

    regions = {}
    learner = build_learner(cfg, memory, cuda, regions)
    resident = torch.cuda.memory_allocated() / GIB if cuda else None
    tokens = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    ids = torch.randint(0, learner.hf.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to("cuda" if cuda else "cpu")
    phases = Phases(cuda)
    aligned, ddp = learner.aligned, learner.ddp

    def old_logprob():
        with torch.no_grad():
            return token_logprobs(ddp, ids)

    def publish():  # the publisher's source: every aligned site's cached engine tensors, one bucket in flight
        bucket = torch.empty(cfg.publish.bucket_mb << 20, dtype=torch.uint8, device=ids.device)
        sent = 0 if aligned is None else sum(
            sum(t.numel() * t.element_size() for t in aligned.cache.engine_tensors(name, site.weight, name).values())
            for name, site in aligned.sites.items())
        del bucket
        return sent

    phases.run("old-logprob", old_logprob)
    step = phases.run("train", lambda: train_step(learner, ids))
    published = phases.run("publish", publish)
    hand_overs = [release_restore_cycle(learner, memory, cuda, ids) for _ in range(cycles)]
    timeline = memory_timeline(cfg, world_size=1, gpu_gib=79.0)
    model_rows = {r["phase"]: {k: v / GIB for k, v in r["terms"].items() if not k.startswith(("engine", "trainer_"))}
                  for r in timeline["rows"] if r["phase"] in phases.peaks}
    return {"attention": cfg.model.core_attention, "tokens": tokens, "resident_after_build_gib": resident,
            "regions_gib": {k: (v / GIB if v is not None else None) for k, v in regions.items()},
            "phases": phases.peaks, "train_step": step,
            "model_terms_gib": {p: {"sum": sum(t.values()), **t} for p, t in model_rows.items()},
            "published_bytes": published, "host_backup_model_gib": timeline["host_backup_per_gpu"] / GIB,
            "release_restore": hand_overs,
            "release": {**{k: hand_overs[0][k] for k in ("freed_gib", "release_s", "restore_s")},
                        "state_bitwise_same": all(h["state"]["bitwise_same"] for h in hand_overs)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=18432)
    ap.add_argument("--attention", nargs="+", default=["sdpa", "unfused"])
    ap.add_argument("--scheme", default="w4a16")
    ap.add_argument("--cycles", type=int, default=2, help="release / restore cycles per variant")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("QARL_GPU_CHECK_ALLOW_CPU") != "1":
        print("gpu_memory_timeline: no CUDA device (QARL_GPU_CHECK_ALLOW_CPU=1 checks the script on the CPU)",
              file=sys.stderr)
        return 2
    from megatron_qarl.memory_saver import TrainerMemory
    from megatron_qarl.parallel import init_distributed

    init_distributed(seed=1234)
    memory = TrainerMemory.for_run(True)  # one per process: the real torch_memory_saver on CUDA, the no-op saver on CPU
    results = []
    for attention in args.attention:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(args.preset, args.layers, args.tokens, attention, args.scheme, Path(tmp), cuda)
            try:
                result = measure(cfg, cuda, memory, args.cycles)
            except torch.OutOfMemoryError as err:  # the unfused O(L^2) scores at L = 18k: the point of the comparison
                result = {"attention": attention, "tokens": args.tokens, "out_of_memory": str(err).splitlines()[0]}
        results.append(result)
        print(json.dumps(result), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    for r in results:
        for phase, m in r.get("phases", {}).items():
            model = r["model_terms_gib"].get(phase, {}).get("sum")
            print(f"{r['attention']:<8} {phase:<12} measured peak {m['peak_gib']}  memory.py model terms "
                  f"{model:.2f} GiB  ({m['seconds']} s)" if model is not None else f"{r['attention']} {phase}: {m}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
