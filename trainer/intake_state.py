"""The intake's verification memory on disk: `intake_state.json` in the trainer's out_dir, and
beside it `intake_batches/`, one file per kept batch (its signed payload, as received).

Owns the file, not what is in it (`Intake.snapshot` / `Intake.restore` say that): `load_into`
reads it at start (a format 1 file, from before the leaderboard's rows were carried, loads with an
empty leaderboard), and `IntakeStateFile` writes it, atomically (`p2pnet.files`: temp name,
fsync, rename, fsync the folder), from the trainer role's nursery: at once after a failed
verdict or a ban (the role calls `urgent()` when the intake emits one), else within
`interval_s` of any other change (a submission indexed, a step forgotten, a leaderboard count),
and at shutdown (`save`). A missing file is a first start. A file we cannot read back is our own
state damaged:
`LocalStateError` naming it, unless `discard_damaged` (the trainer's
`discard_damaged_intake_state`) says start empty; the damaged file is then moved aside to
`intake_state.json.damaged`, never read again.

Kept batches (`trainer.intake_kept`: without them a restarted trainer stalls its step). Each
save first writes the payloads of batches heard since the last one (each file written under a
temporary name, fsynced and renamed, then the folder fsynced once), then the state file that
lists them, then removes the files of batches the intake no longer keeps: the state file never
names a payload that is not on disk, and a file it does not name is never read (one left by a
crash between the two writes goes at the next save). Batches, claims and verdicts
(`Intake.heard_once`) are saved within `SOON_S`, not `interval_s`: nobody sends them again.
`load_into` reads the payloads the file lists; one missing or damaged costs that batch only
(logged; its keys still make a later copy a sibling).

What a crash can lose, and why that is acceptable: a failed verdict or a ban is on disk within
two writes of it (one under way, then its own: milliseconds for a small index, under a second
at the size measured below), so a crash loses one only if it comes in between. The sibling
index written since the last save (at most `interval_s`, 5 s by default) can be lost: a copy of
a batch heard in those last seconds, sent again after the restart, is then not a sibling here.
That needs the crash to fall inside the few seconds after the first copy, which a worker does
not choose, and gains the worker at most that one batch; writing the whole index (one entry per
submission in the replay window) at every submission would cost far more. A clean shutdown
loses nothing. A write that fails (a full disk, an I/O error) is logged as an error at every try
and tried again every `interval_s` (at once on the next `urgent`), the trainer running on: the
bans are in memory and still refuse, and stopping would not put them on disk either (the file
keeps its last good content), while a retry does once the disk recovers. `status()` counts the
failed writes; a save at shutdown that fails raises `LocalStateError` naming the file. A crash in
mid-write can leave a `.intake_state.json.tmp*` file beside it (never read; safe to delete).

The event loop only copies the index (`Intake.memory`); converting, encoding and writing run
in a worker thread. Measured at 180 000 nonces (1000 workers, one batch per 10 s, the 1800 s
window) and 10 000 step keys, on one core of the development machine: a 9.2 MB file, about
0.05 s of copying in the event loop, 0.4 s to convert, encode and write it (with fsync) in the
thread, 0.8 s to read it back at start. The thread's `json.dumps` (about 0.1 s there) holds the
GIL throughout, so the loop still stalls: its longest gap during a save was 0.17-0.25 s at that
size and 0.10-0.12 s at 100 000 nonces, once per save (every `interval_s` at most, unless
failed verdicts keep coming: each one asks for a save at once).
The leaderboard's rows add about 300 bytes per peer:
at 1000 workers and 100 validators (2026-12-05, same core) 0.33 MB, 1.3 ms to copy them in the
event loop (`Contributions.snapshot`), 2.1 ms to encode, 3.7 ms to parse back.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import trio

from p2pnet.errors import LocalStateError
from p2pnet.files import atomic_write_bytes, fsync_dir
from trainer.intake import Intake, IntakeMemory

log = logging.getLogger(__name__)
INTAKE_STATE_FILE = "intake_state.json"
BATCHES_DIR = "intake_batches"  # beside the state file
SAVE_INTERVAL_S = 5.0
SOON_S = 1.0  # a batch, claim or verdict heard is on disk within this (plus the write)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number this file may hold")


def load_into(intake: Intake, path: Path, now: float, wall_s: float, *, discard_damaged: bool = False) -> bool:
    """Restore `intake` from the file at `path`: True when it was there, False when missing
    (a first start). Unreadable content raises `LocalStateError` naming the file, or with
    `discard_damaged` is moved aside and the intake starts empty."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise LocalStateError(f"cannot read the trainer's intake state {path}: {exc.strerror or exc}") from exc
    try:
        state = json.loads(data, parse_constant=_refuse_constant)
        lost = intake.restore(state, now, wall_s, _payloads(path.with_name(BATCHES_DIR), state))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # json: ValueError, or nesting too deep
        if not discard_damaged:
            raise LocalStateError(
                f"the trainer's intake state {path} is damaged ({exc}); it holds the workers validators "
                f"banned: restore it from a backup, or set trainer.discard_damaged_intake_state = true "
                f"to start without it (banned workers' batches may then be admitted unchecked)") from exc
        aside = path.with_name(path.name + ".damaged")
        os.replace(path, aside)
        log.warning("trainer: intake state %s is damaged (%s): moved to %s, starting without bans or sibling "
                    "index (trainer.discard_damaged_intake_state)", path, exc, aside)
        return False
    if lost:
        log.warning("trainer: %d batch(es) listed in %s have no sound payload in %s: they are not trained on "
                    "(their keys still make later copies siblings)", lost, path, path.with_name(BATCHES_DIR))
    return True


