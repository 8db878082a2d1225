"""The accept/reject decisions for TOPLOC measurements, kept apart from measuring them.

Owns: the per-chunk thresholds (a frozen, validated dataclass) and ``decide``, which turns
per-chunk ``ChunkStats`` into a ``Decision`` that names every failing chunk and why; and the
submission-level test (``decide_aggregate``, ``RecentRollouts``), which pools every checked
chunk of a submission (and of a worker's recent submissions for the same stack pair) and
rejects when the pool is implausible for an honest worker on the declared stack.
Must not: measure anything, know about models, or do I/O (calibration tables are loaded by
verify.calibration). Changing a threshold never changes a measurement, so stats can be
logged once and re-decided under another policy.

The submission-level test. Per-chunk thresholds must pass the worst honest chunk, so they
let through attacks whose chunks are only slightly worse than honest ones (int8 weights, 1%
weight noise on SmolLM2: docs/calibration.md). Pooled over many chunks such a shift is
plain. For each statistic s in ``AGGREGATE_STATS`` the calibration table of the (worker
stack, validator stack) pair gives a ``limit`` (an upper quantile of honest per-chunk s)
and ``exceed_rate`` p (an upper confidence bound on an honest rollout's expected fraction
of chunks with s > limit). Each checked rollout contributes its fraction f_r of exceeding
chunks, a number in [0, 1]; rollouts are independent (own prompt row and sampling noise),
chunks within one may be correlated, so the rollout is the unit. For R rollouts with mean
f, Chernoff's bound for independent [0, 1] variables of mean <= p gives
P(mean >= a) <= exp(-R KL(a || p)), KL the Bernoulli relative entropy. So rejecting when
R KL(f || p) >= ln(m / alpha) (m tests: statistics, times two when the worker's recent
rollouts are pooled too) falsely rejects an honest submission with probability <= alpha,
whatever the rollout lengths; R KL(f || p) is the log-likelihood ratio of the best-fitting
Bernoulli rate against p, so this is a generalised likelihood-ratio test.

Defaults follow the TOPLOC paper (exponent mismatches <= 38 of 128, mantissa error mean
<= 10 and median <= 8) and were checked against our own calibration (docs/calibration.md):
honest recomputation across batch sizes, thread counts, attention kernels and bf16/fp32
validators stays far below them, every attack measured lands far above them. The sign
threshold is ours (toploc does not check signs): an honest sign flip among the top-128
entries only happens where the top-k sets differ, which the exponent bound already limits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from verify.toploc import ChunkStats

__all__ = [
    "AGGREGATE_STATS",
    "AggregateDecision",
    "ChunkFailure",
    "Decision",
    "PairCalibration",
    "RecentRollouts",
    "StatCalibration",
    "Thresholds",
    "decide",
    "decide_aggregate",
    "exceed_fractions",
    "kl_bernoulli",
    "kl_upper_bound",
]

# Reason codes, stable and machine-readable (verdicts carry them over the wire).
EXP = "toploc_exp"
MANT_MEAN = "toploc_mant_mean"
MANT_MEDIAN = "toploc_mant_median"
SIGN = "toploc_sign"
AGGREGATE = "toploc_aggregate"

#: The statistics the submission-level test pools (ChunkStats field names).
AGGREGATE_STATS = ("mant_err_mean", "exp_mismatches")


@dataclass(frozen=True)
class Thresholds:
    """A chunk passes when every statistic is <= its maximum.

    exp_mismatches_max / sign_mismatches_max: counts out of topk (128) entries.
    mant_err_mean_max / mant_err_median_max: in mantissa units (bf16 mantissa is 0..127).
    max_failing_chunks: how many chunks of one rollout may fail before it is rejected
      (0: any failing chunk rejects; the paper's rule).
    """

    exp_mismatches_max: int = 38
    mant_err_mean_max: float = 10.0
    mant_err_median_max: float = 8.0
    sign_mismatches_max: int = 24
    max_failing_chunks: int = 0

    def __post_init__(self) -> None:
        for name in ("exp_mismatches_max", "sign_mismatches_max", "max_failing_chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        for name in ("mant_err_mean_max", "mant_err_median_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not (0.0 <= value <= 127.0) or math.isnan(value):
                raise ValueError(f"{name} must lie in [0, 127], got {value!r}")


#: Only for stack pairs measured bit-exact (docs/calibration.md: an fp32 worker checked by an
#: fp32 validator on CPU; a bf16 worker is NOT bit-exact against any prefill, its own dtype
#: included): there the limits can sit just above zero. verify.daemon applies it only to
#: pairs whose calibration table says ``bit_exact`` and refuses to start with it otherwise.
SAME_STACK = Thresholds(exp_mismatches_max=2, mant_err_mean_max=1.0, mant_err_median_max=1.0,
                        sign_mismatches_max=2)


@dataclass(frozen=True)
class ChunkFailure:
    """One failing chunk: its index and the reason codes of the statistics over the limit."""

    chunk: int
    codes: tuple[str, ...]


@dataclass(frozen=True)
class Decision:
    """accepted: the rollout's proofs pass. failures: every failing chunk, in order."""

    accepted: bool
    failures: tuple[ChunkFailure, ...]

    @property
    def reasons(self) -> tuple[str, ...]:
        """The distinct reason codes over all failing chunks, in a stable order."""
        seen: dict[str, None] = {}
        for failure in self.failures:
            for code in failure.codes:
                seen.setdefault(code, None)
        return tuple(seen)


def _chunk_codes(stats: ChunkStats, t: Thresholds) -> tuple[str, ...]:
    codes = []
    if stats.exp_mismatches > t.exp_mismatches_max:
        codes.append(EXP)
    # "not <=" so that NaN or inf (no matching exponent at all) fails.
    if not stats.mant_err_mean <= t.mant_err_mean_max:
        codes.append(MANT_MEAN)
    if not stats.mant_err_median <= t.mant_err_median_max:
        codes.append(MANT_MEDIAN)
    if stats.sign_mismatches > t.sign_mismatches_max:
        codes.append(SIGN)
    return tuple(codes)


def decide(stats: Sequence[ChunkStats], thresholds: Thresholds = Thresholds()) -> Decision:
    """Accept when at most ``max_failing_chunks`` chunks exceed a threshold."""
    failures = []
    for index, chunk in enumerate(stats):
        codes = _chunk_codes(chunk, thresholds)
        if codes:
            failures.append(ChunkFailure(index, codes))
    return Decision(accepted=len(failures) <= thresholds.max_failing_chunks,
                    failures=tuple(failures))


# --------------------------------------------------------------------------- submission level


def kl_bernoulli(a: float, p: float) -> float:
    """KL(Bernoulli(a) || Bernoulli(p)) in nats, with 0 ln 0 = 0; inf where a > 0 = p etc."""
    if not (0.0 <= a <= 1.0 and 0.0 <= p <= 1.0):
        raise ValueError(f"rates must lie in [0, 1], got {a!r} and {p!r}")
    out = 0.0
    for x, y in ((a, p), (1.0 - a, 1.0 - p)):
        if x > 0.0:
            out += math.inf if y == 0.0 else x * math.log(x / y)
    return out


def kl_upper_bound(mean: float, n: int, delta: float) -> float:
    """The largest p with n KL(mean || p) <= ln(1/delta): an upper confidence bound, at level
    1 - delta, on the expected value of n independent [0, 1] samples whose mean is ``mean``."""
    if n < 1 or not 0.0 < delta < 1.0:
        raise ValueError("need n >= 1 and 0 < delta < 1")
    budget = math.log(1.0 / delta) / n
    lo, hi = mean, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if kl_bernoulli(mean, mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class StatCalibration:
    """Honest behaviour of one per-chunk statistic for one stack pair.

    limit: a chunk exceeds when its statistic is > limit (an honest upper quantile).
    exceed_rate: upper bound on an honest rollout's expected fraction of exceeding chunks.
    """

    limit: float
    exceed_rate: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.limit) and self.limit >= 0.0):
            raise ValueError(f"limit must be finite and >= 0, got {self.limit!r}")
        if not 0.0 < self.exceed_rate < 1.0:
            raise ValueError(f"exceed_rate must lie in (0, 1), got {self.exceed_rate!r}")


