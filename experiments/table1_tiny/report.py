"""The Table 1 report, built only from the runs' metrics.jsonl (no number is typed in by hand).

Per run: held-out pass@1 at the start, at the end and at its best evaluation; the reward curve's area
(mean training reward over the steps); the median over steps of the sampler<->learner k3 (a mean is
dominated by the few steps where a router decision flips); the TBPO masked fraction (TBPO arms); the
looping-response rate (rl.repetition) of the training samples and of the last evaluation; the median step
time. Per arm: mean +- sample std over its seeds. Plots: reward and k3 against the step, the seed mean
with a band from the lowest to the highest seed.

The other phases' reports (run.py --phase):
- calibration (`write_calibration_report`): per calibration point (objective, lr, mini-batches, band) the
  mean over steps of tbpo/masked_frac, of GSPO's clipped-sequence fraction (gspo/clip_frac_high + _low: the
  two sides are disjoint), and of the last mini-batch's drift p50/p90 (drift/mb{i}/p50|p90, i the highest
  mini-batch index of the step: the one furthest from the behaviour policy), and the final pass@1;
- ladder (`write_ladder_report`): per rung the unaligned k3 (the BF16-learner arms' mismatch/k3) and the
  aligned k3 (the QaRL arms'), each run's median over steps, averaged over the rung's runs; final pass@1
  per arm; a figure of final pass@1 against the rung's unaligned k3, one line per arm;
- long: the Table 1 table for the long-response task (`write_report`), with the responses' lengths.
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

from megatron_qarl.fileio import atomic_write_text  # noqa: E402
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


def last_minibatch_drift(row: dict) -> tuple[float, float] | None:
    """(p50, p90) of |log r_seq| in the step's last mini-batch (the highest drift/mb{i} index), or None."""
    indices = [int(k.split("/")[1][2:]) for k in row if k.startswith("drift/mb") and k.endswith("/p50")]
    if not indices:
        return None
    i = max(indices)
    return row[f"drift/mb{i}/p50"], row.get(f"drift/mb{i}/p90", math.nan)


def _gspo_clip(row: dict) -> float:
    if "gspo/clip_frac_high" not in row and "gspo/clip_frac_low" not in row:
        return math.nan
    return row.get("gspo/clip_frac_high", 0.0) + row.get("gspo/clip_frac_low", 0.0)


def summarize_run(rows: list[dict]) -> dict:
    train = sorted((r for r in rows if "reward/mean" in r), key=lambda r: r["step"])
    evals = sorted((r for r in rows if "eval/pass@1" in r), key=lambda r: r["step"])
    drift = [d for d in map(last_minibatch_drift, train) if d is not None]
    clip = [c for c in map(_gspo_clip, train) if not math.isnan(c)]
    return {
        "gspo_clip": statistics.fmean(clip) if clip else math.nan,
        "drift_p50": statistics.fmean(d[0] for d in drift) if drift else math.nan,
        "drift_p90": _mean([{"v": d[1]} for d in drift], "v"),
        "length": _mean(train, "response/length_mean"),
        "steps": len(train),
        "pass1_start": evals[0]["eval/pass@1"] if evals else math.nan,
        "pass1_final": evals[-1]["eval/pass@1"] if evals else math.nan,
        "pass1_best": max((r["eval/pass@1"] for r in evals), default=math.nan),
        # the end of training with less evaluation noise: the mean of the last three evaluations
        "pass1_last3": statistics.fmean(r["eval/pass@1"] for r in evals[-3:]) if evals else math.nan,
        "reward_area": _mean(train, "reward/mean"),
        "k3": _median(train, "mismatch/k3"),  # a few steps' routing flips would dominate a mean
        "masked": _mean(train, "tbpo/masked_frac"),
        **{f"masked_{side}": _mean(train, f"tbpo/masked_{side}") for side in TBPO_SIDES},
        "repetitive": _mean(train, "response/repetitive_frac"),
        "repetitive_eval": evals[-1].get("eval/repetitive_frac", math.nan) if evals else math.nan,
        "step_s": statistics.median(r["time/step_s"] for r in train) if train else math.nan,
        "curves": {"step": [r["step"] for r in train], "reward": [r.get("reward/mean", math.nan) for r in train],
                   "k3": [r.get("mismatch/k3", math.nan) for r in train]},
    }


