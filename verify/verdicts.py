"""Verdicts: building one from rollout checks, and deciding which remote verdicts to believe.

Owns: who counts as a worker or a validator (`Membership`: a configured set, else the role a
peer advertises in the peer table), the ledger of submissions seen and verdicts admitted
(`VerdictLedger`), the admission rules for a remote verdict, and `summarize`, which folds
per-rollout results into one submission verdict.

Admission rules, in order (each failure has a stable reason code):
  not_validator        the sender is not a known validator;
  unknown_submission   we never saw that submission (so worker and step cannot be trusted);
  mismatch             worker, step or model version differ from the submission's;
  self_verdict         the sender is the submission's worker (a peer may run both roles, but
                       never checks its own work);
  bad_ticket           the ticket is not the sender's signature over the submission id;
  not_selected         the ticket is genuine but above the eligibility threshold;
  duplicate            this validator already gave a verdict on this submission.
The envelope's own signature was checked by the codec before any of this.

Used by the validator core and by the trainer's intake alike. Pure: no clock, no I/O.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

from p2pnet.errors import MessageRejected
from p2pnet.identity import SignatureChecker
from verify.assign import check_remote_ticket
from verify.messages import MAX_REASON_CHARS, MAX_REASONS, Verdict

VALIDATOR_ROLE = "validator"
WORKER_ROLE = "worker"


class Directory(Protocol):
    """What membership needs from the peer table (`p2pnet.peertable.PeerTable` fits)."""

    def get(self, peer: str) -> Any: ...

    def with_role(self, role: str) -> list[Any]: ...


@dataclass(frozen=True)
class Membership:
    """Who is a worker, who is a validator.

    A non-empty configured set is authoritative (a closed network); otherwise the roles
    peers advertise in their heartbeats count. Advertised roles are self-declared, so an open
    network should configure `validators` (see docs/validators.md).
    """

    self_id: str
    directory: Directory | None = None
    validators: frozenset[str] = frozenset()
    workers: frozenset[str] = frozenset()
    self_is_validator: bool = True

    def _has_role(self, peer: str, role: str) -> bool:
        if self.directory is None:
            return False
        entry = self.directory.get(peer)
        return entry is not None and role in entry.roles

    def is_validator(self, peer: str) -> bool:
        if self.validators:
            return peer in self.validators
        return self._has_role(peer, VALIDATOR_ROLE)

    def is_worker(self, peer: str) -> bool:
        if self.workers:
            return peer in self.workers
        return self._has_role(peer, WORKER_ROLE)

    def live_validators(self) -> int:
        """Validators alive in our view, ourselves included (at least 1)."""
        live = set()
        if self.directory is not None:
            live = {e.peer_id for e in self.directory.with_role(VALIDATOR_ROLE)}
            if self.validators:
                live &= self.validators
        elif self.validators:
            live = set(self.validators)
        live.discard(self.self_id)
        return len(live) + (1 if self.self_is_validator else 0) or 1


@dataclass(frozen=True)
class SubmissionInfo:
    worker: str
    step: int
    model_version: int
    seen_at: float


@dataclass(frozen=True)
class AdmittedVerdict:
    validator: str
    verdict: Verdict
    ticket_value: int


class Outcome(enum.StrEnum):
    """What became of a submission, by the admitted verdicts on it (`VerdictLedger.outcome`)."""

    PENDING = "pending"  # no verdict decides it yet (the ledger says None; the trainer's intake keeps this)
    ACCEPTED = "accepted"  # some admitted verdict passed it and none failed it
    REJECTED = "rejected"  # an admitted verdict failed it


@dataclass
class _Outcome:
    accepted_by: set[str] = field(default_factory=set)
    rejected_by: set[str] = field(default_factory=set)


class VerdictLedger:
    """Submissions seen and verdicts admitted, bounded by count (oldest forgotten first)."""

    def __init__(self, membership: Membership, *, rate: float, max_entries: int = 100_000) -> None:
        self.membership = membership
        self.rate = rate
        self.max_entries = max_entries
        self._checker = SignatureChecker()
        self._submissions: OrderedDict[bytes, SubmissionInfo] = OrderedDict()
        self._outcomes: dict[bytes, _Outcome] = {}

    # -- submissions ----------------------------------------------------------------------

    def note_submission(self, sid: bytes, info: SubmissionInfo) -> None:
        self._submissions[sid] = info
        while len(self._submissions) > self.max_entries:
            old, _ = self._submissions.popitem(last=False)
            self._outcomes.pop(old, None)

    def submission(self, sid: bytes) -> SubmissionInfo | None:
        return self._submissions.get(sid)

    def forget_before(self, horizon: float) -> None:
        while self._submissions:
            sid, info = next(iter(self._submissions.items()))
            if info.seen_at >= horizon:
                break
            del self._submissions[sid]
            self._outcomes.pop(sid, None)

    # -- verdicts -------------------------------------------------------------------------

    def admit(self, sender: str, sender_bytes: bytes, verdict: Verdict) -> AdmittedVerdict:
        """Apply the admission rules; raises MessageRejected(reason) or records the verdict."""
        if not self.membership.is_validator(sender):
            raise MessageRejected("not_validator", "verdict from a peer that is not a validator", sender)
        sid = verdict.submission_id
        info = self._submissions.get(sid)
        if info is None:
            raise MessageRejected("unknown_submission", sid.hex()[:16], sender)
        if (verdict.worker, verdict.step, verdict.model_version) != (info.worker, info.step, info.model_version):
            raise MessageRejected("mismatch", "worker, step or version differ from the submission", sender)
        if sender == info.worker:
            raise MessageRejected("self_verdict", "a verdict on the sender's own submission", sender)
        try:
            value = check_remote_ticket(self._checker, sender_bytes, sid, verdict.validator_ticket,
                                        self.rate, self.membership.live_validators())
        except MessageRejected as exc:
            raise MessageRejected(exc.reason, exc.detail, sender) from exc
        outcome = self._outcomes.setdefault(sid, _Outcome())
        if sender in outcome.accepted_by or sender in outcome.rejected_by:
            raise MessageRejected("duplicate", "second verdict from this validator", sender)
        self.record_own(sid, sender, verdict.accepted)
        return AdmittedVerdict(sender, verdict, value)

    def record_own(self, sid: bytes, validator: str, accepted: bool) -> None:
        outcome = self._outcomes.setdefault(sid, _Outcome())
        (outcome.accepted_by if accepted else outcome.rejected_by).add(validator)

    def voters(self, sid: bytes) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(accepting, rejecting) validators of `sid`'s admitted verdicts (and own records)."""
        outcome = self._outcomes.get(sid)
        return (tuple(outcome.accepted_by), tuple(outcome.rejected_by)) if outcome is not None else ((), ())

    def outcome(self, sid: bytes) -> Outcome | None:
        """REJECTED if any admitted verdict failed it, ACCEPTED if some passed it, else None."""
        outcome = self._outcomes.get(sid)
        if outcome is None:
            return None
        if outcome.rejected_by:
            return Outcome.REJECTED
        return Outcome.ACCEPTED if outcome.accepted_by else None


def summarize(results: Iterable[tuple[int, bool, Sequence[str]]], *, prefix_rows: bool = True) -> tuple[bool, tuple[str, ...]]:
    """Fold per-rollout (row, accepted, reasons) into a submission's (accepted, reasons).

    Reasons are "row<i>:<code>" (or bare codes), deduplicated, at most MAX_REASONS.
    """
    reasons: dict[str, None] = {}
    accepted = True
    for row, ok, codes in results:
        if ok:
            continue
        accepted = False
        for code in codes or ("rejected",):
            reasons.setdefault((f"row{row}:{code}" if prefix_rows else code)[:MAX_REASON_CHARS], None)
    out = tuple(reasons)[:MAX_REASONS]
    return accepted, out if not accepted else ()
