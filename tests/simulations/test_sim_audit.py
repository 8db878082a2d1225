"""Validators (real peer tables and validator cores) against forging workers, in virtual time."""

from __future__ import annotations

import dataclasses
import math

from simulations.audit import run_audit
from simulations.scenarios import AuditScenario


def test_full_sampling_catches_every_cheater_at_once_with_one_check_per_submission() -> None:
    s, rows = run_audit(AuditScenario(validators=5, cheaters=15, honest=5, submissions=3, sample_rate=1.0))
    assert s["p_caught_within_k"] == [1.0, 1.0, 1.0]
    assert s["cheaters_banned"] == 15 and s["honest_banned"] == 0 and s["honest_caught"] == 0
    assert s["mean_accepted_forgeries"] == 0.0
    # claims: the lowest ticket checks, the others stand by, so each submission is checked once
    assert s["checks_per_submission"] == 1.0 and s["takeovers"] == 0
    honest = [r for r in rows if not r["cheater"]]
    assert all(r["outcomes"] == "ppp" for r in honest)
    cheats = [r for r in rows if r["cheater"]]
    assert all(r["outcomes"] == "cuu" for r in cheats)  # caught, then refused as banned (never checked)


def test_sampled_catch_rate_follows_one_minus_one_minus_p_to_the_k() -> None:
    sc = AuditScenario(validators=6, cheaters=150, honest=0, submissions=6, sample_rate=0.3, detection_rate=0.5,
                       seed=5)
    s, _ = run_audit(sc)
    q = sc.sample_rate * sc.detection_rate
    for k, observed in enumerate(s["p_caught_within_k"], start=1):
        expected = 1 - (1 - q) ** k
        assert abs(observed - expected) <= 4 * math.sqrt(expected * (1 - expected) / sc.cheaters) + 1e-9
    assert abs(s["mean_accepted_forgeries"] - s["expected_accepted_forgeries"]) < 0.5
    assert s["honest_banned"] == 0


def test_no_sampling_catches_nobody() -> None:
    s, _ = run_audit(dataclasses.replace(AuditScenario(validators=3, cheaters=10, honest=2, submissions=3),
                                         sample_rate=0.0))
    assert s["p_caught_within_k"] == [0.0, 0.0, 0.0] and s["mean_accepted_forgeries"] == 3.0
