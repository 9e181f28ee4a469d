"""The `logging` section does what it says: metrics.jsonl, the PNG plots and the progress line's cadence,
each switched by its key (through `run_context.build_tracker`, the one place a run makes its tracker)."""
import json

from megatron_qarl.config import load_config
from megatron_qarl.run_context import build_tracker


def _log_steps(out, *overrides, steps=4):
    cfg = load_config(None, [f"logging.out_dir={out}", "logging.wandb.mode=disabled", f"train.steps={steps}",
                             *overrides])
    tracker = build_tracker(cfg)
    for step in range(steps):
        tracker.log(step, {"reward/mean": step / 10, "mismatch/k3": 1e-3, "loss/value": 0.1, "time/step_s": 1.0})
    return tracker, tracker.finish()


def _jsonl_steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_on_writes_every_step(tmp_path):
    _, written = _log_steps(tmp_path)
    assert _jsonl_steps(tmp_path) == [0, 1, 2, 3]
    assert tmp_path / "metrics.jsonl" in written


def test_jsonl_off_writes_no_metrics_file(tmp_path):
    tracker, written = _log_steps(tmp_path, "logging.jsonl=false")
    assert not (tmp_path / "metrics.jsonl").exists()
    assert tmp_path / "metrics.jsonl" not in written
    # the end-of-run summary and the plots still see every step
    assert tracker.summary() == "reward/mean: first 2 steps 0.050 -> last 2 steps 0.250 (+0.200)"
    assert tmp_path / "reward_mean.png" in written


def test_plots_on_and_off(tmp_path):
    _, written = _log_steps(tmp_path / "on")
    assert {p.name for p in written} >= {"reward_mean.png", "mismatch_k3.png", "time_step_s.png"}
    assert all(p.is_file() for p in written)
    _, written = _log_steps(tmp_path / "off", "logging.plots=false")
    assert written == [tmp_path / "off" / "metrics.jsonl"]
    assert not list((tmp_path / "off").glob("*.png"))


def test_log_every_sets_the_progress_line_cadence_not_the_jsonl_one(tmp_path, capsys):
    _log_steps(tmp_path, "logging.log_every=3", "logging.plots=false", steps=7)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[qarl] step")]
    assert [line.split()[2] for line in lines] == ["3/7", "6/7", "7/7"]  # every 3rd step, and the last
    assert "reward 0.2" in lines[0] and "k3 0.001" in lines[0]
    assert _jsonl_steps(tmp_path) == list(range(7))
