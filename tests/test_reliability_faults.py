"""Faults and bad inputs that owe the user one line (issue 36, items 5 and 6): a file system that refuses a write
the way safetensors reports it (its own error type, not OSError), a file-size limit (RLIMIT_FSIZE), random bytes
named like checkpoint files, an --out that is a symbolic-link loop, NaN in the HF weights a run starts from,
prompts longer than the model's context, a dataset smaller than one step, a model directory without a
tokenizer, and a reward plug-in that hangs a run. Each case asserts the exit status, the one line, and that no
file the user had was lost (and nothing was left at --out).
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
from aligned_common import seeded_hf_state  # noqa: E402

from conftest import REPO  # noqa: E402
from conversion.cli import main as convert  # noqa: E402
from megatron_qarl.checkpointing.format import MARKER_NAME  # noqa: E402
from megatron_qarl.models.qwen3_moe import tiny_hf_config  # noqa: E402
from megatron_qarl.weights.hf_io import write_hf_checkpoint  # noqa: E402

CONFIG = str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml")
SMALL = [
    "train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2", "train.micro_batch_size=2",
    "rollout.max_new_tokens=4", "logging.wandb.mode=disabled", "logging.plots=false", "train.steps=1",
]
EXPERT = "model.layers.0.mlp.experts.5.down_proj.weight"


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), *extra.pop("path", []), env.get("PYTHONPATH", "")]), **extra)
    return env


def _train(out: Path, *overrides: str, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_qarl.cli", "--config", CONFIG, f"logging.out_dir={out}", *SMALL, *overrides]
    return subprocess.run(cmd, env=_env(**env), cwd=REPO, capture_output=True, text=True, timeout=600)


def _convert_proc(*args, preexec=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "conversion.cli", *map(str, args)], env=_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300, preexec_fn=preexec)


def _one_line(stderr: str, prog: str) -> str:
    assert "Traceback" not in stderr, stderr[-4000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith(f"{prog}: error:")]
    assert len(lines) == 1, stderr[-4000:]
    return lines[0]


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp" in p.name or ".old-" in p.name)


@pytest.fixture(scope="module")
def source_state():
    return {n: t.to(torch.bfloat16) for n, t in seeded_hf_state(tiny_hf_config(), seed=11).items()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, source_state):
    out = tmp_path_factory.mktemp("src") / "hf"
    write_hf_checkpoint(out, tiny_hf_config(), source_state)
    return out


# ---------------------------------------------------------------- writes the file system refuses

def _refusing_serializer(code: int):
    """What safetensors raises when the file system refuses its write: its own SafetensorError (not an OSError)
    with the OS error inside the message, as its Rust writer formats it."""
    from safetensors import SafetensorError

    def serialize_file(*_a, **_k):
        raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")

    return serialize_file


@pytest.mark.parametrize("code", [28, 30, 27], ids=["disk-full", "read-only", "file-too-large"])
def test_export_whose_writes_safetensors_refuses_is_one_line(hf_dir, tmp_path, capsys, monkeypatch, code):
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "serialize_file", _refusing_serializer(code))
    before = tree_digest(hf_dir)
    assert convert(["export", "--hf", str(hf_dir), "--format", "w4a16", "--out", str(tmp_path / "out")]) == 2
    line = _one_line(capsys.readouterr().err, "qarl-convert")
    assert os.strerror(code) in line and str(tmp_path / "out") in line and "nothing was written there" in line, line
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path) and tree_digest(hf_dir) == before


def test_export_under_a_file_size_limit_is_one_line(hf_dir, tmp_path):
    """RLIMIT_FSIZE (a quota-like limit): the writer's write fails with EFBIG, reported by safetensors."""
    limit = 1 << 20

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = _convert_proc("export", "--hf", hf_dir, "--format", "bf16", "--out", tmp_path / "out", preexec=limited)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc.stderr, "qarl-convert")
    assert "File too large" in line and "--max-shard-bytes" in line and "ulimit -f" in line, line
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_out_that_is_a_symlink_loop_is_one_line(hf_dir, tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for out in (loop, loop / "sub"):
        for force in ([], ["--force"]):
            assert convert(["export", "--hf", str(hf_dir), "--format", "bf16", "--out", str(out), *force]) == 2
            line = _one_line(capsys.readouterr().err, "qarl-convert")
            assert f"{loop} is a symbolic link that cannot be followed" in line, line
    assert loop.is_symlink() and os.readlink(loop) == str(loop) and not leftovers(tmp_path)


# ---------------------------------------------------------------- random bytes named like a checkpoint

CHECKPOINT_NAMES = (".metadata", "__0_0.distcp", "__0_1.distcp", "common.pt", "metadata.json", "qarl_extra_state.pt")


def _random_checkpoint(path: Path, *, forged_marker: bool) -> Path:
    path.mkdir()
    for name in CHECKPOINT_NAMES:
        (path / name).write_bytes(os.urandom(4096))
    if forged_marker:  # a marker that matches the random files: only reading them shows what they are
        files = {n: {"size": 4096, "sha256": hashlib.sha256((path / n).read_bytes()).hexdigest()}
                 for n in CHECKPOINT_NAMES}
        (path / MARKER_NAME).write_text(json.dumps({"format_version": 1, "files": files, "has_extra_state": True}))
    else:
        (path / MARKER_NAME).write_bytes(os.urandom(700))
    return path


@pytest.mark.parametrize("marker", ["random-marker", "forged-marker"])
@pytest.mark.parametrize("command", ["inspect", "mcore-to-hf", "export"])
def test_random_bytes_named_like_checkpoint_files_are_one_line(tmp_path, command, marker):
    """Used to be a UnicodeDecodeError traceback (the marker) or 'holds objects other than tensors' (the side
    state), which sends the user looking for an attack instead of a damaged copy."""
    ckpt = _random_checkpoint(tmp_path / "ckpt", forged_marker=marker == "forged-marker")
    before = tree_digest(ckpt)
    args = {"inspect": ["inspect", ckpt], "mcore-to-hf": ["mcore-to-hf", "--ckpt", ckpt, "--out", tmp_path / "out"],
            "export": ["export", "--ckpt", ckpt, "--format", "bf16", "--out", tmp_path / "out"]}[command]
    proc = _convert_proc(*args)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = _one_line(proc.stderr, "qarl-convert")
    if marker == "random-marker":
        assert f"{MARKER_NAME} is damaged" in line, line
    else:
        assert "qarl_extra_state.pt is not a file torch.save writes" in line and "damaged" in line, line
    assert "objects other than tensors" not in line
    assert tree_digest(ckpt) == before and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- what a run starts from

def test_nan_in_the_hf_weights_a_run_starts_from_is_one_line_at_load(source_state, tmp_path):
    """It used to load, generate non-finite logits and be reported as 'the published weights have diverged'."""
    state = dict(source_state)
    bad = state[EXPERT].clone()
    bad.view(-1)[5] = float("nan")
    state[EXPERT] = bad
    hf = write_hf_checkpoint(tmp_path / "hf", tiny_hf_config(), state)
    before = tree_digest(hf)
    proc = _train(tmp_path / "run", "model.preset=null", f"model.hf_path={hf}", "model.tokenizer=char")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc.stderr, "qarl-train")
    assert f"tensor {EXPERT} of {hf} is not finite: 1 of" in line and "NaN" in line, line
    assert "diverged" not in line.split("comes from")[0]
    assert tree_digest(hf) == before


