"""Checkpoints a user did not write, runs that own their directory, and integrity (issue 19, items 1, 3, 8, 10).

One short `qarl-train` run (2 steps, a checkpoint each) gives real trainer checkpoints; every test works
on a copy of it, so none changes what another reads.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_qarl.checkpointing.format import EXTRA_STATE_NAME, MARKER_NAME
from megatron_qarl.checkpointing.run_checkpoints import RunCheckpoints

from conftest import REPO

CONFIG = str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml")
SMALL = [
    "train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2", "train.micro_batch_size=2",
    "rollout.max_new_tokens=4", "logging.wandb.mode=disabled", "logging.plots=false",
]


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _train(out: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_qarl.cli", "--config", CONFIG, f"logging.out_dir={out}", *SMALL,
           *overrides]
    return subprocess.run(cmd, env=_env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conversion.cli", *args], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _ok(proc):
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _step_lines(out: Path) -> list[int]:
    """The step of every metrics.jsonl row, duplicates included."""
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "run"
    _ok(_train(out, "train.steps=2", "checkpoint.every=1", "checkpoint.keep_last=2"))
    assert [p.name for p in RunCheckpoints(out / "checkpoints").complete()] == ["step_00000001", "step_00000002"]
    return out


@pytest.fixture
def run_copy(base_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


# ---------------------------------------------------------------- item 1: no code execution from files

class _RunsCode:
    """Unpickling this runs `touch <marker>`: what a hostile checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant_pickle(ckpt: Path, marker: Path) -> None:
    import torch

    torch.save({"step": 1, "payload": _RunsCode(marker)}, ckpt / EXTRA_STATE_NAME)


def test_crafted_side_state_runs_no_code_on_read(run_copy, tmp_path):
    from megatron_qarl.checkpointing.trust import read_extra_state
    from megatron_qarl.errors import CheckpointError

    ckpt = run_copy / "checkpoints" / "step_00000002"
    marker = tmp_path / "pwned"
    _plant_pickle(ckpt, marker)
    with pytest.raises(CheckpointError, match=EXTRA_STATE_NAME) as err:
        read_extra_state(ckpt)
    assert not marker.exists(), "unpickling the side state ran code"
    assert "not written by qarl" in str(err.value) or "refused" in str(err.value)


def test_crafted_side_state_runs_no_code_on_inspect_or_resume(run_copy, tmp_path):
    ckpt = run_copy / "checkpoints" / "step_00000002"
    marker = tmp_path / "pwned"
    _plant_pickle(ckpt, marker)

    proc = _convert("inspect", str(ckpt))
    assert not marker.exists(), "qarl-convert inspect ran code from the checkpoint"
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert EXTRA_STATE_NAME in proc.stdout + proc.stderr

    proc = _train(tmp_path / "other", "train.steps=3", f"checkpoint.resume={ckpt}")
    assert not marker.exists(), "resuming ran code from the checkpoint"
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert EXTRA_STATE_NAME in proc.stderr


def test_side_state_of_a_real_checkpoint_reads_without_pickle_globals(base_run):
    """The state a run writes (data position, RNG, HF side files) is plain: torch's weights-only loader
    reads it, and it restores the exact python/torch RNG state."""
    import torch

    from megatron_qarl.checkpointing.trust import read_extra_state

    ckpt = base_run / "checkpoints" / "step_00000002"
    state = torch.load(ckpt / EXTRA_STATE_NAME, weights_only=True)  # independent reader
    assert state["step"] == 2 and read_extra_state(ckpt)["step"] == 2
    assert isinstance(state["rng"]["torch"], torch.Tensor) and state["rng"]["torch"].dtype == torch.uint8


def test_save_refuses_side_state_a_weights_only_reader_could_not_read(tmp_path):
    from megatron_qarl.checkpointing.format import check_plain_state

    check_plain_state({"a": [1, 2.0, "x", b"y", None, (True,)], "t": __import__("torch").zeros(2)})
    with pytest.raises(TypeError, match="extra.bad"):
        check_plain_state({"bad": Path("/x")})


# ---------------------------------------------------------------- item 8/10: integrity

def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_marker_records_size_and_sha256_of_every_file(base_run):
    ckpt = base_run / "checkpoints" / "step_00000002"
    files = json.loads((ckpt / MARKER_NAME).read_text())["files"]
    on_disk = sorted(p.name for p in ckpt.iterdir() if p.name != MARKER_NAME)
    assert sorted(files) == on_disk and any(n.endswith(".distcp") for n in on_disk)
    for name, rec in files.items():
        assert rec["size"] == (ckpt / name).stat().st_size, name
        assert rec["sha256"] == _sha256(ckpt / name), name


