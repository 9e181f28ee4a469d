"""No process outlives the run that started it.

A trainer starts helper processes it does not always own the code of: megatron's checkpoint writers
(forked per save) and its write-results queue (a `spawn` multiprocessing Manager kept in a module global,
megatron-core 0.16.1 `dist_checkpointing/strategies/filesystem_async.py:48-56`), our reward workers, the
SGLang server, torchrun workers. On a clean exit each is shut down by its owner; on SIGKILL of the parent
(OOM killer, `scancel`, a user's `kill -9`) nothing runs in the parent, so each child must end itself.
Linux does that for us: `prctl(PR_SET_PDEATHSIG, SIGKILL)` makes the kernel kill a process when the thread
that created it dies. Elsewhere (macOS) the calls are no-ops.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1
_installed_fork_hook = False


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies; exit now if it already has.

    Call it first thing in a child (a `preexec_fn`, a multiprocessing initializer, a fork hook).
    `parent_pid` closes the race where the parent died before this call: the child is then already
    re-parented and exits at once.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)


def reap_children_on_parent_death() -> None:
    """Make every child this process forks from now on die with it (idempotent).

    Covers children created by libraries we do not control, such as megatron's per-save checkpoint
    writer processes (forked: `filesystem_async.py:266`), which a SIGKILLed trainer would otherwise
    leave blocked on a queue no one reads. The kernel ties the signal to the forking *thread*: a child
    forked from a short-lived worker thread would die with that thread. Nothing in the trainer forks
    from such a thread (megatron's synchronous save forks from the main thread); `subprocess` without
    `preexec_fn` runs no fork hooks at all.
    """
    global _installed_fork_hook
    if _installed_fork_hook or not hasattr(os, "register_at_fork"):
        return
    parent = os.getpid()

    def _child() -> None:
        die_with_parent(parent)

    os.register_at_fork(after_in_child=_child)
    _installed_fork_hook = True


def install_checkpoint_writer_queue() -> None:
    """Give megatron's dist-checkpoint writer a results queue whose Manager dies with this process.

    megatron creates the queue lazily from `mp.get_context("spawn").Manager()`, a server process that
    nothing stops if the trainer is SIGKILLed. Creating the same kind of queue ourselves, from a Manager
    started with `die_with_parent`, changes nothing else: megatron only calls `put`/`get` on it.
    """
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()


def stop_process(proc: subprocess.Popen | None, grace_s: float = 30.0) -> None:
    """End a child we started: SIGTERM, `grace_s` to exit, then SIGKILL. A finished (or absent) child: nothing."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace_s)
