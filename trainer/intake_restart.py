"""What of the trainer's intake survives a restart: its snapshot, and taking one back.

Mixed into `trainer.intake.Intake` (whose docstring, "Restarts", says what is carried and why):
`memory` copies the verification memory in the event loop, `IntakeMemory.to_json` turns it into
the state file's JSON elsewhere (`trainer.intake_state`), `restore` takes a snapshot back into a
fresh intake with the batches whose payloads were kept (`trainer.intake_kept`), and `resume_at`
squares the training marks with the version the restarted learner has. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2pnet.wire import signed_payload
from trainer.intake_kept import KeptBatch, kept_submission, parse_kept
from trainer.leaderboard import Contributions
from verify.messages import Submission
from verify.reputation import Reputation, finite_s
from verify.verdicts import Outcome, SubmissionInfo, VerdictLedger

if TYPE_CHECKING:
    from trainer.intake import Batch, IntakeConfig, WorkerLedger

# `Intake.snapshot`'s layout; 2 added "leaderboard" (a format 1 file restores with an empty one), 3 "batches"
# and "latest_published" (the kept batches' marks, `trainer.intake_kept`; a format 1 or 2 file restores with none)
STATE_FORMAT = 3
READ_FORMATS = (1, 2, 3)


@dataclass(frozen=True)
class IntakeMemory:
    """A copy of the intake's verification memory at `now` (`Intake.memory`); `to_json` is the
    snapshot, times turned into wall-clock seconds."""
    now: float
    wall_s: float
    forgotten_before: int
    reputation: dict[str, Any]  # already JSON-able (`Reputation.snapshot`)
    steps: list[tuple[str, int]]
    nonces: list[tuple[tuple[str, bytes], float]]  # oldest first, with when last heard
    horizon: float  # nonces heard before this are forgotten
    submissions: list[tuple[bytes, SubmissionInfo]]  # the batches kept: a verdict on one may come after a restart
    leaderboard: dict[str, Any]  # already JSON-able (`Contributions.snapshot`)
    kept: list[KeptBatch]  # the batches kept, with their payloads where not yet written (`Intake.spooled`)
    latest_published: int | None  # the future-step bound (`Intake._too_far`)

    def to_json(self) -> dict[str, Any]:
        steps: dict[str, list[int]] = {}
        for worker, step in self.steps:
            steps.setdefault(worker, []).append(step)
        nonces: dict[str, list[list[Any]]] = {}
        offset = self.wall_s - self.now
        for (worker, nonce), heard in self.nonces:
            if heard >= self.horizon:
                nonces.setdefault(worker, []).append([nonce.hex(), round(heard + offset, 3)])
        submissions: dict[str, list[list[Any]]] = {}
        for sid, info in self.submissions:
            submissions.setdefault(info.worker, []).append([sid.hex(), info.step, info.model_version,
                                                            round(info.seen_at + offset, 3)])
        return {"format": STATE_FORMAT, "forgotten_before": self.forgotten_before, "reputation": self.reputation,
                "steps": {w: sorted(s) for w, s in sorted(steps.items())}, "nonces": nonces,
                "submissions": submissions, "leaderboard": self.leaderboard,
                "batches": [kept.to_json() for kept in self.kept], "latest_published": self.latest_published}


class Restarts:
    """The intake's snapshot and restore (module docstring); mixed into `Intake`."""

    config: IntakeConfig
    batches: dict[bytes, Batch]
    workers: dict[str, WorkerLedger]
    by_step: dict[tuple[str, int], list[bytes]]
    by_nonce: OrderedDict[tuple[str, bytes], tuple[float, list[bytes]]]
    forgotten_before: int
    latest_published: int | None
    ledger: VerdictLedger
    reputation: Reputation
    contributions: Contributions
    revision: int

    def _too_far(self, step: int) -> bool:
        """No honest worker is at `step` yet: more than async_level + 1 past the newest version published."""
        return self.latest_published is not None and step > self.latest_published + self.config.async_level + 1

    def mark_trained(self, batches: list[Batch], version: int | None = None) -> None: ...

    def memory(self, now: float, wall_s: float) -> IntakeMemory:
        """What `snapshot` returns, copied but not yet converted: cheap enough to take in the
        event loop (a list copy of the index) while `IntakeMemory.to_json` runs elsewhere."""
        horizon = now - self.config.replay_window_s
        return IntakeMemory(now, wall_s, self.forgotten_before, self.reputation.snapshot(now, wall_s),
                            list(self.by_step), [(k, v[0]) for k, v in self.by_nonce.items()], horizon,
                            [(b.sid, SubmissionInfo(b.worker, b.submission.step, b.submission.model_version, b.seen_at))
                             for b in self.batches.values()], self.contributions.snapshot(),
                            [self._kept(b) for b in self.batches.values()], self.latest_published)

    def _kept(self, batch: Batch) -> KeptBatch:
        accepted, rejected = self.ledger.voters(batch.sid)
        return KeptBatch(batch.sid, batch.worker, batch.claimed, batch.sibling, batch.skewed, batch.withheld,
                         batch.refused, batch.trained_into, self.contributions.credited.get(
                             (batch.worker, batch.submission.step)) == batch.sid, accepted, rejected,
                         signed_payload(batch.envelope) if batch.envelope is not None else None)

    def spooled(self, sids: list[bytes]) -> None:
        """The state file's folder now holds these batches' payloads: the envelopes kept for it go."""
        for sid in sids:
            batch = self.batches.get(sid)
            if batch is not None:
                batch.envelope = None

    def snapshot(self, now: float, wall_s: float) -> dict[str, Any]:
        """The verification memory a restarted trainer needs, as JSON-able data: the reputation
        (bans, failed batches), `forgotten_before`, the (worker, step) keys indexed, the nonces
        still remembered, the ids of the batches kept (worker, step, version: what a verdict is
        checked against) and their marks and verdicts (`trainer.intake_kept`; their payloads go
        to files of their own: `memory` carries those not yet written), the newest version
        published, with times as wall-clock seconds (`wall_s` is the wall clock at `now`); and
        the leaderboard's rows (`Contributions.snapshot`)."""
        return self.memory(now, wall_s).to_json()

    def restore(self, state: Any, now: float, wall_s: float, payloads: dict[bytes, bytes] | None = None) -> int:
        """Take back a `snapshot` (made by an earlier process: `now` and `wall_s` are this one's
        clocks at one moment) into an intake that has heard nothing yet. Its banned workers stay
        banned and its keys make siblings of any copy heard from now on; steps before
        `forgotten_before` and nonces older than `replay_window_s` are left out; the leaderboard's
        rows come back (none from a format 1 snapshot, made before it was carried). The batches it
        lists come back from `payloads` (submission id -> the payload the state file's folder
        kept), with their verdicts and marks (`trainer.intake_kept`); the number listed that did
        not (no payload, or not the one listed) is returned. ValueError if `state` is not a
        snapshot."""
        from trainer.intake import WorkerLedger

        board = self.contributions
        if self.batches or self.by_step or self.by_nonce or board.workers or board.validators:
            raise RuntimeError("restore into a fresh intake")  # keeps `by_nonce` oldest first
        try:
            if state["format"] not in READ_FORMATS or isinstance(state["format"], bool):
                raise ValueError(f"format {state['format']!r}, expected one of {READ_FORMATS}")
            forgotten = _step(state["forgotten_before"])
            steps = {(str(w), _step(step)) for w, listed in dict(state["steps"]).items() for step in listed}
            horizon = now - self.config.replay_window_s
            # a time ahead of `now` (the wall clock went back between the runs) is taken as now: kept a
            # whole window from here, and `by_nonce` stays oldest first, so that pruning its head goes on
            heard = sorted((min(now, now + finite_s(t) - wall_s), str(w), bytes.fromhex(n))
                           for w, listed in dict(state["nonces"]).items() for n, t in listed)
            noted = sorted(((now + finite_s(t) - wall_s, bytes.fromhex(sid), str(w), _step(step), _step(version))
                            for w, listed in dict(state["submissions"]).items() for sid, step, version, t in listed),
                           key=lambda entry: entry[0])  # oldest first, as the ledger forgets them
            rows = Contributions.parse(state["leaderboard"]) if state["format"] >= 2 else ({}, {})
            kept = parse_kept(state["batches"]) if state["format"] >= 3 else []
            latest = state.get("latest_published") if state["format"] >= 3 else None
            if latest is not None:
                latest = _step(latest)
            self.reputation.restore(state["reputation"], now, wall_s)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not an intake snapshot: {exc!r}") from exc
        self.forgotten_before = max(self.forgotten_before, forgotten)
        for key in steps:
            if key[1] >= self.forgotten_before:
                self.by_step.setdefault(key, [])
        for t, worker, nonce in heard:
            if t >= horizon and (worker, nonce) not in self.by_nonce:
                self.by_nonce[(worker, nonce)] = (t, [])
        for t, sid, worker, step, version in noted:  # a verdict on one still counts (as on a forgotten batch)
            if step >= self.forgotten_before:
                self.ledger.note_submission(sid, SubmissionInfo(worker, step, version, t))
        board.restore(rows)
        for worker in self.reputation.banned(now):
            self.workers.setdefault(worker, WorkerLedger()).banned = True
            self.contributions.banned(worker)
        self.latest_published = latest  # the future-step bound holds from the start, not from our next publish
        noted_ids = {sid for _, sid, *_ in noted}
        lost = 0
        for entry in kept:
            payload = (payloads or {}).get(entry.sid)
            sub = kept_submission(entry, payload) if payload is not None and entry.sid in noted_ids else None
            if sub is None or sub.step < self.forgotten_before or self._too_far(sub.step):
                lost += sub is None
                continue
            self._take_back(entry, sub, now)
        return lost

    def _take_back(self, kept: KeptBatch, sub: Submission, now: float) -> None:
        """A batch from before a restart, as it stood then (restore's second half)."""
        from trainer.intake import Batch, WorkerLedger

        # undecided and unclaimed, it waits `unchecked_after_s` from now for unchecked admission, not
        # from when it came: a claim made while we were down comes back by recall first
        batch = Batch(kept.sid, kept.worker, sub, now, kept.claimed, kept.trained_into is not None,
                      kept.sibling, kept.skewed, kept.withheld, kept.refused, kept.trained_into)
        self.batches[kept.sid] = batch
        self.by_step.setdefault((kept.worker, sub.step), []).append(kept.sid)
        nonce = self.by_nonce.get((kept.worker, sub.nonce))
        if nonce is not None:
            nonce[1].append(kept.sid)
        for validator in kept.accepted_by:
            self.ledger.record_own(kept.sid, validator, True)
        for validator in kept.rejected_by:
            self.ledger.record_own(kept.sid, validator, False)
        outcome = self.ledger.outcome(kept.sid)
        ledger = self.workers.setdefault(kept.worker, WorkerLedger())
        if outcome is not None:
            ledger.outcomes[kept.sid] = outcome
            ledger.accepted += outcome is Outcome.ACCEPTED  # a later rejection takes it back from here
        if outcome is Outcome.ACCEPTED:
            self.contributions.taken_back(batch, kept.credited)

    def resume_at(self, version: int, trained: set[tuple[str, int]] | frozenset[tuple[str, int]] = frozenset()) -> None:
        """The learner restarted at `version`, having trained the (worker, step) keys `trained`
        (its checkpoint's, `trainer.checkpoint.trained_keys`). A batch marked trained into a
        later version (lost in the crash before it reached disk) is untrained again, and trained
        into the next; one the learner trained whose mark the crash lost (saved after the
        version) is marked now, so the learner is not offered it again."""
        for batch in self.batches.values():
            key = (batch.worker, batch.submission.step)
            if batch.trained_into is not None and batch.trained_into > version and key not in trained:
                batch.trained, batch.trained_into = False, None
                self.contributions.untrained(batch)
                self.revision += 1
        marked = {(b.worker, b.submission.step) for b in self.batches.values() if b.trained}
        for batch in self.batches.values():
            key = (batch.worker, batch.submission.step)
            if not batch.trained and key in trained and key not in marked:
                marked.add(key)
                self.mark_trained([batch], version)


def _step(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"not a step: {value!r}")
    return value
