"""Reward benchmark: math-verify scoring of one batch of responses with 1 worker vs N workers.

R1  4,096 synthetic math responses (a chain of thought with inline $...$ math, then a final answer: boxed
    integers right and wrong, fractions against decimals, plain-text answers, malformed LaTeX, and a few
    LaTeX-heavy ones: polynomials, radicals, matrices, sets, intervals) scored in one call, as the trainer
    scores a step's rollouts, with each worker count. The pool's start-up (spawn, math-verify import and
    warm-up) is timed apart and excluded. Prints seconds, answers/s, the speed-up over the first worker
    count, the CPU seconds spent, and checks that every worker count gave the same rewards.
R0  the machine's own ceiling, measured before and after the R1 calls: N plain Python processes each
    burning the same loop, against one. On a shared or busy machine it is below N, and R1's speed-up
    cannot beat it for long.

usage: python benchmarks/bench_rewards.py [--responses 4096] [--workers 1,2] [--repeats 3] [--timeout 5]

Measured results and the machine they were taken on: docs/rewards.md, "Benchmark".
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import statistics
import time

import psutil

from megatron_qarl.rl.rewards import RewardConfig, RewardFunction

WORDS = ("so", "we", "get", "then", "thus", "note", "that", "the", "sum", "is", "and", "hence", "let", "be",
         "therefore", "substituting", "gives", "which", "simplifies", "to")


def _reasoning(rng: random.Random) -> str:
    """A few hundred to ~2,000 characters of prose with inline math, as a model's chain of thought."""
    parts = []
    for _ in range(rng.randint(4, 30)):
        parts.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 15))))
        if rng.random() < 0.5:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            parts.append(rng.choice([f"${a} + {b} = {a + b}$", f"$\\frac{{{a}}}{{{b}}}$", f"$x^{{{a % 5 + 2}}}$",
                                     f"$\\sqrt{{{a}}}$", f"${a} \\cdot {b}$"]))
    return " ".join(parts) + ". "


def _answer(rng: random.Random) -> tuple[str, str]:
    """(final answer text, gold answer)."""
    n = rng.randint(0, 10_000)
    kind = rng.random()
    if kind < 0.30:  # boxed integer, right
        return f"The answer is $\\boxed{{{n}}}$.", str(n)
    if kind < 0.50:  # boxed integer, wrong
        return f"The answer is $\\boxed{{{n + rng.randint(1, 9)}}}$.", str(n)
    if kind < 0.65:  # fraction against its decimal, right or wrong
        p, q = rng.choice([(1, 2), (1, 4), (3, 4), (1, 5), (2, 5), (1, 8), (3, 8)])
        gold = f"{p / q:g}" if rng.random() < 0.7 else f"{(p + 1) / q:g}"
        return f"Therefore $\\boxed{{\\frac{{{p}}}{{{q}}}}}$.", gold
    if kind < 0.80:  # plain text: no LaTeX answer to extract
        return f"The answer is {n}.", str(n)
    if kind < 0.85:  # malformed LaTeX
        return rng.choice([f"\\boxed{{{n}", f"\\boxed{{\\frac{{{n}}}{{}}}}", "\\boxed{}"]), str(n)
    a, b = rng.randint(1, 9), rng.randint(1, 9)  # LaTeX-heavy
    return rng.choice([
        (f"$\\boxed{{x^2 + {2 * a}x + {a * a}}}$", f"(x+{a})^2"),
        (f"$\\boxed{{x^2 + {2 * a + 1}x + {a * a}}}$", f"(x+{a})^2"),
        (f"$\\boxed{{\\sqrt{{{a * a * b}}}}}$", f"{a}\\sqrt{{{b}}}"),
        (f"$\\boxed{{\\begin{{pmatrix}} {a} & {b} \\\\ {b} & {a} \\end{{pmatrix}}}}$",
         f"\\begin{{pmatrix}} {a} & {b} \\\\ {b} & {a} \\end{{pmatrix}}"),
        (f"$\\boxed{{\\{{{a}, {b}, {a + b}\\}}}}$", f"\\{{{a + b}, {a}, {b}\\}}"),
        (f"$\\boxed{{[{a}, {a + b})}}$", f"[{a}, {a + b})"),
        (f"$\\boxed{{\\frac{{\\sqrt{{{a}}}}}{{{b}}} + \\frac{{1}}{{{a + b}}}}}$",
         f"\\frac{{\\sqrt{{{a}}}}}{{{b}}} + \\frac{{1}}{{{a + b}}}"),
    ])