@dataclass(frozen=True)
class PairCalibration:
    """What honest recomputation looks like for one (worker stack, validator stack) pair.

    worker / validator: stack keys ("dtype/backend/device", verify.messages.Stack.key).
    bit_exact: every honest chunk measured had all statistics 0 (the ``same_stack`` preset
      is allowed only then). stats: ``StatCalibration`` per name in AGGREGATE_STATS.
    honest_chunks / honest_rollouts: how much honest data the figures rest on.
    """

    worker: str
    validator: str
    bit_exact: bool
    stats: tuple[tuple[str, StatCalibration], ...]
    honest_chunks: int
    honest_rollouts: int

    def __post_init__(self) -> None:
        names = [name for name, _ in self.stats]
        if sorted(names) != sorted(AGGREGATE_STATS):
            raise ValueError(f"calibration must cover {AGGREGATE_STATS}, got {names}")

    def stat(self, name: str) -> StatCalibration:
        return dict(self.stats)[name]


def exceed_fractions(rollouts: Sequence[Sequence[ChunkStats]], name: str,
                     calibration: StatCalibration) -> list[float]:
    """Per rollout: the fraction of its chunks whose ``name`` exceeds the honest limit.
    Rollouts without chunks are skipped; NaN or inf statistics count as exceeding."""
    out = []
    for chunks in rollouts:
        if chunks:
            over = sum(not float(getattr(c, name)) <= calibration.limit for c in chunks)
            out.append(over / len(chunks))
    return out