TBPO_SIDES = {"pos_high": "positives above 1 + eps_h", "neg_low": "negatives below 1 - delta_l",
              "neg_high": "negatives above 1 + delta_h"}


def tbpo_sides(runs: list[dict]) -> str:
    """Where TBPO's band masked, as fractions of all sequences (mean over steps and seeds): by side."""
    return ", ".join(f"{what} {mean_std([r.get(f'masked_{side}', math.nan) for r in runs])[0]:.3f}"
                     for side, what in TBPO_SIDES.items())


def learner_pass1(run: Path) -> float:
    """Held-out pass@1 of the run's final learner evaluated without quantization (run.py --learner-eval: the
    "eval at start" of a 1-step run from its last checkpoint with a BF16 sampler); NaN without one."""
    if not (run / "learner_eval" / "DONE").exists():
        return math.nan
    start = [r for r in load_rows(run / "learner_eval") if "eval/pass@1" in r and r.get("step") == 0]
    return start[0]["eval/pass@1"] if start else math.nan


def learner_lines(rows: list[tuple[str, list[dict]]]) -> list[str]:
    """(label, runs) of unaligned arms -> one line each where their final learners were evaluated unquantized:
    the quantized deployment's final pass@1 against the learner's, mean ± std over the seeds that have both."""
    out = []
    for label, runs in rows:
        both = [r for r in runs if not math.isnan(r.get("learner_pass1", math.nan))]
        if both:
            out.append(f"- {label}: final pass@1 quantized (its sampler) {_cell([r['pass1_final'] for r in both], '{:.3f}')}"
                       f", the same learner unquantized {_cell([r['learner_pass1'] for r in both], '{:.3f}')} "
                       f"(n={len(both)}).")
    return out


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
    out += learner_lines([(labels[a], runs) for a, runs in summaries.items()])
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
        tbpo_runs = [r for arm, runs in summaries.items() if arm.endswith("_tbpo") for r in runs]
        out.append(f"- TBPO's trust band (paper Table 2 bands) masked {statistics.fmean(masked):.0%} of the sequences "
                   f"on average over the TBPO arms ({tbpo_sides(tbpo_runs)}); a masked sequence contributes no "
                   "gradient that step.")
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
                runs.append({**summarize_run(load_rows(run)), "learner_pass1": learner_pass1(run)})
            else:
                missing.append(f"{name}/seed{seed}")
        if runs:
            summaries[role] = runs
    return summaries, missing


def _header(title: str, home: Path, seeds: list[int]) -> list[str]:
    """The report's title, provenance and the task's warm start (`home`: the task's data and sft_log)."""
    sft = home / "sft_log" / "sft_metrics.json"
    warm = json.loads(sft.read_text()) if sft.exists() else {}
    return [
        f"# {title} (generated by `experiments/table1_tiny/run.py`; do not edit by hand)",
        "",
        f"Seeds {seeds}; sampler: the embedded engine (transformers, fp32; W4A16 linears on our dequantization of "
        f"the published codes unless a section says otherwise); report built at commit "
        f"{_git_commit(Path(__file__).resolve().parent)} (each run's overrides.txt, config.yaml and train.log are "
        f"kept beside its metrics); CPU: {cpu_description()}.",
        f"Warm start (shared by every run): SFT {warm.get('step', '?')} steps, held-out sampled accuracy "
        f"{warm.get('eval/sampled_accuracy', math.nan):.3f} (greedy {warm.get('eval/greedy_accuracy', math.nan):.3f}).",
    ]


def _plot_dir(out: Path, docs: Path | None) -> tuple[Path, str]:
    plot_dir = (docs / "results") if docs is not None else (out / "report")
    plot_dir.mkdir(parents=True, exist_ok=True)
    return plot_dir, "results" if docs is not None else "report"


def _write(out: Path, docs: Path | None, name: str, lines: list[str]) -> str:
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    if docs is not None:
        (docs / f"{name}.md").write_text(text)
    return text


def answer_lengths(home: Path) -> tuple[int, float, int] | None:
    """(min, mean, max) characters of the task's training answers (one token each, + EOS), or None."""
    path = home / "data" / "train.jsonl"
    if not path.exists():
        return None
    lengths = [len(json.loads(line)["answer"]) for line in path.read_text().splitlines() if line.strip()]
    return (min(lengths), statistics.fmean(lengths), max(lengths)) if lengths else None


