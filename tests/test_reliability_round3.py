"""Issue 49's third round of faults, items 3 and 6 (safetensors headers): nothing a run had is lost, nothing it
writes follows a link out of its directory, nothing outside a checkpoint is read, no header the safetensors format
does not allow reaches the model build."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from megatron_qarl.errors import CheckpointError
from megatron_qarl.weights.hf_io import INDEX_NAME, scan_hf_checkpoint


# ---------------------------------------------------------------- safetensors files and indexes

def _safetensors(path: Path, header, data: bytes = b"", raw: bytes | None = None) -> Path:
    """A file in the safetensors layout: u64 header length, the header (`raw` bytes as given, else JSON), data."""
    body = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def _good(path: Path, name: str = "w") -> Path:
    return _safetensors(path, {name: {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                               "__metadata__": {"format": "pt"}}, bytes(8))


def test_a_well_formed_file_passes_the_header_check(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 5), "b": torch.ones(7, dtype=torch.bfloat16), "e": torch.zeros(0)},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    index = scan_hf_checkpoint(tmp_path)
    assert index.shapes == {"a": (3, 5), "b": (7,), "e": (0,)}
    _good(tmp_path / "model.safetensors")
    assert scan_hf_checkpoint(tmp_path).shapes == {"w": (2,)}
    _safetensors(tmp_path / "model.safetensors", {"__metadata__": None, "w": {"dtype": "F4", "shape": [4],
                                                                           "data_offsets": [0, 2]}}, bytes(2))
    assert scan_hf_checkpoint(tmp_path).shapes == {"w": (4,)}  # null metadata and sub-byte dtypes are the format's


F32x2 = {"dtype": "F32", "shape": [2]}
BAD_HEADERS = {  # class -> (header as JSON, or raw header bytes; data bytes; what the one line says)
    "a list": ([{"w": {**F32x2, "data_offsets": [0, 8]}}], 8, "a JSON list, not an object"),
    "a string": ("model", 8, "a JSON str, not an object"),
    "non-UTF-8 bytes in a name": (b'{"w\xff\xfe": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 8,
                                  "corrupt safetensors header"),
    "a lone surrogate in a name": (b'{"w\\ud800": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 8,
                                   "is not valid UTF-8"),
    "overlapping offsets": ({"a": {**F32x2, "data_offsets": [0, 8]}, "b": {**F32x2, "data_offsets": [4, 12]}}, 12,
                            "overlaps 'a'"),
    "inverted offsets": ({"w": {**F32x2, "data_offsets": [8, 0]}}, 8, "not [begin, end] with 0 <= begin <= end"),
    "missing data_offsets": ({"w": {**F32x2}}, 8, "has no data_offsets"),
    "nested metadata": ({"__metadata__": {"format": {"nested": "pt"}}, "w": {**F32x2, "data_offsets": [0, 8]}}, 8,
                        "__metadata__ is not a flat {string: string} object"),
    "dtype x shape larger than the offsets": ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, 8,
                                              "needs 16 bytes but its data_offsets [0, 8] span 8"),
    "dtype x shape smaller than the offsets": ({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 8]}}, 8,
                                               "needs 4 bytes but its data_offsets [0, 8] span 8"),
    "an unknown dtype": ({"w": {"dtype": "F128", "shape": [2], "data_offsets": [0, 8]}}, 8,
                         "dtype 'F128', which the safetensors format does not define"),
    "a negative dimension": ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8,
                             "not a list of non-negative integers"),
    "a gap between tensors": ({"a": {**F32x2, "data_offsets": [0, 8]}, "b": {**F32x2, "data_offsets": [12, 20]}}, 20,
                              "leaves bytes 8..12 unused"),
    "bytes after the last tensor": ({"w": {**F32x2, "data_offsets": [0, 8]}}, 12, "4 byte(s) follow"),
    "a duplicate name": (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                         b'"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', 8, "duplicate key 'w'"),
    "a tensor described by a list": ({"w": ["F32", [2], [0, 8]]}, 8, "described by a JSON list"),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_a_safetensors_header_the_format_does_not_allow_is_one_line(tmp_path, case):
    """Each used to pass the header check (json.loads was all it asked) and then crash with a traceback
    (AttributeError, KeyError, UnicodeDecodeError) or load a tensor from the wrong bytes."""
    header, data, says = BAD_HEADERS[case]
    file = tmp_path / "model.safetensors"
    if isinstance(header, bytes):
        _safetensors(file, None, bytes(data), raw=header)
    else:
        _safetensors(file, header, bytes(data))
    with pytest.raises(CheckpointError) as err:
        scan_hf_checkpoint(tmp_path)
    line = str(err.value)
    assert "\n" not in line and str(file) in line and says in line and "re-download or re-export it" in line, line


def test_a_bad_header_is_refused_before_the_run_builds_the_model(tmp_path, monkeypatch, world_of_one):
    """The run checks model.hf_path's headers before the model build (minutes at 30B), not after it."""
    from megatron_qarl import run_context
    from megatron_qarl.config import load_config
    from megatron_qarl.models.qwen3_moe import tiny_hf_config

    hf = tmp_path / "hf"
    hf.mkdir()
    tiny_hf_config().to_json_file(str(hf / "config.json"))
    _safetensors(hf / "model.safetensors", [1, 2], bytes(8))
    cfg = load_config(None, ["model.preset=null", f"model.hf_path={hf}", "model.tokenizer=char",
                             f"logging.out_dir={tmp_path / 'run'}", "logging.wandb.mode=disabled"])
    monkeypatch.setattr(run_context, "load_run_data", lambda *a, **k: (None, None))

    class Unbuilt:
        def __init__(self, family):
            self.family = family

        def __getattr__(self, name):
            if name == "build_model":
                raise AssertionError("the model was built before the header check")
            return getattr(self.family, name)

    real = run_context.family_of
    monkeypatch.setattr(run_context, "family_of", lambda hf_config: Unbuilt(real(hf_config)))
    with pytest.raises(CheckpointError, match="a JSON list, not an object"):
        run_context.build_run_context(cfg)


