"""Test helpers that damage a relay store's files on disk, the way a failing disk would."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable

from relay.store import ChunkStore


def rot_chunk(store: ChunkStore, version: int, index: int, garbage: bytes = b"bit rot") -> None:
    """Overwrite the start of chunk `index` of `version` in its file (read-only files too)."""
    path, offset, length = store.segments(version, index)[0]
    mode = path.stat().st_mode
    os.chmod(path, 0o644)
    try:
        with open(path, "r+b") as fh:
            fh.seek(offset)
            fh.write(garbage[:length])
    finally:
        os.chmod(path, mode)


class InjectedFsyncs:
    """`os.fsync`, replaced: while `failing`, the next `failures` fsyncs of files that `which`
    accepts raise OSError(`error`) (`failed` counts them); `synced` lists the files fsynced for
    real, in order."""

    def __init__(self, failures: float, error: int, which: Callable[[Path], bool]) -> None:
        self.failures, self.error, self.which = failures, error, which
        self.failing = True
        self.failed = 0
        self.synced: list[Path] = []
        self._real = os.fsync

    def __call__(self, fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if self.failing and self.failed < self.failures and self.which(path):
            self.failed += 1
            raise OSError(self.error, "injected: the disk failed an fsync")
        self.synced.append(path)
        self._real(fd)


def failing_fsyncs(monkeypatch, failures: float = 1, error: int = errno.EIO,
                   which: Callable[[Path], bool] = lambda path: True) -> InjectedFsyncs:
    """The next `failures` fsyncs (of files `which` accepts) fail with `error`."""
    injected = InjectedFsyncs(failures, error, which)
    monkeypatch.setattr(os, "fsync", injected)
    return injected


def in_version_folders(path: Path) -> bool:
    """A file of a stored version (not a bitmap, a manifest or a folder)."""
    return path.parent.parent.name == "versions"
