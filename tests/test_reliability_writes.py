"""Writes never hurt what exists (issue 19, items 4-6 and the --out part of 9): an --out that overlaps an
input is refused, outputs keep the user's umask, NaN/Inf or non-float weights are refused, a full disk gives
one clear error and leaves no temp files, a killed export's temp dir is cleaned by the next export, and an
unwritable --out is a clear error. Each case asserts the exit code, the message and what is left on disk."""
import errno
import hashlib
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from aligned_common import seeded_hf_state  # noqa: E402
from convert_common import run_convert_cli as run_cli  # noqa: E402

from conversion.cli import main  # noqa: E402
from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.weights.hf_io import write_hf_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU world-of-one tests")
ROOT = Path(__file__).resolve().parents[1]


def run(*argv) -> int:
    return main([str(a) for a in argv])


def tree_digest(path: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under path (and its mode), to show nothing changed."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() + oct(p.stat().st_mode)
            for p in sorted(path.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def source_state():
    return {n: t.to(torch.bfloat16) for n, t in seeded_hf_state(tiny_hf_config(), seed=7).items()}


def make_hf(path: Path, state) -> Path:
    write_hf_checkpoint(path, tiny_hf_config(), state)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, source_state):
    return make_hf(tmp_path_factory.mktemp("src") / "hf", source_state)


@pytest.fixture(scope="module")
def mcore_dir(hf_dir):
    out = hf_dir.parent / "mcore"
    rc, err = run_cli("hf-to-mcore", "--hf", hf_dir, "--out", out)
    assert rc == 0, err
    return out


# ---------------------------------------------------------------- 1. --out never overlaps an input

def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("kind", ["export-hf-same", "export-hf-inside", "export-hf-containing",
                                  "export-hf-symlink", "export-ckpt-same", "mcore-to-hf-inside",
                                  "hf-to-mcore-same", "hf-to-mcore-containing"])
def test_out_overlapping_an_input_is_refused_and_the_input_untouched(kind, hf_dir, mcore_dir, tmp_path, capsys):
    source = _copy(mcore_dir if "ckpt" in kind or kind.startswith("mcore") else hf_dir, tmp_path / "in" / "src")
    before = tree_digest(tmp_path / "in")
    out = {"same": source, "inside": source / "sub", "containing": source.parent}[kind.rsplit("-", 1)[1]] \
        if not kind.endswith("symlink") else tmp_path / "link"
    if kind.endswith("symlink"):
        out.symlink_to(source, target_is_directory=True)
    cmd, flag = kind.split("-")[0], "--hf"
    if kind.startswith("export-ckpt"):
        argv = ["export", "--ckpt", source, "--format", "bf16"]
    elif kind.startswith("export-hf"):
        argv = ["export", "--hf", source, "--format", "w4a16"]
    elif kind.startswith("mcore"):
        argv = ["mcore-to-hf", "--ckpt", source]
    else:
        argv = ["hf-to-mcore", flag, source]
    argv += ["--out", out, "--force"]
    if cmd == "export" and "hf" in kind:
        rc, err = run(*argv), capsys.readouterr().err
    else:
        rc, err = run_cli(*argv)
    assert rc == 2, err
    assert "qarl-convert: error:" in err and "--out" in err and str(source.resolve()) in err, err
    assert "Traceback" not in err
    assert tree_digest(tmp_path / "in") == before
    assert not leftovers(tmp_path / "in") and not leftovers(source)


# ---------------------------------------------------------------- 2. outputs keep the user's umask

@pytest.fixture
def umask():
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask", [0o027, 0o002])
def test_export_and_atomic_writes_follow_the_umask(hf_dir, tmp_path, umask, mask):
    from megatron_qarl.fileio import atomic_write_text

    umask(mask)
    assert run("export", "--hf", hf_dir, "--format", "bf16", "--out", tmp_path / "out") == 0
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~mask
    for f in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask, f
    atomic_write_text(tmp_path / "note.txt", "x")
    assert stat.S_IMODE((tmp_path / "note.txt").stat().st_mode) == 0o666 & ~mask


# ---------------------------------------------------------------- 3. NaN/Inf and non-float weights refused

Q = "model.layers.1.self_attn.q_proj.weight"
E = "model.layers.0.mlp.experts.5.down_proj.weight"


def _poisoned(state, name, kind):
    state = dict(state)
    t = state[name].clone()
    if kind == "nan":
        t.view(-1)[3] = float("nan")
    elif kind == "inf":
        t.view(-1)[7] = float("inf")
    else:
        t = (t.float() * 100).to(torch.int32)
    state[name] = t
    return state


@pytest.mark.parametrize("name,kind,fmt", [(E, "nan", "w4a16"), (Q, "inf", "fp8"), (Q, "int32", "w4a16"),
                                           (Q, "nan", "bf16")])
def test_export_refuses_non_finite_or_non_float_weights(source_state, tmp_path, capsys, name, kind, fmt):
    src = make_hf(tmp_path / "src", _poisoned(source_state, name, kind))
    before = tree_digest(src)
    assert run("export", "--hf", src, "--format", fmt, "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "qarl-convert: error:" in err and name in err, err
    assert ("not finite" in err) if kind != "int32" else ("int32" in err and "floating" in err), err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)
    assert tree_digest(src) == before


def test_hf_to_mcore_refuses_a_nan_weight(source_state, tmp_path):
    src = make_hf(tmp_path / "src", _poisoned(source_state, E, "nan"))
    rc, err = run_cli("hf-to-mcore", "--hf", src, "--out", tmp_path / "out")
    assert rc == 2, err
    assert E in err and "not finite" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


NAN_MCORE = """
import sys, torch
from megatron_qarl.checkpointing.save_load import save_checkpoint
from megatron_qarl.models.qwen3_moe import build_qwen3_moe_model, tiny_hf_config
from megatron_qarl.models.qwen3_moe.state_dict_adapter import hf_to_mcore
from megatron_qarl.parallel import ParallelLayout, init_distributed
from megatron_qarl.checkpointing.format import HF_SIDECAR_KEY
from megatron_qarl.weights.hf_io import hf_checkpoint_files
from megatron_qarl.weights.hf_io import read_hf_state
from megatron_qarl.weights.sharding import load_full_state_into_model
cfg, layout = tiny_hf_config(), init_distributed(ParallelLayout(), seed=0)
state = {n: t.float() for n, t in read_hf_state(sys.argv[1]).items()}
state[sys.argv[3]].view(-1)[0] = float("nan")
model = build_qwen3_moe_model(cfg, layout, params_dtype=torch.float32)
load_full_state_into_model(model, hf_to_mcore(cfg, state))
save_checkpoint(sys.argv[2], model, extra={HF_SIDECAR_KEY: hf_checkpoint_files(cfg), "source_dtype": "bf16"})
"""


@pytest.fixture(scope="module")
def nan_mcore_dir(hf_dir):
    """A megatron checkpoint (as a diverged run would save) with one NaN in an expert weight."""
    out = hf_dir.parent / "nan_mcore"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", NAN_MCORE, str(hf_dir), str(out), E], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("cmd", ["mcore-to-hf", "export"])
def test_conversions_from_a_checkpoint_refuse_a_nan_weight(nan_mcore_dir, tmp_path, cmd):
    argv = ["mcore-to-hf", "--ckpt", nan_mcore_dir] if cmd == "mcore-to-hf" else \
        ["export", "--ckpt", nan_mcore_dir, "--format", "w4a16"]
    rc, err = run_cli(*argv, "--out", tmp_path / "out")
    assert rc == 2, err
    assert E in err and "not finite" in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------- 4. disk full, killed exports

def _disk_full(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_export_on_a_full_disk_is_one_clear_error_and_leaves_nothing(hf_dir, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _disk_full)
    assert run("export", "--hf", hf_dir, "--format", "w4a16", "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("qarl-convert: error:") == 1 and "No space left on device" in err, err
    assert "Traceback" not in err and str(tmp_path / "out") in err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


class _Engine:
    def __init__(self):
        self.closed = False

    def shutdown(self):
        self.closed = True

    close = shutdown


def _tracker(out: Path):
    from megatron_qarl.tracking import MetricsTracker, TrackerConfig

    tracker = MetricsTracker(TrackerConfig(out_dir=str(out), wandb_mode="disabled", total_steps=3))
    for step in range(3):
        tracker.log(step, {"reward/mean": step / 10, "time/step_s": 1.0})
    return tracker


def test_a_failed_checkpoint_write_is_the_one_error_close_run_reports(tmp_path, capsys, monkeypatch):
    """The checkpoint's ENOSPC propagates alone: no second error from the plots, no success summary,
    no temp files; the engine and the reward workers are still stopped."""
    from megatron_qarl.trainer import close_run

    ctx = SimpleNamespace(tracker=_tracker(tmp_path), engine=_Engine(), reward_fn=_Engine(), no_gradient_steps=0)
    capsys.readouterr()
    monkeypatch.setattr(os, "fsync", _disk_full)  # the disk is full for every later write
    with pytest.raises(OSError) as info:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "step_00000002"))
        finally:
            close_run(ctx)
    assert info.value.filename == str(tmp_path / "step_00000002") and info.value.__context__ is None
    out = capsys.readouterr().out
    assert "first" not in out and "->" not in out, out
    assert ctx.engine.closed and ctx.reward_fn.closed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_plots_that_hit_a_full_disk_after_a_good_run_warn_once_and_leave_no_temp(tmp_path, capsys, monkeypatch):
    from megatron_qarl.trainer import close_run

    ctx = SimpleNamespace(tracker=_tracker(tmp_path), engine=_Engine(), reward_fn=None, no_gradient_steps=0)
    capsys.readouterr()
    monkeypatch.setattr(os, "fsync", _disk_full)
    close_run(ctx)
    out = capsys.readouterr().out
    assert "reward/mean: first" in out and out.count("plots not written") == 1, out
    assert "No space left on device" in out and ctx.engine.closed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_a_killed_exports_temp_dirs_are_reported_and_removed_by_the_next_export(hf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    stale = [tmp_path / ".out.tmp-k1ll3d", tmp_path / ".out.old-abc123"]
    fresh, other = tmp_path / ".out.tmp-running", tmp_path / ".other.tmp-k1ll3d"
    for d in (*stale, fresh, other):
        d.mkdir()
        (d / "part-00000.safetensors").write_bytes(b"x" * 100)
    hour_ago = time.time() - 3600
    for d in (*stale, other):
        os.utime(d, (hour_ago, hour_ago))
    later = time.time() + 3600  # written after this process started: another export's, in progress
    os.utime(fresh, (later, later))
    assert run("export", "--hf", hf_dir, "--format", "bf16", "--out", out) == 0
    err = capsys.readouterr().err
    assert all(not d.exists() and str(d) in err for d in stale), err
    assert fresh.is_dir() and other.is_dir() and str(fresh) not in err
    assert (out / "model.safetensors").is_file()


# ---------------------------------------------------------------- 5. an --out that cannot be written

def test_out_in_a_read_only_directory_is_a_clear_error(hf_dir, tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes into a 0o555 directory")
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        assert run("export", "--hf", hf_dir, "--format", "bf16", "--out", parent / "out") == 2
        err = capsys.readouterr().err
        assert "qarl-convert: error:" in err and str(parent) in err and "not writable" in err, err
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o755)


def test_out_on_a_read_only_filesystem_is_a_clear_error(hf_dir, tmp_path, capsys, monkeypatch):
    """A read-only mount (simulated: creating the temp dir fails with EROFS, as on a `ro` mount)."""
    import tempfile

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    assert run("export", "--hf", hf_dir, "--format", "bf16", "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "qarl-convert: error:" in err and "Read-only file system" in err and str(tmp_path / "out") in err, err
    assert "Traceback" not in err and not (tmp_path / "out").exists()