def test_prompts_plus_max_new_tokens_past_the_context_are_refused(tmp_path):
    """The tiny model's context is 512 tokens (max_position_embeddings)."""
    proc = _train(tmp_path / "run", "rollout.max_new_tokens=508")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc.stderr, "qarl-train")
    assert "rollout.max_new_tokens=508" in line and "past the model's context of 512" in line, line
    assert "tokens; with" in line and "data.max_prompt_len <= 4" in line
    proc = _train(tmp_path / "run2", "rollout.max_new_tokens=600")
    assert "leaves no room for a prompt" in _one_line(proc.stderr, "qarl-train")


def test_a_dataset_smaller_than_one_step_is_refused(tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    proc = _train(tmp_path / "run", "data.source=file", f"data.path={data}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc.stderr, "qarl-train")
    assert f"data.path={data} has 1 usable prompt(s), fewer than train.prompts_per_step=4" in line, line
    assert data.read_text() == '{"prompt": "1+1=", "answer": "2"}\n'


def test_a_model_dir_without_a_tokenizer_is_refused_naming_it(source_state, tmp_path):
    """transformers builds an empty tokenizer from a model dir without tokenizer files; the run used to fail deep
    in the engine ('every prompt needs at least one token')."""
    hf = write_hf_checkpoint(tmp_path / "hf", tiny_hf_config(), source_state)
    proc = _train(tmp_path / "run", "model.preset=null", f"model.hf_path={hf}", "model.tokenizer=null")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc.stderr, "qarl-train")
    assert f"the tokenizer loaded from '{hf}'" in line and "holds no tokenizer files" in line, line
    assert "model.tokenizer" in line


def test_a_reward_plugin_that_hangs_stops_the_run_with_one_line(tmp_path):
    """It used to hang the run forever (the docs called that expected)."""
    plugin = tmp_path / "plugins"
    plugin.mkdir()
    (plugin / "qarl_hanging_reward.py").write_text(textwrap.dedent("""
        import time

        def score(responses, answers, rows):
            while True:
                time.sleep(0.1)
    """))
    proc = _train(tmp_path / "run", "data.reward=qarl_hanging_reward:score", "data.reward_timeout_s=0.5",
                  path=[str(plugin)])
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_line(proc.stderr, "qarl-train")
    assert "reward plug-in 'qarl_hanging_reward:score' did not return within" in line, line
    assert "data.reward_timeout_s=0.5 per response" in line and "was killed" in line, line
