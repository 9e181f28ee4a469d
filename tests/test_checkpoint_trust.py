"""A checkpoint from elsewhere is data, never code (issue 36, item 1), and is verified wherever it is read (item 4).

torch's FileSystemReader reads a dist checkpoint's `.metadata` with plain `pickle.load`, its load planner unpickles
the shards' byte entries with `weights_only=False`, and megatron reads common.pt with torch.load's default. A
planted payload in any of them ran code on every path that reads a checkpoint. Here each payload is harmless: it
would create a file (`touch`), and every test asserts that file does not exist, the exit status, the one line and
that the user's files are untouched. Payloads are planted both ways: with the completion marker left as it was
(its sha256 no longer matches) and with the marker rewritten to match (what whoever ships the files can do too).

One short qarl-train run (2 steps, a checkpoint each) gives real trainer checkpoints; every test works on a copy.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_qarl.checkpointing.format import COMMON_STATE_NAME, DCP_METADATA_NAME, MARKER_NAME
from megatron_qarl.checkpointing.run_checkpoints import RunCheckpoints

from conftest import REPO

CONFIG = str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml")
SMALL = [
    "train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2", "train.micro_batch_size=2",
    "rollout.max_new_tokens=4", "logging.wandb.mode=disabled", "logging.plots=false",
]


def _env(**extra):
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), **extra)
    return env


def _train(out: Path, *overrides: str, mode: tuple[str, ...] = (), env: dict | None = None):
    cmd = [sys.executable, "-m", "megatron_qarl.cli", *mode, "--config", CONFIG, f"logging.out_dir={out}", *SMALL,
           *overrides]
    return subprocess.run(cmd, env=env or _env(), cwd=REPO, capture_output=True, text=True, timeout=600)


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conversion.cli", *map(str, args)], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def _ok(proc):
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _one_error_line(proc, prog: str, rc: int = 2) -> str:
    """The run failed with `rc`, no traceback, and exactly one `<prog>: error:` line; that line."""
    err = proc.stderr
    assert proc.returncode == rc, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{err[-4000:]}"
    assert "Traceback" not in err, err[-4000:]
    lines = [ln for ln in err.splitlines() if ln.startswith(f"{prog}: error:")]
    assert len(lines) == 1, err[-4000:]
    return lines[0]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("trust") / "run"
    _ok(_train(out, "train.steps=2", "checkpoint.every=1", "checkpoint.keep_last=2"))
    assert [p.name for p in RunCheckpoints(out / "checkpoints").complete()] == ["step_00000001", "step_00000002"]
    return out


@pytest.fixture
def ckpt(base_run, tmp_path):
    """A copy of the run's step-2 checkpoint, outside any run dir."""
    out = tmp_path / "ckpt"
    shutil.copytree(base_run / "checkpoints" / "step_00000002", out)
    return out