def write_report(out: Path, sections: list[Section], seeds: list[int], docs: Path | None = None,
                 home: Path | None = None, name: str = "results") -> str:
    """Markdown report of the finished runs under `out`, a table, findings and plots per section (also to
    `docs`/<name>.md with its plots in `docs`/results/ when given). `home`: the task's data and warm start
    (default `out`). Returns the markdown."""
    home = out if home is None else home
    plot_dir, rel = _plot_dir(out, docs)
    title = "Table 1 at CPU scale" if name == "results" else f"Table 1 at CPU scale, {name.removeprefix('results_')}"
    lines = _header(title, home, seeds)
    lengths = answer_lengths(home) if name != "results" else None
    if lengths:
        lines.append(f"Task answers: {lengths[0]}-{lengths[2]} characters (mean {lengths[1]:.1f}) + EOS, one token "
                     "per character.")
    floor = looping_floor(home)
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
        plots = _plots(summaries, labels, plot_dir, prefix=f"table1_{number}_" if name == "results"
                       else f"{name}_{number}_") if summaries else []
        lines += [f"![{p}]({rel}/{p})" for p in plots]
        if summaries and name != "results":
            length = {role: mean_std([r["length"] for r in runs])[0] for role, runs in summaries.items()}
            if any(not math.isnan(v) for v in length.values()):
                lines += ["", "Mean training response length (tokens, mean over steps and seeds): " + "; ".join(
                    f"{labels[role]} {v:.1f}" for role, v in length.items() if not math.isnan(v)) + "."]
    if len(per_section) > 1:
        lines += ["", "## Across the regimes", "", *regime_comparison(per_section)]
    if name == "results" and docs is not None:
        lines += other_phase_links(docs)
    return _write(out, docs, name, lines)


OTHER_PHASES = {"results_calibrate": "Drift calibration (lr x mini-batches, TBPO's band)",
                "results_ladder": "Harsher-sampler ladder (W4 g128 .. W2 g128)",
                "results_calibrate_long": "Drift calibration on the long task (lr for 68-78-token responses)",
                "results_long": "Long responses (16-term chains)"}


PHASES_HEADING = "## The other phases (issue 33)"


def _page_body(text: str) -> list[str]:
    """A phase page without its title line, its headings one level down (they sit under a ### there)."""
    lines = text.rstrip("\n").splitlines()[1:]
    return [("#" + li) if li.startswith("#") else li for li in lines]


def other_phase_links(docs: Path) -> list[str]:
    """docs/results.md's section of the other phases' pages that `run.py --phase ... --docs` wrote: per page its
    title, a link to it and its whole body (tables, decisions, figures: the pages and this one share docs/)."""
    out = []
    for page, title in OTHER_PHASES.items():
        path = docs / f"{page}.md"
        if path.exists():
            out += ["", f"### {title}", "", f"Also as its own page: [{page}.md]({page}.md).", *_page_body(path.read_text())]
    return ["", PHASES_HEADING, "", "These phases ran without the MoE load-balancing loss (every run's overrides.txt "
            "pins train.moe_aux_loss_coeff=0, the trainer's default since); Table 1's sections above ran with "
            "Qwen3's 0.001, before that key existed.", *out] if out else []


def refresh_results_page(docs: Path) -> None:
    """Rewrite only the other phases' section of docs/results.md (after a phase's page changed); Table 1's own
    sections stay as their runs generated them."""
    path = docs / "results.md"
    if not path.exists():
        return
    head = path.read_text().split("\n" + PHASES_HEADING + "\n")[0].rstrip("\n")
    atomic_write_text(path, "\n".join([head, *other_phase_links(docs)]) + "\n")


def _arm_summaries(out: Path, arms, seeds: list[int]) -> tuple[dict, list[str]]:
    """{arm name: [per-seed summary]} of the finished runs, and the runs not finished."""
    return _summaries(out, Section("", [(a.name, a.name, a.label) for a in arms]), seeds)


CALIBRATION_TARGET = (0.10, 0.20)  # the masked / clipped sequence fraction the calibration aims at
CALIBRATION_COLUMNS = (("masked", "TBPO masked", "{:.3f}"), ("gspo_clip", "GSPO clipped", "{:.3f}"),
                       ("drift_p50", "drift last mb p50", "{:.2e}"), ("drift_p90", "drift last mb p90", "{:.2e}"),
                       ("pass1_start", "pass@1 start", "{:.3f}"), ("pass1_final", "pass@1 final", "{:.3f}"))
