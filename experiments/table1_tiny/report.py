"""The Table 1 report, built only from the runs' metrics.jsonl (no number is typed in by hand).

Per run: held-out pass@1 at the start, at the end and at its best evaluation; the reward curve's area
(mean training reward over the steps); the median over steps of the sampler<->learner k3 (a mean is
dominated by the few steps where a router decision flips); the TBPO masked fraction (TBPO arms); the
looping-response rate (rl.repetition) of the training samples and of the last evaluation; the median step
time. Per arm: mean +- sample std over its seeds. Plots: reward and k3 against the step, the seed mean
with a band from the lowest to the highest seed.
"""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from machine import cpu_description  # noqa: E402

from megatron_qarl.rl.repetition import is_repetitive  # noqa: E402

COLUMNS = (  # (key in the per-run summary, column title, format)
    ("pass1_start", "pass@1 start", "{:.3f}"),
    ("pass1_final", "pass@1 final", "{:.3f}"),
    ("pass1_best", "pass@1 best", "{:.3f}"),
    ("reward_area", "reward area", "{:.3f}"),
    ("k3", "k3 sampler-learner (median step)", "{:.2e}"),
    ("masked", "TBPO masked", "{:.3f}"),
    ("repetitive", "looping (train)", "{:.4f}"),
    ("repetitive_eval", "looping (eval, last)", "{:.4f}"),
    ("step_s", "step s", "{:.2f}"),
)


DEQUANTIZED_SAMPLER = "the embedded engine (our dequantized arithmetic), not a real int4 kernel"


@dataclass(frozen=True)
class Section:
    """One regime's table: rows of (role, run name, label). The role is what the findings compare
    (`bf16_grpo_tis`, `qarl_w4a16_tbpo`, ...); the run name is the arm's directory under runs/."""
    title: str
    rows: list[tuple[str, str, str]]
    sampler: str = DEQUANTIZED_SAMPLER  # what samples the section's W4A16 arms


def run_dir(out: Path, arm: str, seed: int) -> Path:
    """Where one arm's run for one seed keeps its metrics, config and log (written by run.py)."""
    return out / "runs" / arm / f"seed{seed}"


