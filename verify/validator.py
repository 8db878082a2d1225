"""The validator's pure core: admit submissions, draw tickets, claim, ask for checks, publish verdicts.

Theory of operation (one submission, as seen by one validator):

    Submission --admit--> seen --ticket--> not selected            (most, when rate < 1)
                                  \\--> claiming --window--> checking --check_done--> verdict published
                                                    \\--> standby --takeover_after_s, no verdict--> checking
                                                              \\--> a verdict arrives --> done

Admission drops, with a stable reason: a submission already seen (gossip duplicate or frame
replay, silently); a banned worker; a sender that is not a known worker (`unknown_worker`);
a reused nonce (`replay`); a second submission for the same step (`replay_step`, when
`one_submission_per_step`); a task seed other than the network's (`wrong_task_seed`).

The recomputation itself is not done here: the core emits `CheckRequested` and the shell runs
the checker (in a thread, `verify.daemon`; inline in virtual time, `InlineChecking`) and calls
`check_done` or `check_failed`. Remote claims and verdicts pass `verify.verdicts` admission;
admitted verdicts feed `verify.reputation`, whose events (`BatchInvalidated`, `WorkerBanned`)
are emitted. Misbehaviour that cannot be an honest race is reported as `Penalise(peer,
reason)` for the shell to charge to the peer table.

Our claims and verdicts are kept, by step, for a restarted trainer that asks (`Recall`, from a
peer in `trainers`): answered directly, signed again (`verify.recall`).

No clock, socket or global random here: time is `now`, the ticket is a deterministic
signature with this validator's key (see `verify.assign`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from p2pnet.config import validated
from p2pnet.core import Effect, Emit, Publish, SetTimer
from p2pnet.errors import MessageRejected
from p2pnet.identity import Identity, SignatureChecker
from p2pnet.wire import Envelope
from verify.assign import choose_rows, eligibility_threshold, make_ticket, ticket_value, check_remote_ticket
from verify.messages import (CLAIMS_TOPIC, SUBMISSIONS_TOPIC, VERDICTS_TOPIC, Claim, Recall, Submission, Verdict,
                             submission_id)
from verify.recall import VALIDATOR_KEPT, VALIDATOR_WORKERS, RecallAnswers
from verify.reputation import Reputation, ReputationConfig
from verify.verdicts import Directory, Membership, SubmissionInfo, VerdictLedger, summarize

TIMER_SWEEP = "verify/sweep"
_CLAIM, _TAKEOVER = "verify/claim/", "verify/takeover/"
MAX_CLAIMS = 65_536  # remote claims remembered (a claim may come before its submission; any validator can send them)
PENALISED = frozenset({"replay", "replay_step", "wrong_task_seed", "bad_ticket", "not_selected", "mismatch"})


@validated
@dataclass(frozen=True)
class ValidatorCoreConfig:
    sample_rate: float = 1.0
    claim_window_s: float = 0.5
    takeover_after_s: float = 120.0
    max_queue: int = 16
    rollouts_per_check: int = 0
    replay_window_s: float = 900.0
    sweep_interval_s: float = 30.0
    one_submission_per_step: bool = True
    task_seed: int | None = None
    max_new_tokens: int = 1024  # the longest output we recompute; a submission allowing more is refused
    workers: tuple[str, ...] = ()
    validators: tuple[str, ...] = ()
    ban_after_failures: int = 2
    ban_min_validators: int = 1
    ban_s: float = 0.0
    trainers: tuple[str, ...] = ()  # whose `Recall` we answer (`verify.recall`): the relay's trusted publishers

    def check(self) -> dict[str, str]:
        problems = {}
        if not 0.0 <= self.sample_rate <= 1.0:
            problems["sample_rate"] = "must lie in [0, 1]"
        for name in ("claim_window_s", "takeover_after_s"):
            if getattr(self, name) < 0:
                problems[name] = "must be >= 0"
        for name in ("replay_window_s", "sweep_interval_s"):
            if not getattr(self, name) > 0:
                problems[name] = "must be > 0"
        if self.max_queue < 1:
            problems["max_queue"] = "must be >= 1"
        if self.rollouts_per_check < 0:
            problems["rollouts_per_check"] = "must be >= 0 (0 checks every rollout)"
        if self.max_new_tokens < 1:
            problems["max_new_tokens"] = "must be >= 1"
        return problems

    def reputation(self) -> ReputationConfig:
        return ReputationConfig(self.ban_after_failures, self.ban_min_validators, self.ban_s)


# -- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubmissionRejected:
    worker: str
    reason: str


@dataclass(frozen=True)
class SubmissionSeen:
    submission_id: bytes
    worker: str
    selected: bool


@dataclass(frozen=True)
class CheckRequested:
    """The shell should recompute `rows` of `submission` and call check_done / check_failed."""

    submission_id: bytes
    worker: str
    submission: Submission
    ticket: bytes
    rows: tuple[int, ...]


class DroppedBecause(enum.StrEnum):
    """Why a selected submission goes unchecked by us (`CheckDropped`): our side, never the worker's."""

    QUEUE_FULL = "queue_full"  # `max_queue` checks already running or waiting
    MODEL_UNAVAILABLE = "model_unavailable"  # the shell could not load the version's model