# A point collapses when its final held-out pass@1 is this far below its start: ~3.5 binomial std of one
# evaluation of 256 samples at p ~ 0.7 (sqrt(0.21 / 256) = 0.029), ~2.5 of the difference of two.
COLLAPSE = 0.1


def _collapsed(runs: list[dict]) -> bool:
    return mean_std([r["pass1_start"] - r["pass1_final"] for r in runs])[0] > COLLAPSE


def _fraction(arm, runs: list[dict]) -> float:
    """The calibrated quantity of a run's objective: TBPO's masked fraction or GSPO's clipped fraction."""
    return mean_std([r["masked" if arm.param["objective"] == "tbpo" else "gspo_clip"] for r in runs])[0]


def write_calibration_report(out: Path, arms, seeds: list[int], home: Path | None = None,
                             docs: Path | None = None, name: str = "results_calibrate",
                             chosen_point: tuple[float, int] | None = None) -> str:
    """The calibration table (one row per calibration point: arm.param objective, lr, mini_batches, band), which
    points put the objective's masked / clipped fraction in CALIBRATION_TARGET, which collapse (final pass@1
    more than COLLAPSE below the start), and the facts of the chosen point (`chosen_point`, run.py's --lr /
    --mini-batches; without it the point of the band sweep)."""
    home = out if home is None else home
    summaries, missing = _arm_summaries(out, arms, seeds)
    low, high = CALIBRATION_TARGET
    lines = _header("Drift calibration at CPU scale", home, seeds)
    lines += ["", f"Target: TBPO's masked fraction (tbpo/masked_frac) and GSPO's clipped-sequence fraction "
                  f"(gspo/clip_frac_high + gspo/clip_frac_low) in {low:.0%}-{high:.0%}. Drift: |log r_seq| between "
                  "the behaviour policy and the current one in the step's last mini-batch (drift/mb{last}), "
                  "mean over steps. Mean ± sample std over seeds.", "",
              "| objective | lr | mini-batches | band | seeds | " + " | ".join(c[1] for c in CALIBRATION_COLUMNS)
              + " | in target |", "|---|---|---|---|---|" + "---|" * len(CALIBRATION_COLUMNS) + "---|"]
    for arm in arms:
        runs = summaries.get(arm.name)
        if not runs:
            continue
        p = arm.param
        frac = _fraction(arm, runs)
        lines.append(f"| {p['objective']} | {p['lr']:g} | {p['mini_batches']} | x{p['band']:g} | {len(runs)} | "
                     + " | ".join(_cell([r[k] for r in runs], fmt) for k, _, fmt in CALIBRATION_COLUMNS)
                     + f" | {'-' if math.isnan(frac) else 'yes' if low <= frac <= high else 'no'} |")
    lines += ["", "Computed:", ""]
    points: dict = {}
    for arm in arms:
        if arm.name in summaries and arm.regime == "grid":
            points.setdefault((arm.param["lr"], arm.param["mini_batches"]), {})[arm.param["objective"]] = \
                _fraction(arm, summaries[arm.name])
    both = [f"lr {lr:g} x {mb} mini-batches" for (lr, mb), fr in points.items()
            if len(fr) == 2 and all(low <= v <= high for v in fr.values())]
    if points:
        lines.append(f"- Grid points where both TBPO's masked and GSPO's clipped fraction are in {low:.0%}-{high:.0%}: "
                     + ("; ".join(both) if both else "none") + ".")
    collapsed = {(a.param["lr"], a.param["mini_batches"]) for a in arms
                 if a.name in summaries and a.regime == "grid" and _collapsed(summaries[a.name])}
    if points:
        lines.append(f"- Grid points where held-out pass@1 collapses (final more than {COLLAPSE:g} below the start): "
                     + ("; ".join(f"lr {lr:g} x {mb} mini-batches" for lr, mb in sorted(collapsed)) or "none") + ".")
    band_arms = [arm for arm in arms if arm.regime == "band"]
    chosen = {chosen_point} if chosen_point else {(a.param["lr"], a.param["mini_batches"]) for a in band_arms}
    if len(chosen) == 1 and not any(a.param["band"] == 1 for a in band_arms):  # x1 is the grid's TBPO run there
        band_arms += [a for a in arms if a.regime == "grid" and a.param["objective"] == "tbpo"
                      and (a.param["lr"], a.param["mini_batches"]) in chosen]
    bands = sorted((arm.param["band"], _fraction(arm, summaries[arm.name]),
                    mean_std([r["pass1_final"] for r in summaries[arm.name]])[0])
                   for arm in band_arms if arm.name in summaries)
    if len(chosen) == 1:  # the point the ladder and long phases train at (run.py --lr / --mini-batches)
        lr, mb = next(iter(chosen))
        fr = points.get((lr, mb), {})
        why = (f"both objectives' fractions are in {low:.0%}-{high:.0%} there" if len(fr) == 2 and
               all(low <= v <= high for v in fr.values()) else f"NOT a grid point with both in {low:.0%}-{high:.0%}")
        if (lr, mb) in points:
            larger = sorted(g for g in points if g[1] == mb and g[0] > lr)
            why += ("; pass@1 collapses there" if (lr, mb) in collapsed else "; pass@1 holds there") + (
                f", and collapses at every larger lr of the grid ({', '.join(f'{g[0]:g}' for g in larger)})"
                if larger and all(g in collapsed for g in larger) else "")
        lines.append(f"- Chosen (run.py --lr / --mini-batches, what the ladder and long phases train at): lr {lr:g} x "
                     f"{mb} mini-batches: {why}.")
    if bands:
        lr, mb = next(iter(chosen)) if len(chosen) == 1 else (math.nan, 0)
        lines.append(f"- TBPO against its band width (lr {lr:g}, {mb} mini-batches): " + "; ".join(
            f"x{k:g}: masked {m:.3f}, final pass@1 {p:.3f}" for k, m, p in bands) + ".")
    steps = sorted({r["steps"] for runs in summaries.values() for r in runs if "steps" in r})
    if steps:
        lines.append(f"- RL steps per run: {'/'.join(map(str, steps))}.")
    if missing:
        lines += ["", f"Not run (yet): {', '.join(missing)}."]
    return _write(out, docs, name, lines)


