"""A trainer that restarts mid-step trains that step on the batches it heard before: workers
send one batch per step and wait for the next version, so without them the network stalls.
The pure core (snapshot, restore, `resume_at`), the payload files beside the state file, and
the worker, intake and learner together across a crash."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import trio

import trainer.roles as roles
from p2pnet.errors import MessageRejected
from p2pnet.wire import Codec, kept_envelope, signed_payload
from tests.trainer.test_intake import (CHEAT, RATE, VALIDATOR, WALL_S, WORKER, Directory, Entry, envelope, make,
                                       signed, submission, submit, verdict)
from trainer.intake import Intake, IntakeConfig
from trainer.intake_state import BATCHES_DIR, SOON_S, IntakeStateFile, load_into
from trainer.checkpoint import trained_keys
from trainer.learner import Learner, LearnerConfig
from trainer.model import save_model_dir
from verify.messages import Claim, submission_id
from verify.assign import make_ticket
from verify.verdicts import Outcome
from p2pnet.identity import Identity
from verify.messages import Recall, submission_id_of

TRAINER = Identity.from_seed_text("kept-trainer")


def through_disk(intake: Intake, tmp_path, *, now: float = 0.0, wall_s: float = WALL_S + 5, **kw) -> Intake:
    """`intake` saved as the trainer role saves it at shutdown, then read back by a restarted one
    (in a trio run: the save reads trio's clock)."""
    path = tmp_path / "intake_state.json"
    IntakeStateFile(path, intake, wall=lambda: WALL_S + 3).save()
    again = make(**kw)
    assert load_into(again, path, now, wall_s) is True
    return again


def test_the_wire_gives_back_a_kept_payload_and_nothing_else():
    env = envelope(WORKER, submission(WORKER, 3))
    kept = kept_envelope(signed_payload(env))
    assert (kept.body, kept.sender, kept.ts_ms, submission_id(kept)) == (env.body, env.sender, env.ts_ms,
                                                                         submission_id(env))
    with pytest.raises(MessageRejected):
        kept_envelope(b"\x83\x01\x02\x03")


async def test_an_accepted_batch_comes_back_admissible_and_a_rejected_one_stays_out(tmp_path):
    before = make()
    good, good_sid = submit(before, WORKER, 4)
    verdict(before, good_sid, WORKER, 4, True)
    _, bad_sid = submit(before, CHEAT, 4)
    verdict(before, bad_sid, CHEAT, 4, False)
    after = through_disk(before, tmp_path)
    assert [(b.sid, b.submission) for b in after.admissible(10.0, 4)] == [(good_sid, good.body)]
    assert after.ledger.outcome(bad_sid) is Outcome.REJECTED and after.undecided_workers(10.0, 4) == []
    assert after.reputation.failures(CHEAT.peer_id) == 1


async def test_marks_come_back_a_claim_a_sibling_a_refusal(tmp_path):
    before = make(sample_rate=RATE, unchecked_after_s=5.0)
    drawn = signed(WORKER, submission(WORKER, 2), drawn=True)
    before.on_message(1.0, drawn)
    claimed = submission_id(drawn)
    before.on_message(1.0, envelope(VALIDATOR, Claim(claimed, make_ticket(VALIDATOR, claimed))))
    assert before.batches[claimed].claimed
    submit(before, CHEAT, 2)
    second = envelope(CHEAT, submission(CHEAT, 2, nonce=b"n" * 16), WALL_S + 1)  # a second copy of a step
    before.on_message(1.0, second)
    _, refused = submit(before, WORKER, 3)
    verdict(before, refused, WORKER, 3, True)
    before.mark_refused([before.batches[refused]])
    after = through_disk(before, tmp_path, sample_rate=RATE, unchecked_after_s=5.0)
    for sid, batch in before.batches.items():
        back = after.batches[sid]
        assert (back.claimed, back.sibling, back.refused) == (batch.claimed, batch.sibling, batch.refused)
    assert after.batches[submission_id(second)].sibling and after.batches[refused].refused
    # the claimed batch waits for its verdict, the siblings for theirs, the refused one never comes
    assert after.admissible(100.0, 3) == []


def test_training_marks_of_a_version_the_learner_lost_are_taken_back():
    before = make(async_level=1)
    for step in (5, 6):
        _, sid = submit(before, WORKER, step)
        verdict(before, sid, WORKER, step, True)
    before.mark_trained(before.admissible(3.0, 5), 6)  # step 5 went into version 6
    before.mark_trained(before.admissible(3.0, 6), 7)  # step 6 into version 7, which never reached disk
    state = json.loads(json.dumps(before.snapshot(3.0, WALL_S + 3)))
    payloads = {b.sid: signed_payload(b.envelope) for b in before.batches.values()}
    after = make(async_level=1)
    assert after.restore(state, 0.0, WALL_S + 5, payloads) == 0
    after.resume_at(6)
    assert [b.submission.step for b in after.admissible(3.0, 6)] == [6]  # trained again, into version 7
    row = after.contributions.workers[WORKER.peer_id]
    assert row.trained_batches == 1  # the lost training is not counted


def test_a_damaged_or_foreign_payload_is_left_out_and_counted(tmp_path):
    before = make()
    ids = []
    for worker in (WORKER, CHEAT):
        _, sid = submit(before, worker, 1)
        verdict(before, sid, worker, 1, True)
        ids.append(sid)
    state = json.loads(json.dumps(before.snapshot(3.0, WALL_S + 3)))
    payloads = {sid: signed_payload(before.batches[sid].envelope) for sid in ids}
    other_step = signed_payload(envelope(WORKER, submission(WORKER, 2)))  # sound, the worker's, another batch
    swapped = {ids[0]: other_step, ids[1]: payloads[ids[0]]}  # the other worker's
    after = make()
    assert after.restore(state, 0.0, WALL_S + 5, swapped) == 2
    assert after.batches == {} and set(after.by_step) == {(WORKER.peer_id, 1), (CHEAT.peer_id, 1)}
    whole = make()
    assert whole.restore(state, 0.0, WALL_S + 5, payloads) == 0 and set(whole.batches) == set(ids)


async def test_a_credit_carried_across_a_restart_is_neither_doubled_nor_kept_after_a_rejection(tmp_path):
    before = make()
    _, sid = submit(before, WORKER, 2)
    verdict(before, sid, WORKER, 2, True)
    after = through_disk(before, tmp_path)
    assert after.contributions.workers[WORKER.peer_id].accepted_batches == 1
    other = Identity.from_seed_text("val2")
    after.membership.directory.entries[other.peer_id] = Entry(other.peer_id, ("validator",))
    verdict(after, sid, WORKER, 2, False, sender=other, now=3.0)  # a later verdict rejects it
    row = after.contributions.workers[WORKER.peer_id]
    assert row.accepted_batches == 0 and row.rejected_batches == 1 and after.admissible(4.0, 2) == []


async def test_payloads_are_on_disk_soon_after_they_are_heard_and_go_with_their_batches(tmp_path, autojump_clock):
    path = tmp_path / "intake_state.json"
    intake = make(async_level=0)
    saver = IntakeStateFile(path, intake, interval_s=3600.0, wall=lambda: WALL_S + trio.current_time())
    folder = tmp_path / BATCHES_DIR
    async with trio.open_nursery() as nursery:
        nursery.start_soon(saver.keep)
        _, sid = submit(intake, WORKER, 0, now=trio.current_time())
        heard = trio.current_time()
        await saver.wait_saved(intake.revision)
        assert trio.current_time() - heard <= SOON_S + 0.1  # not left to the hour's interval
        assert (folder / sid.hex()).read_bytes() and intake.batches[sid].envelope is None
        (folder / ".leftover.tmp1").write_bytes(b"x")  # a crash's half-written file
        intake.forget_before_step(1)
        saver.urgent()
        await saver.wait_saved(intake.revision)
        assert list(folder.iterdir()) == []
        nursery.cancel_scope.cancel()


async def test_a_missing_payload_costs_its_batch_only(tmp_path, caplog):
    before = make()
    ids = [submit(before, w, 1)[1] for w in (WORKER, CHEAT)]
    path = tmp_path / "intake_state.json"
    IntakeStateFile(path, before, wall=lambda: WALL_S + 3).save()
    (tmp_path / BATCHES_DIR / ids[1].hex()).unlink()
    after = make()
    with caplog.at_level(logging.WARNING):
        assert load_into(after, path, 0.0, WALL_S + 5) is True
    assert set(after.batches) == {ids[0]} and "1 batch(es)" in caplog.text


async def test_a_trainer_that_crashes_mid_step_trains_that_step_after_the_restart(tmp_path, tiny):
    """The worker role submits its batch for step 0 and waits for version 1; a validator accepts
    it; the trainer's process dies before training (no shutdown save). The restarted trainer
    reads its state folder and trains step 0 on that batch: version 1 comes."""
    model, tokenizer = tiny
    base = save_model_dir(model, tokenizer, tmp_path / "base")
    cfg = LearnerConfig(prompts_per_batch=2, group_size=2, max_new_tokens=3, task_seed=0, keep_last=0)
    learner = Learner(cfg, base, tmp_path / "out")
    published = {"latest": 0}
    intake = Intake(IntakeConfig(), "trainer-id", Directory())
    path = tmp_path / "out" / "intake_state.json"
    saver = IntakeStateFile(path, intake)

    class Watcher:
        latest = property(lambda self: published["latest"])
        complete_versions = staticmethod(lambda: list(range(published["latest"] + 1)))

        async def wait_change(self):
            await trio.sleep_forever()

    class Relay:
        watcher, store = Watcher(), SimpleNamespace(version_stamp=lambda v: v, version_files=lambda v: ())
        config = SimpleNamespace(trusted_publishers=(TRAINER.peer_id,))

        async def wait_for_version(self, version):
            while published["latest"] < version:
                await trio.sleep(0.05)

    submitted = trio.Event()
    steps: list[int] = []

    async def publish(topic, body):  # gossip, as the trainer hears it, and a validator's accepting verdict
        frame = Codec(WORKER).encode(body, WALL_S)
        env = Codec(None).decode(frame, WALL_S)
        intake.on_message(trio.current_time(), env)
        verdict(intake, submission_id(env), WORKER, body.step, True, now=trio.current_time(),
                version=body.model_version)
        steps.append(body.step)
        submitted.set()
        return frame

    async def run_core(core, name, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started(None)
        await trio.sleep_forever()

    node = SimpleNamespace(peer_id=WORKER.peer_id, roles={"relay": Relay()}, publish=publish, run_core=run_core,
                           config=SimpleNamespace(data_dir=tmp_path / "worker"))
    worker = roles.WorkerRole(node, {"model_dir": str(base), "max_new_tokens": 3, "prompts_per_batch": 2,
                                     "group_size": 2, "backend": "torch"})
    original = roles.load_version
    roles.load_version = lambda base_dir, store, version, loaded: (learner.model, learner.tokenizer)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(saver.keep)
            nursery.start_soon(worker.run)
            await submitted.wait()
            await saver.wait_saved(intake.revision)
            assert saver.saved_heard == intake.heard_once
            nursery.cancel_scope.cancel()  # the process dies: no save on the way out
        assert worker.totals["batches"] == 1 and published["latest"] == 0  # the worker waits for version 1
        [answer] = worker.recall.on_message(0.0, envelope(TRAINER, Recall(0)))  # it kept the frame for a recall
        assert submission_id_of(answer.body.frame) in intake.batches
        again = roles.WorkerRole(node, {"model_dir": str(base), "max_new_tokens": 3, "prompts_per_batch": 2,
                                        "group_size": 2, "backend": "torch"})  # the worker restarts too
        assert again.resumed_step == 0 and [a.body.frame for a in again.recall.on_message(
            0.0, envelope(TRAINER, Recall(0)))] == [answer.body.frame]
        submitted = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(again.run)
            await submitted.wait()
            nursery.cancel_scope.cancel()
        assert steps == [0, 1]  # not step 0 again, which validators refuse and penalise: the next, async
    finally:
        roles.load_version = original
    learner.close()

    restarted = Intake(IntakeConfig(), "trainer-id", Directory())
    assert load_into(restarted, path, 0.0, WALL_S + 30) is True
    learner = Learner(cfg, base, tmp_path / "out")
    restarted.resume_at(learner.version)
    ready = restarted.admissible(1.0, learner.version)
    assert [(b.worker, b.submission.step) for b in ready] == [(WORKER.peer_id, 0)]
    stats = learner.step([roles._to_batch(b) for b in ready])
    assert stats.trained and stats.version == 1 and stats.refused == ()
    learner.flush()  # version 1 on disk says which batch made it (`Intake.resume_at` reads it after a crash)
    assert trained_keys(tmp_path / "out", 1) == {(WORKER.peer_id, 0)}
    learner.close()


async def test_a_restarted_trainer_asks_each_worker_and_validator_it_meets_once(tmp_path, autojump_clock):
    from tests.trainer.test_intake_restart import FakeNode

    sent = []
    node = FakeNode(tmp_path)
    node.carry_out = lambda origin, effect: sent.append(effect)
    role = roles.TrainerRole(node, {"model_dir": str(tmp_path / "model"), "out_dir": str(tmp_path / "out")})
    assert not role.restored  # a first start asks nobody (`_train` starts `_recall` only after a restore)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(role._recall, 4, trio.CancelScope())
        await trio.sleep(5.0)
        late = Identity.from_seed_text("late-worker")  # met later: asked then
        node.peertable.entries[late.peer_id] = Entry(late.peer_id, ("worker",))
        await trio.sleep(roles.RECALL_FOR_S)
        node.peertable.entries["too-late"] = Entry("too-late", ("worker",))
        await trio.sleep(10.0)
        nursery.cancel_scope.cancel()
    asked = {e.peer: e.body for e in sent}
    assert len(sent) == len(asked) == 4 and set(asked.values()) == {Recall(4)}
    assert role.intake.asked == set()  # answers are taken no more
    assert set(asked) == {WORKER.peer_id, CHEAT.peer_id, VALIDATOR.peer_id, late.peer_id}


async def test_an_undrawn_batch_waits_again_after_a_restart_and_then_trains(tmp_path):
    """At a sample rate below 1, a batch nobody claimed before the crash may have been claimed
    (and failed) while the trainer was down: it waits `unchecked_after_s` from the restart, time
    for the recall's answers, before it is admitted unchecked; then it trains like any other."""
    before = make(sample_rate=RATE, unchecked_after_s=5.0)
    undrawn = signed(WORKER, submission(WORKER, 2), drawn=False)
    before.on_message(1.0, undrawn)
    assert [b.sid for b in before.admissible(100.0, 2)] == [submission_id(undrawn)]  # long due before the crash
    after = through_disk(before, tmp_path, now=100.0, sample_rate=RATE, unchecked_after_s=5.0)
    assert after.admissible(100.0, 2) == [] and after.admissible(104.0, 2) == []
    [batch] = after.admissible(105.0, 2)
    after.mark_trained([batch], 3)
    assert after.batches[batch.sid].trained and after.workers_json()[0]["trained_batches"] == 1


async def test_the_future_step_bound_holds_from_the_restart(tmp_path):
    before = make(async_level=1)
    before.published(4, 0.0)
    submit(before, WORKER, 6)  # as far as a worker can be
    after = through_disk(before, tmp_path, async_level=1)
    assert after.latest_published == 4 and [b.submission.step for b in after.batches.values()] == [6]
    submit(after, CHEAT, 7)  # before the restarted trainer publishes anything
    assert after.dropped == {"future_step": 1} and len(after.batches) == 1
    state = json.loads(json.dumps(before.snapshot(3.0, WALL_S + 3)))
    state["latest_published"] = 3  # a batch beyond the bound on disk (an older trainer kept it) is not taken back
    payloads = {sid: (tmp_path / BATCHES_DIR / sid.hex()).read_bytes() for sid in before.batches}
    bounded = make(async_level=1)
    bounded.restore(state, 0.0, WALL_S + 5, payloads)
    assert bounded.batches == {}


def test_training_marks_are_saved_soon():
    intake = make()
    _, sid = submit(intake, WORKER, 0)
    verdict(intake, sid, WORKER, 0, True)
    heard = intake.heard_once
    intake.mark_trained(intake.admissible(3.0, 0), 1)
    assert intake.heard_once > heard  # within a second, not five: the learner's version may be on disk first


async def test_batches_are_forgotten_only_once_the_version_they_made_is_on_disk(tmp_path):
    import threading

    from tests.trainer.test_intake_restart import FakeNode

    role = roles.TrainerRole(FakeNode(tmp_path), {"model_dir": str(tmp_path / "m"), "out_dir": str(tmp_path / "o"),
                                                  "async_level": 0})
    for step in (0, 1):
        submit(role.intake, WORKER, step)
    written = threading.Event()
    role.learner = SimpleNamespace(flush=lambda: written.wait(30))
    role.relay = SimpleNamespace(watcher=SimpleNamespace(is_complete=lambda version: True))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(role._flush_and_publish, 1)
        await trio.sleep(0.2)
        assert role.intake.forgotten_before == 0 and len(role.intake.batches) == 2  # version 1 not on disk yet
        written.set()
    assert role.intake.forgotten_before == 1 and [b.submission.step for b in role.intake.batches.values()] == [1]


def test_a_batch_the_learner_trained_whose_mark_the_crash_lost_is_not_offered_again():
    before = make()
    _, sid = submit(before, WORKER, 0)
    verdict(before, sid, WORKER, 0, True)
    state = json.loads(json.dumps(before.snapshot(3.0, WALL_S + 3)))  # saved before the learner's step
    after = make()
    after.restore(state, 0.0, WALL_S + 5, {sid: signed_payload(before.batches[sid].envelope)})
    after.resume_at(1, {(WORKER.peer_id, 0)})  # version 1 on disk says it trained that key
    assert after.admissible(10.0, 1) == [] and after.batches[sid].trained_into == 1
    assert after.contributions.workers[WORKER.peer_id].trained_batches == 1
