"""Runs that survive their cluster (issue 36, items 2 and 3): one trainer per run directory, pruning that only
removes the run's own checkpoints, clean-up that never touches a live writer's files, and a graceful stop on
SIGTERM / SIGUSR1 / Ctrl-C / the stop file: the step in flight finishes, a checkpoint is written, the engines and
reward workers stop, one line, exit status 3 (lifecycle.EXIT_STOPPED), and the same command resumes.

Every fault is real: real signals to a running `qarl-train` subprocess (the tiny config), two trainers started on
one directory. Each test asserts the exit status, the one line, and that no file the user had was lost.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_qarl.checkpointing.format import MARKER_NAME
from megatron_qarl.checkpointing.run_checkpoints import RunCheckpoints
from megatron_qarl.checkpointing.trust import verify_checkpoint
from megatron_qarl.lifecycle import EXIT_INTERRUPTED, EXIT_STOPPED, STOP_FILE_ENV

from conftest import PROCESS_TAG_VAR, REPO, describe_and_kill, new_process_tag, surviving_processes, torchrun_cmd

CONFIG = str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml")
SMALL = [
    "train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2", "train.micro_batch_size=2",
    "rollout.max_new_tokens=4", "logging.wandb.mode=disabled", "logging.plots=false",
]


def _env(tag: str | None = None, **extra) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), **extra)
    if tag:
        env[PROCESS_TAG_VAR] = tag
    return env


def _cmd(out: Path, *overrides: str, nproc: int = 1) -> list[str]:
    launcher = [sys.executable] if nproc == 1 else torchrun_cmd(nproc)
    return [*launcher, "-m", "megatron_qarl.cli", "--config", CONFIG, f"logging.out_dir={out}", *SMALL, *overrides]


def _run(out: Path, *overrides: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(out, *overrides), env=_env(**env), cwd=REPO, capture_output=True, text=True,
                          timeout=600)


class Background:
    """A qarl-train run in the background with its output in files (so a test can wait for a line)."""

    def __init__(self, tmp: Path, out: Path, *overrides: str, nproc: int = 1, new_session: bool = False, **env):
        self.tag = new_process_tag()
        self.stdout_path, self.stderr_path = tmp / f"{out.name}.stdout", tmp / f"{out.name}.stderr"
        self._out, self._err = open(self.stdout_path, "w"), open(self.stderr_path, "w")
        self.proc = subprocess.Popen(_cmd(out, *overrides, nproc=nproc), env=_env(self.tag, **env), cwd=REPO,
                                     stdout=self._out, stderr=self._err, start_new_session=new_session)

    def wait_for(self, text: str, timeout: float = 300.0, stream: str = "stdout") -> None:
        path = self.stdout_path if stream == "stdout" else self.stderr_path
        deadline = time.monotonic() + timeout
        while text not in path.read_text():
            assert self.proc.poll() is None, f"the run ended before {text!r}:\n{self.stderr_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s"
            time.sleep(0.1)

    def finish(self, timeout: float = 300.0) -> tuple[int, str, str]:
        try:
            rc = self.proc.wait(timeout=timeout)
        finally:
            self._out.close()
            self._err.close()
        left = surviving_processes(self.tag)
        assert not left, f"processes outlived the run:\n{describe_and_kill(left)}"
        return rc, self.stdout_path.read_text(), self.stderr_path.read_text()


def _rows(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _one_line(stderr: str, start: str) -> str:
    assert "Traceback" not in stderr, stderr[-4000:]
    lines = [ln for ln in stderr.splitlines() if ln.startswith(start)]
    assert len(lines) == 1, stderr[-4000:]
    return lines[0]


# A run held at a known point: a reward plug-in (the trainer's own plug-in interface, nothing added to the code
# under test) that counts its calls and, at call HOLD_AT, says so and returns only once the test releases it. Calls,
# per rollout-group leader (its RANK: each leader scores its own requests): the preflight's reward check is call 1;
# with rollout.request_prompts=1 each request is one call, so with R requests per leader and step, step k's calls are
# R(k-1)+2 .. Rk+1 (one leader: R = 4 prompts per step; two under torchrun: R = 2). Held in a step's LAST call, a stop
# signal finds the rollout's requests all served: the step finishes and is checkpointed. Held in an earlier call,
# the rollout is abandoned. Either way the run cannot finish, or reach another phase, before the test has done its
# part, however fast or loaded the machine.
HOLD_REWARD = '''
import json, os, time

def reward(responses, answers, rows):
    """Logs each call's answers (a file per RANK); this leader's call HOLD_AT writes HOLD_HELD.<rank> and waits for
    HOLD_RELEASE (at most HOLD_MAX_S)."""
    rank = os.environ.get("RANK", "0")
    log = f"{os.environ['HOLD_LOG']}.{rank}"
    with open(log, "a") as f:
        f.write(json.dumps(answers) + "\\n")
    with open(log) as f:
        calls = sum(1 for _ in f)
    if calls == int(os.environ["HOLD_AT"]):
        open(f"{os.environ['HOLD_HELD']}.{rank}", "w").close()
        deadline = time.monotonic() + float(os.environ["HOLD_MAX_S"])
        while not os.path.exists(os.environ["HOLD_RELEASE"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    return [float(a in r) for r, a in zip(responses, answers)]
'''
HOLD_MAX_S = 300  # a test that fails while its run is held does not leave it held for longer


def last_call_of_step(k: int, requests: int = 4) -> int:
    """A leader's last reward call of step k (1-based) when it serves `requests` requests a step."""
    return requests * k + 1