def load_rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _mean(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
    return statistics.fmean(values) if values else math.nan


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
    return statistics.median(values) if values else math.nan


def summarize_run(rows: list[dict]) -> dict:
    train = sorted((r for r in rows if "reward/mean" in r), key=lambda r: r["step"])
    evals = sorted((r for r in rows if "eval/pass@1" in r), key=lambda r: r["step"])
    return {
        "steps": len(train),
        "pass1_start": evals[0]["eval/pass@1"] if evals else math.nan,
        "pass1_final": evals[-1]["eval/pass@1"] if evals else math.nan,
        "pass1_best": max((r["eval/pass@1"] for r in evals), default=math.nan),
        "reward_area": _mean(train, "reward/mean"),
        "k3": _median(train, "mismatch/k3"),  # a few steps' routing flips would dominate a mean
        "masked": _mean(train, "tbpo/masked_frac"),
        "repetitive": _mean(train, "response/repetitive_frac"),
        "repetitive_eval": evals[-1].get("eval/repetitive_frac", math.nan) if evals else math.nan,
        "step_s": statistics.median(r["time/step_s"] for r in train) if train else math.nan,
        "curves": {"step": [r["step"] for r in train], "reward": [r.get("reward/mean", math.nan) for r in train],
                   "k3": [r.get("mismatch/k3", math.nan) for r in train]},
    }


def looping_floor(out: Path) -> float:
    """The fraction of the task's correct training answers the looping detector flags (NaN without data).
    The char tokenizer makes one token per character, so characters compare as the token ids do."""
    path = out / "data" / "train.jsonl"
    if not path.exists():
        return math.nan
    answers = [json.loads(line)["answer"] for line in path.read_text().splitlines() if line.strip()]
    return sum(is_repetitive(list(a)) for a in answers) / max(len(answers), 1)


def mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else math.nan


def _cell(values: list[float], fmt: str) -> str:
    mean, std = mean_std(values)
    if math.isnan(mean):
        return "-"
    return fmt.format(mean) + ("" if math.isnan(std) else " ± " + fmt.format(std))


def _git_commit(repo: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _plots(summaries: dict, labels: dict, out: Path, prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for key, title, log in (("reward", "training reward (mean of the step's samples)", False),
                            ("k3", "sampler-learner k3", True)):
        fig, ax = plt.subplots(figsize=(7, 4), dpi=80)
        for arm, runs in summaries.items():
            curves = [r["curves"] for r in runs if r["curves"]["step"]]
            if not curves:
                continue
            n = min(len(c["step"]) for c in curves)
            steps = curves[0]["step"][:n]
            per_step = list(zip(*(c[key][:n] for c in curves)))
            mean = [statistics.fmean(v) for v in per_step]
            line, = ax.plot(steps, mean, label=labels[arm])
            if len(curves) > 1:
                ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step],
                                color=line.get_color(), alpha=0.15)
        ax.set_xlabel("RL step")
        ax.set_title(title + " (band: lowest to highest seed)")
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{prefix}{key}.png"
        fig.savefig(out / name)
        plt.close(fig)
        names.append(name)
    return names


def _per_arm(summaries: dict, key: str) -> dict:
    """{arm: (mean, sample std)} of one per-run summary value over the arm's seeds."""
    return {arm: mean_std([r[key] for r in runs]) for arm, runs in summaries.items()}


def findings(summaries: dict, labels: dict, sampler: str = DEQUANTIZED_SAMPLER) -> list[str]:
    """Statements computed from the numbers: the k3 ratio aligned vs unaligned, and the pass@1 ordering
    with each arm's seed spread."""
    out = []
    k3 = {arm: mean for arm, (mean, _) in _per_arm(summaries, "k3").items()}
    if "qarl_w4a16_tbpo" in k3 and "w4a16_rollout_grpo_tis" in k3 and k3["w4a16_rollout_grpo_tis"] > 0:
        ratio = k3["qarl_w4a16_tbpo"] / k3["w4a16_rollout_grpo_tis"]
        out.append(f"- Sampler-learner k3, aligned W4A16 learner / unaligned (BF16 learner, same W4A16 sampler): "
                   f"**{ratio:.3f}** (the paper's claim, with a real int4 sampler: <= 0.1). Sampler here: {sampler}.")
    final = _per_arm(summaries, "pass1_final")
    ranked = sorted((a for a in final if not math.isnan(final[a][0])), key=lambda a: -final[a][0])
    if ranked:
        parts = [f"{labels[a]} {final[a][0]:.3f}" + ("" if math.isnan(final[a][1]) else f" ± {final[a][1]:.3f}")
                 for a in ranked]
        out.append("- Final held-out pass@1, best first: " + "; ".join(parts) + ".")
        spread = [final[a][1] for a in ranked if not math.isnan(final[a][1])]
        gaps = [final[ranked[i]][0] - final[ranked[i + 1]][0] for i in range(len(ranked) - 1)]
        if spread and gaps:
            separated = sum(g > max(spread) for g in gaps)
            out.append(f"- Neighbouring arms differ by {min(gaps):.3f}-{max(gaps):.3f}; the largest seed std is "
                       f"{max(spread):.3f}: {separated} of {len(gaps)} neighbouring gaps exceed it.")
    out += _paired_findings(final, summaries, labels)
    return out


def _gap(final: dict, a: str, b: str) -> tuple[float, float] | None:
    """(mean of a - mean of b, the larger of the two seed stds) of final pass@1, when both arms ran."""
    if a not in final or b not in final:
        return None
    spread = max((v for v in (final[a][1], final[b][1]) if not math.isnan(v)), default=math.nan)
    return final[a][0] - final[b][0], spread


def _paired_findings(final: dict, summaries: dict, labels: dict) -> list[str]:
    """The comparisons that isolate one cause each: the quantized sampler (BF16 vs W4A16 rollout, both
    GRPO+TIS), alignment + TBPO vs the quantized sampler alone, and the objective at fixed alignment
    (QaRL + TBPO vs QaRL + GRPO)."""
    out = []
    for a, b, what in (("bf16_grpo_tis", "w4a16_rollout_grpo_tis", "cost of the W4A16 sampler (BF16 minus W4A16 rollout)"),
                       ("qarl_w4a16_tbpo", "w4a16_rollout_grpo_tis", "QaRL + TBPO minus W4A16 rollout"),
                       ("qarl_w4a16_tbpo", "qarl_w4a16_grpo", "TBPO minus GRPO, both on the aligned W4A16 learner")):
        gap = _gap(final, a, b)
        if gap is None:
            continue
        diff, spread = gap
        verdict = ("within seed noise" if not math.isnan(spread) and abs(diff) <= spread
                   else "larger than the seed std" if not math.isnan(spread) else "one seed: no spread")
        out.append(f"- {what}: {diff:+.3f} final pass@1 ({verdict}, std {spread:.3f}).")
    masked = [r["masked"] for arm, runs in summaries.items() if arm.endswith("_tbpo") for r in runs
              if not math.isnan(r["masked"])]  # the TBPO arms with the paper's bands (not the ablation)
    if masked:
        out.append(f"- TBPO's trust band (paper Table 2 bands) masked {statistics.fmean(masked):.0%} of the sequences "
                   "on average over the TBPO arms; a masked sequence contributes no gradient that step.")
    return out


def regime_comparison(per_section: list[tuple[Section, dict]]) -> list[str]:
    """How each later regime moves the sampler-learner k3 of the W4A16 arms and the sampler's cost in
    final pass@1, against the first regime."""
    (first, base), out = per_section[0], []
    for section, summaries in per_section[1:]:
        for role, what in (("w4a16_rollout_grpo_tis", "unaligned (BF16 learner)"), ("qarl_w4a16_tbpo", "aligned (QaRL)")):
            if role in base and role in summaries:
                a, b = (_per_arm(s, "k3")[role][0] for s in (base, summaries))
                out.append(f"- {section.title}: the {what} sampler-learner k3 is {b:.2e} against {a:.2e} in "
                           f"{first.title} (x{b / a:.1f}).")
    for section, summaries in per_section:  # each regime's cost of the W4A16 sampler, once
        gap = _gap(_per_arm(summaries, "pass1_final"), "bf16_grpo_tis", "w4a16_rollout_grpo_tis")
        if gap is not None:
            out.append(f"- BF16 minus W4A16 rollout, {section.title}: {gap[0]:+.3f} final pass@1 (larger seed std "
                       f"{gap[1]:.3f}).")
    return out


def _summaries(out: Path, section: Section, seeds: list[int]) -> tuple[dict, list[str]]:
    """{role: [per-seed summary]} of the section's finished runs, and the runs not finished."""
    summaries, missing = {}, []
    for role, name, _ in section.rows:
        runs = []
        for seed in seeds:
            run = run_dir(out, name, seed)
            if (run / "DONE").exists():
                runs.append(summarize_run(load_rows(run)))
            else:
                missing.append(f"{name}/seed{seed}")
        if runs:
            summaries[role] = runs
    return summaries, missing


def write_report(out: Path, sections: list[Section], seeds: list[int], docs: Path | None = None) -> str:
    """Markdown report of the finished runs under `out`, a table, findings and plots per section (also to
    `docs`/results.md with its plots in `docs`/results/ when given). Returns the markdown."""
    plot_dir = (docs / "results") if docs is not None else (out / "report")
    plot_dir.mkdir(parents=True, exist_ok=True)
    rel = "results" if docs is not None else "report"
    sft = out / "sft_log" / "sft_metrics.json"
    warm = json.loads(sft.read_text()) if sft.exists() else {}
    lines = [
        "# Table 1 at CPU scale (generated by `experiments/table1_tiny/run.py`; do not edit by hand)",
        "",
        f"Seeds {seeds}; sampler: the embedded engine (transformers, fp32; W4A16 linears on our dequantization of "
        f"the published codes unless a section says otherwise); report built at commit "
        f"{_git_commit(Path(__file__).resolve().parent)} (each run's config.yaml and train.log are kept beside its "
        f"metrics); CPU: {cpu_description()}.",
        f"Warm start (shared by every run): SFT {warm.get('step', '?')} steps, held-out sampled accuracy "
        f"{warm.get('eval/sampled_accuracy', math.nan):.3f} (greedy {warm.get('eval/greedy_accuracy', math.nan):.3f}).",
    ]
    floor = looping_floor(out)
    if not math.isnan(floor):
        lines.append(f"The looping detector flags {floor:.3%} of this task's correct answers (a chain that adds "
                     "zero three times to a one-digit sum repeats one step): looping rates near that are that "
                     "floor, not loops.")
    per_section = []
    for number, section in enumerate(sections, 1):
        summaries, missing = _summaries(out, section, seeds)
        per_section.append((section, summaries))
        labels = {role: label for role, _, label in section.rows}
        steps = sorted({r["steps"] for runs in summaries.values() for r in runs})
        lines += ["", f"## {number}. {section.title}", "",
                  f"Runs: {', '.join(f'`{name}`' for role, name, _ in section.rows if role in summaries)}; "
                  f"{'/'.join(map(str, steps))} RL steps.", "",
                  "| arm | seeds | " + " | ".join(c[1] for c in COLUMNS) + " |",
                  "|---|---|" + "---|" * len(COLUMNS)]
        for role, runs in summaries.items():
            lines.append(f"| {labels[role]} | {len(runs)} | "
                         + " | ".join(_cell([r[key] for r in runs], fmt) for key, _, fmt in COLUMNS) + " |")
        lines += ["", "Mean ± sample std over seeds. Computed:", "", *findings(summaries, labels, section.sampler), ""]
        if missing:
            lines += [f"Not run (yet): {', '.join(missing)}.", ""]
        plots = _plots(summaries, labels, plot_dir, prefix=f"table1_{number}_") if summaries else []
        lines += [f"![{p}]({rel}/{p})" for p in plots]
    if len(per_section) > 1:
        lines += ["", "## Across the regimes", "", *regime_comparison(per_section)]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    if docs is not None:
        (docs / "results.md").write_text(text)
    return text
