"""Every weight-path benchmark in one run, as the markdown table the README quotes.

Runs each benchmark script as its own process (they set up their own worlds and memory baselines) and
reads the one `RESULT {json}` line each prints last:
  P1  publish bytes W4A16 / BF16 at Qwen3-30B-A3B shapes (bench_publish.py)          target <= 0.30
  P2  publishing cached codes vs re-quantizing at publish (bench_publish.py)         target >= 3x
  P3  aligned W4A16 learner forward (cached codes) / bf16 forward (bench_aligned_model.py)  target <= 1.15x
  P4  peak RSS growth / one 30B-shaped layer: export --hf, mcore-to-hf, export --ckpt (bench_convert.py)
                                                                                       target <= 2.5x
  P5  delta publish: W4A16 bytes sent / full, worst lr (bench_publish.py)            target <= 5%
  Q   per-step quantization cost / one forward, full re-quantization and incremental (bench_aligned_model.py)

    python benchmarks/run_all.py [--init SFT_CHECKPOINT] [--quick] [--log-dir DIR]
(--quick: fewer repeats, 4 experts in the convert layer, 12-step P5 runs; for a smoke run, not for the README.)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(script: str, *args: str, log_dir: Path) -> dict:
    start = time.perf_counter()
    log = log_dir / f"{Path(script).stem}.log"
    print(f"[run_all] {script} {' '.join(args)} (output: {log})", flush=True)
    proc = subprocess.run([sys.executable, str(HERE / script), *args], cwd=HERE.parent, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log.write_text(proc.stdout)  # each script's own tables (P5 per lr, Q per arm) are there
    lines = proc.stdout.splitlines()
    results = [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]
    if proc.returncode or not results:
        tail = "\n".join(lines[-30:])
        raise SystemExit(f"[run_all] {script} failed (exit {proc.returncode}):\n{tail}")
    print(f"[run_all] {script}: {time.perf_counter() - start:.0f} s", flush=True)
    return results[-1]


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", default=None, help="SFT checkpoint of the tiny config for P5 (default: run SFT)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--log-dir", default=None, help="where each script's full output goes (default: a temp dir)")
    args = parser.parse_args()
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="run_all_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    publish_args = ["--repeats", "5" if args.quick else "25", "--p5-steps", "12" if args.quick else "22"]
    if args.init:
        publish_args += ["--init", args.init]
    publish = run("bench_publish.py", *publish_args, log_dir=log_dir)
    model = run("bench_aligned_model.py", *(["--reps", "3"] if args.quick else []), log_dir=log_dir)
    convert = run("bench_convert.py", *(["--experts", "4"] if args.quick else []), log_dir=log_dir)
    rows = [
        ("P1", "publish bytes W4A16 / BF16 (Qwen3-30B-A3B plan)", f"{publish['P1']:.3f}", "<= 0.30",
         publish["P1"] <= 0.30),
        ("P2", "publish cached codes vs re-quantizing (speedup)", f"{publish['P2']:.2f}x", ">= 3x",
         publish["P2"] >= 3),
        ("P3", "aligned W4A16 forward / bf16 forward", f"{model['P3']:.2f}x", "<= 1.15x", model["P3"] <= 1.15),
    ]
    for path, growth in convert["P4"].items():
        rows.append(("P4", f"peak RSS growth / 30B layer, {path}", f"{growth:.2f}x", "<= 2.5x", growth <= 2.5))
    if "P5" in publish:
        rows.append(("P5", "delta publish: W4A16 bytes sent / full (worst lr)", f"{publish['P5']:.2%}", "<= 5%",
                     publish["P5"] <= 0.05))
    for arm, ratio in model["Q"].items():
        rows.append(("Q", f"per-step quantization / one forward, {arm}", f"{ratio:.2f}", "-", None))
    print("\n| | what | measured | target | |\n|---|---|---|---|---|")
    for key, what, value, target, ok in rows:
        print(f"| {key} | {what} | {value} | {target} | {'' if ok is None else verdict(ok)} |")


if __name__ == "__main__":
    main()