class Hold:
    """The plug-in's files, the overrides and the environment of a run whose `leaders` are held at reward call `at`."""

    def __init__(self, tmp: Path, monkeypatch, at: int, leaders: int = 1):
        (tmp / "qarl_hold_reward.py").write_text(HOLD_REWARD)
        monkeypatch.setenv("PYTHONPATH", str(tmp))  # the plug-in, for the trainer and its reward worker
        self.log = tmp / "calls.jsonl.0"  # rank 0's calls
        self.held = [tmp / f"held.{rank}" for rank in range(leaders)]
        self.released = tmp / "release"
        self.env = dict(HOLD_LOG=str(tmp / "calls.jsonl"), HOLD_HELD=str(tmp / "held"),
                        HOLD_RELEASE=str(self.released), HOLD_AT=str(at), HOLD_MAX_S=str(HOLD_MAX_S))
        # the deadline of a plug-in call is data.reward_timeout_s per response: above the longest hold
        self.args = ("rollout.request_prompts=1", "data.reward=qarl_hold_reward:reward",
                     f"data.reward_timeout_s={HOLD_MAX_S}")

    def wait(self, run: "Background", timeout: float = 300.0) -> None:
        """Until every leader is held (the run cannot have finished: it waits for `release`)."""
        deadline = time.monotonic() + timeout
        while not all(p.exists() for p in self.held):
            assert run.proc.poll() is None, f"the run ended before it was held:\n{run.stderr_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the run was not held within {timeout} s"
            time.sleep(0.05)

    def release(self) -> None:
        self.released.touch()


# ---------------------------------------------------------------- one trainer per run directory

