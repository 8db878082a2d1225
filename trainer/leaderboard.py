"""Who contributed what: the contributors leaderboard, counted only from what peers cannot forge.

`Contributions` is fed by the trainer's intake (`trainer.intake`), and only with what the intake
has already admitted: a submission it took (signed by its worker), a verdict that passed the
verdict rules (signed by a validator that was drawn for it, `verify.verdicts`), a batch it
trained on, a ban its reputation decided. A peer's own claims (its heartbeat, its status, the
numbers in its log) are never read, so a peer cannot raise its own row: a worker's tokens count
once a validator's verdict accepted the batch that carries them, a validator's checks once its
verdict was admitted. A worker is credited for one accepted batch per step, as the learner
trains one per (worker, step): a second copy of a step (the intake keeps up to two), accepted by
a validator that heard it first, adds nothing while the first stands, and takes its place if a
later verdict rejects the first.

Per worker: batches submitted, accepted and rejected, the rollouts and tokens of accepted
batches, batches trained on, bans and their reasons, and compute time: for each accepted batch,
the seconds from when its policy version could first be had (the later of the trainer's own
publish time and the worker's first signed `Holding` of it) to the batch's arrival, as the
trainer's clock saw them. Per validator: verdicts admitted (checks done), accepting and
rejecting. A bounded log of admitted verdicts feeds the dashboard's "verdicts over time".

What is kept: counts and a running compute total per row, so memory grows with peers, not
batches, and `rows()` costs O(rows). Per batch only the seconds an accepted batch added, and
only while the intake keeps the batch (`forget`, from `Intake.forget_before_step`): a later
verdict that rejects it takes them back; a verdict on a forgotten batch never reaches this
ledger, so what it earned stays. Publish times come in through `published` (the trainer role,
when it publishes a version): a batch accepted before its version's time is known is timed
when it comes, while the intake still keeps the batch; a version not published in this run
(one from before a restart) leaves its batches untimed. Publish times are kept as long as the
intake keeps holding times (`forget`): a batch of a version older than that, accepted after it
went, is untimed too (the learner's window had closed on it: it is not trained on).

What survives a restart: `snapshot` / `restore`, carried in the intake's state file
(`Intake.snapshot`, `trainer.intake_state`): every worker's and validator's counts, reasons,
ban mark and compute total. Not carried: the verdict log (the dashboard's recent activity,
5 000 entries: too much to rewrite every few seconds) and the per-batch seconds. The intake
carries its kept batches (`trainer.intake_kept`): an accepted one comes back with its credit
(`taken_back`), untimed, so a later verdict rejecting it takes the credit back as before; one
trained into a version the crash lost gives its trained count back (`untrained`).

A pure, synchronous ledger: no clock, I/O or randomness; the caller passes `now` (trio time).
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from verify.reputation import count, finite_s
from verify.verdicts import Outcome

VERDICT_LOG = 5000  # admitted verdicts kept for the dashboard (counts are kept for all)
_ROW_PREFIX = re.compile(r"^row\d+:")
_WORKER_COUNTS = ("submitted", "accepted_batches", "rejected_batches", "accepted_rollouts", "accepted_tokens",
                  "trained_batches", "trained_tokens")  # a worker row's counts, as `snapshot` names them


@dataclass
class WorkerRow:
    submitted: int = 0
    accepted_batches: int = 0
    rejected_batches: int = 0
    accepted_rollouts: int = 0
    accepted_tokens: int = 0
    trained_batches: int = 0
    trained_tokens: int = 0
    banned: bool = False
    ban_reasons: dict[str, int] = field(default_factory=dict)  # reason code -> rejecting verdicts
    compute_s: float = 0.0  # the seconds its accepted batches took (module docstring)


@dataclass
class Timing:
    """An accepted batch the intake still keeps: what its compute time is made of, whether it is
    the one credited for its (worker, step), and the seconds it added to its worker's `compute_s`
    (None: not credited, or its version's publish time is unknown)."""
    worker: str
    step: int
    version: int
    arrived: float
    holding: float | None
    rollouts: int
    tokens: int
    credited: bool = False
    seconds: float | None = None


@dataclass
class ValidatorRow:
    checks: int = 0
    accepted: int = 0
    rejected: int = 0


def rollouts_and_tokens(submission: Any) -> tuple[int, int]:
    return len(submission.rollouts), sum(len(r.output_ids) // 4 for r in submission.rollouts)


class Contributions:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerRow] = {}
        self.validators: dict[str, ValidatorRow] = {}
        self.verdict_log: deque[dict[str, Any]] = deque(maxlen=VERDICT_LOG)
        self.published_at: dict[int, float] = {}  # version -> when the trainer published it (this run)
        self.timing: dict[bytes, Timing] = {}  # accepted batches still kept, by submission id
        self.credited: dict[tuple[str, int], bytes] = {}  # (worker, step) -> the kept batch credited for it

    def submitted(self, worker: str) -> None:
        self.workers.setdefault(worker, WorkerRow()).submitted += 1

    def published(self, version: int, at: float) -> None:
        """The trainer published `version` at `at`: the kept batches of that version are timed
        (again, if an earlier time was given: the latest one counts, as it did when read at
        request time)."""
        self.published_at[version] = at
        for timing in self.timing.values():
            if timing.version == version and timing.credited:
                self._untime(timing)
                self._time(timing)

    def verdict(self, now: float, validator: str, verdict: Any, batch: Any, previous: Outcome | None, outcome: Outcome,
                holding_at: float | None) -> None:
        """An admitted verdict on `batch`; the batch's outcome went from `previous` to `outcome`."""
        checks = self.validators.setdefault(validator, ValidatorRow())
        checks.checks += 1
        if verdict.accepted:
            checks.accepted += 1
        else:
            checks.rejected += 1
        reason = _ROW_PREFIX.sub("", verdict.reasons[0]) if verdict.reasons else ""
        self.verdict_log.append({"t": round(now, 3), "step": verdict.step, "validator": validator,
                                 "worker": batch.worker, "accepted": verdict.accepted, "reason": reason})
        row = self.workers.setdefault(batch.worker, WorkerRow())
        if not verdict.accepted and reason:
            row.ban_reasons[reason] = row.ban_reasons.get(reason, 0) + 1
        if previous == outcome:
            return
        if previous is Outcome.ACCEPTED:  # a later verdict rejected an accepted batch
            timing = self.timing.pop(batch.sid, None)
            if timing is not None and timing.credited:
                self._credit(timing, batch.sid, -1)
                heir = next((sid for sid, t in self.timing.items()
                             if (t.worker, t.step) == (timing.worker, timing.step)), None)
                if heir is not None:  # the step's other accepted copy counts now
                    self._credit(self.timing[heir], heir, +1)
        if outcome is Outcome.ACCEPTED:
            rollouts, tokens = rollouts_and_tokens(batch.submission)
            timing = self.timing[batch.sid] = Timing(batch.worker, batch.submission.step,
                                                     batch.submission.model_version, batch.seen_at, holding_at,
                                                     rollouts, tokens)
            if (batch.worker, batch.submission.step) not in self.credited:
                self._credit(timing, batch.sid, +1)
        elif outcome is Outcome.REJECTED:
            row.rejected_batches += 1

    def _credit(self, timing: Timing, sid: bytes, sign: int) -> None:
        """Count (+1) or take back (-1) an accepted batch as its (worker, step)'s one credit."""
        row = self.workers.setdefault(timing.worker, WorkerRow())
        row.accepted_batches += sign
        row.accepted_rollouts += sign * timing.rollouts
        row.accepted_tokens += sign * timing.tokens
        timing.credited = sign > 0
        if timing.credited:
            self.credited[(timing.worker, timing.step)] = sid
            self._time(timing)
        else:
            del self.credited[(timing.worker, timing.step)]
            self._untime(timing)

    def _time(self, timing: Timing) -> None:
        published = self.published_at.get(timing.version)
        if published is None:
            return  # not published in this run (yet): untimed
        start = max(published, timing.holding) if timing.holding is not None else published
        timing.seconds = max(0.0, timing.arrived - start)
        self.workers.setdefault(timing.worker, WorkerRow()).compute_s += timing.seconds

    def _untime(self, timing: Timing) -> None:
        if timing.seconds is not None:
            row = self.workers[timing.worker]
            row.compute_s = max(0.0, row.compute_s - timing.seconds)
            timing.seconds = None

    def forget(self, sids: list[bytes], before_version: int) -> None:
        """The intake forgot these batches: what they earned stays, no verdict on them comes here.
        Publish times of versions before `before_version` go too (the intake's rule for holding
        times: older than the learner's window for any batch it still keeps)."""
        for sid in sids:
            timing = self.timing.pop(sid, None)
            if timing is not None and self.credited.get((timing.worker, timing.step)) == sid:
                del self.credited[(timing.worker, timing.step)]
        for version in [v for v in self.published_at if v < before_version]:
            del self.published_at[version]

    def trained(self, batch: Any) -> None:
        row = self.workers.setdefault(batch.worker, WorkerRow())
        row.trained_batches += 1
        row.trained_tokens += rollouts_and_tokens(batch.submission)[1]

    def taken_back(self, batch: Any, credited: bool) -> None:
        """An accepted batch kept across a restart (`Intake.restore`): its row already counts it
        (the rows came back first), so only what a later verdict or copy needs is made again:
        its credit for its (worker, step), untimed (its publish time was the last run's)."""
        rollouts, tokens = rollouts_and_tokens(batch.submission)
        timing = self.timing[batch.sid] = Timing(batch.worker, batch.submission.step, batch.submission.model_version,
                                                 batch.seen_at, None, rollouts, tokens, credited=credited)
        if credited:
            self.credited[(timing.worker, timing.step)] = batch.sid

    def untrained(self, batch: Any) -> None:
        """A batch counted as trained into a version the crash lost (`Intake.resume_at`)."""
        row = self.workers.setdefault(batch.worker, WorkerRow())
        row.trained_batches = max(0, row.trained_batches - 1)
        row.trained_tokens = max(0, row.trained_tokens - rollouts_and_tokens(batch.submission)[1])

    def banned(self, worker: str) -> None:
        self.workers.setdefault(worker, WorkerRow()).banned = True

    def compute_s(self, worker: str) -> float:
        """Seconds the worker's accepted batches took, as the trainer saw them (module docstring);
        a batch whose version the trainer did not publish in this run is not timed."""
        row = self.workers.get(worker)
        return row.compute_s if row is not None else 0.0

    def rows(self, names: dict[str, str] | None = None, relayed: dict[str, int] | None = None) -> list[dict[str, Any]]:
        """The leaderboard, best first: by accepted tokens, then checks done, then peer id.
        `names` are display names by peer id (shown, never counted); `relayed` is verified bytes
        this peer fetched from each peer (measured here, not claimed)."""
        names, relayed = names or {}, relayed or {}
        out: list[dict[str, Any]] = []
        for peer in sorted(set(self.workers) | set(self.validators)):
            w = self.workers.get(peer, WorkerRow())
            v = self.validators.get(peer, ValidatorRow())
            out.append({
                "peer_id": peer, "name": names.get(peer, ""),
                "accepted_batches": w.accepted_batches, "accepted_rollouts": w.accepted_rollouts,
                "accepted_tokens": w.accepted_tokens, "trained_batches": w.trained_batches,
                "trained_tokens": w.trained_tokens, "submitted": w.submitted, "rejected_batches": w.rejected_batches,
                "banned": w.banned, "rejection_reasons": dict(sorted(w.ban_reasons.items())),
                "compute_s": round(w.compute_s, 3),
                "checks": v.checks, "checks_accepting": v.accepted, "checks_rejecting": v.rejected,
                "bytes_relayed_to_us": relayed.get(peer, 0),
            })
        out.sort(key=lambda r: (-r["accepted_tokens"], -r["checks"], r["peer_id"]))
        for rank, row in enumerate(out, 1):
            row["rank"] = rank
        return out

    # -- what survives a restart ------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Every row's counts as JSON-able data (module docstring: what is left out). O(rows)."""
        workers = {}
        for peer, w in self.workers.items():
            counts = {name: getattr(w, name) for name in _WORKER_COUNTS}
            workers[peer] = {**counts, "banned": w.banned, "ban_reasons": dict(w.ban_reasons),
                             "compute_s": w.compute_s}  # not rounded: JSON gives it back to the bit
        validators = {peer: [v.checks, v.accepted, v.rejected] for peer, v in self.validators.items()}
        return {"workers": workers, "validators": validators}

    @staticmethod
    def parse(state: Any) -> tuple[dict[str, WorkerRow], dict[str, ValidatorRow]]:
        """The rows in a `snapshot`; ValueError if it is not one (nothing is changed)."""
        try:
            workers = {}
            for peer, w in dict(state["workers"]).items():
                w = dict(w)
                if not isinstance(w["banned"], bool):
                    raise ValueError(f"banned: {w['banned']!r}")
                compute = finite_s(w["compute_s"])
                if compute < 0:
                    raise ValueError(f"compute_s: {compute!r}")
                reasons = {str(r): count(n) for r, n in dict(w["ban_reasons"]).items()}
                workers[str(peer)] = WorkerRow(**{name: count(w[name]) for name in _WORKER_COUNTS},
                                               banned=w["banned"], ban_reasons=reasons, compute_s=compute)
            validators = {}
            for peer, counts in dict(state["validators"]).items():
                checks, accepted, rejected = counts
                validators[str(peer)] = ValidatorRow(count(checks), count(accepted), count(rejected))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a leaderboard snapshot: {exc!r}") from exc
        return workers, validators

    def restore(self, rows: tuple[dict[str, WorkerRow], dict[str, ValidatorRow]]) -> None:
        """Take back `parse`d rows (into a ledger that has counted nothing yet: `Intake.restore`)."""
        self.workers.update(rows[0])
        self.validators.update(rows[1])