@pytest.fixture
def run_copy(base_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- planting payloads

class _RunsCode:
    """Unpickling this runs `touch <marker>`: what a hostile checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def rewrite_marker(ckpt: Path) -> None:
    """Record the current size and sha256 of every file in the completion marker, as a forger would."""
    marker = json.loads((ckpt / MARKER_NAME).read_text())
    for name in marker["files"]:
        data = (ckpt / name).read_bytes()
        marker["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MARKER_NAME).write_text(json.dumps(marker))


def plant_metadata(ckpt: Path, pwned: Path, *, marker: bool = True) -> None:
    (ckpt / DCP_METADATA_NAME).write_bytes(pickle.dumps(_RunsCode(pwned)))
    if marker:
        rewrite_marker(ckpt)


def plant_byte_entry(ckpt: Path, pwned: Path) -> None:
    """A megatron ShardedObject (a layer's `_extra_state`, stored as a torch.save'd byte entry of a shard) replaced
    by a payload; `.metadata` points at it (honest torch-DCP classes only) and the marker matches."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    with open(ckpt / DCP_METADATA_NAME, "rb") as f:
        meta = pickle.load(f)  # the test's own checkpoint: trusted
    index = next(i for i in meta.storage_data if isinstance(meta.state_dict_metadata[i.fqn], BytesStorageMetadata))
    info = meta.storage_data[index]
    buf = io.BytesIO()
    torch.save([_RunsCode(pwned)], buf)
    shard = ckpt / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(buf.getvalue())
    meta.storage_data[index] = _StorageInfo(info.relative_path, offset, len(buf.getvalue()))
    with open(ckpt / DCP_METADATA_NAME, "wb") as f:
        pickle.dump(meta, f)
    rewrite_marker(ckpt)


def plant_common(ckpt: Path, pwned: Path) -> None:
    import torch

    common = torch.load(ckpt / COMMON_STATE_NAME, weights_only=True)
    common["payload"] = _RunsCode(pwned)
    torch.save(common, ckpt / COMMON_STATE_NAME)
    rewrite_marker(ckpt)


# ---------------------------------------------------------------- what the format really pickles

def test_a_real_checkpoints_metadata_pickles_only_the_allowed_globals(base_run):
    """The globals a real run checkpoint's `.metadata` references (recorded by an unpickler that only lists them)
    are all in the restricted unpickler's table, and every pickle of the checkpoint passes check_no_code."""
    from megatron_qarl.checkpointing.trust import _DCP_METADATA_GLOBALS, check_no_code, read_dcp_metadata

    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    for step in ("step_00000001", "step_00000002"):
        ckpt = base_run / "checkpoints" / step
        with open(ckpt / DCP_METADATA_NAME, "rb") as f:
            Recorder(f).load()
        check_no_code(ckpt)
        assert read_dcp_metadata(ckpt).state_dict_metadata
    allowed = {(m, n) for m, names in _DCP_METADATA_GLOBALS.items() for n in names}
    import torch

    outside = {(m, n) for m, n in seen if (m, n) not in allowed
               and not (m == "torch" and (n == "Size" or isinstance(getattr(torch, n, None), torch.dtype)))}
    assert outside == set(), outside
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen


@pytest.mark.parametrize("payload", [
    "os.system", "subprocess.Popen", "builtins.eval", "torch.load", "torch.serialization.load"])
def test_the_restricted_unpickler_refuses_any_other_global(ckpt, tmp_path, payload):
    from megatron_qarl.checkpointing.trust import read_dcp_metadata
    from megatron_qarl.errors import CheckpointError

    module, _, name = payload.rpartition(".")
    (ckpt / DCP_METADATA_NAME).write_bytes(f"c{module}\n{name}\n.".encode())  # protocol 0 GLOBAL
    with pytest.raises(CheckpointError, match=rf"refers to {module}\.{name}, which torch-DCP metadata never holds"):
        read_dcp_metadata(ckpt)


def test_the_restricted_unpickler_refuses_setting_attributes_of_an_allowed_class(ckpt):
    """BUILD on a class (rewiring an allowed class for later loads) is refused, not just unknown globals."""
    from megatron_qarl.checkpointing.trust import read_dcp_metadata
    from megatron_qarl.errors import CheckpointError

    # push the class StorageMeta, then BUILD with (None, {"__eq__": None}): setattr on the class
    payload = b"\x80\x04ctorch.distributed.checkpoint.metadata\nStorageMeta\nN}\x8c\x06__eq__Ns\x86b."
    (ckpt / DCP_METADATA_NAME).write_bytes(payload)
    with pytest.raises(CheckpointError, match="sets attributes of a class"):
        read_dcp_metadata(ckpt)


# ---------------------------------------------------------------- every path that reads a checkpoint

def _paths(tmp_path: Path, ckpt: Path) -> dict:
    """{path name: (runs it, the program's name)} for every command that reads a megatron checkpoint."""
    return {
        "inspect": (lambda: _convert("inspect", ckpt), "qarl-convert"),
        "mcore-to-hf": (lambda: _convert("mcore-to-hf", "--ckpt", ckpt, "--out", tmp_path / "out"), "qarl-convert"),
        "export": (lambda: _convert("export", "--ckpt", ckpt, "--format", "w4a16", "--out", tmp_path / "out"),
                   "qarl-convert"),
        "resume-path": (lambda: _train(tmp_path / "other", "train.steps=3", f"checkpoint.resume={ckpt}"),
                        "qarl-train"),
        "init-checkpoint": (lambda: _train(tmp_path / "other", "train.steps=1", f"model.init_checkpoint={ckpt}"),
                            "qarl-train"),
        "sft-init": (lambda: _train(tmp_path / "other", "sft.steps=1", f"sft.init_checkpoint={ckpt}",
                                    f"sft.out_checkpoint={tmp_path / 'sft_out'}", mode=("sft",)), "qarl-train"),
    }


@pytest.mark.parametrize("path", ["inspect", "mcore-to-hf", "export", "resume-path", "init-checkpoint", "sft-init"])
def test_planted_metadata_runs_no_code_on_any_path(ckpt, tmp_path, path):
    """`.metadata` replaced by a payload and the marker rewritten to match: every reader refuses it in one line
    that names the file, and nothing ran."""
    pwned = tmp_path / "pwned"
    plant_metadata(ckpt, pwned)
    before = _snapshot(ckpt)
    run, prog = _paths(tmp_path, ckpt)[path]
    proc = run()
    assert not pwned.exists(), f"{path}: the checkpoint's .metadata ran code"
    line = _one_error_line(proc, prog)
    assert DCP_METADATA_NAME in line and ("refused" in line or "could run code" in line), line
    assert _snapshot(ckpt) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / "sft_out").exists()


