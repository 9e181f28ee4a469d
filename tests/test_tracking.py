"""The `logging` section does what it says: metrics.jsonl, the PNG plots and the progress line's cadence,
each switched by its key (through `run_context.build_tracker`, the one place a run makes its tracker); and
every TrackerConfig field does what it says: the wandb mode (WANDB_MODE wins), entity and resumed run id
(checked in the offline run files wandb writes), TensorBoard, periodic plots (eval/ curves included) and
samples.jsonl."""
import json
import os
import re
import struct
import sys

import pytest

from megatron_qarl.config import load_config
from megatron_qarl.run_context import build_tracker
from megatron_qarl.tracking import MetricsTracker, TrackerConfig, TrackingError, progress_line, resolve_wandb_mode


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


# -- the tracker's own sinks (TrackerConfig directly) ----------------------------------------------------

def _tracker(out, *, resume=False, start_step=None, **fields):
    fields = {"wandb_mode": "disabled", "plots": False, **fields}
    return MetricsTracker(TrackerConfig(out_dir=str(out), **fields), resume=resume, start_step=start_step)


@pytest.fixture
def no_wandb_env(monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, requested, expected", [
    (None, "offline", "offline"), (None, "disabled", "disabled"), (None, "online", "online"),
    ("offline", "online", "offline"), ("online", "disabled", "online"), ("disabled", "offline", "disabled"),
    ("dryrun", "online", "dryrun"),
])
def test_wandb_mode_from_the_environment_wins(no_wandb_env, env, requested, expected):
    if env is not None:
        no_wandb_env.setenv("WANDB_MODE", env)
    assert resolve_wandb_mode(requested) == expected


def test_an_api_key_makes_offline_online_but_not_disabled_or_an_env_mode(no_wandb_env):
    no_wandb_env.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_wandb_mode("offline") == "online"
    assert resolve_wandb_mode("disabled") == "disabled"
    no_wandb_env.setenv("WANDB_MODE", "offline")
    assert resolve_wandb_mode("online") == "offline"


def test_bad_modes_and_cadences_are_refused(no_wandb_env, tmp_path):
    no_wandb_env.setenv("WANDB_MODE", "Offline")
    with pytest.raises(ValueError, match="WANDB_MODE='Offline'"):
        resolve_wandb_mode("offline")
    for bad in ({"wandb_mode": "on"}, {"plot_every": -1}, {"log_every": 0}):
        with pytest.raises(ValueError):
            TrackerConfig(out_dir=str(tmp_path), **bad)


def test_wandb_mode_disabled_in_the_environment_never_imports_wandb(no_wandb_env, tmp_path):
    no_wandb_env.setenv("WANDB_MODE", "disabled")
    no_wandb_env.setitem(sys.modules, "wandb", None)  # any `import wandb` raises ImportError
    tracker = _tracker(tmp_path, wandb_mode="offline")
    tracker.log(0, {"reward/mean": 0.5})
    assert tracker.wandb_run_id is None
    assert tracker.finish() == [tmp_path / "metrics.jsonl"]
    assert not (tmp_path / "wandb").exists()


def test_online_without_credentials_fails_fast_instead_of_prompting(no_wandb_env, tmp_path):
    no_wandb_env.setenv("WANDB_MODE", "online")
    for var, value in (("HOME", tmp_path), ("NETRC", tmp_path / "no-netrc"), ("WANDB_CONFIG_DIR", tmp_path)):
        no_wandb_env.setenv(var, str(value))
    no_wandb_env.setattr("builtins.input", lambda *a: pytest.fail("prompted for a login"))
    with pytest.raises(TrackingError, match="WANDB_API_KEY"):
        _tracker(tmp_path / "out", wandb_mode="offline")
    assert not (tmp_path / "out" / "wandb").exists()