def ladder_rows(summaries: dict, arms, key: str = "pass1_final") -> list[dict]:
    """Per rung (in the arms' order): its label, the unaligned and aligned k3 (the mean over the rung's
    unaligned / aligned runs of each run's median-step k3), {role: (mean, std)} and {role: per-seed values}
    of `key` (final pass@1), its aligned / unaligned roles and TBPO's masked fraction."""
    rungs: dict = {}
    for arm in arms:
        if "rung" not in arm.param or arm.name not in summaries:
            continue
        rung = rungs.setdefault(arm.param["rung"], {"rung": arm.param["rung"], "label": arm.param["rung_label"],
                                                    "twin": arm.param.get("twin", ""),
                                                    "unaligned": [], "aligned": [], "pass1": {},
                                                    "finals": {}, "aligned_roles": [], "unaligned_roles": [],
                                                    "start": []})
        runs = summaries[arm.name]
        rung["start"] += [r["pass1_start"] for r in runs]  # every arm's sampler at step 0: the rung's codes
        rung["aligned" if arm.param["aligned"] else "unaligned"] += [r["k3"] for r in runs]
        rung["pass1"][arm.role] = mean_std([r[key] for r in runs])
        rung["finals"][arm.role] = [r[key] for r in runs]
        rung["aligned_roles" if arm.param["aligned"] else "unaligned_roles"].append(arm.role)
        if arm.role.endswith("_tbpo"):
            rung["masked"] = mean_std([r["masked"] for r in runs])
    for rung in rungs.values():
        rung["k3_unaligned"] = mean_std(rung.pop("unaligned"))
        rung["k3_aligned"] = mean_std(rung.pop("aligned"))
    return list(rungs.values())


SEEDS_FOR_A_CLAIM = 3  # the bar: a claim needs >= 3 seeds per arm
HURT_STDS = 2.0  # "quantized rollouts hurt": below BF16 by more than this many seed stds
CLOSED_FRACTION = 0.5  # "alignment recovers": the aligned arm closes at least this fraction of that gap


def _spread(*values: list[float]) -> float:
    """The larger sample std of the arms compared (conservative: the noisier arm sets the bar)."""
    return max(mean_std(v)[1] for v in values)