def _payloads(folder: Path, state: Any) -> dict[bytes, bytes]:
    """The payloads in `folder` of the batches `state` lists (what the intake checks them against
    is its own business); an unreadable file is left out, as a missing one."""
    out: dict[bytes, bytes] = {}
    listed = state.get("batches", []) if isinstance(state, dict) else []
    for entry in listed if isinstance(listed, list) else []:
        name = entry.get("sid") if isinstance(entry, dict) else None
        if not isinstance(name, str) or len(name) != 64 or name.strip("0123456789abcdef"):
            continue  # the intake's parse names what is wrong with the entry
        try:
            out[bytes.fromhex(name)] = (folder / name).read_bytes()
        except OSError as exc:
            log.warning("trainer: cannot read the kept batch %s: %s", folder / name, exc.strerror or exc)
    return out


def _write_payloads(folder: Path, memory: IntakeMemory) -> list[bytes]:
    """Write the payloads `memory` carries (each crash-safe, the folder fsynced once), then
    remove the files of batches no longer kept; the ids written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for kept in memory.kept:
        if kept.payload is None:
            continue
        target = folder / kept.sid.hex()
        tmp = folder / f".{target.name}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(kept.payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        written.append(kept.sid)
    if written:
        fsync_dir(folder)
    return written


def _remove_unlisted(folder: Path, memory: IntakeMemory) -> None:
    listed = {kept.sid.hex() for kept in memory.kept}
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        if name not in listed:
            (folder / name).unlink(missing_ok=True)


class IntakeStateFile:
    """Keeps `intake`'s snapshot in `path` (module docstring): run `keep` in a nursery, call
    `urgent()` after a failure or ban, `save` at shutdown."""

    def __init__(self, path: Path, intake: Intake, *, interval_s: float = SAVE_INTERVAL_S,
                 wall: Callable[[], float] = time.time) -> None:
        self.path = path
        self.intake = intake
        self.interval_s = interval_s
        self.wall = wall
        self.saved_revision = -1  # the intake's revision the file holds (-1: not written by us yet)
        self.saved_heard = 0  # the intake's `heard_once` the file holds
        self.soon_s = min(SOON_S, interval_s)
        self.saves = 0
        self.failed_writes = 0  # writes that raised OSError (each logged; retried)
        self.last_error = ""
        self._urgent = trio.Event()
        self._saved = trio.Event()

    def urgent(self) -> None:
        """Save now, not at the next interval (a failed verdict or a ban: rare, and must last)."""
        self._urgent.set()

    def _write(self, memory: IntakeMemory) -> list[bytes]:
        """Payloads, state file, then the payloads no longer listed (module docstring); the ids written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        folder = self.path.with_name(BATCHES_DIR)
        written = _write_payloads(folder, memory)
        atomic_write_bytes(self.path, json.dumps(memory.to_json(), separators=(",", ":"), allow_nan=False).encode())
        _remove_unlisted(folder, memory)
        return written

    def _wrote(self, revision: int, heard_once: int, written: list[bytes]) -> None:
        self.intake.spooled(written)
        self.saved_heard = max(self.saved_heard, heard_once)
        self.saved_revision = max(self.saved_revision, revision)
        self.saves += 1
        self._saved.set()
        self._saved = trio.Event()

    async def keep(self) -> None:
        """Until cancelled: save whenever the snapshot changed, within `soon_s` when something was
        heard that nobody sends again, at once when `urgent`."""
        due = trio.current_time() + self.interval_s
        retry_at = -math.inf  # after a failed write, what was heard waits for this (or `urgent`)
        while True:
            with trio.move_on_after(self.soon_s):
                await self._urgent.wait()
            urgent, self._urgent = self._urgent.is_set(), trio.Event()
            now = trio.current_time()
            heard = self.intake.heard_once != self.saved_heard
            if not (urgent or now >= due or (heard and now >= retry_at)):
                continue
            due = retry_at = now + self.interval_s
            if self.intake.revision != self.saved_revision or heard:
                revision, heard_once = self.intake.revision, self.intake.heard_once
                memory = self.intake.memory(trio.current_time(), self.wall())
                try:
                    written = await trio.to_thread.run_sync(self._write, memory)
                except OSError as exc:  # our disk: the bans stay in memory, the next pass tries again
                    self._failed(exc)
                    continue
                retry_at = -math.inf
                self._wrote(revision, heard_once, written)

    def _failed(self, exc: OSError) -> None:
        self.failed_writes += 1
        self.last_error = str(exc)
        log.error("trainer: cannot write the intake state %s (%s); its file holds revision %d of %d: bans "
                  "and failures since are kept in memory only until a write succeeds (retried every %.0f s)",
                  self.path, exc, self.saved_revision, self.intake.revision, self.interval_s)

    def save(self) -> None:
        """Save now, in this thread (shutdown: a cancelled nursery can no longer wait on one);
        `LocalStateError` naming the file if the write fails."""
        if (self.intake.revision != self.saved_revision or self.intake.heard_once != self.saved_heard
                or not self.path.exists()):
            revision, heard_once = self.intake.revision, self.intake.heard_once
            try:
                written = self._write(self.intake.memory(trio.current_time(), self.wall()))
            except OSError as exc:
                self._failed(exc)
                raise LocalStateError(f"cannot write the trainer's intake state {self.path} at shutdown "
                                      f"({exc}): bans and failures since its last save are lost") from exc
            self._wrote(revision, heard_once, written)

    async def wait_saved(self, revision: int) -> None:
        """Return once the file holds the intake's `revision` or a later one."""
        while self.saved_revision < revision:
            await self._saved.wait()

    def status(self) -> dict[str, Any]:
        return {"file": str(self.path), "saved_revision": self.saved_revision, "saves": self.saves,
                "revision": self.intake.revision, "failed_writes": self.failed_writes, "last_error": self.last_error}
