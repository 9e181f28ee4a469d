"""Full-model aligned-forward overhead: learner log-prob pass of the megatron Qwen3-MoE (CPU or GPU).

Same model, same batch, same process:
  * bf16            : the unaligned learner (bf16 params, megatron's plain linears);
  * w4a16 cached    : aligned W4A16 on the routed experts, codes/dequantized weights cached for the step;
  * w4a16 uncached  : the cache invalidated before every pass (re-quantize per call, the naive way).
Prints the median time per pass and the ratios to bf16. Target: cached <= 1.15x bf16.

    python benchmarks/bench_aligned_model.py [--model tiny|medium] [--batch 4 --seq 128 --reps 10]
"""
from __future__ import annotations

import argparse
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


def timed(fn, reps: int, before=None) -> list[float]:
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="medium", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--scope", default="experts")
    args = parser.parse_args(argv)

    from megatron_qarl.models.logprobs import token_logprobs
    from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config
    from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed
    from megatron_qarl.quant import QuantConfig
    from megatron_qarl.models.aligned import apply_aligned_quantization

    layout = init_distributed(ParallelLayout(), seed=0)
    cfg = tiny_hf_config(**MODELS[args.model])
    model = build_qwen3_moe_model(cfg, layout, params_dtype=torch.bfloat16,
                                  config_overrides=dict(moe_aux_loss_coeff=0.0)).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def logprob_pass():
        with torch.no_grad():
            token_logprobs(model, ids)

    timed(logprob_pass, 2)  # warm-up
    results = {"bf16": timed(logprob_pass, args.reps)}
    aligned = apply_aligned_quantization(model, QuantConfig(scheme="w4a16", scope=args.scope))
    t0 = time.perf_counter()
    logprob_pass()  # fills the cache (one quantization per site)
    quantize_pass = time.perf_counter() - t0
    results["w4a16 cached"] = timed(logprob_pass, args.reps)
    results["w4a16 uncached"] = timed(logprob_pass, args.reps, before=aligned.invalidate)
    n_sites = len(aligned.sites)
    aligned.remove()
    # bf16 again at the end: on a shared machine the load drifts; the base is the median of both runs
    results["bf16 (again)"] = timed(logprob_pass, args.reps)
    destroy_distributed()

    base = statistics.median(results["bf16"] + results["bf16 (again)"])
    print(f"model={args.model} batch={args.batch} seq={args.seq} sites={n_sites} "
          f"threads={torch.get_num_threads()} reps={args.reps}")
    base_min = min(results["bf16"] + results["bf16 (again)"])
    print(f"{'variant':<16}{'median s':>10}{'min s':>10}{'ratio':>8}{'min ratio':>11}")
    summary = {}
    for name, times in results.items():
        med = statistics.median(times)
        summary[name] = med / base
        print(f"{name:<16}{med:>10.4f}{min(times):>10.4f}{med / base:>8.3f}{min(times) / base_min:>11.3f}")
    print(f"first aligned pass (quantize + forward): {quantize_pass:.4f} s")
    return summary


if __name__ == "__main__":
    main()