def _evidence(fractions: Sequence[float], rate: float) -> float:
    """R KL(mean || rate) when the mean exceeds the rate, else 0 (nats)."""
    if not fractions:
        return 0.0
    mean = sum(fractions) / len(fractions)
    return len(fractions) * kl_bernoulli(mean, rate) if mean > rate else 0.0


@dataclass(frozen=True)
class AggregateDecision:
    """accepted: the pooled statistics are plausible for an honest worker.
    evidence: nats per pooled set and statistic ("submission:mant_err_mean", "recent:...").
    limit_nats: ln(tests / alpha), the evidence that rejects. rollouts: this submission's
    checked rollouts with chunks; recent_rollouts: the pool including earlier submissions."""

    accepted: bool
    evidence: tuple[tuple[str, float], ...]
    limit_nats: float
    rollouts: int
    recent_rollouts: int

    @property
    def reasons(self) -> tuple[str, ...]:
        return () if self.accepted else (AGGREGATE,)


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")


def decide_aggregate(rollouts: Sequence[Sequence[ChunkStats]], calibration: PairCalibration,
                     alpha: float) -> AggregateDecision:
    """The submission-level test on one submission's checked rollouts (per-chunk stats each)."""
    _check_alpha(alpha)
    limit = math.log(len(AGGREGATE_STATS) / alpha)
    evidence = []
    for name in AGGREGATE_STATS:
        cal = calibration.stat(name)
        evidence.append((f"submission:{name}", _evidence(exceed_fractions(rollouts, name, cal),
                                                         cal.exceed_rate)))
    n = sum(1 for r in rollouts if r)
    return AggregateDecision(all(e < limit for _, e in evidence), tuple(evidence), limit, n, n)


class RecentRollouts:
    """The submission-level test over a submission and the worker's recent ones (same pair).

    Keeps, per (worker, worker stack, validator stack), the exceed fractions of the last
    ``window_rollouts`` checked rollouts (at most ``max_keys`` keys, least recent dropped).
    Each decision runs two tests at alpha / 2 each: this submission alone, and the pool of
    recent rollouts including it. A rejection clears that key's pool, so the evidence that
    convicted one submission does not convict the next ones too.
    """

    def __init__(self, window_rollouts: int = 256, max_keys: int = 4096) -> None:
        if window_rollouts < 1 or max_keys < 1:
            raise ValueError("window_rollouts and max_keys must be >= 1")
        self.window_rollouts = window_rollouts
        self.max_keys = max_keys
        self._pools: dict[tuple[str, str, str], list[tuple[float, ...]]] = {}

    def decide(self, worker: str, rollouts: Sequence[Sequence[ChunkStats]],
               calibration: PairCalibration, alpha: float) -> AggregateDecision:
        _check_alpha(alpha)
        key = (worker, calibration.worker, calibration.validator)
        pool = self._pools.pop(key, [])
        cals = [calibration.stat(name) for name in AGGREGATE_STATS]
        rows = [tuple(exceed_fractions([r], name, cal)[0] for name, cal in zip(AGGREGATE_STATS, cals))
                for r in rollouts if r]
        pool = (pool + rows)[-self.window_rollouts:]
        limit = math.log(2 * len(AGGREGATE_STATS) / alpha)
        evidence = []
        for i, (name, cal) in enumerate(zip(AGGREGATE_STATS, cals)):
            evidence.append((f"submission:{name}", _evidence([r[i] for r in rows], cal.exceed_rate)))
            evidence.append((f"recent:{name}", _evidence([r[i] for r in pool], cal.exceed_rate)))
        accepted = all(e < limit for _, e in evidence)
        if accepted:
            self._pools[key] = pool  # re-inserted last: the most recently used key
            while len(self._pools) > self.max_keys:
                self._pools.pop(next(iter(self._pools)))
        return AggregateDecision(accepted, tuple(evidence), limit, len(rows), len(pool))
