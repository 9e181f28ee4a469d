"""End-to-end QaRL runs of the tiny config through `qarl-train` (world 1 and torchrun), kill + resume.

The runs start from megatron's seeded random init, so rewards are mostly 0; the router's aux loss still
moves the weights every step, which makes the per-step mismatch / ratio / grad-norm metrics a sharp
fingerprint of the run's state for the resume comparison.
"""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_qarl.checkpointing.format import EXTRA_STATE_NAME, LEGACY_RUN_STATE, MARKER_NAME
from megatron_qarl.checkpointing.run_checkpoints import RunCheckpoints

from conftest import PROCESS_TAG_VAR, REPO, describe_and_kill, new_process_tag, surviving_processes, torchrun_cmd

CONFIG = str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml")
SMALL = [
    "train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2", "train.micro_batch_size=2",
    "rollout.max_new_tokens=4", "logging.wandb.mode=disabled", "publish.verify=true",
]


def _env(tag: str | None = None):
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    if tag:
        env[PROCESS_TAG_VAR] = tag  # inherited by every process the run starts
    return env


def _assert_no_survivors(tag: str, what: str):
    left = surviving_processes(tag)
    assert not left, f"processes of {what} outlived it:\n{describe_and_kill(left)}"


def _train_cmd(nproc: int = 1):
    if nproc == 1:
        return [sys.executable, "-m", "megatron_qarl.cli"]
    return [*torchrun_cmd(nproc), "-m", "megatron_qarl.cli"]


