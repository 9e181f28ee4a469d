"""Weight-publisher benchmarks (prints ratios).

P1  bytes of one publish, W4A16 (routed experts int4 g128) / BF16, from the publisher's own bucket plan at
    the real Qwen3-30B-A3B shapes (meta tensors, no data).                              target <= 0.30
P2  publishing this step's CACHED codes (aligned learner: the forward already quantized) vs re-quantizing
    the masters at publish (unaligned learner path), same model, same process, interleaved repeats; the
    engine is left out (engine=None) so only the publisher's own work is timed.        target >= 2x

usage: python benchmarks/bench_publish.py [--repeats 15] [--hidden 512] [--experts 16] [--moe-inter 512]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, preset_hf_config, tiny_hf_config  # noqa: E402
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed  # noqa: E402
from megatron_qarl.quant import QuantConfig  # noqa: E402
from megatron_qarl.models.aligned import apply_aligned_quantization  # noqa: E402
from megatron_qarl.weights.publish import WeightPublisher, plan_publish  # noqa: E402


def p1() -> float:
    real = preset_hf_config("qwen3-30b-a3b")
    bf16 = plan_publish(real, QuantConfig())
    w4 = plan_publish(real, QuantConfig(scheme="w4a16", scope="experts"))
    fp8 = plan_publish(real, QuantConfig(scheme="fp8", scope="all-linears"))
    ratio = w4["bytes"] / bf16["bytes"]
    print(f"P1 Qwen3-30B-A3B publish bytes: bf16 {bf16['bytes'] / 2**30:.2f} GiB in {bf16['num_buckets']} buckets, "
          f"w4a16 {w4['bytes'] / 2**30:.2f} GiB in {w4['num_buckets']} buckets, fp8 {fp8['bytes'] / 2**30:.2f} GiB")
    print(f"P1 ratio w4a16/bf16 = {ratio:.3f}  (target <= 0.30: {'PASS' if ratio <= 0.30 else 'FAIL'}); "
          f"fp8/bf16 = {fp8['bytes'] / bf16['bytes']:.3f}")
    return ratio


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def p2(repeats: int, hidden: int, experts: int, moe_inter: int) -> float:
    init_distributed(ParallelLayout(), seed=1)
    cfg = tiny_hf_config(hidden_size=hidden, num_experts=experts, moe_intermediate_size=moe_inter,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256))
    quant_cfg = QuantConfig(scheme="w4a16", scope="experts")
    model = build_qwen3_moe_model(cfg, ParallelLayout(), params_dtype=torch.bfloat16,
                                  config_overrides=dict(moe_aux_loss_coeff=0.0))
    aligned = apply_aligned_quantization(model, quant_cfg)
    cached = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=None)
    requant = WeightPublisher(model, cfg, quant_cfg, quant=None, engine=None)

    def new_step():  # (untimed) what an optimizer step + the next forward do to the cache
        aligned.invalidate()
        for name in aligned.sites:
            aligned.entry(name)

    new_step()
    cached.publish(), requant.publish()  # warm-up
    t_cached, t_requant = [], []
    for _ in range(repeats):
        new_step()
        t_cached.append(_time(cached.publish))
        t_requant.append(_time(requant.publish))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"P2 model: {n_params / 1e6:.1f}M params ({len(aligned.sites)} int4 sites), {repeats} interleaved repeats")
    print(f"P2 publish cached codes : min {min(t_cached) * 1e3:.1f} ms, median {statistics.median(t_cached) * 1e3:.1f} ms")
    print(f"P2 publish re-quantizing: min {min(t_requant) * 1e3:.1f} ms, median {statistics.median(t_requant) * 1e3:.1f} ms")
    speedup = statistics.median(t_requant) / statistics.median(t_cached)
    print(f"P2 speedup (median) = {speedup:.2f}x  (target >= 2x: {'PASS' if speedup >= 2 else 'FAIL'}); "
          f"min/min = {min(t_requant) / min(t_cached):.2f}x")
    destroy_distributed()
    return speedup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--moe-inter", type=int, default=512)
    args = parser.parse_args()
    p1()
    p2(args.repeats, args.hidden, args.experts, args.moe_inter)


if __name__ == "__main__":
    main()
