"""megatron_qarl.lifecycle: helper processes die with a SIGKILLed parent (no orphans).

Each test starts a parent Python process that creates a child the way the trainer does, SIGKILLs the
parent, and checks whether the child is still alive. The "without" cases show the orphan the fix removes.
"""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import REPO, describe_and_kill

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")

FORKED_CHILD = """
import os, sys, time
from megatron_qarl.lifecycle import reap_children_on_parent_death
if sys.argv[1] == "reap":
    reap_children_on_parent_death()
pid = os.fork()
if pid == 0:
    time.sleep(120)
    os._exit(0)
print(pid, flush=True)
time.sleep(120)
"""

WRITER_QUEUE = """
import sys, time
import psutil
from megatron.core.dist_checkpointing.strategies import filesystem_async
if sys.argv[1] == "reap":
    from megatron_qarl.lifecycle import install_checkpoint_writer_queue
    install_checkpoint_writer_queue()
queue = filesystem_async._get_write_results_queue()  # what megatron calls on every save
queue.put("x")
assert queue.get() == "x"
print(" ".join(str(c.pid) for c in psutil.Process().children()), flush=True)
time.sleep(120)
"""


def _child_survives_parent_kill(script: str, mode: str, wait_s: float = 10.0) -> bool:
    """True if a child of the SIGKILLed parent is still alive `wait_s` later (it is then killed)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    parent = subprocess.Popen([sys.executable, "-c", script, mode], stdout=subprocess.PIPE, text=True, env=env)
    children = []
    try:
        line = parent.stdout.readline()
        children = [psutil.Process(int(pid)) for pid in line.split()]
        assert children, f"the parent started no child (printed {line!r})"
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
            return False
        time.sleep(0.1)
    describe_and_kill([c for c in children if c.is_running()])
    return True


def test_forked_children_die_with_a_killed_parent():
    assert _child_survives_parent_kill(FORKED_CHILD, "plain", wait_s=2)  # the orphan megatron's writers become
    assert not _child_survives_parent_kill(FORKED_CHILD, "reap")


def test_megatron_checkpoint_results_queue_manager_dies_with_a_killed_parent():
    assert _child_survives_parent_kill(WRITER_QUEUE, "plain", wait_s=2)  # megatron's own spawn Manager
    assert not _child_survives_parent_kill(WRITER_QUEUE, "reap")


def test_stop_process_kills_a_child_that_ignores_sigterm_after_the_grace():
    import subprocess
    import sys
    import time

    from megatron_qarl.lifecycle import stop_process

    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"  # SIGTERM is ignored from here on
    start = time.monotonic()
    stop_process(proc, grace_s=0.5)
    assert proc.returncode == -9 and time.monotonic() - start < 30
    stop_process(proc)  # a finished child: nothing to do
