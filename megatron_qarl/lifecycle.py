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
    started with `die_with_parent`, changes nothing else: megatron only calls `put`/`get` on it. The Manager
    also outlives a stop signal sent to the whole job (Slurm, a terminal's Ctrl-C): the stopping trainer still
    needs it for its last checkpoint.
    """
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(initializer=init_helper_process, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()


def init_helper_process(owner_pid: int) -> None:
    """First thing in a helper process the trainer starts (a multiprocessing initializer): it dies with its owner
    and ignores stop signals that are not its owner's (ignore_stop_signals_from_others)."""
    die_with_parent(owner_pid)
    ignore_stop_signals_from_others(owner_pid)


_REAP_SIGNAL = getattr(signal, "SIGRTMIN", 34) + 3  # a signal no job scheduler or terminal sends


def end_group_with_this_process() -> None:
    """Make this process lead a process group of its own, and have every process of that group (the processes it
    starts, theirs, and so on, unless one leaves the group) SIGKILLed when this process ends, however it ends:
    a clean exit, `os._exit`, a signal, SIGKILL, or its parent's death (die_with_parent).

    A reaper, forked now, waits in the group for this process's death (the kernel's parent-death signal, and a
    check of its parent once a second) and then kills the group, itself last. For a process that runs code we do
    not control (a reward plug-in's worker): call it first thing, before any thread starts (it forks). It ignores
    stop signals from outside (a Slurm job step's SIGTERM, a terminal's Ctrl-C): only this process's end counts.
    Linux only (elsewhere: nothing)."""
    if not sys.platform.startswith("linux"):
        return
    me = os.getpid()
    try:
        os.setpgid(0, 0)
    except OSError:
        return
    if os.getpgid(0) != me:  # never a reaper for a group this process does not lead (it would kill its owner's)
        return
    if os.fork() != 0:
        return
    try:  # the reaper: no Python-level cleanup, no file descriptors of its parent's (its pipes see EOF on time)
        os.closerange(3, 65536)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {_REAP_SIGNAL})
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, _REAP_SIGNAL, 0, 0, 0)
        while os.getppid() == me and signal.sigtimedwait({_REAP_SIGNAL}, 1.0) is None:
            pass
        os.killpg(me, signal.SIGKILL)
    finally:
        os._exit(0)


def kill_process_group(pgid: int | None) -> None:
    """SIGKILL every process of the process group `pgid` (one end_group_with_this_process made); none left: nothing."""
    if pgid is None or not sys.platform.startswith("linux"):
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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


# ------------------------------------------------------------------ stopping a run gracefully

# qarl-train's exit status after a graceful stop (SIGTERM, SIGUSR1, Ctrl-C, the stop file): the step in flight
# finished and was checkpointed; `checkpoint.resume=auto` continues from it. 0 = done, 1 = crash, 2 = a user
# error, 3 = stopped on request (requeue me), 130 = a second Ctrl-C (stopped at once, no new checkpoint).
EXIT_STOPPED = 3
EXIT_INTERRUPTED = 130
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOP_FILE_ENV = "QARL_STOP_FILE"  # a path: the run stops gracefully at the step boundary after it appears
_REPEAT_WINDOW_S = 1.0  # a second SIGINT within this is a forwarded copy (torchrun, a shell), not a second press


def stale_stop_file(environ=None) -> str | None:
    """The problem, as one line, when the stop file `$QARL_STOP_FILE` names exists before a run starts: it is left
    from an earlier stop (a run deletes nothing it did not make), and a run started with it would build its model
    and stop again at its first step boundary, exit 3, "run again": a requeue script would loop. None otherwise."""
    path = (os.environ if environ is None else environ).get(STOP_FILE_ENV) or None
    if path is None or not os.path.exists(path):  # what StopRequest.requested() asks
        return None
    return (f"the stop file {path} (${STOP_FILE_ENV}) exists before the run started, left from an earlier stop: "
            f"the run would stop again at its first step; remove it (rm {path!s}) and run the same command again, "
            f"or unset {STOP_FILE_ENV}")