@pytest.mark.parametrize("outside", ["../outside.safetensors", "{abs}", "sub/../../outside.safetensors", ""])
def test_an_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, outside):
    """weight_map's file names were joined to the checkpoint dir as given: an absolute name or `../` read a file
    from anywhere (here a valid safetensors file beside the checkpoint)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    target = _good(tmp_path / "outside.safetensors")
    _good(ckpt / "model-00001-of-00002.safetensors", "a")
    name = outside.format(abs=target)
    (ckpt / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "w": name}}))
    with pytest.raises(CheckpointError) as err:
        scan_hf_checkpoint(ckpt)
    line = str(err.value)
    assert "\n" not in line and "a file outside the checkpoint directory" in line and repr(name) in line, line


@pytest.mark.parametrize("weight_map", [["a"], {"a": 3}, None])
def test_an_index_whose_weight_map_is_not_names_to_files_is_one_line(tmp_path, weight_map):
    _good(tmp_path / "model.safetensors", "a")
    (tmp_path / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="weight_map is not a"):
        scan_hf_checkpoint(tmp_path)


def test_a_shard_that_is_a_link_inside_the_hub_cache_still_reads(tmp_path):
    """The HF hub's snapshots link every shard to ../../blobs/<hash>: names are checked, not link targets."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    _good(blobs / "123")
    (snap / "model.safetensors").symlink_to("../../blobs/123")
    assert scan_hf_checkpoint(snap).shapes == {"w": (2,)}


# ---------------------------------------------------------------- nothing a run writes follows a link out of its dir

def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "elsewhere" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("a user's file outside the run\n")
    return victim


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_planted_lock_file_link_is_refused_and_its_target_untouched(tmp_path, link):
    """`.qarl.lock` as a link in a copied or shared run dir: the lock used to open it (no O_NOFOLLOW) and truncate
    the file it points to, then write its pid line there."""
    from megatron_qarl.fileio import RunDirInUseError, RunDirLock, RunFileLinkError

    victim, run = _victim(tmp_path), tmp_path / "run"
    run.mkdir()
    lock = run / RunDirLock.NAME
    lock.symlink_to(victim) if link == "symbolic" else lock.hardlink_to(victim)
    with pytest.raises(RunFileLinkError) as err:
        RunDirLock(run, "logging.out_dir").acquire()
    assert isinstance(err.value, RunDirInUseError)  # qarl-train: one line, exit 2
    line = str(err.value)
    fix = "remove it (what it links to is not touched)" if link == "symbolic" else "make it a file of its own"
    assert "\n" not in line and str(lock) in line and fix in line, line
    assert victim.read_text() == "a user's file outside the run\n"


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"])
def test_a_planted_metrics_file_link_gets_no_rows_through_it(tmp_path, name):
    """metrics.jsonl (samples.jsonl, eval_samples.jsonl) as a link: a resumed run appended its rows through it, to
    the file it points to; a link planted while the run is going is refused at the next row too."""
    from megatron_qarl.fileio import RunFileLinkError
    from megatron_qarl.tracking import MetricsTracker, TrackerConfig

    victim, run = _victim(tmp_path), tmp_path / "run"
    run.mkdir()
    cfg = TrackerConfig(out_dir=str(run), wandb_mode="disabled", plots=False, total_steps=3)
    (run / name).symlink_to(victim)
    with pytest.raises(RunFileLinkError, match=f"{name} is a symbolic link"):
        MetricsTracker(cfg, resume=True, start_step=1)
    (run / name).unlink()
    (run / name).hardlink_to(victim)
    with pytest.raises(RunFileLinkError, match=f"{name} has 2 hard links"):
        MetricsTracker(cfg, resume=True, start_step=1)
    (run / name).unlink()
    tracker = MetricsTracker(cfg, resume=True, start_step=0)
    (run / name).symlink_to(victim)  # planted after the start
    with pytest.raises(RunFileLinkError, match=f"{name} is a symbolic link"):
        {"metrics.jsonl": lambda: tracker.log(0, {"reward/mean": 1.0}),
         "samples.jsonl": lambda: tracker.log_samples(0, [{"prompt": "p"}]),
         "eval_samples.jsonl": lambda: tracker.log_eval_samples(0, [{"prompt": "p"}])}[name]()
    assert victim.read_text() == "a user's file outside the run\n"


