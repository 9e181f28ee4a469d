"""experiments/table1_tiny: every arm's config loads with the shared task, and the report's numbers are
the hand-computed ones of made-up metrics."""
import json
import math
import sys
from pathlib import Path

import pytest

from megatron_qarl.config import load_config

EXPERIMENT = Path(__file__).resolve().parents[1] / "experiments" / "table1_tiny"
sys.path.insert(0, str(EXPERIMENT))
import report  # noqa: E402
import run  # noqa: E402


@pytest.mark.parametrize("arm", run.ARMS, ids=lambda a: a.name)
def test_every_arm_loads_with_the_shared_task_and_differs_only_in_what_defines_it(arm, tmp_path):
    sweep = run.Sweep(out=tmp_path, steps=3, seeds=[0], arms=[arm], eval_every=1, eval_prompts=4)
    cfg = load_config(str(run.REPO / arm.config), [*sweep.task_overrides(), *arm.overrides,
                                                    f"train.optim.lr={run.LR}"])
    assert cfg.sft.style == "chain" and cfg.sft.terms == run.TERMS
    assert cfg.rollout.max_new_tokens == run.MAX_NEW_TOKENS and cfg.train.optim.lr == run.LR
    if arm.name == "qarl_w4a16_tbpo_no_neg_band":  # no negative sequence is ever outside the band
        assert cfg.train.loss.neg_seq_clip_ratio_low >= 1.0 and cfg.train.loss.neg_seq_clip_ratio_high >= 1e9


def test_task_data_has_long_answers_and_held_out_prompts_never_trained_on(tmp_path):
    run.write_task_data(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(held) == run.EVAL_ROWS and not {r["prompt"] for r in rows} & {r["prompt"] for r in held}
    assert min(len(r["answer"]) for r in rows + held) >= 15  # + EOS: every response >= 16 tokens


def _write_run(out: Path, arm: str, seed: int, rewards, k3, evals):
    run_dir = out / "runs" / arm / f"seed{seed}"
    run_dir.mkdir(parents=True)
    rows = [{"step": i + 1, "reward/mean": r, "mismatch/k3": k, "time/step_s": 1.0 + i,
             "response/repetitive_frac": 0.0} for i, (r, k) in enumerate(zip(rewards, k3))]
    for step, pass1 in evals:
        rows.append({"step": step, "eval/pass@1": pass1, "eval/repetitive_frac": 0.25})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "DONE").write_text("1\n")


def test_report_numbers_are_the_hand_computed_ones(tmp_path):
    _write_run(tmp_path, "a", 0, [0.1, 0.3], [1e-3, 3e-3], [(0, 0.2), (1, 0.5), (2, 0.4)])
    _write_run(tmp_path, "a", 1, [0.3, 0.5], [2e-3, 2e-3], [(0, 0.2), (2, 0.6)])
    _write_run(tmp_path, "b", 0, [0.0, 0.2], [1e-5, 1e-5], [(0, 0.2), (2, 0.1)])
    text = report.write_report(tmp_path, [report.Section("S", [("a", "a", "Arm A"), ("b", "b", "Arm B")])], [0, 1])
    row_a = next(line for line in text.splitlines() if line.startswith("| Arm A"))
    cells = [c.strip() for c in row_a.strip("|").split("|")]
    # pass@1 final: seeds 0.4 and 0.6 -> 0.5 +- 0.1414; best: 0.5, 0.6 -> 0.55 +- 0.0707
    assert cells[1] == "2" and cells[3] == "0.500 ± 0.141" and cells[4] == "0.550 ± 0.071"
    # reward area 0.2 and 0.4 -> 0.3 +- 0.141; k3 2e-3 both -> 2.00e-03 +- 0; step time median 1.5
    assert cells[5] == "0.300 ± 0.141" and cells[6] == "2.00e-03 ± 0.00e+00" and cells[10] == "1.50 ± 0.00"
    assert cells[7] == "-"  # no TBPO metric in these runs
    row_b = next(line for line in text.splitlines() if line.startswith("| Arm B"))
    assert "0.100 |" in row_b and "±" not in row_b.split("|")[4]  # one seed: no spread
    assert "Not run (yet): b/seed1" in text
    assert "looping detector flags" not in text  # no task data under this out dir: no floor to state
    assert (tmp_path / "report" / "table1_1_reward.png").stat().st_size > 0
    summary = report.summarize_run(report.load_rows(tmp_path / "runs" / "a" / "seed0"))
    assert summary["pass1_start"] == 0.2 and math.isclose(summary["k3"], 2e-3)