def rung_outcome(label: str, control: list[float], finals: dict, labels: dict, unaligned: list[str],
                 aligned: list[str]) -> tuple[list[str], list[str], list[str]]:
    """One rung's test of the issue's two outcomes on final pass@1 (`finals`: role -> per-seed values):
    (lines, the claims of outcome (a) it supports, the aligned arms that fail against BF16 there).
    An unaligned arm hurts when BF16 minus it exceeds HURT_STDS x the larger seed std of the two; an aligned
    arm then recovers when it closes >= CLOSED_FRACTION of that gap. Arms with fewer than SEEDS_FOR_A_CLAIM
    seeds are described but claim nothing."""
    lines, supports, fails = [], [], []
    enough = lambda v: len([x for x in v if not math.isnan(x)]) >= SEEDS_FOR_A_CLAIM  # noqa: E731
    c = mean_std(control)[0]
    for role in unaligned:
        u = finals.get(role)
        if u is None:
            continue
        gap, sd = c - mean_std(u)[0], _spread(control, u)
        claim = enough(control) and enough(u)
        hurts = claim and gap > HURT_STDS * sd
        bar = f"{HURT_STDS:g} seed std = {HURT_STDS * sd:.3f}" if not math.isnan(sd) else "one seed: no spread"
        lines.append(f"- {label}, {labels[role]}: BF16 minus it {gap:+.3f} ({bar}): "
                     + ("**hurts**" if hurts else "not a claim (fewer than 3 seeds)" if not claim else "does not hurt"))
        for a in aligned:
            if hurts and a in finals:
                closed = (mean_std(finals[a])[0] - mean_std(u)[0]) / gap
                ok = enough(finals[a]) and closed >= CLOSED_FRACTION
                lines.append(f"  - {labels[a]} closes {closed:.0%} of that gap "
                             f"({'at least' if ok else 'less than'} {CLOSED_FRACTION:.0%})")
                if ok:
                    supports.append(f"{label}: {labels[role]} {gap:.3f} below BF16 (> {HURT_STDS * sd:.3f}), "
                                    f"{labels[a]} closes {closed:.0%}")
    for a in aligned:
        if a in finals and enough(finals[a]) and enough(control):
            gap, sd = c - mean_std(finals[a])[0], _spread(control, finals[a])
            if gap > HURT_STDS * sd:
                fails.append(f"{label}: {labels[a]} {gap:.3f} below BF16 (> {HURT_STDS:g} seed std {HURT_STDS * sd:.3f})")
    return lines, supports, fails


def nesting_comparison(rows: list[dict], labels: dict) -> list[str]:
    """Each nested rung against its plain twin (same width and group): the unaligned k3 and, per arm, final
    pass@1 nested minus plain with the larger seed std of the two."""
    by_name = {r["rung"]: r for r in rows}
    out = []
    for r in rows:
        plain = by_name.get(r.get("twin", ""))
        if plain is None:
            continue
        ku, kp = r["k3_unaligned"][0], plain["k3_unaligned"][0]
        out.append(f"- {r['label']} against {plain['label']}: unaligned k3 {ku:.2e} against {kp:.2e} (x{ku / kp:.2f}).")
        for role, values in r["finals"].items():
            if role in plain["finals"]:
                diff = mean_std(values)[0] - mean_std(plain["finals"][role])[0]
                sd = _spread(values, plain["finals"][role])
                n = min(len(values), len(plain["finals"][role]))
                out.append(f"  - {labels[role]}: final pass@1 nested minus plain {diff:+.3f} ("
                           + (f"larger seed std {sd:.3f}, n={n}" if not math.isnan(sd) else "one seed: no spread")
                           + ")")
    return out


def ladder_outcome(rows: list[dict], control: list[float] | None, labels: dict) -> list[str]:
    """The issue's decision over the rungs: (a) a rung where a quantized-rollout arm is below BF16 by more than
    2 seed std and an aligned arm closes at least half of that gap, else (b) a null, naming the rungs where
    even aligned training is below BF16 by more than 2 seed std."""
    if not control:
        return ["- No BF16 control finished: no outcome."]
    lines, supports, fails = [], [], []
    for r in rows:
        more, s, f = rung_outcome(r["label"], control, r["finals"], labels, r["unaligned_roles"], r["aligned_roles"])
        lines += more
        supports += s
        fails += f
    if supports:
        lines.append("- **Outcome (a)**: " + "; ".join(supports) + ".")
    else:
        lines.append("- **Outcome (b), a null**: no rung has a quantized-rollout arm below BF16 by more than "
                     f"{HURT_STDS:g} seed std with an aligned arm closing half of it. Aligned training below BF16 by "
                     f"more than {HURT_STDS:g} seed std: " + ("; ".join(fails) if fails else "at no rung") + ".")
    if supports and fails:
        lines.append("- Aligned arms below BF16 by more than 2 seed std: " + "; ".join(fails) + ".")
    return lines