# ---------------------------------------------------------------- a kill during the publish loses no row

import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from conftest import REPO  # noqa: E402

CONFIG = str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml")
SMALL = ["train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2", "train.micro_batch_size=2",
         "rollout.max_new_tokens=4", "logging.wandb.mode=disabled", "logging.plots=false", "train.steps=3",
         "checkpoint.every=1", "eval.path=null"]
# qarl-train with the publisher's N-th call SIGKILLing the process (call 1 is the publish before the first step,
# call k + 2 the one after step k): a real kill at a known point, nothing added to the code under test.
KILL_IN_PUBLISH = '''
import os, signal, sys
import megatron_qarl.trainer as trainer
real, calls = trainer.publish_weights, [0]
def publish_weights(ctx, *args, **kwargs):
    calls[0] += 1
    if calls[0] == int(os.environ["KILL_AT_PUBLISH"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(ctx, *args, **kwargs)
trainer.publish_weights = publish_weights
from megatron_qarl.cli import train_main as main
sys.exit(main(sys.argv[1:]))
'''


def _qarl_train(out: Path, *overrides: str, code: str | None = None, **env) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-c", code] if code else [sys.executable, "-m", "megatron_qarl.cli"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
                "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    return subprocess.run([*launcher, "--config", CONFIG, f"logging.out_dir={out}", *SMALL, *overrides],
                          env=full_env, cwd=REPO, capture_output=True, text=True, timeout=600)


def _steps(path: Path) -> list[int]:
    return sorted({json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()})


