"""Every way a reward plug-in can end its process is one line naming the plug-in and what it did (issue 49 item 4).

A plug-in (`data.reward=package.module:function`) is code we do not control. It used to be able to end the run
silently: `SystemExit(0)` in a call made qarl-train exit 0 (pebble hands a worker's BaseException back to the
caller, which re-raised it), `KeyboardInterrupt` became the trainer's "interrupted (Ctrl-C)" (130), `sys.exit(3)`
at import (the plug-in was imported in the trainer, by the config check) exited 3, "stopped on request, run
again", which loops a requeue script, `os._exit(0)` in the worker was waited on for the whole deadline (pebble
ignores a worker that exits 0) and then called too slow, and the processes a plug-in started outlived the run.
Now the trainer never imports a plug-in; its worker reports every ending as a RewardError line, a worker that
ends is seen at once, and the worker's process group (everything the plug-in starts) dies with it however it
ends (lifecycle.end_group_with_this_process). qarl-train: exit 2, one line, before the model is built.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import REPO
from megatron_qarl.rl.rewards import RewardConfig, RewardError, RewardFunction, check_reward_spec

PLUGIN = '''
import os
import signal
import subprocess
import sys
import time


class Custom(BaseException):
    pass


def exits_0(responses, answers, rows):
    raise SystemExit(0)


def exits_3(responses, answers, rows):
    sys.exit(3)


def ctrl_c(responses, answers, rows):
    raise KeyboardInterrupt


def custom_base_exception(responses, answers, rows):
    raise Custom("out of here")


def os_exit_0(responses, answers, rows):
    os._exit(0)


def kills_itself(responses, answers, rows):
    os.kill(os.getpid(), signal.SIGKILL)


def _start_child(rows):
    child = subprocess.Popen(["sleep", "300"])
    with open(rows[0]["pid_file"], "w") as f:
        f.write(str(child.pid))


def starts_a_child(responses, answers, rows):
    _start_child(rows)
    return [0.0] * len(responses)


def starts_a_child_then_exits(responses, answers, rows):
    _start_child(rows)
    os._exit(0)


def terminates_its_child(responses, answers, rows):
    child = subprocess.Popen(["sleep", "300"])
    child.terminate()  # SIGTERM: the worker ignores outside stop signals, its children must not
    return [float(child.wait(timeout=20))] * len(responses)


def starts_a_child_then_hangs(responses, answers, rows):
    _start_child(rows)
    while True:
        time.sleep(0.05)
'''

IMPORT_ENDINGS = {  # module source -> what the line says it did
    "exit3": ("import sys\nsys.exit(3)\n", "called sys.exit(3) (raised SystemExit) while being imported"),
    "exit0": ("raise SystemExit(0)\n", "called sys.exit(0) (raised SystemExit) while being imported"),
    "ctrl_c": ("raise KeyboardInterrupt\n", "raised KeyboardInterrupt"),
    "os_exit": ("import os\nos._exit(0)\n", "ended its worker process (exit status 0: os._exit, or a crash in "
                                            "native code) while being loaded"),
}

CALL_ENDINGS = {  # function -> what the line says it did
    "exits_0": "called sys.exit(0) (raised SystemExit) (on a batch of 1 responses); a reward function must return "
               "its rewards (or raise an exception), never end its process",
    "exits_3": "called sys.exit(3) (raised SystemExit) (on a batch of 1 responses)",
    "ctrl_c": "raised KeyboardInterrupt (no Ctrl-C reaches a reward worker: the plug-in raised it) (on a batch",
    "custom_base_exception": "raised Custom: out of here (on a batch of 1 responses)",
    "os_exit_0": ": ended its worker process (exit status 0: os._exit, or a crash in native code) on a batch of 1 "
                 "responses",
    "kills_itself": ": its worker process was killed by SIGKILL on a batch of 1 responses",
}


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    name = f"qarl_ending_plugin_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    for suffix, (source, _) in IMPORT_ENDINGS.items():
        (tmp_path / f"{name}_{suffix}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize("attr", sorted(CALL_ENDINGS))
def test_every_way_a_plugin_call_can_end_is_one_line_at_once(plugin, attr):
    """With a 60 s deadline: the line comes within seconds (os._exit(0) used to be waited on for the deadline),
    and SystemExit / KeyboardInterrupt reach this process as a RewardError, never as themselves."""
    spec = f"{plugin}:{attr}"
    with RewardFunction(RewardConfig(kind=spec, timeout_s=60.0)) as fn:
        start = time.monotonic()
        with pytest.raises(RewardError) as err:
            fn(["a"], ["a"], [{}])
        took = time.monotonic() - start
        line = str(err.value)
        assert line.startswith(f"reward plug-in {spec!r}") and CALL_ENDINGS[attr] in line, line
        assert "\n" not in line
        assert took < 20.0, took  # at once, not at the 60 s deadline
        assert fn.stats.total == 0


@pytest.mark.parametrize("suffix", sorted(IMPORT_ENDINGS))
def test_a_plugin_module_that_ends_its_process_at_import_is_one_line(plugin, suffix):
    """The config check imports the plug-in in a worker, never in this process: sys.exit(3) at import used to end
    qarl-train with 3 ("stopped on request, run again"), os._exit(0) with 0."""
    module = f"{plugin}_{suffix}"
    spec = f"{module}:score"
    problem = check_reward_spec(spec)
    assert problem is not None and problem.startswith(f"reward plug-in {spec!r}"), problem
    assert IMPORT_ENDINGS[suffix][1] in problem, problem
    assert "\n" not in problem
    with pytest.raises(RewardError) as err:
        RewardConfig(kind=spec)
    assert str(err.value) == problem
    assert module not in sys.modules  # never imported here


def _pid_when_written(pid_file: Path, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pid_file.exists() and pid_file.read_text():
            return int(pid_file.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{pid_file} was never written")


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["close", "os_exit", "deadline"])
def test_processes_a_plugin_starts_end_with_its_worker(plugin, tmp_path, how):
    """A `sleep 300` the plug-in starts dies when its worker stops: at close(), when the plug-in ends its worker
    with os._exit, when the worker is killed at the deadline."""
    attr = {"close": "starts_a_child", "os_exit": "starts_a_child_then_exits",
            "deadline": "starts_a_child_then_hangs"}[how]
    pid_file = tmp_path / "child.pid"
    rows = [{"pid_file": str(pid_file)}]
    fn = RewardFunction(RewardConfig(kind=f"{plugin}:{attr}", timeout_s=3.0))
    try:
        if how == "close":
            assert fn(["a"], ["a"], rows) == [0.0]
        else:
            with pytest.raises(RewardError):
                fn(["a"], ["a"], rows)
        child = _pid_when_written(pid_file)
        if how == "close":
            assert psutil.pid_exists(child) and not _gone(child, 0.5)  # alive while the worker serves
    finally:
        fn.close()
    assert _gone(child), f"the plug-in's child {child} outlived its worker ({how})"


def test_processes_a_plugin_starts_end_when_the_trainer_is_killed(plugin, tmp_path):
    """SIGKILL of the trainer: the worker dies with it (the kernel's parent-death signal), and the plug-in's
    child with the worker (the worker's reaper kills its process group)."""
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        from megatron_qarl.rl.rewards import RewardConfig, RewardFunction
        fn = RewardFunction(RewardConfig(kind={plugin + ':starts_a_child'!r}))
        fn(["a"], ["a"], [{{"pid_file": {str(pid_file)!r}}}])
        print("called", flush=True)
        time.sleep(300)
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "called"
        child = _pid_when_written(pid_file)
        assert psutil.pid_exists(child)
    finally:
        trainer.kill()
        trainer.wait()
    assert _gone(child), f"the plug-in's child {child} outlived the SIGKILLed trainer"


# ------------------------------------------------------------------------------------------------ qarl-train

CONFIG = str(REPO / "configs" / "tiny_qarl_w4a16_tbpo.yaml")
SMALL = ["train.prompts_per_step=4", "rollout.n=2", "train.mini_batch_prompts=2", "train.micro_batch_size=2",
         "rollout.max_new_tokens=4", "logging.wandb.mode=disabled", "logging.plots=false", "train.steps=1"]


@pytest.mark.parametrize("spec,says", [
    (":exits_0", "called sys.exit(0)"),      # in the preflight's call: used to exit 0, nothing written but config.yaml
    ("_exit3:score", "called sys.exit(3)"),  # at import (the config check): used to exit 3, "stopped on request"
])
def test_qarl_train_with_a_plugin_that_ends_its_process_is_one_line_and_exit_2(plugin, tmp_path, spec, says):
    """Before the model is built: the preflight's smoke call, or the config check."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_qarl.cli", "--config", CONFIG, f"logging.out_dir={out}",
                           *SMALL, f"data.reward={plugin}{spec}"], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = proc.stderr[proc.stderr.index("qarl-train: error:"):]  # one line, or the config's list of problems
    problem = next(ln for ln in error.splitlines() if f"reward plug-in '{plugin}{spec}'" in ln)
    assert says in problem, error
    assert "interrupted" not in proc.stderr and "stopped" not in proc.stderr
    assert not (out / "metrics.jsonl").exists()


def test_processes_a_plugin_starts_keep_the_default_stop_signals(plugin):
    """The worker ignores SIGTERM / SIGINT / SIGUSR1 from outside (Slurm, a terminal); the processes the plug-in
    starts must not inherit that, or its own terminate() hangs (it used to: they inherited a blocked SIGTERM)."""
    with RewardFunction(RewardConfig(kind=f"{plugin}:terminates_its_child", timeout_s=30.0)) as fn:
        assert fn(["a"], ["a"], [{}]) == [-float(signal.SIGTERM)]  # Popen's returncode: killed by SIGTERM
