"""The batches a restarted trainer takes back: what the intake's snapshot says of each batch it
keeps, and the checks a batch's kept bytes pass before the intake trusts them again.

Workers submit one batch per step and then wait for the next version; validators refuse a
second submission for a step. So a batch the trainer heard, and a verdict on it, are heard
once: a trainer that restarts without them has nothing to train its step on while every
worker waits for the version after it, and the network stalls. The trainer therefore keeps
each batch's signed payload, as received, in a file of its own (`trainer.intake_state` writes
them, beside the state file), and the snapshot lists, for each batch whose payload is on disk,
what the intake had decided about it: the validators whose verdicts accepted or rejected it,
whether a validator claimed it, its sibling, skew and refusal marks, the version it was
trained into, and whether the leaderboard credited it.

A payload comes back only if its blake3 submission id is the one listed (a damaged or swapped
file is left out, its batch lost as before: its keys still make a later copy a sibling), it
parses as a `Submission` (`p2pnet.wire.kept_envelope`: signature and age were checked when it
arrived) and its sender is the listed worker. Verdicts come back as the sets of validators
that gave them (each was admitted by the verdict rules when heard), so a restored batch is
admissible exactly when it was before the restart.

Training marks. A batch trained into version V is marked so only once the learner has V; the
learner writes V after the step (`Learner.flush`, in the background), so a crash can lose V
after the intake marked its batches. `Intake.resume_at` takes those marks back when the
restarted learner is behind them: the batches are trained again, into the version that is now
the next one.

The intake's side of the restore is `Intake.restore` and `Intake.resume_at`: an unclaimed,
undecided batch waits `unchecked_after_s` again from the restart, and the learner's own
checkpoint (the keys it trained) is the last word on what was trained.

A pure module: no I/O (the file's owner reads the payloads and passes them in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pnet.errors import MessageRejected
from p2pnet.wire import kept_envelope
from verify.messages import Submission, submission_id


@dataclass(frozen=True)
class KeptBatch:
    """One kept batch as the snapshot lists it; `payload` is its signed payload while the
    state file's folder does not hold it yet (None once written: `Intake.spooled`)."""
    sid: bytes
    worker: str
    claimed: bool
    sibling: bool
    skewed: bool
    withheld: bool
    refused: bool
    trained_into: int | None
    credited: bool
    accepted_by: tuple[str, ...]
    rejected_by: tuple[str, ...]
    payload: bytes | None = None

    def to_json(self) -> dict[str, Any]:
        return {"sid": self.sid.hex(), "worker": self.worker, "claimed": self.claimed, "sibling": self.sibling,
                "skewed": self.skewed, "withheld": self.withheld, "refused": self.refused,
                "trained_into": self.trained_into, "credited": self.credited,
                "accepted_by": sorted(self.accepted_by), "rejected_by": sorted(self.rejected_by)}


_FLAGS = ("claimed", "sibling", "skewed", "withheld", "refused", "credited")


def parse_kept(listed: Any) -> list[KeptBatch]:
    """The `batches` list of a snapshot; ValueError if an entry is not one (nothing is kept)."""
    out = []
    try:
        for entry in list(listed):
            entry = dict(entry)
            flags = {name: entry[name] for name in _FLAGS}
            if not all(isinstance(v, bool) for v in flags.values()):
                raise ValueError(f"a batch's marks are not booleans: {flags!r}")
            trained = entry["trained_into"]
            if trained is not None and (not isinstance(trained, int) or isinstance(trained, bool) or trained < 0):
                raise ValueError(f"trained_into: {trained!r}")
            sid = bytes.fromhex(entry["sid"])
            if len(sid) != 32:
                raise ValueError(f"a submission id of {len(sid)} bytes")
            out.append(KeptBatch(sid, str(entry["worker"]), trained_into=trained,
                                 accepted_by=tuple(str(v) for v in entry["accepted_by"]),
                                 rejected_by=tuple(str(v) for v in entry["rejected_by"]), **flags))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a list of kept batches: {exc!r}") from exc
    return out


def kept_submission(kept: KeptBatch, payload: bytes) -> Submission | None:
    """The submission in `payload` if it is the batch `kept` lists, else None (module docstring)."""
    try:
        envelope = kept_envelope(payload)
    except MessageRejected:
        return None
    if not isinstance(envelope.body, Submission) or envelope.sender != kept.worker:
        return None
    return envelope.body if submission_id(envelope) == kept.sid else None
