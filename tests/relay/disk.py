"""Test helpers that damage a relay store's files on disk, the way a failing disk would."""

from __future__ import annotations

import os

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
