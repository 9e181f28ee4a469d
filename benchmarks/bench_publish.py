"""Weight-publisher benchmarks (prints ratios).

P1  bytes of one publish, W4A16 (routed experts int4 g128) / BF16, from the publisher's own bucket plan at
    the real Qwen3-30B-A3B shapes (meta tensors, no data).                              target <= 0.30
P2  publishing this step's CACHED codes (aligned learner: the forward already quantized) vs re-quantizing
    the masters at publish (unaligned learner path), same model, same process, interleaved repeats; the
    engine is left out (engine=None) so only the publisher's own work is timed.        target >= 3x
    Also timed: the cached publish with full mode's opt-in code-flip count (publish.code_flips).
P5  publish.mode=delta on the real trainer (`qarl-train`, configs/tiny_qarl_w4a16_tbpo.yaml, from one SFT
    warm start): bytes sent for the W4A16 linears (codes + scales, as deltas) / their full bytes, mean over
    the steady state (steps after the first 5) of >= 20 steps, at the demo's lr and at 1e-5 and 1e-6;
    with the code flip rate, the whole publish's bytes (bf16 tensors always go whole) and the publish time
    of delta mode vs full mode (a full-mode run at the demo's lr, same seed).           target <= 5%

usage: python benchmarks/bench_publish.py [--repeats 15] [--hidden 512] [--experts 16] [--moe-inter 512]
                                          [--p5-steps 22] [--init SFT_CHECKPOINT] [--skip-p5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

from megatron_qarl.models.registry import build_model, family_of, preset_hf_config  # noqa: E402
from megatron_qarl.parallel import ParallelLayout, destroy_distributed, init_distributed  # noqa: E402
from megatron_qarl.quant import QuantConfig  # noqa: E402
from megatron_qarl.models.aligned import apply_aligned_quantization  # noqa: E402
from megatron_qarl.weights.publish import WeightPublisher  # noqa: E402
from megatron_qarl.weights.publish_plan import plan_publish  # noqa: E402


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
    cfg = preset_hf_config("tiny", hidden_size=hidden, num_experts=experts, moe_intermediate_size=moe_inter,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256))
    quant_cfg = QuantConfig(scheme="w4a16", scope="experts")
    model = build_model(cfg, ParallelLayout(), params_dtype=torch.bfloat16,
                                  config_overrides=dict(moe_aux_loss_coeff=0.0))
    aligned = apply_aligned_quantization(model, quant_cfg)
    cached = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=None)
    requant = WeightPublisher(model, cfg, quant_cfg, quant=None, engine=None)
    counting = WeightPublisher(model, cfg, quant_cfg, quant=aligned, engine=None, count_flips=True)

    def new_step():  # (untimed) what an optimizer step + the next forward do to the cache
        aligned.invalidate()
        for name in aligned.sites:
            aligned.entry(name)

    new_step()
    cached.publish(), requant.publish(), counting.publish()  # warm-up
    t_cached, t_requant, t_counting = [], [], []
    for _ in range(repeats):
        new_step()
        t_cached.append(_time(cached.publish))
        t_requant.append(_time(requant.publish))
        t_counting.append(_time(counting.publish))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"P2 model: {n_params / 1e6:.1f}M params ({len(aligned.sites)} int4 sites), {repeats} interleaved repeats")
    print(f"P2 publish cached codes : min {min(t_cached) * 1e3:.1f} ms, median {statistics.median(t_cached) * 1e3:.1f} ms")
    print(f"P2 publish re-quantizing: min {min(t_requant) * 1e3:.1f} ms, median {statistics.median(t_requant) * 1e3:.1f} ms")
    print(f"P2 publish cached codes + code-flip count (publish.code_flips): "
          f"median {statistics.median(t_counting) * 1e3:.1f} ms "
          f"({statistics.median(t_requant) / statistics.median(t_counting):.2f}x faster than re-quantizing)")
    speedup = statistics.median(t_requant) / statistics.median(t_cached)
    print(f"P2 speedup (median) = {speedup:.2f}x  (target >= 3x: {'PASS' if speedup >= 3 else 'FAIL'}); "
          f"min/min = {min(t_requant) / min(t_cached):.2f}x")
    destroy_distributed()
    return speedup


CONFIG = "configs/tiny_qarl_w4a16_tbpo.yaml"
STEADY_FROM = 6  # Adam's first steps are larger (bias correction): the steady state starts after step 5


def _qarl_train(args: list[str], log: Path) -> None:
    cmd = [sys.executable, "-m", "megatron_qarl.cli", *args]
    with open(log, "w") as out:
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{' '.join(cmd)} failed; see {log}")


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in rows if "publish/bytes" in r), key=lambda r: r["step"])


def _run(work: Path, init: str, name: str, steps: int, *extra: str) -> list[dict]:
    out = work / name
    _qarl_train(["--config", CONFIG, f"model.init_checkpoint={init}", f"logging.out_dir={out}",
                 "checkpoint.resume=none", "checkpoint.every=0", "logging.wandb.mode=disabled",
                 f"train.steps={steps}", *extra], work / f"{name}.log")
    return _metrics(out)


def p5(steps: int, init: str | None) -> float:
    from megatron_qarl.config import load_config

    demo_lr = load_config(CONFIG).train.optim.lr
    work = Path(tempfile.mkdtemp(prefix="bench_p5_"))
    if init is None:
        init = str(work / "sft")
        print(f"P5 SFT warm start -> {init} (pass --init to reuse one)", flush=True)
        _qarl_train(["sft", "--config", CONFIG, f"sft.out_checkpoint={init}", f"logging.out_dir={work / 'sft_log'}",
                     "logging.wandb.mode=disabled"], work / "sft.log")
    print(f"P5 {steps} steps per run of {CONFIG}; steady state = steps {STEADY_FROM}..{steps}", flush=True)
    full = _run(work, init, "full", steps, f"train.optim.lr={demo_lr}", "publish.mode=full")
    t_full = statistics.median(r["publish/time_s"] for r in full[STEADY_FROM - 1:])
    print("| lr | code flips | W4A16 bytes sent / full (P5) | max over steps | whole publish / full | "
          "delta publish time / full mode |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for lr in (demo_lr, 1e-5, 1e-6):
        rows = _run(work, init, f"delta_lr{lr:g}", steps, f"train.optim.lr={lr}", "publish.mode=delta",
                    f"publish.full_every={steps + 1}")[STEADY_FROM - 1:]
        frac = [r["publish/quantized_bytes_frac"] for r in rows]
        whole = statistics.mean(r["publish/bytes"] for r in rows) / statistics.mean(r["publish/bytes"] for r in full)
        t_delta = statistics.median(r["publish/time_s"] for r in rows)
        flips = statistics.mean(r["publish/code_flip_frac"] for r in rows)
        worst = max(worst, statistics.mean(frac))
        print(f"| {lr:g}{' (demo)' if lr == demo_lr else ''} | {flips:.4%} | {statistics.mean(frac):.2%} | "
              f"{max(frac):.2%} | {whole:.2%} | {t_delta / t_full:.2f}x |", flush=True)
    print(f"P5 worst steady-state mean = {worst:.2%}  (target <= 5%: {'PASS' if worst <= 0.05 else 'FAIL'}); "
          f"full-mode publish median {t_full * 1e3:.1f} ms; runs in {work}")
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--moe-inter", type=int, default=512)
    parser.add_argument("--p5-steps", type=int, default=22)
    parser.add_argument("--init", default=None, help="an SFT checkpoint of the tiny config (default: run the SFT)")
    parser.add_argument("--skip-p5", action="store_true")
    args = parser.parse_args()
    result = {"P1": p1(), "P2": p2(args.repeats, args.hidden, args.experts, args.moe_inter)}
    if not args.skip_p5:
        result["P5"] = p5(args.p5_steps, args.init)
    print("RESULT " + json.dumps(result), flush=True)  # read by benchmarks/run_all.py


if __name__ == "__main__":
    main()
