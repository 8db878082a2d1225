"""A worker's submissions on disk: `data_dir/submitted/`, the frames of its last few as published.

A worker submits one batch per step. Validators refuse a second submission for a step, and
penalise it (`replay_step`), and a restarted trainer asks workers for the frames it missed
(`verify.recall`). So a worker that restarts must know which steps it already submitted, and
still have their frames: each frame is written once it is published (`save`: temporary name,
fsync, rename; the newest `kept` are kept), and at start `load` gives them back, oldest first.
The worker answers a recall with them, and goes on from the step after the newest, unless the
network does not have the version that step was made with (a new run, its versions counted
from 0 again: its steps are not ours).

A crash between the publish and the write (the write follows at once, in a thread) loses that
one frame: the restarted worker submits that step again and is refused once. A file that does
not hold one of our own submissions for the step its name says is skipped, with a warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from p2pnet.files import atomic_write_bytes
from trainer.intake_recall import signed_submission

log = logging.getLogger(__name__)
SUBMITTED_DIR = "submitted"
_SUFFIX = ".frame"


def save(folder: Path, step: int, frame: bytes, kept: int) -> None:
    """Keep `frame`, our submission for `step`, and only the newest `kept` of them."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / f"{step:012d}{_SUFFIX}", frame)
    for old in sorted(folder.glob(f"*{_SUFFIX}"))[:-kept]:
        old.unlink(missing_ok=True)


def load(folder: Path, peer_id: str) -> list[tuple[int, bytes, int]]:
    """(step, frame, model version) of our submissions kept in `folder`, oldest first; [] if none."""
    out = []
    try:
        names = sorted(name for name in os.listdir(folder) if name.endswith(_SUFFIX))
    except FileNotFoundError:
        return []
    for name in names:
        path = folder / name
        try:
            step = int(name[:-len(_SUFFIX)])
            frame = path.read_bytes()
        except (ValueError, OSError) as exc:
            log.warning("worker: skipping %s, not a submission frame we can read: %s", path, exc)
            continue
        envelope = signed_submission(frame, peer_id)
        if envelope is None or envelope.body.step != step:
            log.warning("worker: skipping %s: not our own signed submission for step %d", path, step)
            continue
        out.append((step, frame, envelope.body.model_version))
    return out
