"""Crash-safe file writes shared by every package: temp name, fsync, rename, fsync the folder.

A reader never sees a partially written file under its final name: it sees the old file, the
new one, or none. Used for identity keys, chunk files, manifests, model folders and checkpoints.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

_WRITES = itertools.count()  # next() is atomic under the GIL


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644) -> None:
    """Write `data` to `path` through a temporary name beside it, fsynced, then renamed. The
    temporary name is this call's own (process, thread, a counter), so two writes of the same
    path at once (two threads, two processes) never share one: the later rename wins whole."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.{threading.get_ident()}.{next(_WRITES)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