@dataclass(frozen=True)
class CheckDropped:
    submission_id: bytes
    reason: DroppedBecause


@dataclass(frozen=True)
class VerdictPublished:
    verdict: Verdict
    check_s: float


@dataclass(frozen=True)
class VerdictAdmitted:
    validator: str
    verdict: Verdict


@dataclass(frozen=True)
class VerdictIgnored:
    sender: str
    kind: str  # "verdict" or "claim"
    reason: str


@dataclass(frozen=True)
class Penalise:
    """A peer sent something that cannot be an honest race; the shell charges the peer table.

    Emitted by the validator core and by the trainer's intake alike."""

    peer: str
    reason: str


class Stage(enum.StrEnum):
    """Where a selected submission is (the theory of operation above); a verdict, a dropped check
    or a submission another validator answered leaves `_pending` instead."""

    CLAIMING = "claiming"  # our claim is out; the claim window runs
    STANDBY = "standby"  # a lower ticket claimed it: we check only if no verdict comes in time
    CHECKING = "checking"  # the shell recomputes it (`check_done` / `check_failed` end it)


@dataclass
class _Pending:
    submission: Submission
    worker: str
    ticket: bytes
    value: int
    stage: Stage


# -- the core -----------------------------------------------------------------------------


class ValidatorCore:
    topics = (SUBMISSIONS_TOPIC, CLAIMS_TOPIC, VERDICTS_TOPIC)
    kinds = (Submission.KIND, Claim.KIND, Verdict.KIND, Recall.KIND)  # type: ignore[attr-defined]

    def __init__(self, config: ValidatorCoreConfig, identity: Identity, directory: Directory | None) -> None:
        self.config = config
        self.identity = identity
        self.membership = Membership(identity.peer_id, directory, frozenset(config.validators),
                                     frozenset(config.workers))
        self.ledger = VerdictLedger(self.membership, rate=config.sample_rate)
        self.reputation = Reputation(config.reputation())
        self._signatures = SignatureChecker()
        self._nonces: dict[tuple[str, bytes], float] = {}
        self._steps: dict[tuple[str, int], float] = {}
        self._refused: dict[bytes, float] = {}  # ids of refused submissions: a repeat is dropped silently
        self._pending: dict[bytes, _Pending] = {}
        self._claims: dict[bytes, tuple[int, str, float]] = {}  # lowest remote claim: value, peer, when
        self._checking = 0
        self.recall = RecallAnswers(config.trainers, per_worker=VALIDATOR_KEPT,  # our claims and verdicts
                                    workers=VALIDATOR_WORKERS)
        self.stats: dict[str, Any] = {
            "seen": 0, "selected": 0, "checked": 0, "accepted": 0, "rejected": 0, "dropped": 0,
            "check_errors": 0, "standby": 0, "takeovers": 0, "verdicts_admitted": 0,
            "check_s_total": 0.0, "check_s_last": 0.0,
            "submissions_rejected": {}, "verdicts_ignored": {},
        }

    # -- core contract ---------------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        return [SetTimer(now + self.config.sweep_interval_s, TIMER_SWEEP)]

    def on_message(self, now: float, envelope: Envelope[Any]) -> list[Effect]:
        if envelope.sender == self.identity.peer_id:
            return []
        body = envelope.body
        if isinstance(body, Submission):
            return self._on_submission(now, envelope)
        if isinstance(body, Claim):
            return self._on_claim(now, envelope)
        if isinstance(body, Verdict):
            return self._on_verdict(now, envelope)
        if isinstance(body, Recall):
            return self.recall.answer(now, envelope)
        return []

    def on_timer(self, now: float, key: str) -> list[Effect]:
        if key == TIMER_SWEEP:
            self._sweep(now)
            return [SetTimer(now + self.config.sweep_interval_s, TIMER_SWEEP)]
        if key.startswith(_CLAIM):
            return self._claim_window_over(now, bytes.fromhex(key[len(_CLAIM):]))
        if key.startswith(_TAKEOVER):
            return self._takeover(now, bytes.fromhex(key[len(_TAKEOVER):]))
        return []

    def on_rejected(self, now: float, peer: str, reason: str) -> list[Effect]:
        return []  # the peer table charges undecodable frames; nothing of ours to undo

    # -- results from the shell --------------------------------------------------------------

    def check_done(self, now: float, sid: bytes, accepted: bool, reasons: Sequence[str],
                   checked_rollouts: int, check_s: float) -> list[Effect]:
        pending = self._pending.pop(sid, None)
        if pending is None or pending.stage is not Stage.CHECKING:
            return []
        self._checking -= 1
        ok, codes = summarize([(0, accepted, tuple(reasons))], prefix_rows=False)
        sub = pending.submission
        verdict = Verdict(sid, pending.worker, sub.model_version, sub.step, ok, codes,
                          max(1, checked_rollouts), pending.ticket)
        self.stats["checked"] += 1
        self.stats["accepted" if ok else "rejected"] += 1
        self.stats["check_s_total"] += check_s
        self.stats["check_s_last"] = check_s
        self.ledger.record_own(sid, self.identity.peer_id, ok)
        self.recall.sent(pending.worker, sub.step, verdict)
        effects: list[Effect] = [Publish(VERDICTS_TOPIC, verdict), Emit(VerdictPublished(verdict, check_s))]
        for event in self.reputation.record(now, pending.worker, sid, self.identity.peer_id, ok, codes):
            effects.append(Emit(event))
        return effects

    def check_failed(self, now: float, sid: bytes, why: DroppedBecause) -> list[Effect]:
        """Our own side could not check (model missing, our bug): no verdict is published."""
        pending = self._pending.pop(sid, None)
        if pending is None or pending.stage is not Stage.CHECKING:
            return []
        self._checking -= 1
        self.stats["check_errors"] += 1
        return [Emit(CheckDropped(sid, why))]

    # -- submissions ------------------------------------------------------------------------

    def _on_submission(self, now: float, env: Envelope[Any]) -> list[Effect]:
        sub: Submission = env.body
        worker = env.sender
        sid = submission_id(env)
        if self.ledger.submission(sid) is not None or sid in self._refused:
            return []  # the same signed submission again: a gossip duplicate or a frame replay
        reason = self._refusal(now, worker, sub)
        if reason is not None:
            self._refused[sid] = now
            return self._reject_submission(worker, reason)
        self._nonces[(worker, sub.nonce)] = now
        self._steps[(worker, sub.step)] = now
        self.ledger.note_submission(sid, SubmissionInfo(worker, sub.step, sub.model_version, now))
        self.stats["seen"] += 1
        ticket = make_ticket(self.identity, sid)
        value = ticket_value(ticket)
        n = self.membership.live_validators()
        if value >= eligibility_threshold(self.config.sample_rate, n):
            return [Emit(SubmissionSeen(sid, worker, selected=False))]
        self.stats["selected"] += 1
        self._pending[sid] = _Pending(sub, worker, ticket, value, Stage.CLAIMING)
        claim = Claim(sid, ticket)
        self.recall.sent(worker, sub.step, claim)
        effects: list[Effect] = [Emit(SubmissionSeen(sid, worker, selected=True)), Publish(CLAIMS_TOPIC, claim)]
        if n <= 1 or self.config.claim_window_s == 0:
            return effects + self._start_check(sid)
        return effects + [SetTimer(now + self.config.claim_window_s, _CLAIM + sid.hex())]

    def _refusal(self, now: float, worker: str, sub: Submission) -> str | None:
        if self.reputation.is_banned(worker, now):
            return "banned"
        if not self.membership.is_worker(worker):
            return "unknown_worker"
        if (worker, sub.nonce) in self._nonces:
            return "replay"
        if self.config.one_submission_per_step and (worker, sub.step) in self._steps:
            return "replay_step"
        if self.config.task_seed is not None and sub.task_seed != self.config.task_seed:
            return "wrong_task_seed"
        # what a check recomputes is bounded before it is queued: a 2 MiB submission of one
        # 250,000-token output passed every other check, and its forward pass stopped the peer
        if sub.max_new_tokens > self.config.max_new_tokens:  # (its outputs are within it: `Submission`)
            return "too_long"
        return None

    def _reject_submission(self, worker: str, reason: str) -> list[Effect]:
        counts = self.stats["submissions_rejected"]
        counts[reason] = counts.get(reason, 0) + 1
        effects: list[Effect] = [Emit(SubmissionRejected(worker, reason))]
        if reason in PENALISED:
            effects.append(Emit(Penalise(worker, reason)))
        return effects

    def _claim_window_over(self, now: float, sid: bytes) -> list[Effect]:
        pending = self._pending.get(sid)
        if pending is None or pending.stage is not Stage.CLAIMING:
            return []
        if self.ledger.outcome(sid) is not None:
            del self._pending[sid]
            return []
        best = self._claims.get(sid)
        if best is not None and (best[0], best[1]) < (pending.value, self.identity.peer_id):
            pending.stage = Stage.STANDBY
            self.stats["standby"] += 1
            return [SetTimer(now + self.config.takeover_after_s, _TAKEOVER + sid.hex())]
        return self._start_check(sid)

    def _takeover(self, now: float, sid: bytes) -> list[Effect]:
        pending = self._pending.get(sid)
        if pending is None or pending.stage is not Stage.STANDBY:
            return []
        if self.ledger.outcome(sid) is not None:
            del self._pending[sid]
            return []
        self.stats["takeovers"] += 1
        return self._start_check(sid)

    def _start_check(self, sid: bytes) -> list[Effect]:
        pending = self._pending[sid]
        if self._checking >= self.config.max_queue:
            del self._pending[sid]
            self.stats["dropped"] += 1
            return [Emit(CheckDropped(sid, DroppedBecause.QUEUE_FULL))]
        pending.stage = Stage.CHECKING
        self._checking += 1
        rows = choose_rows(pending.ticket, len(pending.submission.rollouts), self.config.rollouts_per_check)
        return [Emit(CheckRequested(sid, pending.worker, pending.submission, pending.ticket, rows))]

    # -- claims and verdicts of other validators -----------------------------------------------

    def _on_claim(self, now: float, env: Envelope[Any]) -> list[Effect]:
        claim: Claim = env.body
        if not self.membership.is_validator(env.sender):
            return self._ignore(env.sender, "claim", "not_validator")
        try:
            value = check_remote_ticket(self._signatures, env.sender_bytes, claim.submission_id, claim.ticket,
                                        self.config.sample_rate, self.membership.live_validators())
        except MessageRejected as exc:
            return self._ignore(env.sender, "claim", exc.reason)
        best = self._claims.get(claim.submission_id)
        if best is None or (value, env.sender) < (best[0], best[1]):
            if best is None and len(self._claims) >= MAX_CLAIMS:  # claims for ids we may never see: the oldest go
                del self._claims[next(iter(self._claims))]
            self._claims[claim.submission_id] = (value, env.sender, now)
        return []

    def _on_verdict(self, now: float, env: Envelope[Any]) -> list[Effect]:
        verdict: Verdict = env.body
        try:
            admitted = self.ledger.admit(env.sender, env.sender_bytes, verdict)
        except MessageRejected as exc:
            return self._ignore(env.sender, "verdict", exc.reason)
        self.stats["verdicts_admitted"] += 1
        sid = verdict.submission_id
        pending = self._pending.get(sid)
        if pending is not None and pending.stage is Stage.STANDBY:
            del self._pending[sid]
        effects: list[Effect] = [Emit(VerdictAdmitted(admitted.validator, verdict))]
        for event in self.reputation.record(now, verdict.worker, sid, env.sender, verdict.accepted, verdict.reasons):
            effects.append(Emit(event))
        return effects

    def _ignore(self, sender: str, kind: str, reason: str) -> list[Effect]:
        counts = self.stats["verdicts_ignored"]
        counts[f"{kind}:{reason}"] = counts.get(f"{kind}:{reason}", 0) + 1
        effects: list[Effect] = [Emit(VerdictIgnored(sender, kind, reason))]
        if reason in PENALISED:
            effects.append(Emit(Penalise(sender, reason)))
        return effects

    # -- housekeeping ----------------------------------------------------------------------

    def _sweep(self, now: float) -> None:
        horizon = now - self.config.replay_window_s
        tables: tuple[dict[Any, float], ...] = (self._nonces, self._steps, self._refused)
        for table in tables:
            for key in [k for k, at in table.items() if at < horizon]:
                del table[key]
        for sid in [s for s, c in self._claims.items() if c[2] < horizon]:
            del self._claims[sid]
        self.ledger.forget_before(horizon)

    def status(self, now: float) -> dict[str, Any]:
        stats = dict(self.stats)
        stats["submissions_rejected"] = dict(stats["submissions_rejected"])
        stats["verdicts_ignored"] = dict(stats["verdicts_ignored"])
        checked = stats["checked"]
        stats["check_s_mean"] = round(stats["check_s_total"] / checked, 4) if checked else 0.0
        stats["in_flight"] = self._checking
        stats["live_validators"] = self.membership.live_validators()
        stats["reputation"] = self.reputation.to_json(now)
        return stats


