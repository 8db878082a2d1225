"""The leaderboard's memory grows with peers, not with accepted batches, and its compute time,
now a running total per worker, is what the per-batch definition gives (`trainer.leaderboard`)."""

from __future__ import annotations

from collections import deque

from relay.messages import HeldVersion, Holding
from tests.trainer.test_intake import CHEAT, VALIDATOR, WORKER, Entry, envelope, make, submit, verdict
from p2pnet.identity import Identity

OTHER = Identity.from_seed_text("val2")


def held(value) -> int:
    """Items in every container reachable from `value`; a deque with a maxlen is bounded by design."""
    if isinstance(value, deque) and value.maxlen is not None:
        return 0
    if isinstance(value, dict):
        return len(value) + sum(held(k) + held(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset, deque)):
        return len(value) + sum(held(v) for v in value)
    if hasattr(value, "__dict__"):
        return sum(held(v) for v in vars(value).values())
    return 0


def holds(intake, worker, version, now):
    intake.on_message(now, envelope(worker, Holding((HeldVersion(version, bytes([version % 255 + 1]) * 32),))))


def steps_run(steps, measure, at, claiming_version_0=False):
    """`steps` steps of one honest worker (published at 10 s a step, held 1 s later, its batch
    arriving 3 s after that, accepted, trained, the window closed, async_level 2); with
    `claiming_version_0`, CHEAT's batch claiming version 0 too, every step, left pending. The
    intake, and `measure(intake)` after each step in `at`."""
    intake = make(async_level=2)
    sizes = {}
    for step in range(steps):
        intake.published(step, 10.0 * step)
        holds(intake, WORKER, step, 10.0 * step + 1)
        _, sid = submit(intake, WORKER, step, now=10.0 * step + 4)
        if claiming_version_0:
            submit(intake, CHEAT, step, version=0, now=10.0 * step + 4.5)
        verdict(intake, sid, WORKER, step, True, now=10.0 * step + 5)
        intake.mark_trained(intake.admissible(10.0 * step + 5, step))
        intake.forget_before_step(step + 1 - 2)
        if step in at:
            sizes[step] = measure(intake)
    return intake, sizes


def test_memory_stays_bounded_over_many_accepted_and_forgotten_steps():
    intake, sizes = steps_run(400, lambda intake: held(intake.contributions), (99, 399))
    assert sizes[399] == sizes[99]  # nothing kept per batch once its step is forgotten
    row = intake.contributions.rows()[0]
    assert row["accepted_batches"] == row["trained_batches"] == 400 and row["compute_s"] == 400 * 3.0


def test_a_batch_claiming_an_old_version_does_not_pin_the_times_kept():
    """A worker whose every batch claims version 0 (never trainable: the learner refuses a version
    more than async_level behind its step) must not keep every version's publish and holding
    times alive for the whole run."""
    intake, sizes = steps_run(200, lambda intake: (len(intake.contributions.published_at), len(intake.holders)),
                              (49, 199), claiming_version_0=True)
    assert sizes[199] == sizes[49]
    assert intake.contributions.rows()[0]["compute_s"] == 200 * 3.0  # the honest worker's timing is untouched


def test_compute_time_is_the_per_batch_definition_on_a_scripted_sequence():
    """By hand, per accepted batch: arrival - max(publish, first holding), at least 0; untimed if
    its version was never published; taken back if a later verdict rejects the batch."""
    intake = make(async_level=4)
    intake.membership.directory.entries[OTHER.peer_id] = Entry(OTHER.peer_id, ("validator",))
    intake.published(0, 10.0)
    holds(intake, WORKER, 0, 12.0)
    _, w0 = submit(intake, WORKER, 0, now=15.0)
    verdict(intake, w0, WORKER, 0, True, now=16.0)  # 15 - max(10, 12) = 3
    _, c0 = submit(intake, CHEAT, 0, now=14.0)
    verdict(intake, c0, CHEAT, 0, True, now=16.5)  # 14 - 10 = 4 ...
    rows = {r["peer_id"]: r["compute_s"] for r in intake.contributions.rows()}
    assert rows == {WORKER.peer_id: 3.0, CHEAT.peer_id: 4.0, VALIDATOR.peer_id: 0.0}
    verdict(intake, c0, CHEAT, 0, False, sender=OTHER, now=17.0)  # ... taken back: rejected later
    _, w1 = submit(intake, WORKER, 1, now=25.0)
    verdict(intake, w1, WORKER, 1, True, now=26.0)  # accepted before version 1's publish time is known
    holds(intake, WORKER, 1, 26.5)  # heard after the verdict: the holding time at the verdict (none) counts
    intake.published(1, 21.0)  # 25 - 21 = 4
    _, c1 = submit(intake, CHEAT, 1, now=20.5)
    verdict(intake, c1, CHEAT, 1, True, now=27.0)  # arrived before the publish time: 0
    _, c2 = submit(intake, CHEAT, 2, version=1, now=30.0)
    verdict(intake, c2, CHEAT, 2, True, now=31.0, version=1)  # 30 - 21 = 9
    _, w2 = submit(intake, WORKER, 2, version=7, now=32.0)
    verdict(intake, w2, WORKER, 2, True, now=33.0, version=7)  # version 7 never published: untimed
    rows = {r["peer_id"]: r for r in intake.contributions.rows()}
    assert rows[WORKER.peer_id]["compute_s"] == 3.0 + 4.0 and rows[WORKER.peer_id]["accepted_batches"] == 3
    assert rows[CHEAT.peer_id]["compute_s"] == 0.0 + 9.0 and rows[CHEAT.peer_id]["accepted_batches"] == 2
    intake.forget_before_step(3)  # forgotten: what they earned stays
    assert intake.contributions.rows()[0]["compute_s"] == 7.0 and intake.contributions.timing == {}
