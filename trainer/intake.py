"""The trainer's intake: which submitted batches may be trained on, and the ledger of who sent what.

A pure core (p2pnet.core contract). It listens to worker submissions, validator claims and
verdicts, and relay `Holding` announcements, and decides nothing by itself about proofs: a
batch is admitted only when an admitted validator verdict accepted it (`verify.verdicts` rules:
known validator, genuine eligible ticket, no duplicates), its worker is not banned, and no
verdict rejected it. With a sample rate below 1, a batch that no validator claimed within
`unchecked_after_s` was not drawn for checking and is admitted unchecked, as the assignment
rules intend. Failed verdicts feed `verify.reputation`: one invalidates that batch, repeated
ones ban the worker, and a banned worker's batches are never admitted again.

Theory: "unclaimed" means "not drawn" only for a submission the validators admitted. They
refuse some at admission without drawing or claiming anything (`verify.validator`, `_refusal`):
a reused (worker, nonce) (`replay`), a worker's second submission for a step (`replay_step`),
a banned or unknown worker, a wrong task seed. Refused, such a copy stays unclaimed for ever,
and admitting it unchecked would let a worker re-send a batch that was checked and rejected
(same body, new timestamp, so a new id), or publish two copies of one step so that the
validators draw on the one they heard first while the trainer admits the other unchecked.
So the intake links a worker's batches that share a step or a nonce: siblings. Honest workers
send one submission per step with a fresh nonce, so their batches have none and nothing
changes for them. A batch with a sibling, heard before or after it, is never admitted
unchecked: only with an accepted verdict of its own (and a rejected verdict on it, as on any
batch, keeps it out). Such a batch is counted once under `dropped["sibling"]` when it would
otherwise have been admitted unchecked. The intake drops unknown and banned workers itself,
steps before its window (`stale_step`) and steps no honest worker can be at yet, more than
`async_level` + 1 past the newest version published (`future_step`: kept, they would never be
forgotten), and the learner refuses a wrong task seed and trains one batch per (worker, step)
(`trainer.learner.admission_reason`). Steps are indexed as long as their batches are kept
(`forget_before_step`); nonces for `replay_window_s` after their last copy, twice the
validators' default memory of them (which lasts up to a sweep interval past their window, from
the copy they admitted: not always the first heard, as one refused for its step records no
nonce), so a nonce reused after its batch was forgotten is still a sibling while they may
refuse it.

Validators also drop, unclaimed, a submission whose timestamp is older than the codec's
`max_age_s` (300 s) or more than its `max_future_s` (30 s) ahead of their clocks, which a worker
can aim at (a timestamp near an edge, or just past it for validators whose clocks run ahead of
the trainer's). So a batch that reached the trainer more than `unchecked_max_skew_s` (20 s) from
its signed timestamp, either way, is not admitted unchecked either (`dropped["skewed"]`, and a
`BatchesSkewed` event at most once a minute for the role to log): an honest worker's reaches it
within a gossip delay and its clock's error. Validators configured with tighter margins than
the codec's defaults (`peer.max_message_age_s`, `peer.max_future_s`) reopen that edge.

What remains: a submission the validators refuse or drop while the trainer admits it, without
a sibling here, still passes unchecked: one they cannot decode or refuse by a rule the trainer
does not have (an upgrade where the trainer is newer than the validators), one they judge stale
or from the future though it reached the trainer within `unchecked_max_skew_s` (clocks apart by
more than the rest of the codec's margins: 280 s behind, 10 s ahead), one whose sibling they heard and the trainer did not, or a nonce reused after the
intake forgot it while the validators still refuse it (their `replay_window_s` set longer).
Upgrade validators before the trainer, or run `sample_rate = 1` meanwhile (docs/validators.md).
The same holds wherever the validators' view of a worker is stricter than the intake's: a
worker outside a `validator.workers` list (the trainer has none), and one banned by validators
whose `ban_after_failures` is lower than the trainer's.

Restarts. Validators keep their bans and nonces across a trainer restart, so a fresh intake
would admit unchecked, for good, every worker they banned (refused `banned`, never claimed) and
any copy of a batch heard before it. `snapshot` and `restore` carry what prevents that: the
reputation, `forgotten_before`, the (worker, step) keys and the nonces still in their window,
times as wall-clock seconds. Workers send one batch per step and wait for the next version, so
the batches themselves are carried too, or a restarted trainer would wait for its step's
batches while every worker waits for its next version: each kept batch's payload (written
once, beside the state file) with the verdicts heard on it and its marks (`trainer.intake_kept`;
`spooled` drops the envelope kept until then). A batch whose payload is missing or damaged
comes back as a key only: a copy that shares it is a sibling all the same, and the ledger still
knows its id, so a verdict on it heard after the restart counts toward its worker's
reputation. An unclaimed, undecided batch waits `unchecked_after_s` from the restart (a claim
made while we were down comes back by recall first), and the newest version published is
carried, so the future-step bound holds from the start. `resume_at` takes back training marks
of versions the restarted learner lacks, and makes those its checkpoint lists but we lost.
The snapshot also carries the leaderboard's rows (`Contributions.snapshot`: counts, reasons,
ban marks, compute totals; not its verdict log). The trainer role keeps the snapshot on disk
(`trainer.intake_state`); `revision` tells it when the snapshot changed, `heard_once` when it
changed by something nobody sends again (a batch, a claim, a verdict), to be saved soon.
Messages published while the trainer was down are never heard: a batch submitted then is not
trained on, and a failure among the verdicts counts for the validators and not here, so a worker
they ban on it is refused unclaimed while this intake has not banned it.

Rewards, advantages and training are not here (`trainer.learner`); neither are sockets.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from p2pnet.config import validated
from p2pnet.core import Effect, Emit, ReactiveCore
from p2pnet.errors import MessageRejected
from p2pnet.identity import SignatureChecker
from p2pnet.wire import Envelope
from relay.messages import HOLDING_TOPIC, Holding
from trainer.intake_restart import IntakeMemory, Restarts
from trainer.intake_recall import EarlyVerdicts, recalled_submission
from trainer.leaderboard import Contributions
from verify.messages import (CLAIMS_TOPIC, SUBMISSIONS_TOPIC, VERDICTS_TOPIC, Claim, Recalled, Submission, Verdict,
                             submission_id)
from verify.assign import check_remote_ticket
from verify.reputation import Reputation, ReputationConfig, WorkerBanned
from verify.validator import Penalise, ValidatorCoreConfig
from verify.verdicts import Directory, Membership, Outcome, SubmissionInfo, VerdictLedger

SKEW_WARN_INTERVAL_S = 60.0  # `BatchesSkewed` at most this often, counting the workers skewed this long
# copies of one (worker, step) kept: an honest worker sends one; each copy is up to 2 MiB, and a
# worker sending thousands held them all until the step's window closed
MAX_COPIES_PER_STEP = 2


@dataclass(frozen=True)
class BatchesSkewed:
    """Submissions reached us further than `unchecked_max_skew_s` from their signed timestamps,
    so they pass only with verdicts of their own: from `workers` workers within the last
    `SKEW_WARN_INTERVAL_S`, `median_age_s` off (positive: behind our clock). Many workers that
    agree point at our clock. Emitted at most once per `SKEW_WARN_INTERVAL_S`."""
    workers: int
    median_age_s: float


@validated
@dataclass(frozen=True)
class IntakeConfig:
    sample_rate: float = 1.0
    async_level: int = 2
    unchecked_after_s: float = 30.0
    # nonces are remembered this long: longer than validators do (their window, then up to a sweep
    # interval until it is swept, counted from when they heard it: perhaps later than the trainer)
    replay_window_s: float = 2 * ValidatorCoreConfig.replay_window_s
    # admitted unchecked only if it reached us within this many seconds of its signed timestamp, either
    # way: validators drop a message more than the codec's max_future_s (30 s) ahead of their clocks or
    # older than its max_age_s (300 s) without a claim, so one near those edges may have been refused
    unchecked_max_skew_s: float = 20.0
    ban_after_failures: int = 2
    ban_min_validators: int = 1
    ban_s: float = 0.0  # 0 or less: forever
    workers: tuple[str, ...] = ()
    validators: tuple[str, ...] = ()

    def check(self) -> dict[str, str]:
        problems = {}
        if not 0.0 < self.sample_rate <= 1.0:
            problems["sample_rate"] = "must be in (0, 1]"
        if self.async_level < 0:
            problems["async_level"] = "must be >= 0"
        if not self.unchecked_after_s > 0:
            problems["unchecked_after_s"] = "must be > 0"
        if not self.replay_window_s > 0:
            problems["replay_window_s"] = "must be > 0"
        if not self.unchecked_max_skew_s > 0:
            problems["unchecked_max_skew_s"] = "must be > 0"
        return problems


@dataclass
class Batch:
    sid: bytes
    worker: str
    submission: Submission
    seen_at: float
    claimed: bool = False
    trained: bool = False
    sibling: bool = False  # another batch of its worker has its step or nonce: never admitted unchecked
    skewed: bool = False  # reached us further than unchecked_max_skew_s from its timestamp: never unchecked
    withheld: bool = False  # counted under dropped["sibling"] or dropped["skewed"] (once)
    refused: bool = False  # the learner refused it (`mark_refused`): never offered again
    trained_into: int | None = None  # the version it was trained into (`mark_trained`)
    # as received, until the state file's folder holds its payload (`Intake.spooled`): then None
    envelope: Envelope[Any] | None = None


@dataclass
class WorkerLedger:
    submitted: int = 0
    accepted: int = 0  # batches accepted now (a later rejecting verdict takes one back)
    rejected: int = 0
    trained_batches: int = 0
    accepted_ever: int = 0  # batches that were accepted at some point (only grows: a metric's counter)
    banned: bool = False
    outcomes: dict[bytes, Outcome] = field(default_factory=dict)


class Intake(ReactiveCore, Restarts):
    topics = (SUBMISSIONS_TOPIC, CLAIMS_TOPIC, VERDICTS_TOPIC, HOLDING_TOPIC)
    kinds = (Submission.KIND, Claim.KIND, Verdict.KIND, Holding.KIND, Recalled.KIND)  # type: ignore[attr-defined]

    def __init__(self, config: IntakeConfig, self_id: str, directory: Directory | None) -> None:
        self.config = config
        membership = Membership(self_id, directory, validators=frozenset(config.validators),
                                workers=frozenset(config.workers), self_is_validator=False)
        self.membership = membership
        self.ledger = VerdictLedger(membership, rate=config.sample_rate)
        self._signatures = SignatureChecker()  # claims' tickets
        self.reputation = Reputation(ReputationConfig(ban_after_failures=config.ban_after_failures,
                                                      ban_min_validators=config.ban_min_validators,
                                                      ban_s=config.ban_s))
        self.batches: dict[bytes, Batch] = {}
        self.workers: dict[str, WorkerLedger] = {}
        self.holders: dict[int, dict[str, float]] = {}  # version -> peer -> first heard holding it
        self.dropped: dict[str, int] = {}
        self.forgotten_before = 0  # batches of earlier steps are forgotten (`forget_before_step`)
        # the newest version the trainer published (`published`): a worker runs at most async_level
        # steps ahead of the newest it holds, so a later step is refused (None: nothing published yet)
        self.latest_published: int | None = None
        self.by_step: dict[tuple[str, int], list[bytes]] = {}  # (worker, step) -> its batches' ids
        # (worker, nonce) -> (last heard, its batches' ids), oldest first; kept replay_window_s
        self.by_nonce: OrderedDict[tuple[str, bytes], tuple[float, list[bytes]]] = OrderedDict()
        self.contributions = Contributions()  # the leaderboard: admitted facts only (trainer.leaderboard)
        self.revision = 0  # counts changes to what `snapshot` returns (a caller saves when it moved)
        # counts the changes nobody sends again (a batch kept, a claim or verdict admitted): a
        # restarted trainer has them only from its state file, so a caller saves these soon
        self.heard_once = 0
        self.early = EarlyVerdicts()  # claims and verdicts that came before their submission
        self.recalled = 0  # batches first heard from a worker's answer to our recall (`verify.recall`)
        self.asked: set[str] = set()  # peers whose `Recalled` answers we take now (`asking`)
        self._skews: dict[str, tuple[float, float]] = {}  # worker -> (when, age) of its last skewed batch
        self._skew_warned_at = -math.inf

    # -- core inputs ----------------------------------------------------------------------

    def on_message(self, now: float, envelope: Envelope[Any]) -> list[Effect]:
        body = envelope.body
        if isinstance(body, Submission):
            return self._on_submission(now, envelope)
        if isinstance(body, Recalled):  # a worker's answer to our recall (`trainer.intake_recall`)
            if envelope.sender not in self.asked:
                return self._drop("recall_unasked")  # frames of any age only from whom we asked, while we ask
            inner = recalled_submission(envelope)
            if inner is None:
                return self._drop("recall_bad")
            kept = len(self.batches)
            effects = self._on_submission(now, inner, recalled=True)
            self.recalled += len(self.batches) - kept
            return effects
        if isinstance(body, Claim):
            batch = self.batches.get(body.submission_id)
            if batch is not None and self.membership.is_validator(envelope.sender):
                try:  # a claim holds the batch back from unchecked admission: only a drawn validator's
                    check_remote_ticket(self._signatures, envelope.sender_bytes, body.submission_id, body.ticket,
                                        self.config.sample_rate, self.membership.live_validators())
                except MessageRejected as exc:
                    return self._drop(f"claim_{exc.reason}")
                if not batch.claimed:
                    batch.claimed = True
                    self.revision += 1
                    self.heard_once += 1
            return []
        if isinstance(body, Verdict):
            return self._on_verdict(now, envelope)
        if isinstance(body, Holding) and self.membership.is_worker(envelope.sender):
            # only workers' holding times matter (a verdict's version lag), and only for versions
            # we published: a made-up future version would stay until training reached it
            newest = self.latest_published
            for held in body.versions:
                if newest is not None and held.version <= newest:
                    self.holders.setdefault(held.version, {}).setdefault(envelope.sender, now)
        return []

    def _drop(self, reason: str) -> list[Effect]:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return []

    def _on_submission(self, now: float, envelope: Envelope[Any], *, recalled: bool = False) -> list[Effect]:
        worker, sub = envelope.sender, envelope.body
        sid = submission_id(envelope)
        if sid in self.batches:
            return []  # a gossip duplicate
        if sub.step < self.forgotten_before:
            return self._drop("stale_step")  # its window closed: too late to train on, or a late echo
        if self._too_far(sub.step):
            return self._drop("future_step")  # no honest worker is this far ahead; kept, it would never be forgotten
        if not self.membership.is_worker(worker):
            return self._drop("unknown_worker")
        if self.reputation.is_banned(worker, now):
            return self._drop("banned_worker")
        if len(self.by_step.get((worker, sub.step), ())) >= MAX_COPIES_PER_STEP:
            return self._drop("copies_per_step")  # two already make every copy a sibling: a third adds nothing
        ledger = self.workers.setdefault(worker, WorkerLedger())
        ledger.submitted += 1
        self.contributions.submitted(worker)
        age = envelope.age_s  # None: built in-process (the simulator), never skewed
        skewed = recalled or (age is not None and abs(age) > self.config.unchecked_max_skew_s)
        self.batches[sid] = batch = Batch(sid, worker, sub, now, skewed=skewed, envelope=envelope)
        self.heard_once += 1
        self._link(now, batch)
        self.ledger.note_submission(sid, SubmissionInfo(worker, sub.step, sub.model_version, now))
        effects = self._skewed(now, worker, age) if age is not None and skewed and not recalled else []
        for early in self.early.take(now, sid):  # claims and verdicts that came first
            effects += self.on_message(now, early)
        return effects

    def _skewed(self, now: float, worker: str, age_s: float) -> list[Effect]:
        """Say, now and then, that batches are withheld for their timestamps: a clock off by more
        than `unchecked_max_skew_s` (theirs, or ours when many agree) makes the trainer wait
        for verdicts that only a sample of batches gets."""
        self._skews[worker] = (now, age_s)
        for other in [w for w, (when, _) in self._skews.items() if when < now - SKEW_WARN_INTERVAL_S]:
            del self._skews[other]
        if now - self._skew_warned_at < SKEW_WARN_INTERVAL_S:
            return []
        self._skew_warned_at = now
        ages = sorted(age for _, age in self._skews.values())
        return [Emit(BatchesSkewed(len(ages), ages[len(ages) // 2]))]

    def _link(self, now: float, batch: Batch) -> None:
        """Index `batch` by (worker, step) and (worker, nonce); it and every batch it shares a key
        with (kept, or a nonce still remembered) are siblings."""
        horizon = now - self.config.replay_window_s
        while self.by_nonce and next(iter(self.by_nonce.values()))[0] < horizon:
            self.by_nonce.popitem(last=False)
        step_key = (batch.worker, batch.submission.step)
        step_known = step_key in self.by_step  # restored keys have no batches: heard before a restart
        same_step = self.by_step.setdefault(step_key, [])
        nonce_key = (batch.worker, batch.submission.nonce)
        known = self.by_nonce.pop(nonce_key, None)  # put back last: kept replay_window_s after its last copy
        same_nonce = known[1] if known is not None else []
        self.revision += 1
        if step_known or known is not None:
            batch.sibling = True
            for group in (same_step, same_nonce):
                if len(group) == 1:  # its one member becomes a sibling now; a larger group's already are
                    elder = self.batches.get(group[0])
                    if elder is not None:
                        elder.sibling = True
        same_step.append(batch.sid)
        same_nonce.append(batch.sid)
        self.by_nonce[nonce_key] = (now, same_nonce)  # validators keep it from the copy they admitted

    def _on_verdict(self, now: float, envelope: Envelope[Any]) -> list[Effect]:
        verdict = envelope.body
        try:
            self.ledger.admit(envelope.sender, envelope.sender_bytes, verdict)
        except MessageRejected as exc:
            if exc.reason == "unknown_submission" and self.membership.is_validator(envelope.sender):
                self.early.park(now, verdict.submission_id, envelope)  # its submission may come yet
                return []
            if exc.reason in ("unknown_submission", "duplicate"):
                return self._drop(exc.reason)  # races and gossip echoes, not malice
            return [Emit(Penalise(envelope.sender, exc.reason))]
        self.heard_once += 1
        batch = self.batches.get(verdict.submission_id)
        if batch is None:  # forgotten, its window closed: what it earned stays, a failure still counts
            return self._reputation(now, verdict.worker, verdict.submission_id, envelope.sender, verdict)
        ledger = self.workers.setdefault(batch.worker, WorkerLedger())
        outcome = self.ledger.outcome(batch.sid) or Outcome.PENDING
        previous = ledger.outcomes.get(batch.sid)
        if previous != outcome:
            if previous is Outcome.ACCEPTED:
                ledger.accepted -= 1
            if outcome is Outcome.ACCEPTED:
                ledger.accepted += 1
                ledger.accepted_ever += 1
            elif outcome is Outcome.REJECTED:
                ledger.rejected += 1
            ledger.outcomes[batch.sid] = outcome
        self.contributions.verdict(now, envelope.sender, verdict, batch, previous, outcome,
                                   self.holders.get(batch.submission.model_version, {}).get(batch.worker))
        return self._reputation(now, batch.worker, batch.sid, envelope.sender, verdict)

    def _reputation(self, now: float, worker: str, sid: bytes, validator: str, verdict: Verdict) -> list[Effect]:
        effects: list[Effect] = []
        self.revision += 1
        for event in self.reputation.record(now, worker, sid, validator, verdict.accepted, verdict.reasons):
            if isinstance(event, WorkerBanned):
                self.workers.setdefault(worker, WorkerLedger()).banned = True
                self.contributions.banned(worker)
            effects.append(Emit(event))
        return effects

    # -- what the trainer asks ---------------------------------------------------------------

    def admissible(self, now: float, version: int) -> list[Batch]:
        """Untrained batches for steps version-async_level..version that may be trained on now."""
        out = []
        for batch in self.batches.values():
            sub = batch.submission
            if batch.trained or batch.refused or not 0 <= version - sub.step <= self.config.async_level:
                continue
            if self.reputation.is_banned(batch.worker, now):
                continue
            outcome = self.ledger.outcome(batch.sid)
            if outcome is Outcome.ACCEPTED:
                out.append(batch)
            elif (outcome is None and self.config.sample_rate < 1.0 and not batch.claimed
                  and now - batch.seen_at >= self.config.unchecked_after_s):
                if not (batch.sibling or batch.skewed):
                    out.append(batch)  # not drawn: admitted unchecked
                elif not batch.withheld:  # unclaimed because refused, perhaps: only its own verdict admits it
                    batch.withheld = True
                    self._drop("sibling" if batch.sibling else "skewed")
        return sorted(out, key=lambda b: (b.submission.step, b.worker))

    def published(self, version: int, at: float) -> None:
        """The trainer published `version` at `at` (its trio time): the leaderboard's compute time
        counts from it (`Contributions.published`)."""
        self.contributions.published(version, at)
        self.latest_published = max(version, self.latest_published if self.latest_published is not None else version)
        self.revision += 1

    def mark_refused(self, batches: list[Batch]) -> None:
        """The learner refused these (`trainer.learner.admission_reason`: settings, version or
        prompts other than the trainer's, which validators do not know): not trained on, not
        credited as trained, and not offered again (`dropped["learner_refused"]`). Handed back,
        one alone made the trainer loop at once on a batch it would never take."""
        for batch in batches:
            if not batch.refused:
                batch.refused = True
                self._drop("learner_refused")
        self.revision += bool(batches)

    def mark_trained(self, batches: list[Batch], version: int | None = None) -> None:
        """The learner trained these into `version` (`resume_at` takes the mark back if a restart
        finds the learner without that version)."""
        self.revision += bool(batches)  # the leaderboard's trained counts
        self.heard_once += bool(batches)  # soon on disk: a restart must not offer them to the learner again
        for batch in batches:
            batch.trained = True
            batch.trained_into = version
            self.workers.setdefault(batch.worker, WorkerLedger()).trained_batches += 1
            self.contributions.trained(batch)

    def forget_before_step(self, step: int) -> None:
        """Forget the batches of steps before `step`, which the async window has closed: none can be
        trained on again, and keeping them would grow memory and every `admissible` scan without
        end. The leaderboard keeps what they earned; a late copy of one is dropped as stale."""
        self.forgotten_before = max(self.forgotten_before, step)
        self.revision += 1
        forgotten = [sid for sid, b in self.batches.items() if b.submission.step < step]
        for sid in forgotten:
            batch = self.batches.pop(sid)
            ledger = self.workers.get(batch.worker)
            if ledger is not None:
                ledger.outcomes.pop(sid, None)
        for key in [k for k in self.by_step if k[1] < step]:
            del self.by_step[key]  # a late copy for these steps is dropped as stale; nonces stay (`_link`)
        # holding times matter for verdicts on batches the learner may still take: a kept batch's
        # step is >= `step`, so a version below step - async_level is one it refuses (stale). Not
        # the oldest version a kept batch claims: a worker claiming version 0 would keep them all
        floor = step - self.config.async_level
        for version in [v for v in self.holders if v < floor]:
            del self.holders[version]
        self.contributions.forget(forgotten, floor)

    def asking(self, peer: str) -> None:
        """We sent `peer` a `Recall`: its `Recalled` answers are taken until `asking_done`."""
        self.asked.add(peer)

    def asking_done(self) -> None:
        self.asked.clear()

    def step_counts(self, step: int) -> tuple[int, int]:
        """(accepted, rejected) batches submitted for `step` so far."""
        accepted = rejected = 0
        for ledger in self.workers.values():
            for sid, outcome in ledger.outcomes.items():
                batch = self.batches.get(sid)
                if batch is not None and batch.submission.step == step:
                    accepted += outcome is Outcome.ACCEPTED
                    rejected += outcome is Outcome.REJECTED
        return accepted, rejected

    def live_workers(self, now: float) -> list[str]:
        directory = [e.peer_id for e in self.membership.directory.with_role("worker")] \
            if self.membership.directory is not None else list(self.config.workers)
        return [w for w in directory if not self.reputation.is_banned(w, now)]

    def undecided_workers(self, now: float, version: int) -> list[str]:
        """Live workers with no decided (accepted or rejected) untrained batch in the step window."""
        decided = set()
        for batch in self.batches.values():
            step = batch.submission.step
            if batch.trained or not 0 <= version - step <= self.config.async_level:
                continue
            if self.ledger.outcome(batch.sid) is not None:
                decided.add(batch.worker)
        return [w for w in self.live_workers(now) if w not in decided]

    def workers_json(self) -> list[dict[str, Any]]:
        return [{"peer_id": w, "submitted": l.submitted, "accepted": l.accepted, "rejected": l.rejected,
                 "banned": l.banned, "trained_batches": l.trained_batches}
                for w, l in sorted(self.workers.items())]
