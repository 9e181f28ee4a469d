"""Does the CPU demo learn on this machine, for every seed? (a benchmark, not a test)

Runs the demo pipeline of `launch/demo_cpu.sh` (SFT warm-up to a measured accuracy, then the QaRL run:
W4A16 experts in the engine and the aligned learner, TBPO, per-step publish) once per seed and prints,
per seed, the warm-up's steps and final sampled accuracy, the reward of the first vs the last 5 RL steps,
and the wall time; then the CPU it ran on, as a markdown table for the README.

    . .venv/bin/activate
    python benchmarks/demo_robustness.py                 # seeds 0 1 2, the full demo (~5-8 min a seed)
    python benchmarks/demo_robustness.py --seeds 3 --quick   # one seed, 20 RL steps
    python benchmarks/demo_robustness.py --family deepseek_v3   # the tiny DeepSeek-V3 twin's demo config
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_qarl.tracking import first_last_means

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_description  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WINDOW = 5  # steps averaged at each end of the run, as the demo's summary line does
TARGET_GAIN = 0.15  # what "visibly learns" means (issue: last-5 mean >= first-5 mean + 0.15)
# each model family's demo config (the same pipeline and objective; the tiny twin of that family)
FAMILY_CONFIGS = {
    "qwen3_moe": "configs/tiny_qarl_w4a16_tbpo.yaml",
    "deepseek_v3": "configs/tiny_deepseek_v3_qarl_w4a16_tbpo.yaml",
}


def _run(cmd: list[str], log: Path, env: dict) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"demo_robustness: `{' '.join(cmd)}` failed (rc={proc.returncode}); log {log}:\n{tail}")
    return time.perf_counter() - t0


def run_seed(seed: int, config: str, out: Path, rl_overrides: list[str], env: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    train = shutil.which("qarl-train") or "qarl-train"
    sft_s = _run([train, "sft", "--config", config, f"sft.seed={seed}", f"sft.out_checkpoint={out / 'sft_checkpoint'}",
                  f"logging.out_dir={out / 'sft'}"], out / "sft.log", env)
    sft = json.loads((out / "sft" / "sft_metrics.json").read_text())
    rl_s = _run([train, "--config", config, f"model.init_checkpoint={out / 'sft_checkpoint'}",
                 f"logging.out_dir={out / 'rl'}", "checkpoint.resume=none", f"train.seed={1234 + seed}",
                 f"data.shuffle_seed={seed}", *rl_overrides], out / "rl.log", env)
    rows = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward/mean"] for r in sorted(rows, key=lambda r: r["step"])]
    _, first, last = first_last_means(rewards, WINDOW)  # what the demo's summary line prints
    return {"seed": seed, "sft_steps": sft["step"], "sft_sampled_acc": sft["eval/sampled_accuracy"],
            "sft_greedy_acc": sft["eval/greedy_accuracy"], "rl_steps": len(rewards), "first5": first, "last5": last,
            "gain": last - first, "sft_s": sft_s, "rl_s": rl_s}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--quick", action="store_true", help="20 RL steps instead of the config's (a smoke run)")
    p.add_argument("--family", choices=sorted(FAMILY_CONFIGS), default="qwen3_moe",
                   help="whose tiny twin runs the demo: its config in FAMILY_CONFIGS (--config overrides)")
    p.add_argument("--config", default=None, help="the demo config (default: the --family's)")
    p.add_argument("--out", default=None, help="keep the runs here (default: a temp dir, removed after)")
    args = p.parse_args(argv)
    args.config = args.config or FAMILY_CONFIGS[args.family]

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    env["WANDB_MODE"] = env.get("WANDB_MODE", "disabled")
    rl_overrides = ["train.steps=20", "checkpoint.every=0"] if args.quick else []
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="qarl-robustness-"))
    cpu = cpu_description()
    print(f"CPU: {cpu}\nconfig: {args.config}{' (quick: 20 RL steps)' if args.quick else ''}", flush=True)
    results = []
    try:
        for seed in args.seeds:
            r = run_seed(seed, args.config, root / f"seed{seed}", rl_overrides, env)
            results.append(r)
            print(f"seed {seed}: warm-up {r['sft_steps']} steps -> sampled acc {r['sft_sampled_acc']:.3f}; "
                  f"reward first {WINDOW} {r['first5']:.3f} -> last {WINDOW} {r['last5']:.3f} ({r['gain']:+.3f}); "
                  f"wall {r['sft_s']:.0f}+{r['rl_s']:.0f} s", flush=True)
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)

    print(f"\nMeasured on {cpu}, `{args.config}`{' --quick' if args.quick else ''}:\n")
    print("| seed | warm-up steps | warm-up sampled acc | reward first 5 | reward last 5 | gain | wall (SFT + RL) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['seed']} | {r['sft_steps']} | {r['sft_sampled_acc']:.3f} | {r['first5']:.3f} | {r['last5']:.3f} | "
              f"{r['gain']:+.3f} | {r['sft_s']:.0f} + {r['rl_s']:.0f} s |")
    ok = all(r["gain"] >= TARGET_GAIN for r in results)
    print(f"\nevery seed gained >= {TARGET_GAIN}: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