def _run(out: Path, *overrides: str, nproc: int = 1, timeout: int = 600,
         tag: str | None = None) -> subprocess.CompletedProcess:
    cmd = _train_cmd(nproc) + ["--config", CONFIG, f"logging.out_dir={out}", *SMALL, *overrides]
    return subprocess.run(cmd, env=_env(tag), cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _rows(out: Path) -> dict[int, dict]:
    """Last logged row per step (a resumed run may re-log the step it was killed in)."""
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    return rows


def _check_ok(proc):
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _assert_healthy_run(out: Path, steps: int):
    rows = _rows(out)
    assert sorted(rows) == list(range(steps))
    for row in rows.values():
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert math.isfinite(row["loss/value"])
        assert row["publish/num_tensors"] > 0 and row["publish/bytes"] > 0  # published every step
        assert math.isfinite(row["mismatch/k3"]) and row["mismatch/k3"] >= 0
        assert row["count/seqs"] == 8  # 4 prompts x n 2, all DP ranks together
        # the refit canary after every early publish: the engine computes what was published (canary.py's bound)
        assert 0 <= row["canary/max_gap"] <= row["canary/bound"], row
    assert (out / "reward_mean.png").is_file() and (out / "mismatch_k3.png").is_file()
    assert (out / "config.yaml").is_file()


@pytest.fixture(scope="module")
def world1_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("world1")
    tag = new_process_tag()
    _check_ok(_run(out, "train.steps=3", "checkpoint.every=1", tag=tag))
    (out / "process_tag").write_text(tag)
    return out


def test_finished_run_leaves_no_process_behind(world1_run):
    """The run saved checkpoints (megatron's writer processes and results-queue manager) and scored
    rewards; once qarl-train has exited, nothing it started is alive."""
    _assert_no_survivors((world1_run / "process_tag").read_text(), "a finished qarl-train run")


def test_world1_end_to_end(world1_run):
    _assert_healthy_run(world1_run, 3)
    assert [p.name for p in RunCheckpoints(world1_run / "checkpoints").complete()] == [
        "step_00000002", "step_00000003"]  # keep_last=2


@pytest.mark.dist
@pytest.mark.parametrize("layout", [["parallel.ep=2"], ["parallel.tp=2"], ["parallel.pp=2"]],
                         ids=["dp2-ep2", "tp2-sp", "pp2"])
def test_torchrun_two_processes(tmp_path, layout):
    """The whole loop at world 2 (pp2: two pipeline stages, an engine on each, the canary and telemetry through
    the schedule, the stage relay's publish); docs/pipeline.md has the 80-step PP 2 run beside PP 1."""
    proc = _run(tmp_path, "train.steps=2", "checkpoint.every=0", *layout, nproc=2)
    _check_ok(proc)
    _assert_healthy_run(tmp_path, 2)


@pytest.mark.slow  # CI budget; fast counterpart: test_rollout_topology's two engines equal one
@pytest.mark.dist
def test_two_embedded_engines_train_exactly_like_one(tmp_path):
    """World 2 (EP 2): one embedded engine per rank vs one engine on rank 0 (rank 1 idle during rollout).
    Per-row seeds and fixed request compositions make the batches identical, so every metric but the
    timings and this rank's publish peak matches."""
    runs = {}
    for engines in (1, 2):
        out = tmp_path / f"engines{engines}"
        _check_ok(_run(out, "train.steps=3", "checkpoint.every=0", "parallel.ep=2", f"rollout.engines={engines}",
                       "rollout.allow_idle_gpus=true", "rollout.request_prompts=1", nproc=2))
        rows = _rows(out)
        assert [r["rollout/engines"] for r in rows.values()] == [engines] * 3
        runs[engines] = {s: {k: v for k, v in _fingerprint(r).items() if k not in ("publish/peak_bytes",
                                                                                 "rollout/engines")}
                         for s, r in rows.items()}
    assert sorted(runs[1]) == [0, 1, 2] and runs[1][0]["rollout/requests"] == 4
    assert runs[2] == runs[1]


def _fingerprint(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time/") and not k.startswith("publish/time")}


@pytest.mark.slow  # CI budget; fast counterparts: sigkill during a checkpoint write + resume, resumed-run tests
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    steps = ["train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=4"]
    ref = tmp_path / "ref"
    _check_ok(_run(ref, *steps))

    out = tmp_path / "killed"
    cmd = _train_cmd() + ["--config", CONFIG, f"logging.out_dir={out}", *SMALL, *steps]
    tag = new_process_tag()
    proc = subprocess.Popen(cmd, env=_env(tag), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 500
    while not (out / "checkpoints" / "step_00000002" / MARKER_NAME).exists():
        assert proc.poll() is None, "run ended before its step-2 checkpoint"
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # in the middle of step 3 (rollout / update / checkpointing)
    proc.wait()
    # Its helpers (checkpoint writers, megatron's results-queue manager) die with it: no orphans.
    _assert_no_survivors(tag, "a SIGKILLed qarl-train run")
    assert not (out / "checkpoints" / "step_00000004").exists()

    _check_ok(_run(out, *steps))  # resume: auto
    want, got = _rows(ref), _rows(out)
    assert sorted(got) == [0, 1, 2, 3]
    for step in (2, 3):  # the steps recomputed after the resume from the step-2 checkpoint
        assert _fingerprint(got[step]) == _fingerprint(want[step]), f"step {step} differs after resume"


def test_resume_ignores_half_written_checkpoints(world1_run, tmp_path):
    ckpts = RunCheckpoints(world1_run / "checkpoints")
    assert ckpts.latest().name == "step_00000003"
    (world1_run / "checkpoints" / ".tmp-step_00000004").mkdir()  # interrupted save
    unfinished = world1_run / "checkpoints" / "step_00000005"  # renamed but without its state file
    unfinished.mkdir()
    (unfinished / "metadata.json").write_text("{}")
    assert ckpts.latest().name == "step_00000003"


def test_corrupted_checkpoint_is_a_clear_error(world1_run, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(world1_run / "checkpoints" / "step_00000003", broken)
    for f in broken.glob("*.distcp"):
        f.write_bytes(f.read_bytes()[: 64])  # truncated shard
    proc = _run(tmp_path / "run", "train.steps=4", f"checkpoint.resume={broken}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "corrupted" in proc.stderr and str(broken) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_incomplete_checkpoint_path_is_a_clear_error(tmp_path):
    partial = tmp_path / "step_00000007"
    partial.mkdir()
    proc = _run(tmp_path / "run", "train.steps=1", f"checkpoint.resume={partial}")
    assert proc.returncode == 2
    assert "incomplete" in proc.stderr


def test_run_checkpoint_converts_to_hf_without_the_run_config(tmp_path, capsys):
    """A run checkpoint carries its model's config.json: qarl-convert needs neither the run's config.yaml nor
    the HF dir the run started from. With a vanishing lr the weights stay the HF source's, a reference
    the converter never sees."""
    import shutil

    import torch

    from conversion.cli import main as convert_main
    from megatron_qarl.models.qwen3_moe import tiny_hf_config
    from megatron_qarl.weights.hf_io import read_hf_checkpoint, write_hf_checkpoint

    sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
    from aligned_common import seeded_hf_state

    source = {n: t.to(torch.bfloat16) for n, t in seeded_hf_state(tiny_hf_config(), seed=3).items()}
    hf_dir = tmp_path / "hf"
    write_hf_checkpoint(hf_dir, tiny_hf_config(), source)
    source_config = json.loads((hf_dir / "config.json").read_text())
    run = tmp_path / "run"
    _check_ok(_run(run, "model.preset=null", f"model.hf_path={hf_dir}", "train.steps=1", "train.optim.lr=1e-30",
                   "checkpoint.every=1"))
    ckpt = tmp_path / "ckpt"
    shutil.move(run / "checkpoints" / "step_00000001", ckpt)
    shutil.rmtree(run)
    shutil.rmtree(hf_dir)

    assert convert_main(["inspect", str(ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "megatron-run" and info["complete"]
    assert info["parameters"]["total"] == sum(t.numel() for t in source.values())
    back = tmp_path / "back"
    proc = subprocess.run([sys.executable, "-m", "conversion.cli", "mcore-to-hf", "--ckpt", str(ckpt),
                           "--out", str(back)], env=_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, state = read_hf_checkpoint(back)
    assert sorted(state) == sorted(source)
    for name in source:  # an Adam step moves a weight by ~lr: only weights near 0 show it
        assert state[name].dtype == torch.bfloat16, name
        torch.testing.assert_close(state[name].float(), source[name].float(), rtol=0, atol=1e-20, msg=name)
    back_config = json.loads((back / "config.json").read_text())
    dtypes = ("torch_dtype", "dtype")  # the output's own
    assert {k: v for k, v in back_config.items() if k not in dtypes} == {
        **{k: v for k, v in source_config.items() if k not in dtypes}, "architectures": ["Qwen3MoeForCausalLM"]}


def test_run_checkpoint_of_the_old_format_resumes_and_refuses_conversion_clearly(world1_run, tmp_path, capsys):
    """Before the formats merged, a run checkpoint kept its state (no HF config) in qarl_state.pt, which was
    also its completion marker: a run in progress still resumes from it; converting it names the fix."""
    import shutil

    import torch

    from conversion.cli import main as convert_main
    from megatron_qarl.checkpointing.format import HF_SIDECAR_KEY

    legacy = tmp_path / "checkpoints" / "step_00000003"
    shutil.copytree(world1_run / "checkpoints" / "step_00000003", legacy)
    state = torch.load(legacy / EXTRA_STATE_NAME, weights_only=False)
    del state[HF_SIDECAR_KEY]
    torch.save(state, legacy / LEGACY_RUN_STATE)
    (legacy / EXTRA_STATE_NAME).unlink()
    (legacy / MARKER_NAME).unlink()
    assert RunCheckpoints(tmp_path / "checkpoints").latest() == legacy

    assert convert_main(["mcore-to-hf", "--ckpt", str(legacy), "--out", str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err
    assert "carried the model's config.json" in err and "resume the run" in err, err
    assert not (tmp_path / "back").exists()

    proc = _run(tmp_path / "run", "train.steps=4", f"checkpoint.resume={legacy}")
    _check_ok(proc)
    assert f"resumed from {legacy} (step 3)" in proc.stdout
    assert sorted(_rows(tmp_path / "run")) == [3]


@pytest.mark.parametrize("aux_loss", ["null", "0"])
def test_a_diverging_run_stops_clearly_and_never_checkpoints_nan(tmp_path, aux_loss):
    """lr=1e6 without clipping (the issue's recipe) diverges by one of two routes, and both stop with one clear
    error (exit 2) and leave only finite checkpoints (read back with the converter's own loader).
    With the model's balance loss (aux null) the routers get gradients on this zero-advantage batch and the
    loss goes non-finite: those optimizer steps are skipped and counted until train.max_nonfinite_steps.
    Without it (aux 0, the default) Adam turns the tiny finite gradients into ~lr-sized updates that overflow
    the weights; the checkpoint due at that step is refused (or, where none is due, the next steps' losses
    go non-finite and are skipped)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
    from convert_common import load_mcore_full_hf_state
    from megatron_qarl.weights.convert import open_mcore_checkpoint

    proc = _run(tmp_path, "train.steps=8", "checkpoint.every=1", "train.optim.lr=1e6", "train.optim.clip_grad=0",
                "checkpoint.keep_last=10", f"train.moe_aux_loss_coeff={aux_loss}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "qarl-train: error: training diverged" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-3000:]
    if aux_loss == "null":
        assert "optimizer step skipped (3 in a row, stop at 3)" in proc.stdout
    checkpoints = RunCheckpoints(tmp_path / "checkpoints").complete()
    for ckpt in checkpoints:
        state = load_mcore_full_hf_state(open_mcore_checkpoint(ckpt))
        bad = [n for n, t in state.items() if not bool(torch.isfinite(t).all())]
        assert bad == [], (ckpt.name, bad[:3])


# ---------------------------------------------------------------- fault injection (issue 19): kill mid-save, mid-publish

FAULT_STEPS = ["train.steps=4", "checkpoint.every=1", "checkpoint.keep_last=4"]


@pytest.fixture(scope="module")
def uninterrupted_4_steps(tmp_path_factory):
    ref = tmp_path_factory.mktemp("fault_ref")
    _check_ok(_run(ref, *FAULT_STEPS))
    return _rows(ref)


def _raw_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _resume_matches(out: Path, want: dict, resumed_from: int):
    proc = _run(out, *FAULT_STEPS)  # resume: auto
    _check_ok(proc)
    assert f"step_{resumed_from:08d} (step {resumed_from})" in proc.stdout, proc.stdout[-2000:]
    assert _raw_steps(out) == [0, 1, 2, 3]  # one row per step: the re-run steps replaced, not duplicated
    got = _rows(out)
    for step in range(resumed_from, 4):
        assert _fingerprint(got[step]) == _fingerprint(want[step]), f"step {step} differs after the resume"
    return proc


def _forked_children(proc) -> list:
    """Children of `proc` forked from it (megatron's checkpoint writers): same command line as the parent.
    The reward workers and megatron's results-queue manager are spawned (another command line)."""
    import psutil

    try:
        parent = psutil.Process(proc.pid)
        mine = parent.cmdline()
        return [c for c in parent.children() if c.cmdline() == mine]
    except psutil.Error:
        return []


def test_sigkill_during_checkpoint_write_leaves_no_orphan_and_resumes(tmp_path, uninterrupted_4_steps):
    """SIGKILL while megatron's forked writer processes write a checkpoint's shards into its temp dir: every
    writer dies with the trainer, the next run reports and removes the temp dir, resumes from the last
    complete checkpoint, and its next steps equal the uninterrupted run's."""
    out = tmp_path / "killed"
    cmd = _train_cmd() + ["--config", CONFIG, f"logging.out_dir={out}", *SMALL, *FAULT_STEPS]
    tag = new_process_tag()
    proc = subprocess.Popen(cmd, env=_env(tag), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = out / "checkpoints"
    writers, deadline = [], time.time() + 500
    while not writers:
        assert proc.poll() is None, "the run ended before a checkpoint write could be caught"
        assert time.time() < deadline
        started = (ckpts / "step_00000001" / MARKER_NAME).exists()  # catch a later save: a real resume follows
        temps = list(ckpts.glob(".step_*.tmp-*")) if started else []
        if temps and (writers := _forked_children(proc)):
            proc.send_signal(signal.SIGKILL)  # a writer is alive, the checkpoint is still a temp dir
        else:
            time.sleep(0.002)
    proc.wait()
    _assert_no_survivors(tag, "a qarl-train run SIGKILLed during a checkpoint write")
    killed_in = temps[0].name.split(".")[1]  # step_XXXXXXXX whose save was interrupted
    complete = [p.name for p in RunCheckpoints(ckpts).complete()]
    assert killed_in not in complete
    left = [p.name for p in ckpts.iterdir() if p.name.startswith(".")]
    last = int(complete[-1].split("_")[1])
    assert 1 <= last <= 3 and killed_in == f"step_{last + 1:08d}", (killed_in, complete)
    proc2 = _resume_matches(out, uninterrupted_4_steps, resumed_from=last)
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]
    for name in left:  # reported by name, then removed
        assert name in proc2.stdout


@pytest.mark.slow  # ~1 min; the checkpoint-write kill above stays in the default suite
def test_sigkill_during_publish_resumes_from_last_complete_checkpoint(tmp_path, uninterrupted_4_steps):
    """SIGKILL in the middle of step 2's publish (after the first bucket reached the engine): the next run
    resumes from step_00000002, re-publishes, and steps 2 and 3 equal the uninterrupted run's."""
    out = tmp_path / "killed"
    tag = new_process_tag()
    cmd = [sys.executable, str(REPO / "tests" / "dist" / "kill_in_publish.py"), "3", "--config", CONFIG,
           f"logging.out_dir={out}", *SMALL, *FAULT_STEPS]
    proc = subprocess.run(cmd, env=_env(tag), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "SIGKILL in publish 3" in proc.stdout
    _assert_no_survivors(tag, "a qarl-train run SIGKILLed during a publish")
    assert [p.name for p in RunCheckpoints(out / "checkpoints").complete()] == ["step_00000001", "step_00000002"]
    assert _raw_steps(out) == [0, 1]  # killed before step 2 logged
    _resume_matches(out, uninterrupted_4_steps, resumed_from=2)