def test_a_sigkill_during_the_publish_leaves_no_hole_in_metrics_or_samples(tmp_path):
    """The step is checkpointed before the publish and logged after it: a SIGKILL in between lost its metrics and
    samples rows for good (the resumed run starts after it): rows 0, 2 remained. The checkpoint now keeps the row,
    and the resumed run logs it."""
    out = tmp_path / "run"
    killed = _qarl_train(out, code=KILL_IN_PUBLISH, KILL_AT_PUBLISH="3")  # during the publish after step 1
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (out / "checkpoints" / "step_00000002").is_dir() and _steps(out / "metrics.jsonl") == [0]
    resumed = _qarl_train(out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step 1's row was checkpointed but never logged" in resumed.stdout
    assert _steps(out / "metrics.jsonl") == [0, 1, 2] and _steps(out / "samples.jsonl") == [0, 1, 2]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and "reward/mean" in rows[1] and rows[1]["restored_from_checkpoint"] == 1.0


# ---------------------------------------------------------------- resume=auto continues this run's own checkpoints

def _cfg(*overrides: str):
    from megatron_qarl.config import load_config

    return load_config(None, ["logging.out_dir=/runs/a", "checkpoint.dir=/shared/ckpt", *overrides])


@pytest.mark.parametrize("other,says", [
    (["train.seed=7"], "train.seed: 1234 there, 7 here"),
    (["train.optim.lr=0.5"], "train.optim.lr:"),
    (["logging.out_dir=/runs/b"], "logging.out_dir: '/runs/a' there, '/runs/b' here"),
])
def test_resume_auto_refuses_another_runs_checkpoint_and_a_requeue_still_resumes(other, says):
    from megatron_qarl.config import ConfigError
    from megatron_qarl.run_context import check_own_checkpoint, run_settings

    side = {"run_id": "abc123", "run_settings": run_settings(_cfg())}
    check_own_checkpoint(_cfg(), "/shared/ckpt/step_00000004", side)  # the same command again: resumed
    with pytest.raises(ConfigError) as err:
        check_own_checkpoint(_cfg(*other), "/shared/ckpt/step_00000004", side)
    line = str(err.value)
    assert "\n" not in line and "is another run's (run abc123" in line and says in line, line
    assert "own checkpoint.dir" in line and "checkpoint.resume=/shared/ckpt/step_00000004" in line, line
    check_own_checkpoint(_cfg(*other, "checkpoint.resume=force"), "/shared/ckpt/step_00000004", side)  # on purpose
    check_own_checkpoint(_cfg(*other), "/shared/ckpt/step_00000004", {"run_id": "abc123"})  # before run settings


def test_a_run_dir_moved_or_copied_still_resumes_its_own_checkpoints():
    """With checkpoint.dir unset the checkpoints live in the out dir: a moved run dir is the same run."""
    from megatron_qarl.run_context import check_own_checkpoint, run_settings

    side = {"run_settings": run_settings(_cfg("checkpoint.dir=null"))}
    check_own_checkpoint(_cfg("checkpoint.dir=null", "logging.out_dir=/moved/a"), "/moved/a/checkpoints/step_1", side)


def test_a_second_run_on_a_shared_checkpoint_dir_does_not_take_over_the_first_ones(tmp_path):
    """Another seed on a shared checkpoint.dir: resume=auto resumed the first run's checkpoint, took its run id and
    would prune its steps; now refused in one line naming that run, nothing of either run touched."""
    shared = tmp_path / "shared"
    first = _qarl_train(tmp_path / "a", f"checkpoint.dir={shared}", "train.steps=1")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = shared / "step_00000001"
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    second = _qarl_train(tmp_path / "b", f"checkpoint.dir={shared}", "train.steps=2", "train.seed=7")
    assert second.returncode == 2, second.stderr[-3000:]
    lines = [ln for ln in second.stderr.splitlines() if ln.startswith("qarl-train: error:")]
    assert len(lines) == 1 and "is another run's" in lines[0] and "train.seed: 1234 there, 7 here" in lines[0], \
        second.stderr[-3000:]
    assert sorted(p.name for p in shared.iterdir() if p.name.startswith("step_")) == ["step_00000001"]
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


# ---------------------------------------------------------------- qarl-train sft: lock, graceful stop, resume, refuse

SFT_SMALL = ["sft.steps=4", "sft.batch_size=8", "sft.eval_every=0", "sft.eval_prompts=8", "sft.eval_max_new_tokens=4",
             "sft.log_every=1", "sft.lr_warmup_steps=0", "sft.stop_at_sampled_accuracy=null",
             "logging.wandb.mode=disabled"]


def _sft(tmp_path: Path, name: str, *overrides: str) -> tuple[Path, list[str]]:
    out = tmp_path / name / "checkpoint"
    return out, ["sft", "--config", CONFIG, f"sft.out_checkpoint={out}", f"logging.out_dir={tmp_path / name / 'log'}",
                 *SFT_SMALL, *overrides]


def _losses(out: Path) -> list:
    return json.loads((out.parent / "log" / "sft_metrics.json").read_text())["loss_history"]


def test_sft_stops_at_a_step_boundary_with_its_state_and_the_same_command_continues_it(tmp_path, monkeypatch, capsys):
    """SIGTERM used to end `qarl-train sft` at once, the whole warm-up lost, and Ctrl-C promised a checkpoint and
    a resume SFT did not have. Now the step finishes, the state is saved, exit 3; the same command continues it to
    the very losses of an uninterrupted run, writes sft.out_checkpoint and drops the state."""
    from megatron_qarl import sft as sft_module
    from megatron_qarl.checkpointing.format import is_complete
    from megatron_qarl.checkpointing.trust import verify_checkpoint
    from megatron_qarl.cli import train_main
    from megatron_qarl.lifecycle import EXIT_STOPPED

    monkeypatch.delenv("QARL_STOP_FILE", raising=False)
    reference, args = _sft(tmp_path, "reference")
    assert train_main(args) == 0
    out, args = _sft(tmp_path, "stopped")
    real, steps = sft_module.train_step, [0]

    def sigterm_in_step_2(*a, **k):  # a real signal, inside step 2: the run's handler records it
        steps[0] += 1
        if steps[0] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(sft_module, "train_step", sigterm_in_step_2)
    capsys.readouterr()
    assert train_main(args) == EXIT_STOPPED
    state = Path(f"{out}.resume")
    line = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("qarl-train:")]
    assert line == [f"qarl-train: stopped by SIGTERM after SFT step 2/4; its state is in {state}; exit status 3; run "
                    "the same command again to continue from step 2"], line
    assert is_complete(state) and verify_checkpoint(state) == [] and not out.exists()
    monkeypatch.setattr(sft_module, "train_step", real)
    assert train_main([*args, "sft.seed=5", "sft.lr=0.01"]) == 2  # another run's settings: not continued
    err = capsys.readouterr().err
    assert f"{state} is the state of a stopped SFT run with other settings (sft.lr, sft.seed)" in err, err
    assert train_main(args) == 0
    assert f"[sft] resumed from {state} (step 2/4)" in capsys.readouterr().out
    assert is_complete(out) and not state.exists()
    assert _losses(out) == _losses(reference) and [s for s, _ in _losses(out)] == [1, 2, 3, 4]