def _ladder_plot(rows: list[dict], roles: dict, control, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=80)

    def points(role, nested):
        return sorted((r["k3_unaligned"][0], *r["pass1"][role]) for r in rows if bool(r.get("twin")) == nested
                      and role in r["pass1"] and not math.isnan(r["k3_unaligned"][0])
                      and not math.isnan(r["pass1"][role][0]))
    for role, label in roles.items():
        pts = points(role, nested=False)
        line = None
        if pts:
            line = ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[0 if math.isnan(p[2]) else p[2] for p in pts],
                               marker="o", capsize=3, label=label)
        nested = points(role, nested=True)  # the nested rungs: hollow markers in the arm's colour, no line
        if nested:
            ax.errorbar([p[0] for p in nested], [p[1] for p in nested],
                        yerr=[0 if math.isnan(p[2]) else p[2] for p in nested], marker="o", mfc="none", linestyle="none",
                        capsize=3, color=line.lines[0].get_color() if line else None,
                        label=f"{label} (nested rungs)")
    if control is not None and not math.isnan(control[0]):
        ax.axhline(control[0], color="grey", linestyle="--", label="BF16 GRPO+TIS (control)")
    ax.set_xscale("log")
    ax.set_xlabel("unaligned sampler-learner k3 of the rung (log)")
    ax.set_ylabel("final held-out pass@1")
    ax.set_title("final pass@1 against the sampler's mismatch (bars: seed std)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def training_settings(arms, summaries: dict) -> str:
    """lr, mini-batches per step and RL steps the finished runs of `arms` share (from their overrides / metrics)."""
    def values(key: str) -> set:
        return {o.split("=", 1)[1] for a in arms for o in a.overrides if o.startswith(key + "=")}
    lr, mini, prompts = values("train.optim.lr"), values("train.mini_batch_prompts"), values("train.prompts_per_step")
    steps = sorted({r["steps"] for runs in summaries.values() for r in runs if "steps" in r})
    parts = [f"lr {'/'.join(sorted(lr))}" if lr else "lr as configured"]
    if len(mini) == 1 and len(prompts) == 1:
        parts.append(f"{int(next(iter(prompts))) // int(next(iter(mini)))} mini-batches per step")
    parts.append(f"{'/'.join(map(str, steps)) or '-'} RL steps")
    return ", ".join(parts)


def write_ladder_report(out: Path, arms, seeds: list[int], home: Path | None = None, docs: Path | None = None,
                        name: str = "results_ladder") -> str:
    """Per rung: unaligned and aligned k3 and each arm's final pass@1; a figure of pass@1 against the
    unaligned k3 (one line per arm role; the BF16 control as a horizontal line)."""
    home = out if home is None else home
    summaries, missing = _arm_summaries(out, arms, seeds)
    rows = ladder_rows(summaries, arms)
    roles = {a.role: a.param["arm_label"] for a in arms if "rung" in a.param}
    control_arm = next((a for a in arms if "rung" not in a.param and a.name in summaries), None)
    control = mean_std([r["pass1_final"] for r in summaries[control_arm.name]]) if control_arm else None
    control_values = [r["pass1_final"] for r in summaries[control_arm.name]] if control_arm else None
    labels = {role: label for role, label in roles.items()}
    lines = _header("Harsher-sampler ladder at CPU scale", home, seeds)
    lines += ["", f"Trained at: {training_settings(arms, summaries)}."]
    lines += ["", "Every rung quantizes the same master (the shared warm start). k3: each run's median over steps "
                  "of mismatch/k3 (sampler vs the learner's old log-probs), averaged over the rung's unaligned "
                  "(BF16 learner) or aligned (QaRL) runs. Final pass@1: mean ± sample std over seeds (n = seeds "
                  "finished). TBPO masked: tbpo/masked_frac, mean over steps and seeds.", "",
              "| rung | unaligned k3 | aligned k3 | aligned / unaligned | " + " | ".join(roles.values())
              + " | TBPO masked |", "|---|---|---|---|" + "---|" * len(roles) + "---|"]
    for r in rows:
        (ku, _), (ka, _) = r["k3_unaligned"], r["k3_aligned"]
        ratio = "-" if math.isnan(ku) or math.isnan(ka) or ku <= 0 else f"{ka / ku:.2e}"
        cells = [("-" if math.isnan(r["pass1"][role][0]) else f"{r['pass1'][role][0]:.3f}"
                  + ("" if math.isnan(r["pass1"][role][1]) else f" ± {r['pass1'][role][1]:.3f}")
                  + f" (n={len(r['finals'][role])})")
                 if role in r["pass1"] else "-" for role in roles]
        masked = r.get("masked", (math.nan, math.nan))[0]
        lines.append(f"| {r['label']} | {'-' if math.isnan(ku) else f'{ku:.2e}'} | "
                     f"{'-' if math.isnan(ka) else f'{ka:.2e}'} | {ratio} | " + " | ".join(cells)
                     + f" | {'-' if math.isnan(masked) else f'{masked:.3f}'} |")
    lines += ["", "Computed:", ""]
    if control is not None:
        lines.append(f"- BF16 GRPO+TIS control (no quantization): final pass@1 {control[0]:.3f}"
                     + ("" if math.isnan(control[1]) else f" ± {control[1]:.3f}") + f" (n={len(control_values)}).")
    if rows:
        starts = [f"of the {r['label']} sampler {mean_std(r['start'])[0]:.3f}" for r in rows]
        if control_values:
            starts.insert(0, f"of the BF16 sampler {mean_std([r['pass1_start'] for r in summaries[control_arm.name]])[0]:.3f}")
        lines.append(f"- Before any RL step (the shared warm start), held-out pass@1 {'; '.join(starts)} (mean of the "
                     "runs' step-0 evaluations): the gap quantizing alone costs, which RL then widens or closes.")
    plain = [r for r in rows if not r["twin"]]  # a nested rung is compared with its twin below, not climbed
    if len(plain) > 1:
        first, last = plain[0], plain[-1]
        for role, label in roles.items():
            if role in first["pass1"] and role in last["pass1"]:
                lines.append(f"- {label}: final pass@1 {first['pass1'][role][0]:.3f} at {first['label']} -> "
                             f"{last['pass1'][role][0]:.3f} at {last['label']} "
                             f"({last['pass1'][role][0] - first['pass1'][role][0]:+.3f}).")
    for arm in arms:
        if arm.role.startswith("qarl_tbpo") and arm.name in summaries:
            runs = summaries[arm.name]
            lines.append(f"- {arm.param['rung_label']}, {arm.param['arm_label']} masked "
                         f"{mean_std([r['masked'] for r in runs])[0]:.3f} of the sequences: {tbpo_sides(runs)}.")
    learned = learner_lines([(f"{a.param['rung_label']}, {a.param['arm_label']}", summaries[a.name]) for a in arms
                             if "rung" in a.param and not a.param["aligned"] and a.name in summaries])
    if learned:
        lines += ["", "The unaligned arms' final learners (BF16) evaluated without quantization, against their "
                      "quantized samplers' evaluation (run.py --learner-eval):", "", *learned]
    lines += ["", f"The decision (issue 33), on final pass@1; a claim needs >= {SEEDS_FOR_A_CLAIM} seeds per arm:", ""]
    lines += ladder_outcome(rows, control_values, labels)
    late = ladder_rows(summaries, arms, key="pass1_last3")
    late_control = [r["pass1_last3"] for r in summaries[control_arm.name]] if control_arm else None
    verdict = next(li for li in ladder_outcome(late, late_control, labels) if "Outcome" in li or "no outcome" in li)
    lines += ["", "The same decision on the mean of each run's last three evaluations (less evaluation noise): "
              + verdict.removeprefix("- ")]
    nesting = nesting_comparison(rows, labels)
    if nesting:
        lines += ["", "Nested grids (the lower width's codes made from the W4 g128 codes: code4 / 2^(4-b) rounded, "
                      "scale4 x 2^(4-b)) against the direct quantizer of the same width:", "", *nesting]
    if missing:
        lines += ["", f"Not run (yet): {', '.join(missing)}."]
    if rows:
        plot_dir, rel = _plot_dir(out, docs)
        figure = f"{name.removeprefix('results_')}_pass1_vs_k3.png"
        _ladder_plot(rows, roles, control, plot_dir / figure)
        lines += ["", f"![{figure}]({rel}/{figure})"]
    return _write(out, docs, name, lines)
