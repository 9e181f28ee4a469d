"""experiments/table1_tiny phases beyond Table 1 (calibrate, ladder, long): every phase's arms load with its
task, the long task's lengths are what its limits assume, phases never share a run directory, --plan
launches nothing, and the calibration / ladder / long reports give the hand-computed numbers of made-up
metrics."""
import json
import math
import sys
from pathlib import Path

import pytest

from megatron_qarl.config import load_config
from megatron_qarl.quant.schemes import SCHEMES

EXPERIMENT = Path(__file__).resolve().parents[1] / "experiments" / "table1_tiny"
sys.path.insert(0, str(EXPERIMENT))
import phases  # noqa: E402
import report  # noqa: E402
import run  # noqa: E402

CALIBRATION = phases.calibration_arms([2.5e-5, 1e-4], [1, 4], [1, 3, 10], 1e-4, 4)
LADDER = phases.ladder_arms(list(phases.RUNGS), 5e-5, 2, 3.0)
LONG = phases.long_arms(5e-5, 2, 1.0)


def _load(arm, task, tmp_path):
    sweep = run.Sweep(out=tmp_path, steps=3, seeds=[0], arms=[arm], eval_every=1, eval_prompts=4, task=task)
    cfg = load_config(str(run.REPO / arm.config), [*sweep.task_overrides(), f"train.optim.lr={run.LR}",
                                                    *arm.overrides])
    assert cfg.sft.style == "chain" and cfg.sft.terms == task.terms
    assert cfg.rollout.max_new_tokens == task.max_new_tokens and cfg.data.max_prompt_len == task.max_prompt_len
    return cfg


@pytest.mark.parametrize("arm", CALIBRATION, ids=lambda a: a.name)
def test_every_calibration_arm_loads_with_its_lr_mini_batches_and_band(arm, tmp_path):
    cfg = _load(arm, run.CHAIN, tmp_path)
    p = arm.param
    assert cfg.train.optim.lr == p["lr"] and cfg.train.prompts_per_step == phases.PROMPTS_PER_STEP
    assert cfg.train.prompts_per_step // cfg.train.mini_batch_prompts == p["mini_batches"]
    assert cfg.train.loss.name == p["objective"] and cfg.quant.learner_aligned
    default = phases.LossConfig()
    for key in phases.BAND_KEYS:
        assert math.isclose(getattr(cfg.train.loss, key), getattr(default, key) * p["band"])


def test_the_calibration_grid_and_band_sweep_share_the_x1_run():
    names = [a.name for a in CALIBRATION]
    assert len(names) == len(set(names)) == 2 * 2 * 2 + 2  # the grid x {tbpo, gspo}, then bands x3 and x10
    assert [a.param["band"] for a in CALIBRATION if a.regime == "band"] == [3, 10]
    off_grid = phases.calibration_arms([1e-4], [4], [1, 3], 5e-5, 2)  # a chosen point off the grid runs x1 too
    assert [a.param["band"] for a in off_grid if a.regime == "band"] == [1, 3]
    with pytest.raises(ValueError, match="divide"):
        phases.trust(1e-4, 3)


@pytest.mark.parametrize("arm", LADDER, ids=lambda a: a.name)
def test_every_ladder_arm_loads_with_its_rung_and_the_calibrated_settings(arm, tmp_path):
    rung = next((r for r in phases.RUNGS if r.name == arm.param.get("rung")), None)
    if rung is not None and rung.scheme not in SCHEMES:
        pytest.skip(f"quant scheme {rung.scheme} is not in this checkout yet")
    cfg = _load(arm, run.CHAIN, tmp_path)
    assert cfg.train.optim.lr == 5e-5 and cfg.train.mini_batch_prompts == phases.PROMPTS_PER_STEP // 2
    if rung is None:  # the shared BF16 control
        assert cfg.quant.scheme == "none" and cfg.train.loss.token_tis_cap == 2.0
        return
    assert cfg.quant.scheme == rung.scheme and cfg.quant.group_size == rung.group_size
    assert cfg.quant.learner_aligned == arm.param["aligned"] == arm.role.startswith("qarl")
    expected = {"rollout_grpo_tis": ("grpo", 2.0), "rollout_grpo": ("grpo", None), "qarl_grpo": ("grpo", None),
                "qarl_tbpo": ("tbpo", None)}[arm.role]
    assert (cfg.train.loss.name, cfg.train.loss.token_tis_cap) == expected
    band = 3.0 if arm.role == "qarl_tbpo" else 1.0  # the calibrated band goes to TBPO only
    assert math.isclose(cfg.train.loss.seq_clip_ratio_high, phases.LossConfig().seq_clip_ratio_high * band)