def test_a_second_trainer_on_the_same_dir_is_refused_and_the_first_one_is_untouched(tmp_path, monkeypatch):
    """The second trainer used to clean the first one's in-progress checkpoint as a leftover at start-up: now it is
    refused in one line naming the holder's pid and host, before it reads, moves or removes anything. The first run
    is held in step 3's rollout (its steps 1-2 checkpointed) until the second has been refused: it used to be
    raced, and on a loaded machine it finished before the second reached the lock."""
    out = tmp_path / "run"
    hold = Hold(tmp_path, monkeypatch, at=last_call_of_step(2) + 1)
    first = Background(tmp_path, out, "train.steps=6", "checkpoint.every=1", "checkpoint.keep_last=2", *hold.args,
                       **hold.env)
    try:
        hold.wait(first)
        assert "step 2/6" in first.stdout_path.read_text()
        _second_is_refused(out, first)
    finally:
        hold.release()
    rc, stdout, stderr = first.finish()
    assert rc == 0, stderr[-3000:]
    ckpts = out / "checkpoints"
    assert [p.name for p in RunCheckpoints(ckpts).complete()] == ["step_00000005", "step_00000006"]
    assert all(verify_checkpoint(p) == [] for p in RunCheckpoints(ckpts).complete())
    assert _rows(out) == list(range(6))  # the refused run wrote no metrics row
    # the lock went with the first run: the dir is usable again (the same experiment: resumed, nothing left to do)
    proc = _run(out, "train.steps=6", "checkpoint.every=1", "checkpoint.keep_last=2", *hold.args,
                **{**hold.env, "HOLD_AT": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def _second_is_refused(out: Path, first: "Background") -> None:
    ckpts = out / "checkpoints"
    writing = ckpts / f".step_00000099.tmp-{first.proc.pid}-inprogress"  # what a save in flight looks like
    writing.mkdir()
    (writing / "__0_0.distcp").write_bytes(b"x" * 1000)
    proc = _run(out, "train.steps=6")
    line = _one_line(proc.stderr, "qarl-train: error:")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"pid {first.proc.pid} on {os.uname().nodename}" in line and "in use by another run" in line, line
    assert writing.is_dir() and (writing / "__0_0.distcp").stat().st_size == 1000  # not cleaned by the second
    assert first.proc.poll() is None  # still held: the refusal was the lock's, not a finished run's


def test_clean_stale_removes_dead_writers_temp_dirs_only(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        root = tmp_path / "checkpoints"
        names = {"live": f".step_00000003.tmp-{live.pid}-abc", "dead": f".step_00000004.tmp-{dead.pid}-abc",
                 "no-pid": ".step_00000005.tmp-abc123", "old": f".step_00000002.old-{dead.pid}-xyz"}
        for name in names.values():
            (root / name).mkdir(parents=True)
        removed = RunCheckpoints(root).clean_stale()
        assert sorted(removed) == sorted(names[k] for k in ("dead", "no-pid", "old"))
        assert sorted(p.name for p in root.iterdir()) == [names["live"]]
    finally:
        live.kill()
        live.wait()


def test_a_run_dir_lock_is_released_by_the_kernel_when_its_holder_is_killed(tmp_path):
    from megatron_qarl.fileio import RunDirInUseError, RunDirLock

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from megatron_qarl.fileio import RunDirLock; "
        f"RunDirLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(60)")],
        env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirInUseError, match=rf"pid {holder.pid} on "):
            RunDirLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    RunDirLock(tmp_path).acquire().release()  # a SIGKILLed holder leaves no stale lock