def test_paired_findings_compare_the_gap_with_the_seed_spread(tmp_path):
    for seed, final in ((0, 0.6), (1, 0.8)):
        _write_run(tmp_path, "bf16_grpo_tis", seed, [0.1], [1e-5], [(0, 0.2), (1, final)])
    for seed in (0, 1):
        _write_run(tmp_path, "w4a16_rollout_grpo_tis", seed, [0.1], [1e-4], [(0, 0.2), (1, 0.5)])
    text = report.write_report(tmp_path, [report.Section("S", [("bf16_grpo_tis", "bf16_grpo_tis", "B"),
                                                                ("w4a16_rollout_grpo_tis", "w4a16_rollout_grpo_tis", "W")])],
                               [0, 1])
    # 0.7 - 0.5 = +0.2 against the larger std sqrt(0.02) = 0.141; k3 1e-5 / 1e-4 is no aligned arm: not reported
    assert "(BF16 minus W4A16 rollout): +0.200 final pass@1 (larger than the seed std, std 0.141)" in text
    assert "aligned W4A16 learner / unaligned" not in text
    (tmp_path / "data").mkdir()  # 1 of 4 correct answers repeats a step: the floor is 25%
    (tmp_path / "data" / "train.jsonl").write_text("".join(
        json.dumps({"prompt": "", "answer": a}) + "\n" for a in ("4:7,0:7,0:7,0:7", "1:3", "2:5,3:8", "0:1")))
    text = report.write_report(tmp_path, [report.Section("S", [("bf16_grpo_tis", "bf16_grpo_tis", "B")])], [0, 1])
    assert "The looping detector flags 25.000% of this task's correct answers" in text


def test_the_attention_regime_reruns_the_w4a16_arms_with_attention_quantized_and_shares_the_bf16_control(tmp_path):
    attention = [a for a in run.ARMS if a.regime == "attention"]
    assert {a.name for a in attention} == {"attn_w4a16_rollout_grpo_tis", "attn_qarl_w4a16_tbpo", "attn_qarl_w4a16_grpo"}
    for arm in attention:
        cfg = load_config(str(run.REPO / arm.config), [*run.Sweep(out=tmp_path, steps=1, seeds=[0], arms=[arm],
                                                                  eval_every=1, eval_prompts=4).task_overrides(),
                                                        *arm.overrides])
        assert cfg.quant.scope == "experts+attention"
    sections = run.report_sections(list(run.ARMS))
    assert [s.title for s in sections] == list(run.REGIMES.values())
    roles = [[role for role, _, _ in s.rows] for s in sections]
    assert roles[1] == ["bf16_grpo_tis", "w4a16_rollout_grpo_tis", "qarl_w4a16_tbpo", "qarl_w4a16_grpo"]
    assert sections[1].rows[0][1] == "bf16_grpo_tis" and sections[1].rows[2][1] == "attn_qarl_w4a16_tbpo"
    # the paired findings of the second section compare the attention runs under the roles they know
    for arm, k3 in (("bf16_grpo_tis", 1e-5), ("attn_w4a16_rollout_grpo_tis", 1e-3), ("attn_qarl_w4a16_tbpo", 5e-5)):
        _write_run(tmp_path, arm, 0, [0.1], [k3], [(0, 0.2), (1, 0.5)])
    text = report.write_report(tmp_path, sections[1:], [0])
    assert "aligned W4A16 learner / unaligned (BF16 learner, same W4A16 sampler): **0.050**" in text
    _write_run(tmp_path, "w4a16_rollout_grpo_tis", 0, [0.1], [2e-4], [(0, 0.2), (1, 0.5)])
    text = report.write_report(tmp_path, sections, [0])
    assert "the unaligned (BF16 learner) sampler-learner k3 is 1.00e-03 against 2.00e-04" in text and "(x5.0)" in text
    assert "BF16 minus W4A16 rollout" in text.split("## Across the regimes")[1]


