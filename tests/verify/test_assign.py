"""Validator assignment: tickets are unforgeable, the checked rate holds, workers cannot predict."""

from __future__ import annotations

import math
import random

import blake3
import pytest

from p2pnet.errors import MessageRejected
from p2pnet.identity import Identity, SignatureChecker
from verify.assign import (VALUE_RANGE, check_remote_ticket, check_ticket, choose_rows, eligibility_probability,
                           eligibility_threshold, is_eligible, make_ticket, ticket_value)

N_SUBMISSIONS = 2000
VALIDATORS = [Identity.from_seed_text(f"validator-{i}") for i in range(5)]


def _sids(seed: int, count: int = N_SUBMISSIONS) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(count)]


def _within_binomial(successes: int, trials: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(successes - trials * p) <= sigmas * math.sqrt(trials * p * (1 - p)) + 1


@pytest.fixture(scope="module")
def values() -> list[list[int]]:
    """values[s][v]: ticket value of validator v for submission s (2,000 x 5 signatures)."""
    return [[ticket_value(make_ticket(v, sid)) for v in VALIDATORS] for sid in _sids(1234)]


def test_ticket_is_deterministic_and_verifiable() -> None:
    sid = bytes(range(32))
    v = VALIDATORS[0]
    ticket = make_ticket(v, sid)
    assert ticket == make_ticket(v, sid) and len(ticket) == 64
    check_ticket(SignatureChecker(), v.peer_id_bytes, sid, ticket)


def test_forged_tickets_are_rejected() -> None:
    sid, other_sid = bytes(32), bytes([1]) * 32
    checker = SignatureChecker()
    honest, forger = VALIDATORS[0], Identity.from_seed_text("forger")
    # a ticket made with another key, claimed for the honest validator
    with pytest.raises(MessageRejected) as info:
        check_ticket(checker, honest.peer_id_bytes, sid, make_ticket(forger, sid))
    assert info.value.reason == "bad_signature"
    # a genuine ticket of another submission
    with pytest.raises(MessageRejected):
        check_ticket(checker, honest.peer_id_bytes, sid, make_ticket(honest, other_sid))
    # random bytes with a low value (what a forger would pick) are no ticket either
    rng = random.Random(5)
    low = next(t for t in (rng.randbytes(64) for _ in range(10_000)) if ticket_value(t) < VALUE_RANGE // 100)
    with pytest.raises(MessageRejected) as info:
        check_remote_ticket(checker, honest.peer_id_bytes, sid, low, rate=0.5, n_validators=5)
    assert info.value.reason == "bad_ticket"


def test_eligibility_probability_gives_the_rate() -> None:
    for rate in (0.01, 0.1, 0.3, 0.9, 0.999):
        for n in (1, 2, 5, 100):
            p = eligibility_probability(rate, n)
            assert 1 - (1 - p) ** n == pytest.approx(rate, rel=1e-9)
    assert eligibility_threshold(1.0, 7) == VALUE_RANGE
    assert eligibility_threshold(0.0, 7) == 0
    with pytest.raises(ValueError):
        eligibility_probability(1.5, 3)


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.7])
def test_checked_fraction_matches_rate(values: list[list[int]], rate: float) -> None:
    threshold = eligibility_threshold(rate, len(VALIDATORS))
    checked = sum(1 for row in values if min(row) < threshold)
    assert _within_binomial(checked, N_SUBMISSIONS, rate), (checked, rate)
    # each validator individually is eligible at rate p
    p = eligibility_probability(rate, len(VALIDATORS))
    for v in range(len(VALIDATORS)):
        hits = sum(1 for row in values if row[v] < threshold)
        assert _within_binomial(hits, N_SUBMISSIONS, p)


def test_rate_one_checks_everything_once_by_a_fair_winner(values: list[list[int]]) -> None:
    sid = _sids(1234, 1)[0]
    assert all(is_eligible(make_ticket(v, sid), 1.0, 5) for v in VALIDATORS)
    wins = [0] * len(VALIDATORS)
    for row in values:
        wins[row.index(min(row))] += 1
    assert sum(wins) == N_SUBMISSIONS
    for count in wins:
        assert _within_binomial(count, N_SUBMISSIONS, 1 / len(VALIDATORS)), wins


def test_worker_without_keys_predicts_no_better_than_chance(values: list[list[int]]) -> None:
    """A worker knows every public key and the submission id; its best public guess is noise."""
    sids = _sids(1234)

    def public_guess(pub: bytes, sid: bytes) -> int:  # e.g. hash of public key and id
        return int.from_bytes(blake3.blake3(pub + sid).digest(), "big")

    correct = 0
    for sid, row in zip(sids, values):
        guesses = [public_guess(v.public_key, sid) for v in VALIDATORS]
        correct += guesses.index(min(guesses)) == row.index(min(row))
    assert _within_binomial(correct, N_SUBMISSIONS, 1 / len(VALIDATORS)), correct

    # grinding: submitting only the ids the guess calls "unchecked" does not lower the checked rate
    rate = 0.3
    threshold = eligibility_threshold(rate, len(VALIDATORS))
    picked = [row for sid, row in zip(sids, values)
              if min(public_guess(v.public_key, sid) for v in VALIDATORS) >= threshold]
    checked = sum(1 for row in picked if min(row) < threshold)
    assert len(picked) > 500
    assert _within_binomial(checked, len(picked), rate), (checked, len(picked))


def test_choose_rows_is_drawn_from_the_ticket() -> None:
    t1, t2 = make_ticket(VALIDATORS[0], bytes(32)), make_ticket(VALIDATORS[1], bytes(32))
    assert choose_rows(t1, 8, 0) == tuple(range(8))
    assert choose_rows(t1, 8, 20) == tuple(range(8))
    rows = choose_rows(t1, 64, 4)
    assert len(rows) == 4 and len(set(rows)) == 4 and all(0 <= r < 64 for r in rows)
    assert rows == choose_rows(t1, 64, 4)
    assert rows != choose_rows(t2, 64, 4)