def test_keep_last_prunes_only_this_runs_own_checkpoints(tmp_path):
    """A checkpoint dir that also holds another run's higher-numbered checkpoints: pruning by step number used to
    delete the new run's checkpoint at once (the other run's ranked newer); now only the run's own go."""
    out = tmp_path / "run"
    proc = _run(out, "train.steps=1", "checkpoint.every=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpts = out / "checkpoints"
    theirs = ckpts / "step_00000100"  # another run's, newer by step number
    (ckpts / "step_00000001").rename(theirs)
    marker = json.loads((theirs / MARKER_NAME).read_text())
    marker["run_id"] = "another-run"
    (theirs / MARKER_NAME).write_text(json.dumps(marker))
    ext = tmp_path / "start"
    ext.mkdir()
    proc = _run(ext, "train.steps=1", "checkpoint.every=1")  # this run starts from its own step-1 checkpoint
    assert proc.returncode == 0
    start = ext / "checkpoints" / "step_00000001"
    before = {p.name: p.stat().st_mtime for p in theirs.iterdir()}
    proc = _run(out, "train.steps=3", "checkpoint.every=1", "checkpoint.keep_last=1", f"checkpoint.resume={start}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in RunCheckpoints(ckpts).complete()) == ["step_00000003", "step_00000100"]
    assert {p.name: p.stat().st_mtime for p in theirs.iterdir()} == before and verify_checkpoint(theirs) == []


# ---------------------------------------------------------------- a graceful stop

STOP_RUN = ["train.steps=40", "checkpoint.every=0"]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_stop_signal_finishes_the_step_checkpoints_and_exits_3(tmp_path, monkeypatch, sig):
    """SIGTERM (Slurm preemption, kill), SIGUSR1 (Slurm's --signal before the time limit) and Ctrl-C (SIGINT)
    used to kill the run at once (no checkpoint: up to checkpoint.every steps lost; a traceback for Ctrl-C).
    The signal comes while the run is held in step 2's last reward call: the step in flight finishes."""
    out = tmp_path / "run"
    hold = Hold(tmp_path, monkeypatch, at=last_call_of_step(2))
    run = Background(tmp_path, out, *STOP_RUN, *hold.args, **hold.env)
    try:
        hold.wait(run)
        run.proc.send_signal(getattr(signal, sig))
        run.wait_for(f"[qarl] {'Ctrl-C' if sig == 'SIGINT' else sig} received", stream="stderr")
    finally:
        hold.release()
    rc, stdout, stderr = run.finish()
    assert rc == EXIT_STOPPED, stderr[-3000:]
    ckpt = out / "checkpoints" / "step_00000002"
    assert _one_line(stderr, "qarl-train:") == (
        f"qarl-train: stopped by {sig} after step 2/40; checkpoint {ckpt} written; exit status 3; run the same "
        "command again to continue (checkpoint.resume=auto)")
    assert verify_checkpoint(ckpt) == [] and (ckpt / MARKER_NAME).is_file()
    assert _rows(out) == [0, 1]
    if sig == "SIGTERM":  # the same command resumes from it
        proc = _run(out, "train.steps=3", "checkpoint.every=0", *hold.args, **{**hold.env, "HOLD_AT": "0"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"resumed from {ckpt} (step 2)" in proc.stdout
        assert _rows(out) == [0, 1, 2]


def test_the_stop_file_stops_the_run_like_a_signal(tmp_path, monkeypatch):
    out, stop = tmp_path / "run", tmp_path / "STOP"
    hold = Hold(tmp_path, monkeypatch, at=last_call_of_step(2))
    run = Background(tmp_path, out, *STOP_RUN, *hold.args, **hold.env, **{STOP_FILE_ENV: str(stop)})
    try:
        hold.wait(run)
        stop.touch()
    finally:
        hold.release()
    rc, _, stderr = run.finish()
    assert rc == EXIT_STOPPED, stderr[-3000:]
    assert f"stopped by the stop file {stop} after step 2/40;" in _one_line(stderr, "qarl-train:")


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path, monkeypatch):
    """Held in step 2's rollout, the run cannot end between the two presses; the second comes past the window in
    which lifecycle takes a SIGINT for a forwarded copy of the first (a fixed interval, not a machine's speed)."""
    from megatron_qarl.lifecycle import _REPEAT_WINDOW_S

    out = tmp_path / "run"
    hold = Hold(tmp_path, monkeypatch, at=last_call_of_step(1) + 1)
    run = Background(tmp_path, out, *STOP_RUN, *hold.args, **hold.env)
    try:
        hold.wait(run)
        run.proc.send_signal(signal.SIGINT)
        run.wait_for("[qarl] Ctrl-C received", stream="stderr")
        time.sleep(_REPEAT_WINDOW_S + 0.5)  # a second press, not a forwarded copy of the first
        assert run.proc.poll() is None  # still held
        run.proc.send_signal(signal.SIGINT)
        run.proc.wait(timeout=120)  # it ends on the second press, still held
    finally:
        hold.release()
    rc, _, stderr = run.finish()
    assert rc == EXIT_INTERRUPTED, stderr[-3000:]
    assert "stopped at once" in _one_line(stderr, "qarl-train: interrupted")


def test_sigterm_to_every_process_of_the_run_still_stops_it_gracefully(tmp_path, monkeypatch):
    """Slurm signals every process of a job step, and a terminal's Ctrl-C the whole foreground group: the reward
    workers (the plug-in's, in the middle of a call here) and megatron's helpers get the signal too. They outlive
    it, so the step in flight still finishes and is checkpointed."""
    out = tmp_path / "run"
    hold = Hold(tmp_path, monkeypatch, at=last_call_of_step(2))
    run = Background(tmp_path, out, "train.steps=40", "checkpoint.every=1", *hold.args, **hold.env,
                     new_session=True)
    try:
        hold.wait(run)
        workers = [c for c in psutil.Process(run.proc.pid).children(recursive=True)]
        assert workers, "the run has no helper processes to signal"
        os.killpg(run.proc.pid, signal.SIGTERM)
        run.wait_for("[qarl] SIGTERM received", stream="stderr")
    finally:
        hold.release()
    rc, _, stderr = run.finish()
    assert rc == EXIT_STOPPED, stderr[-3000:]
    line = _one_line(stderr, "qarl-train:")
    assert "stopped by SIGTERM after step 2/40" in line and "written" in line, line


@pytest.mark.dist
@pytest.mark.parametrize("target", ["one-worker", "torchrun"])
def test_under_torchrun_every_rank_stops_after_the_same_step(tmp_path, monkeypatch, target):
    """A signal that reaches one rank only (or torchrun, which forwards SIGTERM to its workers): the ranks agree at
    the step boundary (a max over a flag), write one checkpoint together (every rank's shards) and stop. The signal
    comes while both ranks (each a rollout group's leader) are held in their last reward call of step 2."""
    out = tmp_path / "run"
    # two rollout groups (an engine on each rank), 2 requests each a step: both leaders held in their last one
    hold = Hold(tmp_path, monkeypatch, at=last_call_of_step(2, requests=2), leaders=2)
    run = Background(tmp_path, out, *STOP_RUN, "parallel.ep=2", *hold.args, nproc=2, **hold.env)
    try:
        hold.wait(run, timeout=400)
        if target == "torchrun":
            run.proc.send_signal(signal.SIGTERM)
        else:
            workers = [c for c in psutil.Process(run.proc.pid).children()
                       if "megatron_qarl.cli" in " ".join(c.cmdline())]
            assert len(workers) == 2
            rank1 = next(w for w in workers if w.environ().get("RANK") == "1")
            rank1.send_signal(signal.SIGTERM)
        if target == "torchrun":  # forwarded by torchrun: here once rank 0 has it (rank 1's handler says nothing;
            run.wait_for("[qarl] SIGTERM received", timeout=120, stream="stderr")  # a signal sent is pending)
    finally:
        hold.release()
    rc, _, stderr = run.finish()
    assert rc != 0  # torchrun reports its workers' status 3 as a failure of its own
    lines = [ln for ln in stderr.splitlines() if ln.startswith("qarl-train: stopped by")]
    assert len(lines) == 1, stderr[-4000:]  # rank 0 says it, once
    assert " after step 2/40;" in lines[0], lines[0]
    ckpt = out / "checkpoints" / "step_00000002"
    assert verify_checkpoint(ckpt) == [] and json.loads((ckpt / MARKER_NAME).read_text())["world_size"] == 2
    assert _rows(out) == [0, 1]
    if target == "one-worker":  # torchrun names its workers' status (after its own signal it prints a traceback)
        assert "exitcode:3" in stderr.replace(" ", ""), stderr[-3000:]


def test_a_stop_during_a_rollout_abandons_it_checkpoints_the_last_complete_step_and_exits_3(tmp_path, monkeypatch):
    """Issue 42 item 3: SIGTERM used to be honoured only at the next step boundary, after the whole rollout (hours on
    GPUs, past Slurm's grace). Now the rollout's requests in flight are abandoned, the last complete step is
    checkpointed, exit 3; the resumed run reads the abandoned step's prompts again and finishes. The signal comes
    while the run is held in step 2's first reward call (it used to come during a 4 s sleep there: a race)."""
    hold = Hold(tmp_path, monkeypatch, at=last_call_of_step(1) + 1)
    args = ("train.steps=40", "checkpoint.every=0", *hold.args)
    out = tmp_path / "run"
    run = Background(tmp_path, out, *args, **hold.env)
    try:
        hold.wait(run)
        run.proc.send_signal(signal.SIGTERM)  # during step 2's rollout, its first reward call in progress
        run.wait_for("[qarl] SIGTERM received", stream="stderr")
    finally:
        hold.release()
    rc, _, stderr = run.finish(timeout=120)
    assert rc == EXIT_STOPPED, stderr[-3000:]
    ckpt = out / "checkpoints" / "step_00000001"
    assert _one_line(stderr, "qarl-train:") == (
        f"qarl-train: stopped by SIGTERM after step 1/40, during step 2's rollout (its requests in flight were "
        f"abandoned: the resumed run samples them again); checkpoint {ckpt} written; exit status 3; run the same "
        "command again to continue (checkpoint.resume=auto)")
    assert verify_checkpoint(ckpt) == [] and (ckpt / MARKER_NAME).is_file()
    assert _rows(out) == [0]  # the abandoned step logged nothing
    calls = hold.log.read_text().splitlines()
    assert len(calls) == 6  # the rest of step 2's requests were not scored: abandoned
    proc = _run(out, *args[1:], "train.steps=2", **{**hold.env, "HOLD_AT": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpt} (step 1)" in proc.stdout
    assert _rows(out) == [0, 1]
    # the resumed step 2 read the prompts the abandoned one had: its first request (after the resumed run's
    # preflight call) has the same answers
    assert hold.log.read_text().splitlines()[7] == calls[5]
