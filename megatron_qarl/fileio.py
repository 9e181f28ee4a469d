"""Atomic file and directory writes: a reader sees the old file/dir or the new one, never a torn one."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, payload: bytes, mode: int = 0o644) -> Path:
    """Write `payload` to a temp file beside `path`, fsync, then rename over `path`.

    `mode` is applied before the rename (mkstemp creates 0600; outputs are meant to be shared).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str, mode: int = 0o644) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


@contextmanager
def atomic_dir(path: str | os.PathLike, mode: int = 0o755) -> Iterator[Path]:
    """Yield a temp dir beside `path` (`.<name>.tmp-*`); on success it replaces `path` (the old one is
    removed only after the new one is in place), on any failure it is removed and `path` is left as it was.

    `mode` is applied before the rename (mkdtemp creates 0700; outputs are meant to be shared).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, mode)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, old / path.name)
            os.rename(tmp, path)
            shutil.rmtree(old)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