@pytest.mark.parametrize("arm", LONG, ids=lambda a: a.name)
def test_every_long_arm_loads_with_the_long_task(arm, tmp_path):
    cfg = _load(arm, phases.TASKS["long"], tmp_path)
    assert cfg.sft.terms == 16 and cfg.train.optim.lr == 5e-5 and cfg.train.mini_batch_prompts == 16


def test_the_long_task_has_64_to_128_token_responses_within_its_limits(tmp_path):
    task = phases.TASKS["long"]
    run.write_task_data(tmp_path, task)
    rows = [json.loads(line) for f in ("train.jsonl", "eval.jsonl") for line in (tmp_path / f).read_text().splitlines()]
    answers = [len(r["answer"]) + 1 for r in rows]  # one token per character, + EOS
    assert 64 <= min(answers) and max(answers) <= 128 and min(answers) - 1 >= task.min_answer_chars
    assert max(answers) <= task.max_new_tokens and max(len(r["prompt"]) + 1 for r in rows) <= task.max_prompt_len
    held = [json.loads(line)["prompt"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    train = {json.loads(line)["prompt"] for line in (tmp_path / "train.jsonl").read_text().splitlines()}
    assert len(held) == task.eval_rows and not train & set(held)


def test_phases_never_share_a_run_directory_and_tasks_keep_one_warm_start(tmp_path):
    dirs = {(p, t): run.phase_dirs(tmp_path, p, t) for p in run.PHASES for t in phases.TASKS}
    assert dirs["table1", "chain"] == (tmp_path, tmp_path)  # today's layout
    assert dirs["long", "long"] == (tmp_path / "long", tmp_path / "task_long")
    assert dirs["calibrate", "long"] == (tmp_path / "calibrate_long", tmp_path / "task_long")
    assert dirs["ladder", "chain"] == (tmp_path / "ladder", tmp_path)
    runs = [d[0] / "runs" for d in dirs.values()]
    assert len(set(runs)) == len(runs)
    assert {d[1] for d in dirs.values()} == {tmp_path, tmp_path / "task_long"}


def _main(monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", ["run.py", *argv])
    monkeypatch.setattr(run, "_qarl_train", lambda *a, **k: pytest.fail("--plan must launch nothing"))
    run.main()
    return capsys.readouterr().out


def test_plan_prints_the_runs_and_launches_nothing(tmp_path, monkeypatch, capsys):
    out = _main(monkeypatch, capsys, "--out", str(tmp_path / "o"), "--phase", "calibrate", "ladder", "long", "--plan",
                "--lr", "5e-5", "--mini-batches", "2")
    assert not (tmp_path / "o").exists()
    assert "== phase calibrate: task chain" in out and "30 RL steps x seeds [0]; 20 arms, 20 runs" in out  # 18 grid + band x3, x10
    assert "100 RL steps x seeds [0, 1, 2]; 17 arms, 51 runs" in out and "4 arms, 12 runs" in out
    assert "w2g128_qarl_tbpo [W2 g128: QaRL + TBPO]: --config configs/tiny_qarl_w4a16_tbpo.yaml quant.scheme=w2a16" in out
    assert "train.optim.lr=5e-05 train.prompts_per_step=32 train.mini_batch_prompts=16" in out
    assert "sft.terms=16" in out and str(tmp_path / "o" / "task_long" / "sft") in out
    quick = _main(monkeypatch, capsys, "--out", str(tmp_path / "o"), "--quick", "--plan")
    assert quick.count("6 RL steps x seeds [0]") == 2 and "2 arms, 2 runs" in quick and "4 arms, 4 runs" in quick
    monkeypatch.chdir(tmp_path)  # without --out: a smoke run has its own root, never a real run's dirs
    quick_default = _main(monkeypatch, capsys, "--quick", "--plan")
    assert f"runs under {tmp_path / 'runs' / 'table1_tiny_quick'}/calibrate/runs" in quick_default
    assert "table1_tiny/" not in quick_default
    table1 = _main(monkeypatch, capsys, "--out", str(tmp_path / "o"), "--plan", "--regimes", "experts")
    assert f"runs under {tmp_path / 'o'}/runs; 100 RL steps x seeds [0, 1, 2]; 7 arms" in table1


def test_a_finished_run_keeps_its_arguments_and_is_refused_with_other_ones(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(run, "_qarl_train", lambda sweep, args, log: calls.append(args) or 1.0)
    arm = LADDER[1]
    sweep = run.Sweep(out=tmp_path, steps=3, seeds=[0], arms=[arm], eval_every=1, eval_prompts=4)
    run.run_arm(sweep, arm, 0, tmp_path / "sft")
    recorded = (tmp_path / "runs" / arm.name / "seed0" / "overrides.txt").read_text().splitlines()
    assert recorded == calls[0] and recorded[-len(arm.overrides):] == list(arm.overrides)  # the arm's come last
    run.run_arm(sweep, arm, 0, tmp_path / "sft")  # same arguments: kept, not run again
    assert len(calls) == 1
    sweep.steps = 4
    with pytest.raises(SystemExit, match="other arguments"):
        run.run_arm(sweep, arm, 0, tmp_path / "sft")
    legacy = tmp_path / "runs" / arm.name / "seed1"  # finished before overrides.txt existed: its config.yaml decides
    legacy.mkdir(parents=True)
    (legacy / "DONE").write_text("1\n")
    (legacy / "config.yaml").write_text("train:\n  steps: 30\n")
    with pytest.raises(SystemExit, match="train.steps=30"):
        run.run_arm(sweep, arm, 1, tmp_path / "sft")
    sweep.steps = 30
    run.run_arm(sweep, arm, 1, tmp_path / "sft")  # kept
    assert len(calls) == 1 and (legacy / "DONE").exists()


def _write(out: Path, arm: str, seed: int, steps: list[dict], evals: list[float]):
    d = out / "runs" / arm / f"seed{seed}"
    d.mkdir(parents=True)
    rows = [{"step": i + 1, "reward/mean": 0.5, "time/step_s": 1.0, **s} for i, s in enumerate(steps)]
    rows += [{"step": i, "eval/pass@1": p} for i, p in enumerate(evals)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "DONE").write_text("1\n")


def _row(text: str, start: str) -> list[str]:
    return [c.strip() for c in next(li for li in text.splitlines() if li.startswith(start)).strip("|").split("|")]


def test_calibration_report_numbers_are_the_hand_computed_ones(tmp_path):
    arms = phases.calibration_arms([1e-4, 5e-5], [2], [1, 3], 1e-4, 2)
    assert [a.name for a in arms] == ["tbpo_lr0.0001_mb2", "gspo_lr0.0001_mb2", "tbpo_lr5e-05_mb2", "gspo_lr5e-05_mb2",
                                      "tbpo_band_x3_lr0.0001_mb2"]
    drift = [{"drift/mb0/p50": 0.0, "drift/mb0/p90": 0.0, "drift/mb1/p50": 1e-3, "drift/mb1/p90": 3e-3},
             {"drift/mb0/p50": 0.0, "drift/mb0/p90": 0.0, "drift/mb1/p50": 3e-3, "drift/mb1/p90": 5e-3}]
    # TBPO masked 0.1, 0.2 -> 0.150; last mini-batch (mb1) drift p50 (1e-3 + 3e-3)/2, p90 (3e-3 + 5e-3)/2
    _write(tmp_path, "tbpo_lr0.0001_mb2", 0, [{"tbpo/masked_frac": 0.1, **drift[0]},
                                               {"tbpo/masked_frac": 0.2, **drift[1]}], [0.3, 0.5])
    # GSPO clipped: high + low per step, 0.1 and 0.2 -> 0.150
    _write(tmp_path, "gspo_lr0.0001_mb2", 0, [{"gspo/clip_frac_high": 0.05, "gspo/clip_frac_low": 0.05},
                                               {"gspo/clip_frac_high": 0.15, "gspo/clip_frac_low": 0.05}], [0.3, 0.6])
    _write(tmp_path, "tbpo_lr5e-05_mb2", 0, [{"tbpo/masked_frac": 0.4}], [0.3, 0.4])
    _write(tmp_path, "tbpo_band_x3_lr0.0001_mb2", 0, [{"tbpo/masked_frac": 0.05}], [0.3, 0.55])
    text = report.write_calibration_report(tmp_path, arms, [0])
    assert _row(text, "| tbpo | 0.0001 | 2 | x1") == ["tbpo", "0.0001", "2", "x1", "1", "0.150", "-", "2.00e-03",
                                                     "4.00e-03", "0.300", "0.500", "yes"]
    assert _row(text, "| gspo | 0.0001 | 2 | x1") == ["gspo", "0.0001", "2", "x1", "1", "-", "0.150", "-", "-",
                                                     "0.300", "0.600", "yes"]
    assert _row(text, "| tbpo | 5e-05 | 2 | x1")[-1] == "no"
    assert _row(text, "| tbpo | 0.0001 | 2 | x3")[5] == "0.050"
    assert "both TBPO's masked and GSPO's clipped fraction are in 10%-20%: lr 0.0001 x 2 mini-batches." in text
    assert ("TBPO against its band width (lr 0.0001, 2 mini-batches): x1: masked 0.150, final pass@1 0.500; "
            "x3: masked 0.050, final pass@1 0.550.") in text
    assert "Not run (yet): gspo_lr5e-05_mb2/seed0." in text
    assert "pass@1 collapses (final more than 0.1 below the start): none." in text
    assert (tmp_path / "results.md").read_text() == text


def test_calibration_report_names_collapses_and_the_chosen_points_facts(tmp_path):
    arms = phases.calibration_arms([5e-6, 1e-5, 2.5e-5], [2], [1], 5e-6, 2)
    for arm, evals in (("tbpo_lr5e-06_mb2", [0.73, 0.70]), ("tbpo_lr1e-05_mb2", [0.73, 0.57]),  # 0.16 > 0.1
                       ("tbpo_lr2.5e-05_mb2", [0.73, 0.25])):
        _write(tmp_path, arm, 0, [{"tbpo/masked_frac": 0.02}], evals)
    text = report.write_calibration_report(tmp_path, arms, [0], chosen_point=(5e-6, 2))
    assert ("- Grid points where held-out pass@1 collapses (final more than 0.1 below the start): lr 1e-05 x 2 "
            "mini-batches; lr 2.5e-05 x 2 mini-batches.") in text
    assert ("- Chosen (run.py --lr / --mini-batches, what the ladder and long phases train at): lr 5e-06 x 2 "
            "mini-batches: NOT a grid point with both in 10%-20%; pass@1 holds there, and collapses at every larger "
            "lr of the grid (1e-05, 2.5e-05).") in text


def test_ladder_report_numbers_are_the_hand_computed_ones(tmp_path):
    arms = phases.ladder_arms([phases.RUNGS[0], phases.RUNGS[3]], 1e-4, 4, 1.0)
    values = {  # arm -> (k3, final pass@1 per seed)
        "bf16_grpo_tis": (1e-6, [0.8, 0.8]),
        "w4g128_rollout_grpo_tis": (1e-4, [0.7, 0.7]), "w4g128_rollout_grpo": (3e-4, [0.6, 0.6]),
        "w4g128_qarl_grpo": (1e-5, [0.75, 0.75]), "w4g128_qarl_tbpo": (3e-5, [0.7, 0.8]),
        "w2g128_rollout_grpo_tis": (1e-2, [0.5, 0.5]), "w2g128_rollout_grpo": (3e-2, [0.2, 0.2]),
        "w2g128_qarl_grpo": (2e-5, [0.7, 0.7]), "w2g128_qarl_tbpo": (4e-5, [0.6, 0.8]),
    }
    for arm, (k3, finals) in values.items():
        for seed, final in enumerate(finals):
            start = {"bf16": 0.3, "w4g128": 0.28, "w2g128": 0.2}[arm.split("_")[0]] + 0.01 * seed
            _write(tmp_path, arm, seed, [{"mismatch/k3": k3}], [start, final])
    text = report.write_ladder_report(tmp_path, arms, [0, 1])
    assert ("- Before any RL step (the shared warm start), held-out pass@1 of the BF16 sampler 0.305; of the W4 g128 "
            "sampler 0.285; of the W2 g128 sampler 0.205 (mean of the runs' step-0 evaluations)") in text
    # unaligned k3: mean of 1e-4 and 3e-4; aligned: of 1e-5 and 3e-5; ratio 2e-5 / 2e-4
    assert _row(text, "| W4 g128") == ["W4 g128", "2.00e-04", "2.00e-05", "1.00e-01", "0.700 ± 0.000 (n=2)",
                                       "0.600 ± 0.000 (n=2)", "0.750 ± 0.000 (n=2)", "0.750 ± 0.071 (n=2)", "-"]
    assert _row(text, "| W2 g128")[:4] == ["W2 g128", "2.00e-02", "3.00e-05", "1.50e-03"]
    assert "BF16 GRPO+TIS control (no quantization): final pass@1 0.800 ± 0.000 (n=2)." in text
    assert "not a claim (fewer than 3 seeds)" in text and "**Outcome (b), a null**" in text  # 2 seeds claim nothing
    assert "- quantized rollout, BF16 learner, GRPO (no TIS): final pass@1 0.600 at W4 g128 -> 0.200 at W2 g128 (-0.400)." in text
    assert "- QaRL + TBPO: final pass@1 0.750 at W4 g128 -> 0.700 at W2 g128 (-0.050)." in text
    assert (tmp_path / "report" / "ladder_pass1_vs_k3.png").stat().st_size > 0
    rows = report.ladder_rows(report._arm_summaries(tmp_path, arms, [0, 1])[0], arms)
    assert [r["rung"] for r in rows] == ["w4g128", "w2g128"] and math.isclose(rows[1]["k3_aligned"][0], 3e-5)


def _ladder_runs(tmp_path, finals: dict, masked: float = 0.2):
    arms = phases.ladder_arms([phases.RUNGS[3]], 1e-4, 4, 1.0)
    sides = {"tbpo/masked_frac": masked, "tbpo/masked_pos_high": masked / 2, "tbpo/masked_neg_low": masked / 4,
             "tbpo/masked_neg_high": masked / 4}
    for arm in arms:
        for seed, final in enumerate(finals[arm.role]):
            step = {"mismatch/k3": 1e-3, **(sides if arm.role == "qarl_tbpo" else {})}
            _write(tmp_path, arm.name, seed, [step], [0.3, final])
    return report.write_ladder_report(tmp_path, arms, [0, 1, 2])


def test_ladder_outcome_a_is_a_rung_where_the_rollout_hurts_by_2_std_and_alignment_closes_half(tmp_path):
    text = _ladder_runs(tmp_path, {
        "bf16_grpo_tis": [0.80, 0.82, 0.78],  # mean 0.80, std 0.02
        "rollout_grpo_tis": [0.60, 0.62, 0.58],  # gap 0.20 > 2 x 0.02: hurts
        "rollout_grpo": [0.79, 0.81, 0.77],  # gap 0.01 < 0.04: does not hurt
        "qarl_grpo": [0.75, 0.77, 0.73],  # closes (0.75 - 0.60) / 0.20 = 75%
        "qarl_tbpo": [0.65, 0.67, 0.63],  # closes 25%
    })
    assert _row(text, "| W2 g128")[-1] == "0.200"
    assert ("- W2 g128, QaRL + TBPO masked 0.200 of the sequences: positives above 1 + eps_h 0.100, negatives below "
            "1 - delta_l 0.050, negatives above 1 + delta_h 0.050.") in text
    assert ("- W2 g128, quantized rollout, BF16 learner, GRPO+TIS: BF16 minus it +0.200 (2 seed std = 0.040): "
            "**hurts**") in text
    assert "  - QaRL + GRPO closes 75% of that gap (at least 50%)" in text
    assert "  - QaRL + TBPO closes 25% of that gap (less than 50%)" in text
    assert "GRPO (no TIS): BF16 minus it +0.010 (2 seed std = 0.040): does not hurt" in text
    assert ("- **Outcome (a)**: W2 g128: quantized rollout, BF16 learner, GRPO+TIS 0.200 below BF16 (> 0.040), "
            "QaRL + GRPO closes 75%.") in text
    # aligned arms still below BF16 by more than 2 std are named beside the outcome: GRPO 0.05, TBPO 0.15 > 0.04
    assert ("- Aligned arms below BF16 by more than 2 seed std: W2 g128: QaRL + GRPO 0.050 below BF16 (> 2 seed std "
            "0.040); W2 g128: QaRL + TBPO 0.150 below BF16 (> 2 seed std 0.040).") in text
    # the robustness line: each run's evaluations are [0.3, final], so its last-three mean is (0.3 + final) / 2:
    # every gap halves (TIS: 0.100 > 2 x 0.010) and QaRL + GRPO still closes 75%
    assert ("on the mean of each run's last three evaluations (less evaluation noise): **Outcome (a)**: W2 g128: "
            "quantized rollout, BF16 learner, GRPO+TIS 0.100 below BF16 (> 0.020), QaRL + GRPO closes 75%.") in text


def test_ladder_outcome_b_is_a_null_that_names_where_aligned_training_fails(tmp_path):
    text = _ladder_runs(tmp_path, {
        "bf16_grpo_tis": [0.80, 0.82, 0.78], "rollout_grpo_tis": [0.78, 0.80, 0.76],  # gap 0.02 < 0.04
        "rollout_grpo": [0.79, 0.81, 0.77], "qarl_grpo": [0.79, 0.81, 0.77],
        "qarl_tbpo": [0.70, 0.72, 0.68],  # 0.10 below BF16 > 0.04: aligned training fails here
    })
    assert "Outcome (a)" not in text
    assert ("- **Outcome (b), a null**: no rung has a quantized-rollout arm below BF16 by more than 2 seed std with "
            "an aligned arm closing half of it. Aligned training below BF16 by more than 2 seed std: W2 g128: "
            "QaRL + TBPO 0.100 below BF16 (> 2 seed std 0.040).") in text


def test_long_report_states_the_task_lengths_and_the_response_lengths(tmp_path):
    home = tmp_path / "task_long"
    (home / "data").mkdir(parents=True)
    (home / "data" / "train.jsonl").write_text("".join(json.dumps({"prompt": "", "answer": a}) + "\n"
                                                       for a in ("1:1", "1:1,2:3")))
    out = tmp_path / "long"
    arms = phases.long_arms(1e-4, 4, 1.0)
    _write(out, "bf16_grpo_tis", 0, [{"mismatch/k3": 1e-5, "response/length_mean": 70.0},
                                     {"mismatch/k3": 1e-5, "response/length_mean": 74.0}], [0.2, 0.5])
    _write(out, "qarl_w4a16_tbpo", 0, [{"mismatch/k3": 1e-5, "response/length_mean": 80.0}], [0.2, 0.4])
    section = report.Section("long task", [(a.role, a.name, a.label) for a in arms])
    text = report.write_report(out, [section], [0], home=home, name="results_long")
    assert "Task answers: 3-7 characters (mean 5.0) + EOS" in text
    assert "Mean training response length (tokens, mean over steps and seeds): BF16 GRPO+TIS 72.0; QaRL W4A16 + TBPO 80.0." in text
    assert _row(text, "| BF16 GRPO+TIS")[3] == "0.500" and "Not run (yet): w4a16_rollout_grpo_tis/seed0" in text
    assert (out / "report" / "results_long_1_reward.png").exists()


def test_the_table1_page_carries_the_other_phases_pages_that_exist(tmp_path):
    import report

    assert report.other_phase_links(tmp_path) == []
    (tmp_path / "results_calibrate.md").write_text("# calibration\n\nChosen: lr 1e-4.\n")
    (tmp_path / "results_long.md").write_text("# long\n\n## 1. arms\n\n| a | b |\n")
    links = report.other_phase_links(tmp_path)
    assert links[:3] == ["", "## The other phases (issue 33)", ""] and "train.moe_aux_loss_coeff=0" in links[3]
    links = links[:2] + links[4:]
    assert links == ["", "## The other phases (issue 33)",
                     "", "### Drift calibration (lr x mini-batches, TBPO's band)", "",
                     "Also as its own page: [results_calibrate.md](results_calibrate.md).", "", "Chosen: lr 1e-4.",
                     "", "### Long responses (16-term chains)", "",
                     "Also as its own page: [results_long.md](results_long.md).", "", "### 1. arms", "", "| a | b |"]
    # refreshing docs/results.md rewrites only that section; Table 1's own sections stay as they were
    (tmp_path / "results.md").write_text("# Table 1\n\n## 1. experts\n\nnumbers\n\n## The other phases (issue 33)\n\nold\n")
    report.refresh_results_page(tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert text.startswith("# Table 1\n\n## 1. experts\n\nnumbers\n\n## The other phases (issue 33)\n")
    assert "old" not in text and text.endswith("| a | b |\n") and text.count("## The other phases") == 1
    report.refresh_results_page(tmp_path)
    assert (tmp_path / "results.md").read_text() == text  # idempotent


def test_the_ladder_page_states_the_lr_mini_batches_and_steps_it_trained_at():
    arms = phases.ladder_arms(phases.RUNGS[:1], 2.5e-5, 2, 1.0)
    summaries = {arms[0].name: [{"steps": 100}], arms[1].name: [{"steps": 100}]}
    assert report.training_settings(arms, summaries) == "lr 2.5e-05, 2 mini-batches per step, 100 RL steps"


def _fake_runs(monkeypatch, script_of):
    """run._start_qarl_train replaced by a Python child running `script_of(run dir)`; returns started dirs."""
    import subprocess

    started = []

    def start(sweep, args, log):
        out = log.parent
        started.append(out)
        return subprocess.Popen([sys.executable, "-c", script_of(out)], stdout=open(log, "w"),
                                stderr=subprocess.STDOUT)
    monkeypatch.setattr(run, "_start_qarl_train", start)
    return started


def test_jobs_run_that_many_runs_at_once_and_finish_each(tmp_path, monkeypatch):
    # each fake run records when it started and ended; with 2 jobs the first two overlap, the third waits
    _fake_runs(monkeypatch, lambda out: f"import time, pathlib; p = pathlib.Path({str(out)!r}); "
                                        "(p / 'start').write_text(repr(time.time())); time.sleep(0.6); "
                                        "(p / 'end').write_text(repr(time.time()))")
    arms = LADDER[:3]
    sweep = run.Sweep(out=tmp_path, steps=3, seeds=[0], arms=arms, eval_every=1, eval_prompts=4)
    run.run_arms_parallel(sweep, [(a, 0) for a in arms], tmp_path / "sft", jobs=2, poll_s=0.05)
    span = {a.name: [float((tmp_path / "runs" / a.name / "seed0" / f).read_text()) for f in ("start", "end")]
            for a in arms}
    first, second, third = (span[a.name] for a in arms)
    assert second[0] < first[1] and first[0] < second[1]  # the first two ran at the same time
    assert third[0] >= min(first[1], second[1])  # the third started only when one of them had ended
    assert all((tmp_path / "runs" / a.name / "seed0" / "DONE").exists() for a in arms)


def test_jobs_a_failed_run_stops_the_others_and_leaves_no_done(tmp_path, monkeypatch):
    started = _fake_runs(monkeypatch, lambda out: "import sys; print('boom'); sys.exit(3)" if out.parts[-2] == LADDER[1].name
                         else "import time; time.sleep(60)")
    arms = LADDER[:3]
    sweep = run.Sweep(out=tmp_path, steps=3, seeds=[0], arms=arms, eval_every=1, eval_prompts=4)
    t0 = __import__("time").perf_counter()
    with pytest.raises(SystemExit, match=r"failed \(exit 3\)[\s\S]*boom"):
        run.run_arms_parallel(sweep, [(a, 0) for a in arms], tmp_path / "sft", jobs=2, poll_s=0.05)
    assert __import__("time").perf_counter() - t0 < 30  # the 60-s sibling was killed, not waited for
    assert len(started) == 2 and not any((d / "DONE").exists() for d in started)


def test_nested_rungs_are_compared_with_their_plain_twin(tmp_path):
    plain, nested = phases.RUNGS[3], next(r for r in phases.RUNGS if r.twin == "w2g128")
    arms = phases.ladder_arms([plain, nested], 1e-4, 4, 1.0, control=False)
    values = {"w2g128_rollout_grpo_tis": (2e-2, [0.50, 0.54]), "w2g128n_rollout_grpo_tis": (1e-2, [0.60, 0.62]),
              "w2g128_qarl_grpo": (1e-5, [0.70, 0.70]), "w2g128n_qarl_grpo": (1e-5, [0.69, 0.71])}
    for arm, (k3, finals) in values.items():
        for seed, final in enumerate(finals):
            _write(tmp_path, arm, seed, [{"mismatch/k3": k3}], [0.3, final])
    text = report.write_ladder_report(tmp_path, arms, [0, 1])
    # nested 0.61 - plain 0.52 = +0.09; stds 0.0141 (nested) and 0.0283 (plain)
    assert "- W2 g128 nested against W2 g128: unaligned k3 1.00e-02 against 2.00e-02 (x0.50)." in text
    assert "-> 0.610 at W2 g128 nested" not in text  # the climb across rungs leaves the nested twin out
    assert ("  - quantized rollout, BF16 learner, GRPO+TIS: final pass@1 nested minus plain +0.090 (larger seed std "
            "0.028, n=2)") in text
    assert "  - QaRL + GRPO: final pass@1 nested minus plain +0.000 (larger seed std 0.014, n=2)" in text


def test_a_report_without_finished_runs_leaves_the_docs_pages_as_they_are(tmp_path, monkeypatch, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results_ladder.md").write_text("# the committed ladder page\n")
    monkeypatch.setattr(run, "REPO", tmp_path)
    out = _main(monkeypatch, capsys, "--out", str(tmp_path / "o"), "--phase", "ladder", "--report-only", "--docs")
    assert (docs / "results_ladder.md").read_text() == "# the committed ladder page\n"
    assert "no finished run" in out and "docs/results_ladder.md left as it is" in out
    arm = phases.ladder_arms(phases.RUNGS[:1], run.LR, run.MINI_BATCHES, 1.0)[0]
    _write(tmp_path / "o" / "ladder", arm.name, 0, [{"mismatch/k3": 1e-5}], [0.3, 0.5])
    _main(monkeypatch, capsys, "--out", str(tmp_path / "o"), "--phase", "ladder", "--report-only", "--docs")
    assert (docs / "results_ladder.md").read_text().startswith("# Harsher-sampler ladder")  # a finished run: rebuilt


def test_extra_tbpo_bands_add_one_aligned_arm_per_rung_at_that_band():
    arms = phases.ladder_arms(list(phases.RUNGS[:2]), 2.5e-5, 2, 1.0, extra_bands=(10,))
    wide = [a for a in arms if a.role == "qarl_tbpo_x10"]
    assert [a.name for a in wide] == ["w4g128_qarl_tbpo_x10", "w4g32_qarl_tbpo_x10"]
    assert wide[0].param["aligned"] and wide[0].param["arm_label"] == "QaRL + TBPO, band x10"
    assert "train.loss.seq_clip_ratio_high=0.004" in wide[0].overrides  # 10 x Table 2's 4e-4
    assert "train.loss.name=grpo" not in wide[0].overrides and "quant.scheme=w4a16" in wide[0].overrides
    assert len(arms) == 1 + 2 * 5


def test_learner_eval_keeps_only_unaligned_checkpoints_and_evaluates_them_unquantized(tmp_path, monkeypatch):
    arms = phases.ladder_arms(phases.RUNGS[3:4], 2.5e-5, 2, 1.0)
    sweep = run.Sweep(out=tmp_path, steps=3, seeds=[0], arms=arms, eval_every=1, eval_prompts=4, learner_eval=True)
    assert [run.unaligned(sweep, a) for a in arms] == [False, True, True, False, False]  # control, 2 rollout, 2 QaRL
    calls = []

    def fake_train(sweep_, args, log):  # a run leaves its final checkpoint; a learner eval its step-0 evaluation
        calls.append(args)
        out = Path([a for a in args if a.startswith("logging.out_dir=")][-1].split("=", 1)[1])  # the last wins
        (out / "checkpoints" / "step_00000003").mkdir(parents=True)
        (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/pass@1": 0.75}) + "\n")
        return 1.0
    monkeypatch.setattr(run, "_qarl_train", fake_train)
    for arm in arms:
        run.run_arm(sweep, arm, 0, tmp_path / "sft")
    kept = {a.name: (tmp_path / "runs" / a.name / "seed0" / "checkpoints").exists() for a in arms}
    assert kept == {a.name: run.unaligned(sweep, a) for a in arms}
    rollout = arms[1]
    run.evaluate_learner(sweep, rollout, 0)
    args, run_out = calls[-1], tmp_path / "runs" / rollout.name / "seed0"
    assert args[:-6] == (run_out / "overrides.txt").read_text().splitlines()  # the run's own, then:
    assert args[-6:] == [f"model.init_checkpoint={run_out / 'checkpoints' / 'step_00000003'}", "train.steps=1",
                         "quant.scheme=none", "quant.learner_aligned=true", f"logging.out_dir={run_out / 'learner_eval'}",
                         f"checkpoint.dir={run_out / 'learner_eval' / 'checkpoints'}"]
    assert not (run_out / "checkpoints").exists() and (run_out / "learner_eval" / "DONE").exists()
    assert report.learner_pass1(run_out) == 0.75
    run.evaluate_learner(sweep, rollout, 0)  # done: not again
    assert len(calls) == len(arms) + 1


def test_the_ladder_page_sets_the_unaligned_learners_unquantized_beside_their_samplers(tmp_path):
    arms = phases.ladder_arms(phases.RUNGS[3:4], 1e-4, 4, 1.0)
    for seed, (final, learner) in enumerate([(0.40, 0.70), (0.50, 0.80)]):
        _write(tmp_path, "w2g128_rollout_grpo_tis", seed, [{"mismatch/k3": 1e-2}], [0.3, final])
        evaluated = tmp_path / "runs" / "w2g128_rollout_grpo_tis" / f"seed{seed}" / "learner_eval"
        evaluated.mkdir()
        (evaluated / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/pass@1": learner}) + "\n")
        (evaluated / "DONE").write_text("1\n")
    text = report.write_ladder_report(tmp_path, arms, [0, 1])
    assert ("- W2 g128, quantized rollout, BF16 learner, GRPO+TIS: final pass@1 quantized (its sampler) 0.450 ± 0.071, "
            "the same learner unquantized 0.750 ± 0.071 (n=2).") in text
