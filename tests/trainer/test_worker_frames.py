"""A worker keeps the frames of its last submissions on disk, so that after its own restart it
neither submits a step again (validators refuse and penalise that) nor loses what a restarted
trainer may ask it for. Real files in a temporary folder."""

from __future__ import annotations

import logging

from p2pnet.wire import Codec
from tests.trainer.test_intake import CHEAT, WALL_S, WORKER, submission
from trainer.worker_frames import load, save


def frame(worker, step: int) -> bytes:
    return Codec(worker).encode(submission(worker, step), WALL_S)


def test_the_newest_frames_are_kept_and_given_back_oldest_first(tmp_path):
    for step in range(5):
        save(tmp_path, step, frame(WORKER, step), kept=3)
    assert load(tmp_path, WORKER.peer_id) == [(step, frame(WORKER, step)) for step in (2, 3, 4)]
    assert load(tmp_path / "none", WORKER.peer_id) == []


def test_a_damaged_foreign_or_misnamed_file_is_skipped_with_a_warning(tmp_path, caplog):
    save(tmp_path, 1, frame(WORKER, 1), kept=8)
    save(tmp_path, 2, frame(WORKER, 2)[:-1] + b"\x00", kept=8)  # its signature broken
    save(tmp_path, 3, frame(CHEAT, 3), kept=8)  # another's
    save(tmp_path, 4, frame(WORKER, 5), kept=8)  # the name says another step
    (tmp_path / "x.frame").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        assert load(tmp_path, WORKER.peer_id) == [(1, frame(WORKER, 1))]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 4
