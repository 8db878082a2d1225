"""verify.policy: threshold validation and the per-chunk decision."""

from __future__ import annotations

import math

import pytest

from verify.policy import ChunkFailure, Thresholds, decide
from verify.toploc import ChunkStats

GOOD = ChunkStats(exp_mismatches=3, mant_err_mean=1.5, mant_err_median=1.0, sign_mismatches=1)


def test_defaults_are_the_papers():
    t = Thresholds()
    assert (t.exp_mismatches_max, t.mant_err_mean_max, t.mant_err_median_max) == (38, 10.0, 8.0)


@pytest.mark.parametrize("kwargs", [
    {"exp_mismatches_max": -1}, {"exp_mismatches_max": 1.5}, {"sign_mismatches_max": True},
    {"mant_err_mean_max": -0.1}, {"mant_err_median_max": 200.0},
    {"mant_err_mean_max": math.nan}, {"max_failing_chunks": -1}, {"mant_err_mean_max": "1"},
])
def test_thresholds_validated(kwargs):
    with pytest.raises(ValueError):
        Thresholds(**kwargs)


def test_decide_accepts_and_names_each_failure():
    assert decide([GOOD, GOOD]).accepted
    assert decide([]).accepted
    bad_exp = ChunkStats(39, 1.0, 1.0, 0)
    bad_mant = ChunkStats(0, 10.5, 9.0, 0)
    bad_sign = ChunkStats(0, 0.0, 0.0, 25)
    none_match = ChunkStats(128, math.inf, math.inf, 60)
    d = decide([GOOD, bad_exp, bad_mant, bad_sign, none_match])
    assert not d.accepted
    assert d.failures == (
        ChunkFailure(1, ("toploc_exp",)),
        ChunkFailure(2, ("toploc_mant_mean", "toploc_mant_median")),
        ChunkFailure(3, ("toploc_sign",)),
        ChunkFailure(4, ("toploc_exp", "toploc_mant_mean", "toploc_mant_median", "toploc_sign")),
    )
    assert d.reasons == ("toploc_exp", "toploc_mant_mean", "toploc_mant_median", "toploc_sign")


def test_boundaries_inclusive_and_nan_fails():
    assert decide([ChunkStats(38, 10.0, 8.0, 24)]).accepted
    assert not decide([ChunkStats(0, math.nan, 0.0, 0)]).accepted


def test_max_failing_chunks():
    bad = ChunkStats(100, 1.0, 1.0, 0)
    assert decide([GOOD, bad], Thresholds(max_failing_chunks=1)).accepted
    assert not decide([bad, bad], Thresholds(max_failing_chunks=1)).accepted