def test_the_kernel_regime_samples_the_w4a16_arms_on_the_int4_kernel_and_says_so(tmp_path):
    kernel = [a for a in run.ARMS if a.regime == "int4_kernel"]
    assert {a.name for a in kernel} == {"kernel_w4a16_rollout_grpo_tis", "kernel_qarl_w4a16_tbpo"}
    for arm in kernel:
        cfg = load_config(str(run.REPO / arm.config), [*run.Sweep(out=tmp_path, steps=1, seeds=[0], arms=[arm],
                                                                  eval_every=1, eval_prompts=4).task_overrides(),
                                                        *arm.overrides])
        assert cfg.rollout.embedded.w4a16_kernel == "aten_int4" and cfg.quant.scope == "experts"
    section = run.report_sections(list(run.ARMS))[2]
    assert section.rows[2] == ("qarl_w4a16_tbpo", "kernel_qarl_w4a16_tbpo", "QaRL W4A16 + TBPO")
    for arm, k3 in (("kernel_w4a16_rollout_grpo_tis", 1e-3), ("kernel_qarl_w4a16_tbpo", 2e-5)):
        _write_run(tmp_path, arm, 0, [0.1], [k3], [(0, 0.2), (1, 0.5)])
    text = report.write_report(tmp_path, [section], [0])
    assert "**0.020** (the paper's claim, with a real int4 sampler: <= 0.1). Sampler here: PyTorch's int4" in text


def test_the_vllm_regime_has_its_own_bf16_control_and_is_skipped_with_the_reason_where_it_cannot_run(
        tmp_path, monkeypatch):
    vllm = [a for a in run.ARMS if a.regime == "vllm"]
    assert {a.name for a in vllm} == {"vllm_bf16_grpo_tis", "vllm_w4a16_rollout_grpo_tis", "vllm_qarl_w4a16_tbpo"}
    section = run.report_sections(list(run.ARMS))[3]
    assert [row[1] for row in section.rows] == ["vllm_bf16_grpo_tis", "vllm_w4a16_rollout_grpo_tis",
                                                "vllm_qarl_w4a16_tbpo"]  # no second, embedded BF16 control
    sweep = run.Sweep(out=tmp_path, steps=1, seeds=[0], arms=vllm, eval_every=1, eval_prompts=4)
    monkeypatch.setenv("QARL_VLLM_VENV", str(tmp_path / "no-venv"))
    assert "bash launch/vllm_env.sh" in run.machine_blocker(sweep, vllm[0])
    assert run.machine_blocker(sweep, run.ARMS[0]) is None  # the embedded engine runs anywhere


def test_regimes_select_their_arms_and_keep_the_shared_control():
    names = [a.name for a in run.select_arms(["attention"], quick=False)]
    assert names == ["bf16_grpo_tis", "attn_w4a16_rollout_grpo_tis", "attn_qarl_w4a16_tbpo", "attn_qarl_w4a16_grpo"]
    assert {a.regime for a in run.select_arms(list(run.REGIMES), quick=False)} == set(run.REGIMES)
    assert all(a.main for a in run.select_arms(list(run.REGIMES), quick=True))