def test_planted_metadata_with_the_old_marker_is_reported_by_inspect_and_skipped_by_resume(run_copy, tmp_path):
    """The payload without a matching marker: inspect names the file whose sha256 differs (exit 2); resume=auto
    falls back to the previous checkpoint, which verifies. Nothing ran either way."""
    pwned = tmp_path / "pwned"
    newest = run_copy / "checkpoints" / "step_00000002"
    plant_metadata(newest, pwned, marker=False)
    proc = _convert("inspect", newest)
    assert not pwned.exists()
    line = _one_error_line(proc, "qarl-convert")
    assert "incomplete" in line and DCP_METADATA_NAME in proc.stdout and "sha256" in proc.stdout, proc.stdout
    proc = _train(run_copy, "train.steps=3", "checkpoint.every=1", "checkpoint.keep_last=3")
    assert not pwned.exists()
    _ok(proc)
    assert "fails verification" in proc.stdout + proc.stderr and "step_00000001 (step 1)" in proc.stdout


def test_planted_metadata_in_the_newest_run_checkpoint_stops_resume_auto(run_copy, tmp_path):
    """A payload whose marker matches is not damage to fall back past: resume=auto refuses the run (exit 2) and
    changes nothing in the run dir."""
    pwned = tmp_path / "pwned"
    plant_metadata(run_copy / "checkpoints" / "step_00000002", pwned)
    before = _snapshot(run_copy)
    proc = _train(run_copy, "train.steps=3")
    assert not pwned.exists()
    line = _one_error_line(proc, "qarl-train")
    assert "step_00000002" in line and DCP_METADATA_NAME in line
    after = _snapshot(run_copy)
    assert {k: v for k, v in after.items() if k != "error.log"} == before


@pytest.mark.parametrize("path", ["resume-path", "init-checkpoint"])
def test_planted_byte_entry_of_a_shard_runs_no_code(ckpt, tmp_path, path):
    """torch's load planner unpickles a shard's byte entries (megatron ShardedObjects) with weights_only=False;
    they are read with the weights-only loader first, so a planted one is refused."""
    pwned = tmp_path / "pwned"
    plant_byte_entry(ckpt, pwned)
    run, prog = _paths(tmp_path, ckpt)[path]
    proc = run()
    assert not pwned.exists(), "a byte entry of the shards ran code"
    line = _one_error_line(proc, prog)
    assert ".distcp" in line and "refused" in line, line


def test_planted_common_state_runs_no_code_even_when_torch_is_told_to_unpickle(ckpt, tmp_path):
    """megatron reads common.pt with torch.load's default, which TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 turns into a
    full unpickle; qarl reads it with an explicit weights_only=True first."""
    pwned = tmp_path / "pwned"
    plant_common(ckpt, pwned)
    proc = _train(tmp_path / "other", "train.steps=1", f"model.init_checkpoint={ckpt}",
                  env=_env(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1"))
    assert not pwned.exists(), "common.pt ran code"
    line = _one_error_line(proc, "qarl-train")
    assert COMMON_STATE_NAME in line and "refused" in line, line


def test_a_storage_backend_qarl_does_not_read_is_refused(ckpt, tmp_path):
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "common_backend": "torch"}))
    rewrite_marker(ckpt)
    line = _one_error_line(_convert("mcore-to-hf", "--ckpt", ckpt, "--out", tmp_path / "out"), "qarl-convert")
    assert "metadata.json" in line and "storage format" in line
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- digests wherever a checkpoint is read

def _flip_a_byte(ckpt: Path) -> Path:
    shard = sorted(ckpt.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest tells
    shard.write_bytes(bytes(data))
    return shard


@pytest.mark.parametrize("path", ["mcore-to-hf", "export", "init-checkpoint"])
def test_a_bit_flipped_shard_is_refused_by_conversions_and_init_checkpoints(ckpt, tmp_path, path):
    shard = _flip_a_byte(ckpt)
    run, prog = _paths(tmp_path, ckpt)[path]
    line = _one_error_line(run(), prog)
    assert shard.name in line and "sha256" in line and "corrupted" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["not-json", "random-bytes", "names-outside"])
def test_resume_auto_falls_back_past_a_damaged_marker(run_copy, damage):
    """A completion marker that is not what qarl writes is a damaged checkpoint like a damaged shard: resume=auto
    says so and continues from the previous one (it used to crash, again at every requeue)."""
    marker = run_copy / "checkpoints" / "step_00000002" / MARKER_NAME
    if damage == "not-json":
        marker.write_text(marker.read_text()[:-40])
    elif damage == "random-bytes":
        marker.write_bytes(os.urandom(600))
    else:
        fields = json.loads(marker.read_text())
        fields["files"]["../../../etc/passwd"] = {"size": 1, "sha256": "0" * 64}
        marker.write_text(json.dumps(fields))
    proc = _train(run_copy, "train.steps=3", "checkpoint.every=1", "checkpoint.keep_last=3")
    _ok(proc)
    out = proc.stdout + proc.stderr
    assert "step_00000002" in out and MARKER_NAME in out and "is damaged" in out, out[-3000:]
    assert "resumed from" in proc.stdout and "step_00000001 (step 1)" in proc.stdout
