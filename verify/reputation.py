"""Per-worker reputation from admitted verdicts: invalidated batches, then bans.

Rules. One failed verdict invalidates that batch (soft: the worker keeps its standing
otherwise). A worker is banned once it has at least `ban_after_failures` failed batches
*and* those failures were reported by at least `ban_min_validators` distinct validators
(set it to 2 so that a single lying validator cannot get an honest worker banned). Bans last
`ban_s` (0 or less: forever). Each batch counts once however many validators fail it.

This module only counts verdicts it is handed; deciding which verdicts to believe (known
validator, ticket, signature, duplicates) is `verify.verdicts`. It returns events (plain
frozen dataclasses) for the caller to emit. Pure: time comes in as `now`.

`snapshot` / `restore` carry the whole record (per worker: accepted count, failed batches,
failing validators; bans with their end) as JSON-able data, for a caller that keeps it across a
restart. `now` is a monotonic clock that does not survive one, so a ban's end is written as
wall-clock seconds (`wall_s`, taken at the same moment as `now`; None when permanent) and turned
back into the new clock on restore. `restore` raises ValueError on data it cannot read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from p2pnet.config import validated


@validated
@dataclass(frozen=True)
class ReputationConfig:
    ban_after_failures: int = 2
    ban_min_validators: int = 1
    ban_s: float = 0.0

    def check(self) -> dict[str, str]:
        problems = {}
        if self.ban_after_failures < 1:
            problems["ban_after_failures"] = "must be >= 1"
        if self.ban_min_validators < 1:
            problems["ban_min_validators"] = "must be >= 1"
        return problems


@dataclass(frozen=True)
class BatchInvalidated:
    worker: str
    submission_id: bytes
    validator: str
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class WorkerBanned:
    worker: str
    failures: int
    validators: tuple[str, ...]
    until: float  # inf when permanent


@dataclass
class _Record:
    accepted: int = 0
    failed_batches: set[bytes] = field(default_factory=set)
    failing_validators: set[str] = field(default_factory=set)


class Reputation:
    def __init__(self, config: ReputationConfig | None = None) -> None:
        self.config = config or ReputationConfig()
        self._records: dict[str, _Record] = {}
        self._banned_until: dict[str, float] = {}

    def record(self, now: float, worker: str, submission_id: bytes, validator: str,
               accepted: bool, reasons: tuple[str, ...]) -> list[object]:
        """Count one admitted verdict; returns BatchInvalidated / WorkerBanned events."""
        rec = self._records.setdefault(worker, _Record())
        if accepted:
            rec.accepted += 1
            return []
        events: list[object] = []
        if submission_id not in rec.failed_batches:
            rec.failed_batches.add(submission_id)
            events.append(BatchInvalidated(worker, submission_id, validator, reasons))
        rec.failing_validators.add(validator)
        if (not self.is_banned(worker, now)
                and len(rec.failed_batches) >= self.config.ban_after_failures
                and len(rec.failing_validators) >= self.config.ban_min_validators):
            until = now + self.config.ban_s if self.config.ban_s > 0 else float("inf")
            self._banned_until[worker] = until
            events.append(WorkerBanned(worker, len(rec.failed_batches),
                                       tuple(sorted(rec.failing_validators)), until))
        return events

    def is_banned(self, worker: str, now: float) -> bool:
        until = self._banned_until.get(worker)
        if until is None:
            return False
        if now >= until:
            del self._banned_until[worker]
            self._records.pop(worker, None)  # a served ban starts a clean record
            return False
        return True

    def failures(self, worker: str) -> int:
        rec = self._records.get(worker)
        return len(rec.failed_batches) if rec else 0

    def is_invalidated(self, worker: str, submission_id: bytes) -> bool:
        rec = self._records.get(worker)
        return rec is not None and submission_id in rec.failed_batches

    def banned(self, now: float) -> list[str]:
        return sorted(w for w in list(self._banned_until) if self.is_banned(w, now))

    def snapshot(self, now: float, wall_s: float) -> dict[str, Any]:
        """The record as JSON-able data; bans end at wall-clock seconds (None: permanent)."""
        return {
            "workers": {w: {"accepted": r.accepted, "failed_batches": sorted(sid.hex() for sid in r.failed_batches),
                            "failing_validators": sorted(r.failing_validators)}
                        for w, r in sorted(self._records.items())},
            "banned_until": {w: None if self._banned_until[w] == math.inf else wall_s + self._banned_until[w] - now
                             for w in self.banned(now)},
        }

    def restore(self, state: Any, now: float, wall_s: float) -> None:
        """Replace the record by a `snapshot`'s (bans already over are dropped, as `is_banned`
        would); ValueError if `state` is not one."""
        try:
            records = {str(w): _Record(accepted=count(r["accepted"]),
                                       failed_batches={bytes.fromhex(sid) for sid in _strings(r["failed_batches"])},
                                       failing_validators=set(_strings(r["failing_validators"])))
                       for w, r in dict(state["workers"]).items()}
            banned = {str(w): math.inf if end is None else now + finite_s(end) - wall_s
                      for w, end in dict(state["banned_until"]).items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a reputation snapshot: {exc!r}") from exc
        self._records, self._banned_until = records, banned
        self.banned(now)  # drops bans that ended meanwhile, with their records

    def to_json(self, now: float) -> dict[str, object]:
        return {
            "banned": self.banned(now),
            "workers": {w: {"accepted": r.accepted, "failed": len(r.failed_batches),
                            "failing_validators": len(r.failing_validators)}
                        for w, r in sorted(self._records.items())},
        }


def count(value: Any) -> int:
    """`value` as a count, if it is a non-negative integer (for data read back from disk); else
    ValueError."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


def _strings(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not a list of strings: {value!r}")
    return value


def finite_s(value: Any) -> float:
    """`value` as seconds, if it is a finite number (for data read back from disk); else ValueError
    (an integer too large for a float too: JSON reads `1000...0` as one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"not a finite time: {value!r}")
    try:
        seconds = float(value)
    except OverflowError as exc:
        raise ValueError("not a finite time: an integer too large for a float") from exc
    if not math.isfinite(seconds):
        raise ValueError(f"not a finite time: {value!r}")
    return seconds
