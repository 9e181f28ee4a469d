"""Atomic file and directory writes: a reader sees the old file/dir or the new one, never a torn one.

Outputs get the permissions a plain `open`/`mkdir` would give under the user's umask (mkstemp/mkdtemp
create 0600/0700, which another user's engine could not read). Temp names are `.<name>.tmp-*` beside the
target, so `remove_stale_temps` can find what a killed writer left behind.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_qarl.errors import UserError


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask can only set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    return 0o666 & ~current_umask()


def default_dir_mode() -> int:
    return 0o777 & ~current_umask()


def atomic_write_bytes(path: str | os.PathLike, payload: bytes, mode: int | None = None) -> Path:
    """Write `payload` to a temp file beside `path`, fsync, then rename over `path`.

    `mode` (default: 0o666 under the umask, as `open` would) is applied before the rename; on any
    failure (a full disk included) the temp file is removed and `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, default_file_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def _temp_prefix(path: Path, kind: str) -> str:
    return f".{path.name}.{kind}-{os.getpid()}-"


@contextmanager
def atomic_dir(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """Yield a temp dir beside `path` (`.<name>.tmp-<pid>-*`); on success it replaces `path` (the old one is
    removed only after the new one is in place), on any failure it is removed and `path` is left as it was.

    `mode` (default: 0o777 under the umask, as `mkdir` would) is applied before the rename; what was
    written inside gets the umask's modes too (safetensors writes 0600 files, mkdtemp makes 0700 dirs).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(path, "tmp"), dir=path.parent))
    try:
        yield tmp
        _share_tree(tmp)
        os.chmod(tmp, default_dir_mode() if mode is None else mode)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=_temp_prefix(path, "old"), dir=path.parent))
            os.rename(path, old / path.name)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _share_tree(root: Path) -> None:
    """Give every file and directory under `root` the mode a plain open/mkdir would under the umask."""
    file_mode, dir_mode = default_file_mode(), default_dir_mode()
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):  # children before their dir
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), dir_mode)
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                os.chmod(full, file_mode)


def process_start_time() -> float:
    """Wall-clock time this process started (the import time of this module where /proc is unavailable)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


_IMPORTED_AT = time.time()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_TEMP_PID = re.compile(r"\.(?:tmp|old)-(\d+)-")


def temp_writer_alive(name: str) -> bool:
    """Whether the temp name `name` (atomic_dir's `.<target>.tmp-<pid>-*` / `.old-<pid>-*`) carries the pid
    of another process that is still running on this host: its writer may still be writing it."""
    match = _TEMP_PID.search(name)
    pid = int(match.group(1)) if match else None
    return pid is not None and pid != os.getpid() and _pid_alive(pid)


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Remove what atomic_dir left beside `path` when its writer was killed: `.<name>.tmp-*` / `.<name>.old-*`
    siblings last modified before this process started (so not another live writer's) and, where the name
    carries a pid, whose process is gone. Returns the removed paths (the caller reports them)."""
    path = Path(path)
    parent = path.parent
    if not parent.is_dir():
        return []
    pattern = re.compile(r"^\." + re.escape(path.name) + r"\.(tmp|old)-(?:(\d+)-)?")
    started, removed = process_start_time(), []
    for entry in parent.iterdir():
        match = pattern.match(entry.name)
        if not match or entry.is_symlink() or not entry.is_dir():
            continue
        if temp_writer_alive(entry.name):
            continue
        try:
            if entry.stat().st_mtime >= started:
                continue
        except OSError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
    return removed


# ------------------------------------------------------------------ a run's own files, never through a link

def _link_problem(path: Path, fd: int | None = None) -> str | None:
    """Why writing `path` (or the open `fd` of it) would write a file outside the run; None when it would not."""
    if fd is None and os.path.islink(path):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"{path} is a symbolic link (to {target}): remove it (what it links to is not touched)"
    try:
        links = os.fstat(fd).st_nlink if fd is not None else os.lstat(path).st_nlink
    except FileNotFoundError:
        return None
    if links > 1:
        return (f"{path} has {links} hard links (the same file is elsewhere too, e.g. a backup made with hard links): "
                f"make it a file of its own (cp {path} {path}.own && mv {path}.own {path})")
    return None


def _refuse_link(problem: str) -> RunFileLinkError:
    return RunFileLinkError(f"{problem}; a run writes only its own files, never through a link out of its directory "
                            "(or use another directory)")


def check_own_file(path: str | os.PathLike) -> None:
    """RunFileLinkError if `path` (a file the run will append to or rewrite) is a symbolic link or has other hard
    links."""
    problem = _link_problem(Path(path))
    if problem:
        raise _refuse_link(problem)


def open_own_file(path: str | os.PathLike, flags: int, mode: int | None = None) -> int:
    """os.open(path, flags) for a file the run owns: never through a symbolic link (O_NOFOLLOW) nor into a file
    with other hard links (RunFileLinkError either way, nothing written); the fd, close-on-exec."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, default_file_mode() if mode is None else mode)
    except OSError as err:
        problem = _link_problem(path) if err.errno in (errno.ELOOP, errno.EMLINK) else None
        if problem:
            raise _refuse_link(problem) from None
        raise
    problem = _link_problem(path, fd)
    if problem:
        os.close(fd)
        raise _refuse_link(problem)
    return fd


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append `text` to the run's file `path` (created if absent) in one write, never through a link."""
    fd = open_own_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        data = text.encode("utf-8")
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


# ------------------------------------------------------------------ one writer per run directory

class RunDirInUseError(RuntimeError, UserError):
    """Another live process holds the run directory's lock (a second trainer on the same out dir)."""


class RunFileLinkError(RunDirInUseError):
    """A file the run appends to or locks in its directory is a symbolic link, or has other hard links: writing it
    would write a file outside the run (a copied or shared run dir can hold such planted links). A RunDirInUseError:
    the directory cannot be used as it is (qarl-train: one line, exit 2)."""


class RunDirLock:
    """An exclusive `fcntl.flock` on `<dir>/.qarl.lock`, held for a run's life by one process (the logging rank):
    a second trainer on the same directory is refused with RunDirInUseError naming the holder's pid and host,
    before it reads or removes anything there. The kernel releases the lock when the holder exits, however it
    exits (SIGKILL included), so a stale lock never blocks a restart. The file stays (removing it would race a
    process that just opened it); it names the holder while held and is emptied on release."""

    NAME = ".qarl.lock"

    def __init__(self, directory: str | os.PathLike, what: str = "run directory", name: str | None = None):
        """`name`: another lock file in `directory` (one output of several there, e.g. `.<checkpoint>.qarl.lock`)."""
        self.directory, self.what = Path(directory), what
        self.path = self.directory / (name or self.NAME)
        self._fd: int | None = None
        self._moved: list[int] = []  # locks held on files whose directory was renamed since (follow)

    def acquire(self) -> "RunDirLock":
        import fcntl
        import json
        import socket

        self.directory.mkdir(parents=True, exist_ok=True)
        fd = open_own_file(self.path, os.O_RDWR | os.O_CREAT)  # never through a planted link
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirInUseError(f"{self.what} {self.directory} is in use by another run ({self.holder()}, lock "
                                   f"{self.path}); wait for it to end or stop it, or give this run another "
                                   "directory (logging.out_dir / checkpoint.dir)") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd
        return self

    def holder(self) -> str:
        """'pid N on HOST since TIME' from the lock file (what the holder wrote when it took the lock)."""
        import json

        for _ in range(20):  # the holder writes its line right after taking the lock
            try:
                info = json.loads(self.path.read_text())
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
                return f"pid {info['pid']} on {info['host']} since {started}"
            except (OSError, ValueError, KeyError, TypeError):
                time.sleep(0.05)
        return "a process that did not say who it is"

    def follow(self) -> None:
        """Lock `path` again if the locked file is no longer there (its directory was renamed after acquire,
        e.g. moved aside by logging.overwrite): the lock protects the directory at the path, not the old one."""
        if self._fd is None:
            return
        try:
            here = os.path.samestat(os.stat(self.path), os.fstat(self._fd))
        except FileNotFoundError:
            here = False
        if not here:
            self._moved.append(self._fd)
            self._fd = None
            self.acquire()

    def release(self) -> None:
        import fcntl

        for fd in [self._fd, *self._moved]:
            if fd is None:
                continue
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._fd, self._moved = None, []

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