def make_batch(n: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    responses, golds = [], []
    for _ in range(n):
        final, gold = _answer(rng)
        responses.append(_reasoning(rng) + final)
        golds.append(gold)
    return responses, golds


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _workers_now() -> list:
    """Every reward worker alive now (all pools': the idle ones add nothing to the CPU time)."""
    return [psutil.Process(p.pid) for p in mp.active_children() if p.name == "pebble_pool_worker"]


def _cpu_s(procs: list) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _burn(n: int = 3_000_000) -> None:
    total = 0
    for i in range(n):
        total += i * i


def ceiling(workers: int) -> float:
    """How much faster `workers` processes finish `workers` units of plain Python work than one does them."""
    ctx = mp.get_context("spawn")
    times = []
    for k in (1, workers):
        procs = [ctx.Process(target=_burn) for _ in range(k)]
        start = time.perf_counter()
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        times.append(time.perf_counter() - start)
    return workers * times[0] / times[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--responses", type=int, default=4096)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts; the first is the baseline")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per worker count, interleaved")
    ap.add_argument("--timeout", type=float, default=5.0, help="per-answer budget (RewardConfig.timeout_s)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    responses, golds = make_batch(args.responses, args.seed)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"CPU: {cpu_model()}, {cores} cores usable, load average {os.getloadavg()[0]:.2f} at start")
    print(f"R1 {len(responses)} responses, mean {sum(map(len, responses)) / len(responses):.0f} chars, "
          f"timeout {args.timeout:g} s, {args.repeats} interleaved calls per worker count, medians")
    fns = {w: RewardFunction(RewardConfig(kind="math_verify", timeout_s=args.timeout, num_workers=w))
           for w in counts}
    try:
        startup = {}
        for w, fn in fns.items():
            start = time.perf_counter()
            fn(responses[:4 * w], golds[:4 * w])  # starts the pool; returns once a worker is warm
            startup[w] = time.perf_counter() - start
            time.sleep(startup[w])  # the other workers started at the same time: let them finish warming up
        top = max(counts)
        print(f"R0 the machine runs {top} processes {ceiling(top):.2f}x as fast as 1 (before)")
        seconds = {w: [] for w in counts}
        cpu = {w: [] for w in counts}
        rewards = {}
        for _ in range(args.repeats):
            for w, fn in fns.items():
                fn.stats.__init__()
                workers = _workers_now()
                cpu0, start = _cpu_s(workers), time.perf_counter()
                rewards[w] = fn(responses, golds)
                seconds[w].append(time.perf_counter() - start)
                cpu[w].append(_cpu_s(workers) - cpu0)
        print(f"R0 the machine runs {top} processes {ceiling(top):.2f}x as fast as 1 (after)")
        base = statistics.median(seconds[counts[0]])
        for w, fn in fns.items():
            t, st = statistics.median(seconds[w]), fn.stats
            print(f"R1 workers={w}: {t:.2f} s ({len(responses) / t:.0f} answers/s; calls "
                  f"{', '.join(f'{x:.1f}' for x in seconds[w])} s), speed-up {base / t:.2f}x; CPU s in all "
                  f"reward workers during the call {statistics.median(cpu[w]):.1f}; start-up {startup[w]:.2f} s; "
                  f"correct {st.correct}, timeouts {st.timeouts}, errors {st.errors}, worker restarts "
                  f"{st.worker_restarts}; same rewards as {counts[0]} worker(s): {rewards[w] == rewards[counts[0]]}")
    finally:
        for fn in fns.values():
            fn.close()
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
