"""Measure the trainer's side of memory.memory_timeline on one CUDA GPU (issue 31), phase by phase.

    PYTHONPATH=. python3 benchmarks/gpu_memory_timeline.py [--preset qwen3-30b-a3b --layers 2] [--tokens 18432]
        [--attention sdpa unfused] [--scheme w4a16] [--json out.json]

For each core attention it builds the learner the way run_context does (TP1, bf16 params, fp32 masters, the
paper's Muon; params / masters / optimizer state in the TRAINER_STATE region, grads in TRAINER_GRADS), then runs
the phases of memory_timeline that the trainer owns and records torch.cuda.max_memory_allocated in each
(the peak is reset at each phase's start): old-logprob (no-grad forward), train (forward + backward + step),
publish (the cached engine tensors of every aligned site, one bucket in flight). It then times one release /
restore cycle through the real torch_memory_saver (memory_saver.TrainerMemory): the bytes freed on the device
(cudaMemGetInfo before / after), the seconds each way, and whether every parameter is bitwise the same after.
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


def measure(cfg, cuda: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_qarl.memory import memory_timeline
    from megatron_qarl.memory_saver import TRAINER_GRADS, TRAINER_STATE, TrainerMemory, init_optimizer_state
    from megatron_qarl.models.aligned import apply_aligned_quantization
    from megatron_qarl.models.logprobs import token_logprobs
    from megatron_qarl.models.registry import build_model, family_of
    from megatron_qarl.models.registry import resolve_hf_config
    from megatron_qarl.optim import build_optimizer
    from megatron_qarl.parallel import ParallelLayout

    hf = resolve_hf_config(cfg.model)
    memory = TrainerMemory.for_run(True)  # the real torch_memory_saver on CUDA, the no-op saver on the CPU
    dtype = torch.bfloat16 if cuda else torch.float32
    with memory.region(TRAINER_STATE):
        model = build_model(hf, ParallelLayout(), params_dtype=dtype, core_attention=cfg.model.core_attention,
                                      config_overrides={"calculate_per_token_loss": True, "recompute_granularity": "full",
                                                        "recompute_method": "uniform", "recompute_num_layers": 1})
    aligned = apply_aligned_quantization(model, cfg.quant)
    with memory.region(TRAINER_GRADS):
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model)
    with memory.region(TRAINER_STATE):
        opt = build_optimizer(cfg.train.optim, [ddp], family_of(hf))
        init_optimizer_state(opt)
    resident = torch.cuda.memory_allocated() / GIB if cuda else None
    tokens = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    ids = torch.randint(0, hf.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    ids = ids.to("cuda" if cuda else "cpu")
    phases = Phases(cuda)

    def old_logprob():
        with torch.no_grad():
            return token_logprobs(ddp, ids)

    def train():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        (-token_logprobs(ddp, ids).mean()).backward()
        finalize_model_grads([ddp])
        opt.step()
        aligned.invalidate()

    def publish():  # the publisher's source: every aligned site's cached engine tensors, one bucket in flight
        bucket = torch.empty(cfg.publish.bucket_mb << 20, dtype=torch.uint8, device=ids.device)
        sent = sum(sum(t.numel() * t.element_size() for t in aligned.cache.engine_tensors(name, site.weight, name).values())
                   for name, site in aligned.sites.items())
        del bucket
        return sent

    phases.run("old-logprob", old_logprob)
    phases.run("train", train)
    published = phases.run("publish", publish)
    before = [p.detach().clone() for p in model.parameters()]
    aligned.cache.clear()
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    t0 = time.perf_counter()
    memory.release()
    t_release = time.perf_counter() - t0
    free1 = torch.cuda.mem_get_info()[0] if cuda else 0
    t0 = time.perf_counter()
    memory.restore()
    if cuda:
        torch.cuda.synchronize()
    t_restore = time.perf_counter() - t0
    same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    timeline = memory_timeline(cfg, world_size=1, gpu_gib=79.0)
    model_rows = {r["phase"]: {k: v / GIB for k, v in r["terms"].items() if not k.startswith(("engine", "trainer_"))}
                  for r in timeline["rows"] if r["phase"] in phases.peaks}
    return {"attention": cfg.model.core_attention, "tokens": tokens, "resident_after_build_gib": resident,
            "phases": phases.peaks, "model_terms_gib": {p: {"sum": sum(t.values()), **t} for p, t in model_rows.items()},
            "published_bytes": published, "release": {"freed_gib": (free1 - free0) / GIB, "release_s": round(t_release, 3),
                                                      "restore_s": round(t_restore, 3), "params_bitwise_same": same,
                                                      "host_backup_model_gib": timeline["host_backup_per_gpu"] / GIB}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=18432)
    ap.add_argument("--attention", nargs="+", default=["sdpa", "unfused"])
    ap.add_argument("--scheme", default="w4a16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("QARL_GPU_CHECK_ALLOW_CPU") != "1":
        print("gpu_memory_timeline: no CUDA device (QARL_GPU_CHECK_ALLOW_CPU=1 checks the script on the CPU)",
              file=sys.stderr)
        return 2
    from megatron_qarl.parallel import init_distributed

    init_distributed(seed=1234)
    results = []
    for attention in args.attention:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(args.preset, args.layers, args.tokens, attention, args.scheme, Path(tmp), cuda)
            try:
                result = measure(cfg, cuda)
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
