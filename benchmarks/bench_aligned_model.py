"""Full-model aligned-forward overhead: learner log-prob pass of the megatron Qwen3-MoE (CPU or GPU).

Same model, same batch, same process:
  * bf16            : the unaligned learner (bf16 params, megatron's plain linears);
  * <scheme> cached   : aligned W4A16 (or FP8) on the scope's linears, codes/dequantized weights cached for the step;
  * <scheme> uncached : the cache invalidated before every pass (re-quantize per call, the naive way).
Prints the median time per pass and the ratios to bf16. Target: cached <= 1.15x bf16.

Then the per-step quantization cost (what the first aligned forward after an optimizer step pays on top
of a forward: every site quantized and dequantized once), as a ratio to one cached aligned forward:
  * main's unfused quantizer : the quantize-then-dequantize ops main ran before the fused path (a copy of
                               them is kept below as the baseline), from scratch for every site;
  * fused, from scratch      : QuantCache as the trainer builds it;
  * incremental              : QuantCache(incremental=True), with the weights unchanged (the best case:
                               frozen weights) and after one real AdamW step on fp32 masters with noise
                               gradients at each --lrs learning rate; the line names the fraction of int4
                               groups / FP8 blocks whose bf16 cast did not change, the only ones it reuses.

    python benchmarks/bench_aligned_model.py [--model tiny|medium] [--scheme w4a16|fp8]
        [--batch 4 --seq 128 --reps 10 --steps 3 --lrs 1e-4,1e-5,1e-6]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch  # noqa: E402

# medium: experts large enough that GEMMs dominate like in the real model, still a few seconds on CPU
MODELS = {
    "tiny": {},
    "medium": dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512,
                   intermediate_size=2048, vocab_size=4096),
}
DEFAULT_SCOPE = {"w4a16": "experts", "fp8": "all-linears"}


def timed(fn, reps: int, before=None) -> list[float]:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


# ------------------------------------------------------------------ main's unfused quantizer (baseline)

def main_unfused_int4(w: torch.Tensor, group_size: int) -> tuple:
    """int4.py before the fused path: abs/amax/divide/clamp/round/int8 as separate ops, then dequantize
    the int8 codes again."""
    weight = w.detach().to(torch.bfloat16)
    groups = weight.unflatten(-1, (weight.shape[-1] // group_size, group_size))
    scales = groups.abs().amax(dim=-1) / 7.5
    scales = torch.where(scales == 0, torch.tensor(torch.finfo(scales.dtype).eps, dtype=scales.dtype), scales)
    codes = torch.round(torch.clamp(groups / scales.unsqueeze(-1), -8, 7)).flatten(-2).to(torch.int8)
    dequantized = (codes.unflatten(-1, groups.shape[-2:]).to(scales.dtype) * scales.unsqueeze(-1)).flatten(-2)
    return codes, scales, dequantized


def main_unfused_fp8(w: torch.Tensor, block: int) -> tuple:
    """fp8.py before the fused path: fp32 copy, padded copy, abs, divide, clamp, cast; dequantize through
    the scalar e4m3 cast and repeat_interleave'd scales."""
    n, k = w.shape
    x = w.detach().to(torch.bfloat16).float()
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(x, (0, kb * block - k, 0, nb * block - n))
    tiles = padded.reshape(nb, block, kb, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = amax.float() / torch.tensor(448.0)
    scale_inv = torch.where(amax == 0, torch.ones_like(scale_inv), scale_inv)
    q = (tiles / scale_inv[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    q = q.reshape(nb * block, kb * block)[:n, :k].contiguous()
    scale_full = scale_inv.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q, scale_inv, q.float() * scale_full


# ------------------------------------------------------------------ per-step quantization arms

class StepArms:
    """The per-step quantization arms over the aligned sites' weights (bf16 params, as megatron keeps them)."""

    def __init__(self, sites: dict, quant_cfg, dequant_dtype: torch.dtype):
        from megatron_qarl.quant import QuantCache

        self.weights = {name: module.weight for name, module in sites.items()}
        self.quant_cfg = quant_cfg
        self.full = QuantCache(quant_cfg, dequant_dtype=dequant_dtype)
        self.incremental = QuantCache(quant_cfg, dequant_dtype=dequant_dtype, incremental=True)
        self.main_entries: dict = {}

    def main_unfused(self) -> float:
        """Main's cache did this per site: quantize, dequantize, then drop the stale entry it replaced."""
        if self.quant_cfg.scheme == "w4a16":
            quantize = lambda w: main_unfused_int4(w, self.quant_cfg.group_size)  # noqa: E731
        else:
            quantize = lambda w: main_unfused_fp8(w, self.quant_cfg.block_size)  # noqa: E731
        t0 = time.perf_counter()
        for name, w in self.weights.items():
            self.main_entries[name] = quantize(w)
        return time.perf_counter() - t0

    def through(self, cache) -> float:
        cache.invalidate()
        t0 = time.perf_counter()
        for name, w in self.weights.items():
            cache.entry(w, name)
        return time.perf_counter() - t0

    def unchanged_fraction(self, before: dict) -> float:
        """Fraction of int4 groups / FP8 blocks whose bf16 bits equal `before`'s (the reusable ones)."""
        from megatron_qarl.quant.fp8 import changed_fp8_blocks
        from megatron_qarl.quant.int4 import changed_int4_groups

        unchanged = total = 0
        for name, w in self.weights.items():
            if self.quant_cfg.scheme == "w4a16":
                changed = changed_int4_groups(w.detach(), before[name], self.quant_cfg.group_size)
            else:
                changed = changed_fp8_blocks(w.detach(), before[name], self.quant_cfg.block_size)
            unchanged += int((~changed).sum())
            total += changed.numel()
        return unchanged / total


class NoiseAdamW:
    """One real AdamW step on fp32 masters of the site weights with i.i.d. N(0, 1) gradients (noise-dominated,
    as RL gradients are), copied into the bf16 params the way megatron's optimizer does."""

    def __init__(self, weights: dict, warmup: int = 3):
        self.params = weights
        self.masters = [w.detach().float().requires_grad_() for w in weights.values()]
        self.opt = torch.optim.AdamW(self.masters, lr=0.0, foreach=False)
        self.gen = torch.Generator().manual_seed(0)
        for _ in range(warmup):  # lr 0: the moments reach a steady state, the weights do not move
            self.step(0.0)

    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        for m in self.masters:
            m.grad = torch.randn(m.shape, generator=self.gen)
        self.opt.step()
        with torch.no_grad():
            for w, m in zip(self.params.values(), self.masters):
                w.copy_(m)


def per_step_costs(arms: StepArms, lrs: list[float], steps: int) -> list[tuple[str, list[float]]]:
    """Every arm after the same updates, interleaved (the allocator's state and the machine's load drift)."""
    main_unfused, fused, unchanged = [], [], []
    for arm in (arms.main_unfused, lambda: arms.through(arms.full), lambda: arms.through(arms.incremental)):
        arm()  # first entries and the incremental history
    for _ in range(steps):  # weights unchanged: the incremental best case (frozen weights)
        unchanged.append(arms.through(arms.incremental))
    adam = NoiseAdamW(arms.weights)
    unit = "groups" if arms.quant_cfg.scheme == "w4a16" else "blocks"
    incremental_rows = []
    for lr in lrs:
        times, fractions = [], []
        for _ in range(steps):
            before = {name: w.detach().clone() for name, w in arms.weights.items()}
            adam.step(lr)
            fractions.append(arms.unchanged_fraction(before))
            del before
            main_unfused.append(arms.main_unfused())
            fused.append(arms.through(arms.full))
            times.append(arms.through(arms.incremental))
        incremental_rows.append(
            (f"incremental, AdamW lr={lr:g} ({statistics.mean(fractions):.1%} {unit} unchanged)", times))
    return [("main's unfused quantizer, from scratch", main_unfused), ("fused, from scratch (default)", fused),
            ("incremental, weights unchanged", unchanged)] + incremental_rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="medium", choices=sorted(MODELS))
    parser.add_argument("--scheme", default="w4a16", choices=sorted(DEFAULT_SCOPE))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--scope", default=None, help="default: experts (w4a16), all-linears (fp8)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per per-step-cost arm")
    parser.add_argument("--lrs", default="1e-4,1e-5,1e-6", help="AdamW learning rates of the incremental arm")
    args = parser.parse_args(argv)

    from megatron_qarl.models.logprobs import token_logprobs
    from megatron_qarl.models.registry import build_model, preset_hf_config
    from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
    from megatron_qarl.quant import QuantConfig
    from megatron_qarl.models.aligned import apply_aligned_quantization

    layout = init_distributed(ParallelLayout(), seed=0)
    cfg = preset_hf_config("tiny", **MODELS[args.model])
    model = build_model(cfg, layout, params_dtype=torch.bfloat16,
                                  config_overrides=dict(moe_aux_loss_coeff=0.0)).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def logprob_pass():
        with torch.no_grad():
            token_logprobs(model, ids)

    timed(logprob_pass, 2)  # warm-up
    results = {"bf16": timed(logprob_pass, args.reps)}
    quant_cfg = QuantConfig(scheme=args.scheme, scope=args.scope or DEFAULT_SCOPE[args.scheme])
    aligned = apply_aligned_quantization(model, quant_cfg)
    t0 = time.perf_counter()
    logprob_pass()  # fills the cache (one quantization per site)
    quantize_pass = time.perf_counter() - t0
    results[f"{args.scheme} cached"] = timed(logprob_pass, args.reps)
    results[f"{args.scheme} uncached"] = timed(logprob_pass, args.reps, before=aligned.invalidate)
    n_sites = len(aligned.sites)
    arms = StepArms(aligned.sites, quant_cfg, aligned.cache.dequant_dtype)
    step_rows = per_step_costs(arms, [float(lr) for lr in args.lrs.split(",") if lr], args.steps)
    forward = statistics.median(results[f"{args.scheme} cached"])
    aligned.remove()
    # bf16 again at the end: on a shared machine the load drifts; the base is the median of both runs
    results["bf16 (again)"] = timed(logprob_pass, args.reps)
    destroy_distributed()

    base = statistics.median(results["bf16"] + results["bf16 (again)"])
    print(f"model={args.model} scheme={args.scheme} scope={quant_cfg.scope} batch={args.batch} seq={args.seq} "
          f"sites={n_sites} threads={torch.get_num_threads()} reps={args.reps}")
    base_min = min(results["bf16"] + results["bf16 (again)"])
    print(f"{'variant':<16}{'median s':>10}{'min s':>10}{'ratio':>8}{'min ratio':>11}")
    summary = {}
    for name, times in results.items():
        med = statistics.median(times)
        summary[name] = med / base
        print(f"{name:<16}{med:>10.4f}{min(times):>10.4f}{med / base:>8.3f}{min(times) / base_min:>11.3f}")
    print(f"first aligned pass (quantize + forward): {quantize_pass:.4f} s")
    print(f"per-step quantization of all {n_sites} sites (median over the AdamW steps: {args.steps} per lr, "
          f"pooled for the from-scratch arms), as a ratio to one cached aligned forward ({forward:.4f} s):")
    per_step = {}
    for name, times in step_rows:
        med = statistics.median(times)
        per_step[name] = med / forward
        print(f"  {name:<58}{med:>9.4f} s{med / forward:>8.3f}x forward")
    summary["per-step"] = per_step
    # for benchmarks/run_all.py: P3 the cached aligned forward / bf16, Q the per-step arms / one forward
    print("RESULT " + json.dumps({"P3": summary[f"{args.scheme} cached"], "Q": per_step}))
    return summary


if __name__ == "__main__":
    main()
