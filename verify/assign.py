"""Validator assignment: which validators check a submission, drawn so no worker can predict it.

Theory of operation. For a submission with id `sid`, validator v's *ticket* is its Ed25519
signature over `TICKET_DOMAIN || sid`. Ed25519 signing is deterministic, so the ticket is a
fixed function of (v's private key, sid): v cannot re-draw it, anyone can verify it from v's
peer id, and nobody without v's private key (the worker included) can compute it or forge
it. The ticket's *value* `blake3(ticket)`, read as a 256-bit integer, is uniform on
[0, 2**256) and independent across validators and submissions.

Rate. With `n` live validators and a target `rate` (the probability that a submission is
checked at all), v is *eligible* iff value < p * 2**256 with

    p = 1 - (1 - rate) ** (1 / n)

so P(at least one of n eligible) = 1 - (1 - p)**n = rate exactly. At rate 1.0, p = 1: every
validator is eligible. To avoid n redundant checks, eligible validators publish a `Claim`
(their ticket) and wait a short claim window; the one with the *lowest* value checks, the
others stand by and take over only if no verdict arrives in time (a crashed or withholding
winner). So a checked submission is recomputed about once, by a validator that neither the
worker nor the other validators could pick in advance.

Views of n differ a little between validators (peer tables converge over heartbeats). The
rate holds for the view each validator has; when accepting a *remote* verdict a receiver
allows views up to `VIEW_SLACK` times smaller than its own (`p` computed with n // VIEW_SLACK).

Which rollouts: with `rollouts_per_check` = k > 0 the checker recomputes k rows chosen by a
PRNG seeded with the ticket, equally unpredictable to the worker.

Must not: sign anything but tickets, do I/O, or read clocks.
"""

from __future__ import annotations

import random
from fractions import Fraction

import blake3

from p2pnet.errors import MessageRejected
from p2pnet.identity import Identity, SignatureChecker

TICKET_DOMAIN = b"p2pnet/verify/ticket/v1\x00"
VALUE_BITS = 256
VALUE_RANGE = 1 << VALUE_BITS
VIEW_SLACK = 2


def make_ticket(identity: Identity, submission_id: bytes) -> bytes:
    """This validator's ticket for a submission: a deterministic, unforgeable signature."""
    return identity.sign(TICKET_DOMAIN + submission_id)


def check_ticket(checker: SignatureChecker, validator_id_bytes: bytes, submission_id: bytes, ticket: bytes) -> None:
    """Raise MessageRejected('bad_signature' / 'bad_sender') unless `ticket` is the validator's."""
    checker.verify(validator_id_bytes, TICKET_DOMAIN + submission_id, ticket)


def ticket_value(ticket: bytes) -> int:
    """The ticket's lottery value, uniform on [0, 2**256)."""
    return int.from_bytes(blake3.blake3(ticket).digest(), "big")


def eligibility_probability(rate: float, n_validators: int) -> float:
    """p such that at least one of n independent validators is eligible with probability `rate`."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError("rate must lie in [0, 1]")
    n = max(1, n_validators)
    if rate >= 1.0:
        return 1.0
    return 1.0 - (1.0 - rate) ** (1.0 / n)


def eligibility_threshold(rate: float, n_validators: int) -> int:
    """Integer threshold on ticket values: eligible iff value < threshold (exact at p = 0 and 1)."""
    p = eligibility_probability(rate, n_validators)
    if p >= 1.0:
        return VALUE_RANGE
    return int(Fraction(p) * VALUE_RANGE)


def is_eligible(ticket: bytes, rate: float, n_validators: int) -> bool:
    return ticket_value(ticket) < eligibility_threshold(rate, n_validators)


def tolerant_threshold(rate: float, n_validators: int) -> int:
    """The threshold a receiver applies to remote tickets: views of n may be VIEW_SLACK x smaller."""
    return eligibility_threshold(rate, max(1, n_validators // VIEW_SLACK))


def choose_rows(ticket: bytes, n_rows: int, k: int) -> tuple[int, ...]:
    """The rows to recompute: all when k <= 0 or k >= n_rows, else k drawn from the ticket."""
    if k <= 0 or k >= n_rows:
        return tuple(range(n_rows))
    rng = random.Random(blake3.blake3(b"rows\x00" + ticket).digest())
    return tuple(sorted(rng.sample(range(n_rows), k)))


def check_remote_ticket(checker: SignatureChecker, sender_bytes: bytes, submission_id: bytes,
                        ticket: bytes, rate: float, n_validators: int) -> int:
    """Verify a remote validator's ticket and eligibility; returns its value.

    Raises MessageRejected('bad_ticket') for a ticket not signed by the sender over this id,
    MessageRejected('not_selected') for a genuine ticket above the (tolerant) threshold.
    """
    try:
        check_ticket(checker, sender_bytes, submission_id, ticket)
    except MessageRejected as exc:
        raise MessageRejected("bad_ticket", exc.detail) from exc
    value = ticket_value(ticket)
    if value >= tolerant_threshold(rate, n_validators):
        raise MessageRejected("not_selected", "ticket value above the eligibility threshold")
    return value