def _wandb_records(path):
    """The records of a run-<id>.wandb file: wandb's LevelDB-log framing (7-byte file header, 32 KiB blocks,
    7-byte chunk headers: crc, length, type full=1/first=2/middle=3/last=4) of Record protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768  # block trailer
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _wandb_run(run_dir):
    """(run ids, entities, logged steps, logged reward/mean values) of one offline run dir."""
    (wandb_file,) = run_dir.glob("run-*.wandb")
    ids, entities, steps, rewards = set(), set(), [], []
    for record in _wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            ids.add(record.run.run_id)
            entities.add(record.run.entity)
        elif kind == "history":
            steps.append(record.history.step.num)
            items = {"/".join(i.nested_key) or i.key: i.value_json for i in record.history.item}
            rewards.append(json.loads(items["reward/mean"]))
    return ids, entities, steps, rewards


def test_a_resumed_run_continues_the_same_offline_wandb_run(no_wandb_env, tmp_path):
    import wandb

    no_wandb_env.setenv("WANDB_MODE", "offline")  # wins over the config's online: no credentials needed
    first = _tracker(tmp_path, wandb_mode="online", entity="qarl-team", total_steps=3)
    run_id = first.wandb_run_id
    assert run_id
    for step in (0, 1):
        first.log(step, {"reward/mean": step / 10})
    first.finish()

    second = _tracker(tmp_path, wandb_mode="online", entity="qarl-team", total_steps=3, wandb_run_id=run_id,
                      resume=True, start_step=2)
    assert second.wandb_run_id == run_id
    second.log(2, {"reward/mean": 0.2})
    second.finish()
    wandb.teardown()  # run.finish() returns before wandb's service has written the run files; this waits

    # one offline dir per process run, named offline-run-<start time>-<id> (plus -1 when two start in the
    # same second), both for the one run id: `wandb sync` uploads them into the same run
    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2, run_dirs
    assert all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", d.name) for d in run_dirs), run_dirs
    assert [p.name for p in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")] == [f"run-{run_id}.wandb"] * 2
    runs = sorted((_wandb_run(d) for d in run_dirs), key=lambda run: run[2])
    assert runs == [({run_id}, {"qarl-team"}, [0, 1], [0.0, 0.1]), ({run_id}, {"qarl-team"}, [2], [0.2])]


def test_tensorboard_gets_every_numeric_metric_and_a_resume_replaces_the_rerun_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch = pytest.importorskip("torch")
    tracker = _tracker(tmp_path, tensorboard=True)
    for step in range(4):
        tracker.log(step, {"reward/mean": float(step), "loss/value": torch.tensor(step / 2), "note": "text",
                           "flag": True})
    assert tmp_path / "tensorboard" in tracker.finish()
    tracker = _tracker(tmp_path, tensorboard=True, resume=True, start_step=2)
    for step in (2, 3):
        tracker.log(step, {"reward/mean": 10.0 + step, "loss/value": 0.0})
    tracker.finish()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss/value", "reward/mean"]
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
    assert [(e.step, e.value) for e in events.Scalars("loss/value")] == [(0, 0.0), (1, 0.5), (2, 0.0), (3, 0.0)]

    (tmp_path / "metrics.jsonl").unlink()
    with pytest.raises(TrackingError, match=r"tensorboard/"):  # a fresh run never deletes another run's points
        _tracker(tmp_path, tensorboard=True)


def test_no_tensorboard_dir_unless_asked(tmp_path):
    tracker = _tracker(tmp_path)
    tracker.log(0, {"reward/mean": 1.0})
    assert tracker.finish() == [tmp_path / "metrics.jsonl"]
    assert not (tmp_path / "tensorboard").exists()


def test_plots_are_refreshed_every_plot_every_steps_and_eval_rows_are_plotted(tmp_path, capsys):
    png = tmp_path / "reward_mean.png"
    tracker = _tracker(tmp_path, plots=True, plot_every=2, total_steps=4)
    tracker.log(0, {"reward/mean": 0.0})
    assert not png.exists()
    tracker.log(1, {"reward/mean": 0.1})
    first = png.read_bytes()
    tracker.log(2, {"reward/mean": 0.2, "eval/pass@1": 0.25, "eval/pass@4": 0.5, "eval/mean_reward": 0.3})
    tracker.log(3, {"reward/mean": 0.3})
    assert png.read_bytes() == first  # step 4/4 is the last one: finish() draws it
    tracker.log(4, {"eval/pass@1": 0.5, "eval/pass@4": 0.75, "eval/mean_reward": 0.6})  # the final eval, alone
    written = tracker.finish()
    assert png.read_bytes() != first
    assert {p.name for p in written} == {"metrics.jsonl", "reward_mean.png", "eval_pass@1.png", "eval_pass@4.png",
                                         "eval_mean_reward.png"}
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[qarl] ")]
    assert lines[-3] == ("[qarl] step 3/4  reward 0.2  | eval after step 2/4:  eval/mean_reward 0.3  eval/pass@1 0.25"
                         "  eval/pass@4 0.5")
    assert lines[-1] == "[qarl] eval after step 4/4:  eval/mean_reward 0.6  eval/pass@1 0.5  eval/pass@4 0.75"
    assert tracker.summary() == "reward/mean: first 2 steps 0.050 -> last 2 steps 0.250 (+0.200)"


def test_plot_every_zero_plots_only_at_finish(tmp_path):
    tracker = _tracker(tmp_path, plots=True, plot_every=0)
    for step in range(3):
        tracker.log(step, {"reward/mean": step / 10})
    assert not list(tmp_path.glob("*.png"))
    assert tmp_path / "reward_mean.png" in tracker.finish()


def test_periodic_plots_on_a_full_disk_warn_once_and_never_raise(tmp_path, capsys, monkeypatch):
    import errno

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    tracker = _tracker(tmp_path, plots=True, plot_every=1, jsonl=False)
    monkeypatch.setattr(os, "fsync", disk_full)
    for step in range(3):
        tracker.log(step, {"reward/mean": step / 10})
    assert tracker.finish() == []
    assert capsys.readouterr().out.count("plots not written") == 1
    assert not list(tmp_path.iterdir())  # no temp file left


def _samples(out):
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def test_samples_jsonl_appends_resumes_and_starts_fresh(tmp_path):
    torch = pytest.importorskip("torch")
    tracker = _tracker(tmp_path)
    for step in range(3):
        tracker.log_samples(step, [{"prompt": f"{step}+1=", "response": str(step + 1), "reward": torch.tensor(1.0),
                                    "answer": str(step + 1)}, {"prompt": "p", "response": "r", "reward": 0.0}])
    assert tmp_path / "samples.jsonl" in tracker.finish()
    rows = _samples(tmp_path)
    assert [r["step"] for r in rows] == [0, 0, 1, 1, 2, 2]
    assert rows[0] == {"step": 0, "prompt": "0+1=", "response": "1", "reward": 1.0, "answer": "1"}

    tracker = _tracker(tmp_path, resume=True, start_step=2)  # step 2 is re-run: its samples go
    assert [r["step"] for r in _samples(tmp_path)] == [0, 0, 1, 1]
    tracker.log_samples(2, [{"prompt": "again", "reward": 0.5}])
    tracker.finish()
    assert _samples(tmp_path)[-1] == {"step": 2, "prompt": "again", "reward": 0.5}

    with pytest.raises(TrackingError, match="holds an earlier run's results"):  # a fresh run never deletes them
        _tracker(tmp_path)
    assert len(_samples(tmp_path)) == 5


def test_samples_off_writes_no_samples_file(tmp_path):
    tracker = _tracker(tmp_path, samples=False)
    tracker.log_samples(0, [{"prompt": "p", "response": "r", "reward": 1.0}])
    assert tracker.finish() == []
    assert not (tmp_path / "samples.jsonl").exists()


def test_progress_line_of_a_row_without_training_keys():
    assert progress_line(10, 10, {"eval/pass@1": 0.5}) == "[qarl] eval after step 10/10:  eval/pass@1 0.5"
    assert progress_line(0, 10, {"eval/pass@1": 0.5}) == "[qarl] eval at start:  eval/pass@1 0.5"
    assert progress_line(0, None, {}) == "[qarl] step 1/?  "


def test_progress_line_leaves_out_what_was_not_measured():
    line = progress_line(2, 5, {"reward/mean": 0.25, "publish/code_flip_frac": float("nan")})
    assert line == "[qarl] step 3/5  reward 0.25"