def test_a_second_sft_run_on_the_same_out_checkpoint_is_refused_or_moves_it_aside(tmp_path, capsys):
    """Two SFT runs on one sft.out_checkpoint both exited 0, the second silently replacing the first (sft.overwrite
    defaulted to true). Now refused in one line naming the choices; sft.overwrite=true moves it aside, deletes
    nothing."""
    from megatron_qarl.checkpointing.trust import verify_checkpoint
    from megatron_qarl.cli import train_main

    out, args = _sft(tmp_path, "run", "sft.steps=2")
    assert train_main(args) == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    capsys.readouterr()
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert f"qarl-train: error: sft.out_checkpoint={out} holds an earlier SFT run's checkpoint; choose one: write to " \
           "a new sft.out_checkpoint, or set sft.overwrite=true to move it to checkpoint.old-<timestamp> (nothing is " \
           "deleted)" in err and "Traceback" not in err, err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert train_main([*args, "sft.overwrite=true"]) == 0
    (moved,) = [p for p in out.parent.iterdir() if p.name.startswith("checkpoint.old-")]
    assert {p.name: p.stat().st_mtime_ns for p in moved.iterdir()} == before and verify_checkpoint(moved) == []
    assert verify_checkpoint(out) == []


@pytest.mark.parametrize("held", ["logging.out_dir", "sft.out_checkpoint"])
def test_a_second_sft_run_on_a_live_ones_directories_is_refused(tmp_path, capsys, held):
    """SFT took no lock: two runs on one out dir or out checkpoint both ran, one replacing the other's output."""
    from megatron_qarl.cli import train_main
    from megatron_qarl.fileio import RunDirLock

    out, args = _sft(tmp_path, "run")
    lock = RunDirLock(out.parent / "log") if held == "logging.out_dir" else \
        RunDirLock(out.parent, name=".checkpoint.qarl.lock")
    with lock:  # the live run, held by this process at a known point
        assert train_main(args) == 2
    err = capsys.readouterr().err
    assert "is in use by another run" in err and f"pid {os.getpid()}" in err and "Traceback" not in err, err
    assert not out.exists()


def test_a_second_ctrl_c_in_sft_promises_no_resume_that_does_not_exist(tmp_path, monkeypatch, capsys):
    """It said 'the last complete checkpoint stands (checkpoint.resume=auto continues from it)': SFT had none."""
    from megatron_qarl import sft as sft_module
    from megatron_qarl.cli import train_main
    from megatron_qarl.lifecycle import EXIT_INTERRUPTED

    out, args = _sft(tmp_path, "run")

    def second_ctrl_c(*a, **k):  # what StopRequest raises on a second Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(sft_module, "train_step", second_ctrl_c)
    assert train_main(args) == EXIT_INTERRUPTED
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("qarl-train:")]
    assert lines == ["qarl-train: interrupted (Ctrl-C): stopped at once; nothing of this SFT run was saved: the same "
                     "command starts it over"], lines
    assert not out.exists() and not Path(f"{out}.resume").exists()


def test_a_planted_error_log_link_gets_no_traceback_through_it(tmp_path, monkeypatch):
    """qarl-train appends a failed run's traceback to <out_dir>/error.log: through a planted link it went to the
    link's target. Now the traceback goes to the temp-dir fallback and the target is untouched."""
    import types

    from megatron_qarl.cli import write_error_log

    victim, run = _victim(tmp_path), tmp_path / "run"
    run.mkdir()
    (run / "error.log").symlink_to(victim)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    cfg = types.SimpleNamespace(logging=types.SimpleNamespace(out_dir=str(run)))
    where = write_error_log(cfg, RuntimeError("boom"), "boom")
    assert where == tmp_path / f"qarl-error-{os.getpid()}.log" and "RuntimeError: boom" in where.read_text()
    assert victim.read_text() == "a user's file outside the run\n" and (run / "error.log").is_symlink()
