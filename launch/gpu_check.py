"""End-to-end SGLang check for GPU users (step 2 of launch/gpu_check.sh): export -> serve -> refit -> generate ->
compare sampler logprobs with a transformers recompute on the same (dequantized) weights.

    python launch/gpu_check.py [--scheme none|w4a16|fp8] [--workdir DIR] ...

A script beside the shell script that runs it, not a module of the package: nothing in megatron_qarl imports it.
Its CPU-side logic is tested with the embedded engine standing in for SGLang (tests/test_gpu_check_script.py).

1. Export a tiny Qwen3-MoE checkpoint (weights A) in engine layout with our code (bf16 / W4A16 experts /
   FP8) plus the matching ``quantization_config``.
2. Start SGLang on it (``SGLangEngine``, subprocess, loopback + api key, Marlin MoE backend).
3. Refit to weights B through begin/update(flattened buckets)/end/flush.
4. Generate (temperature 1, seeded) with sampler logprobs (and routed experts).
5. Recompute the logprobs with transformers on exactly the weights B the engine was sent (the
   EmbeddedEngine dequantizes with the quant spec), fp32, full sequence.
Exit 1 when |Δlogprob| exceeds ``--mean-tol`` (mean), ``--p99-tol`` or ``--max-tol``, or when the engine's
logprobs are not closer to weights B than to A (the refit did not take). Default tolerances come from the
bf16 EmbeddedEngine vs the fp32 recompute on CPU for this model (mean 0.016-0.020, p99 0.07-0.16, max
0.59-0.76 over 16x32 tokens, all three schemes) with headroom for GPU kernels; vs stale weights A the
mean gap is ~5.3.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def tiny_hf_config():
    from megatron_qarl.models.registry import preset_hf_config

    return preset_hf_config("tiny", bos_token_id=1, eos_token_id=2)


def master_weights(seed: int) -> dict[str, torch.Tensor]:
    """Random HF-named fp32 weights; lm_head scaled so the next-token distribution is peaked (a refit
    that did not take then shows up as a large logprob gap)."""
    from megatron_qarl.rollout.embedded import EmbeddedEngine

    w = EmbeddedEngine.from_hf_config(tiny_hf_config(), dtype="float32", seed=seed).hf_state()
    w["lm_head.weight"] = w["lm_head.weight"] * 8.0
    return w


def export_checkpoint(out_dir: str, weights: dict[str, torch.Tensor], quant_cfg) -> None:
    from safetensors.torch import save_file

    from megatron_qarl.models.registry import family_of
    from megatron_qarl.quant.engine_layout import engine_named_tensors, quantization_config_for

    family = family_of(tiny_hf_config())
    cfg = tiny_hf_config().to_dict()
    cfg["architectures"] = [family.architecture]
    cfg["torch_dtype"] = "bfloat16"
    qc = quantization_config_for(quant_cfg, naming=family)
    if qc is not None:
        cfg["quantization_config"] = qc
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in engine_named_tensors(weights.items(), quant_cfg, naming=family)}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def recompute_logprobs(engine, prompts, results) -> list[torch.Tensor]:
    """Full-sequence fp32 logprobs of each result's tokens under the weights ``engine`` holds."""
    out = []
    for r in results:
        prompt = prompts[r.prompt_index]
        seq = torch.tensor([prompt + r.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=seq).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        pos = torch.arange(len(prompt) - 1, seq.shape[1] - 1)
        out.append(logp[pos, torch.tensor(r.token_ids)])
    return out


def reference_engine(weights, quant_cfg):
    from megatron_qarl.rollout.embedded import EmbeddedEngine
    from megatron_qarl.quant.engine_layout import engine_named_tensors

    ref = EmbeddedEngine.from_hf_config(tiny_hf_config(), dtype="float32")
    ref.begin_weight_update()
    ref.update_weights(engine_named_tensors(weights.items(), quant_cfg, naming=ref.family))
    ref.end_weight_update()
    return ref


def logprob_gaps(results, prompts, weights_a, weights_b, quant_cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """|sampler - HF recompute| per token under the refit weights B and under the exported weights A."""
    sampler = torch.cat([torch.tensor(r.logprobs) for r in results])
    ref_b = torch.cat(recompute_logprobs(reference_engine(weights_b, quant_cfg), prompts, results))
    ref_a = torch.cat(recompute_logprobs(reference_engine(weights_a, quant_cfg), prompts, results))
    return (sampler - ref_b).abs(), (sampler - ref_a).abs()


def random_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def main(argv=None) -> int:
    from megatron_qarl.quant import QuantConfig
    from megatron_qarl.quant.config import SCHEMES
    from megatron_qarl.quant.schemes import DEFAULT_LOW_BIT, NO_SCHEME, scheme_named
    from megatron_qarl.rollout.protocol import SamplingParams
    from megatron_qarl.models.registry import family_of
    from megatron_qarl.rollout.sglang_client import SGLangEngine
    from megatron_qarl.rollout.sglang_engine_config import SGLangEngineConfig
    from megatron_qarl.quant.engine_layout import engine_named_tensors

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scheme", choices=list(SCHEMES), default=DEFAULT_LOW_BIT)
    ap.add_argument("--mean-tol", type=float, default=0.05)
    ap.add_argument("--p99-tol", type=float, default=0.5)
    ap.add_argument("--max-tol", type=float, default=2.0)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--health-timeout", type=float, default=900)
    ap.add_argument("--cuda-graph", choices=["auto", "on", "off"], default="off",
                    help="SGLang CUDA graphs (auto: off for W4A16, whose Marlin workspace moves at refit)")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; this check needs a GPU with sglang==0.5.23 installed", file=sys.stderr)
        return 2
    scope = scheme_named(args.scheme).default_scope if args.scheme != NO_SCHEME else "experts"
    quant_cfg = QuantConfig(scheme=args.scheme, scope=scope)
    weights_a, weights_b = master_weights(seed=1), master_weights(seed=2)
    workdir = args.workdir or tempfile.mkdtemp(prefix="qarl_gpu_check_")
    ckpt = os.path.join(workdir, f"tiny_{args.scheme}")
    export_checkpoint(ckpt, weights_a, quant_cfg)
    print(f"exported {args.scheme} checkpoint (weights A) to {ckpt}")

    cfg = tiny_hf_config()
    family = family_of(cfg)
    engine = SGLangEngine(
        SGLangEngineConfig(mode="subprocess", model_path=ckpt, model_type=family.model_type,
                           quant_scheme=args.scheme, moe_runner_backend="auto",
                           mem_fraction_static=0.5, return_routed_experts=True, health_timeout_s=args.health_timeout,
                           route_geometry=family.moe_geometry(cfg),
                           log_path=os.path.join(workdir, "sglang_server.log"), cuda_graph=args.cuda_graph),
    )
    try:
        t0 = time.time()
        engine.begin_weight_update()
        engine.update_weights((n, t.cuda()) for n, t in engine_named_tensors(weights_b.items(), quant_cfg,
                                                                             naming=family))
        engine.end_weight_update()
        print(f"refit to weights B in {time.time() - t0:.2f} s ({engine.pushes} buckets)")
        prompts = random_prompts(args.prompts, cfg.vocab_size)
        results = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0))
    finally:
        engine.shutdown()

    gap_b, gap_a = logprob_gaps(results, prompts, weights_a, weights_b, quant_cfg)
    p99 = gap_b.quantile(0.99)
    print(f"tokens {gap_b.numel()}: |sampler - HF(B)| mean {gap_b.mean():.4f} p99 {p99:.4f} max {gap_b.max():.4f}; "
          f"|sampler - HF(A)| mean {gap_a.mean():.4f}")
    ok = True
    if gap_b.mean() > args.mean_tol or p99 > args.p99_tol or gap_b.max() > args.max_tol:
        print(f"FAIL: logprob gap beyond tolerance (mean {args.mean_tol}, p99 {args.p99_tol}, max {args.max_tol})")
        ok = False
    if not gap_b.mean() < gap_a.mean():
        print("FAIL: engine logprobs are not closer to the refit weights B than to the exported A: refit did not take")
        ok = False
    print("gpu_check: OK" if ok else "gpu_check: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
