"""Who contributed what: the contributors leaderboard, counted only from what peers cannot forge.

`Contributions` is fed by the trainer's intake (`trainer.intake`), and only with what the intake
has already admitted: a submission it took (signed by its worker), a verdict that passed the
verdict rules (signed by a validator that was drawn for it, `verify.verdicts`), a batch it
trained on, a ban its reputation decided. A peer's own claims (its heartbeat, its status, the
numbers in its log) are never read, so a peer cannot raise its own row: a worker's tokens count
once a validator's verdict accepted the batch that carries them, a validator's checks once its
verdict was admitted.

Per worker: batches submitted, accepted and rejected, the rollouts and tokens of accepted
batches, batches trained on, bans and their reasons, and compute time: for each accepted batch,
the seconds from when its policy version could first be had (the later of the trainer's own
publish time and the worker's first signed `Holding` of it) to the batch's arrival, as the
trainer's clock saw them. Per validator: verdicts admitted (checks done), accepting and
rejecting. A bounded log of admitted verdicts feeds the dashboard's "verdicts over time".

A pure, synchronous ledger: no clock, I/O or randomness; the caller passes `now` (trio time).
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from verify.verdicts import Outcome

VERDICT_LOG = 5000  # admitted verdicts kept for the dashboard (counts are kept for all)
_ROW_PREFIX = re.compile(r"^row\d+:")


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
    accepted: list[tuple[int, float, float | None]] = field(default_factory=list)  # version, arrived, holding


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

    def submitted(self, worker: str) -> None:
        self.workers.setdefault(worker, WorkerRow()).submitted += 1

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
        rollouts, tokens = rollouts_and_tokens(batch.submission)
        if previous is Outcome.ACCEPTED:  # a later verdict rejected an accepted batch
            row.accepted_batches -= 1
            row.accepted_rollouts -= rollouts
            row.accepted_tokens -= tokens
            row.accepted = [a for a in row.accepted if a[1] != batch.seen_at]
        if outcome is Outcome.ACCEPTED:
            row.accepted_batches += 1
            row.accepted_rollouts += rollouts
            row.accepted_tokens += tokens
            row.accepted.append((batch.submission.model_version, batch.seen_at, holding_at))
        elif outcome is Outcome.REJECTED:
            row.rejected_batches += 1

    def trained(self, batch: Any) -> None:
        row = self.workers.setdefault(batch.worker, WorkerRow())
        row.trained_batches += 1
        row.trained_tokens += rollouts_and_tokens(batch.submission)[1]

    def banned(self, worker: str) -> None:
        self.workers.setdefault(worker, WorkerRow()).banned = True

    def compute_s(self, worker: str, published_at: dict[int, float]) -> float:
        """Seconds the worker's accepted batches took, as the trainer saw them (module docstring);
        a batch whose version the trainer did not publish in this run is not timed."""
        total = 0.0
        for version, arrived, holding in self.workers[worker].accepted:
            published = published_at.get(version)
            if published is None:
                continue
            start = max(published, holding) if holding is not None else published
            total += max(0.0, arrived - start)
        return total

    def rows(self, published_at: dict[int, float], names: dict[str, str] | None = None,
             relayed: dict[str, int] | None = None) -> list[dict[str, Any]]:
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
                "compute_s": round(self.compute_s(peer, published_at), 3) if peer in self.workers else 0.0,
                "checks": v.checks, "checks_accepting": v.accepted, "checks_rejecting": v.rejected,
                "bytes_relayed_to_us": relayed.get(peer, 0),
            })
        out.sort(key=lambda r: (-r["accepted_tokens"], -r["checks"], r["peer_id"]))
        for rank, row in enumerate(out, 1):
            row["rank"] = rank
        return out