# -- running checks inline, for the simulator -------------------------------------------------

Checker = Callable[[CheckRequested], tuple[bool, Sequence[str]]]


class InlineChecking:
    """A core wrapping a ValidatorCore that runs each requested check itself, `check_s` later.

    For simulations and tests in virtual time; the real peer runs checks in a thread instead
    (verify.daemon). Behaves as the wrapped core in every other respect.
    """

    _KEY = "verify/inline/"

    def __init__(self, core: ValidatorCore, checker: Checker, check_s: float = 1.0) -> None:
        self.core = core
        self.checker = checker
        self.check_s = check_s
        self.topics = core.topics
        self.kinds = core.kinds
        self._requests: dict[str, CheckRequested] = {}

    def start(self, now: float) -> list[Effect]:
        return self._wrap(now, self.core.start(now))

    def on_message(self, now: float, envelope: Envelope[Any]) -> list[Effect]:
        return self._wrap(now, self.core.on_message(now, envelope))

    def on_rejected(self, now: float, peer: str, reason: str) -> list[Effect]:
        return self._wrap(now, self.core.on_rejected(now, peer, reason))

    def on_timer(self, now: float, key: str) -> list[Effect]:
        if not key.startswith(self._KEY):
            return self._wrap(now, self.core.on_timer(now, key))
        request = self._requests.pop(key, None)
        if request is None:
            return []
        accepted, reasons = self.checker(request)
        return self._wrap(now, self.core.check_done(now, request.submission_id, accepted, reasons,
                                                    len(request.rows), self.check_s))

    def _wrap(self, now: float, effects: list[Effect]) -> list[Effect]:
        out: list[Effect] = []
        for effect in effects:
            if isinstance(effect, Emit) and isinstance(effect.event, CheckRequested):
                key = self._KEY + effect.event.submission_id.hex()
                self._requests[key] = effect.event
                out.append(SetTimer(now + self.check_s, key))
            out.append(effect)
        return out