class StopRequest:
    """What asked the run to stop: a signal (SIGTERM: Slurm preemption, `kill`; SIGUSR1: Slurm's --signal
    before the time limit; SIGINT: Ctrl-C) or the file $QARL_STOP_FILE. The handlers only record the request;
    the loop asks `requested()` at a step boundary, so the step in flight finishes and is checkpointed. A
    second Ctrl-C (more than a second after the first) raises KeyboardInterrupt: stop at once."""

    def __init__(self, stop_file: str | None = None):
        self.reason: str | None = None
        self.stop_file = stop_file
        self._at = 0.0

    def requested(self) -> bool:
        if self.reason is None and self.stop_file and os.path.exists(self.stop_file):
            self.reason = f"the stop file {self.stop_file}"
        return self.reason is not None

    def _handle(self, signum, frame) -> None:
        import time

        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.reason is None:
            self.reason, self._at = name, now
            if os.environ.get("RANK", "0") == "0":  # one line per run, not per torchrun worker
                what = "Ctrl-C" if signum == signal.SIGINT else name
                again = "; Ctrl-C again stops at once, without a checkpoint" if signum == signal.SIGINT else ""
                # os.write, not print: a handler may run while the main thread is inside print()
                os.write(2, f"\n[qarl] {what} received: finishing the current step, then writing a checkpoint and "
                            f"stopping{again}\n".encode())
        elif signum == signal.SIGINT and now - self._at > _REPEAT_WINDOW_S:
            raise KeyboardInterrupt


class stop_on_signals:
    """`with stop_on_signals() as stop:` installs StopRequest's handlers for STOP_SIGNALS in the main thread
    (the previous ones are restored on exit); `stop.requested()` at a step boundary. Elsewhere (not the main
    thread) it installs nothing and only the stop file counts."""

    def __init__(self, stop_file: str | None = None):
        self.request = StopRequest(stop_file if stop_file is not None else os.environ.get(STOP_FILE_ENV) or None)
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self.request._handle)
        return self.request

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}


def ignore_stop_signals_here() -> None:
    """In a helper process that runs code we do not control (a reward plug-in's worker): SIGTERM, SIGINT and SIGUSR1
    do nothing to this process (Slurm signals every process of a job step; the trainer finishes its step and stops
    its helpers itself), while the processes it starts keep the default actions, so that their own owner can still
    `terminate()` them: a Python handler, unlike SIG_IGN or a blocked signal mask (ignore_stop_signals_from_others),
    is reset by exec, and a fork hook resets it in forked children. The owner stops this process by other means
    (a message, SIGKILL). Call it after any fork that must keep the defaults of this process's start."""
    def ignore(signum, frame) -> None:
        pass

    def defaults_in_child() -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)

    for sig in STOP_SIGNALS:
        signal.signal(sig, ignore)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=defaults_in_child)


def ignore_stop_signals_from_others(owner_pid: int) -> None:
    """In a helper process (a reward worker): a stop signal is its owner's business. Slurm signals every process
    of a job step (preemption's SIGTERM, --signal's SIGUSR1) and a terminal's Ctrl-C reaches the whole
    foreground group; the trainer then finishes its step and stops its helpers itself, so a helper must not
    die first. SIGINT and SIGUSR1 are ignored; SIGTERM ends this process only when `owner_pid` sent it (how the
    owner's pool stops a worker), read by a thread that waits for it with the signal blocked elsewhere.
    SIGKILL, and the kernel's parent-death signal (die_with_parent), still end it at once."""
    import threading

    for sig in (signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait_for_owner() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == owner_pid:
                os._exit(128 + signal.SIGTERM)

    threading.Thread(target=wait_for_owner, name="qarl-stop-from-owner", daemon=True).start()
