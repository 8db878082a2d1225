"""p2pnet.files.atomic_write_bytes: a reader sees the old file or a whole new one, also when two
writers write the same path at once (two overlapping checkpoints of one role, in two threads)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from p2pnet import files


def test_two_writes_of_one_path_at_once_both_finish_and_the_later_rename_wins_whole(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    target = tmp_path / "state.st"
    first_synced, second_done = threading.Event(), threading.Event()
    real_fsync = os.fsync
    holder: dict[str, threading.Thread] = {}

    def fsync(fd: int) -> None:  # the first writer stops after writing, before its rename
        real_fsync(fd)
        if threading.current_thread() is holder["first"] and not first_synced.is_set():
            first_synced.set()
            assert second_done.wait(60.0)

    monkeypatch.setattr(os, "fsync", fsync)
    errors: list[BaseException] = []

    def write(data: bytes, done: threading.Event | None = None) -> None:
        try:
            files.atomic_write_bytes(target, data)
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            errors.append(exc)
        if done is not None:
            done.set()

    holder["first"] = threading.Thread(target=write, args=(b"a" * 100_000,))
    holder["first"].start()
    assert first_synced.wait(60.0)
    second = threading.Thread(target=write, args=(b"b" * 50_000, second_done))
    second.start()
    second.join()
    holder["first"].join()
    assert errors == []
    assert target.read_bytes() == b"a" * 100_000  # the first writer renamed last: its file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.st"]  # no temporary file left
