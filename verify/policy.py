"""The accept/reject decision for TOPLOC measurements, kept apart from measuring them.

Owns: the thresholds (a frozen, validated dataclass) and ``decide``, which turns per-chunk
``ChunkStats`` into a ``Decision`` that names every failing chunk and why.
Must not: measure anything, know about models, or do I/O. Changing a threshold never
changes a measurement, so stats can be logged once and re-decided under another policy.

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

__all__ = ["ChunkFailure", "Decision", "Thresholds", "decide"]

# Reason codes, stable and machine-readable (verdicts carry them over the wire).
EXP = "toploc_exp"
MANT_MEAN = "toploc_mant_mean"
MANT_MEDIAN = "toploc_mant_median"
SIGN = "toploc_sign"


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


#: For networks whose workers and validators run the same model dtype and kernels (one hardware
#: stack, e.g. a devnet): honest recomputation there is bit-exact (docs/calibration.md), so the
#: limits can sit just above zero, which rejects int8 weights and near-identical models that
#: the paper's cross-hardware defaults let through. Never use it across GPU kinds or dtypes.
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