def test_inspect_trainer_checkpoint_is_complete(base_run):
    proc = _convert("inspect", str(base_run / "checkpoints" / "step_00000002"), "--json")
    _ok(proc)
    info = json.loads(proc.stdout)
    assert info["format"] == "megatron-run" and info["complete"] and info["verified"] == info["files"] > 0, info


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_inspect_finds_a_damaged_shard(run_copy, damage):
    ckpt = run_copy / "checkpoints" / "step_00000002"
    shard = sorted(ckpt.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[:2000]
    else:
        data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    shard.write_bytes(bytes(data))
    proc = _convert("inspect", str(ckpt))
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]  # an incomplete checkpoint is a user error
    assert "complete:    NO" in proc.stdout and shard.name in proc.stdout, proc.stdout
    assert "is incomplete" in proc.stderr and shard.name in proc.stderr, proc.stderr  # and says so on stderr
    assert ("size" if damage == "truncate" else "sha256") in proc.stdout


def test_resume_auto_falls_back_past_a_damaged_newest_checkpoint(run_copy):
    """The newest checkpoint fails verification: resume=auto warns, names both, resumes the previous one;
    metrics.jsonl keeps one row per step; a killed save's temp dir is reported and removed."""
    ckpts = run_copy / "checkpoints"
    newest = ckpts / "step_00000002"
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:2000])
    stale = ckpts / ".step_00000003.tmp-abc123"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"x" * 100)
    proc = _train(run_copy, "train.steps=3", "checkpoint.every=1", "checkpoint.keep_last=3")
    _ok(proc)
    out = proc.stdout + proc.stderr
    assert "step_00000002" in out and "step_00000001" in out and "fails verification" in out, out[-3000:]
    assert "resumed from" in proc.stdout and "step_00000001 (step 1)" in proc.stdout
    assert str(stale.name) in out and not stale.exists()
    assert _step_lines(run_copy) == [0, 1, 2]


def test_resume_with_an_explicit_damaged_checkpoint_is_a_clear_error(run_copy, tmp_path):
    ckpt = run_copy / "checkpoints" / "step_00000002"
    shard = sorted(ckpt.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:2000])
    proc = _train(tmp_path / "other", "train.steps=3", f"checkpoint.resume={ckpt}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert shard.name in proc.stderr and "corrupted" in proc.stderr


# ---------------------------------------------------------------- item 3: a run owns its directory

def _snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("change", [["quant.scheme=none"], ["name=another_experiment"]], ids=["quant", "name"])
def test_resume_into_another_experiments_dir_is_refused_and_changes_nothing(run_copy, change):
    before = _snapshot(run_copy)
    proc = _train(run_copy, "train.steps=3", *change)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "checkpoint.resume=force" in proc.stderr and "different experiment" in proc.stderr
    key = change[0].split("=")[0]
    assert key in proc.stderr
    assert _snapshot(run_copy) == before  # config.yaml, metrics.jsonl and every checkpoint untouched


def test_resume_force_continues_another_config(run_copy):
    proc = _train(run_copy, "train.steps=3", "name=another_experiment", "checkpoint.resume=force")
    _ok(proc)
    assert "resumed from" in proc.stdout and "step_00000002 (step 2)" in proc.stdout
    assert _step_lines(run_copy) == [0, 1, 2]


def test_resumed_run_has_no_duplicate_metric_rows(run_copy):
    proc = _train(run_copy, "train.steps=3", f"checkpoint.resume={run_copy / 'checkpoints' / 'step_00000001'}")
    _ok(proc)
    assert _step_lines(run_copy) == [0, 1, 2]


def test_tracker_truncates_rows_from_the_start_step(tmp_path):
    from megatron_qarl.tracking import MetricsTracker, TrackerConfig

    rows = [{"step": s, "x": s * 1.5} for s in (0, 1, 2, 3, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tracker = MetricsTracker(TrackerConfig(out_dir=str(tmp_path), wandb_mode="disabled", plots=False),
                             resume=True, start_step=2)
    assert tracker.rows() == rows[:2]
    tracker.log(2, {"x": 9.0})
    assert [r["step"] for r in tracker.rows()] == [0, 1, 2]
    assert not [p for p in tmp_path.iterdir() if p.name != "metrics.jsonl"]  # no temp file left
