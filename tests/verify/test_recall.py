"""A restarted trainer gets back what was sent while it was down: it asks (`Recall`), a worker
answers with its submission frames as first published, a validator with its claims and
verdicts; only a trusted trainer is answered, not too often, and a recalled batch is trained
only with a verdict of its own. Pure cores, then three real peers over loopback TCP."""

from __future__ import annotations

import time
from functools import partial
from types import SimpleNamespace

import trio

from p2pnet.core import Send
from p2pnet.identity import Identity
from p2pnet.node import PeerConfig, run_node
from p2pnet.wire import Codec
from tests.trainer.test_intake import VALIDATOR, WALL_S, WORKER, CHEAT, envelope, make, submission, verdict
from trainer.intake import Intake, IntakeConfig
from trainer.intake_recall import EarlyVerdicts
from verify.assign import make_ticket
from verify.messages import Claim, Recall, Recalled, Verdict, submission_id, submission_id_of
from verify.recall import MAX_ANSWER, RecallAnswers, RecallCore
from verify.validator import ValidatorCore, ValidatorCoreConfig

TRAINER = Identity.from_seed_text("recall-trainer")


def recall(sender, since: int, at: float = WALL_S):
    return envelope(sender, Recall(since), at)


def test_answers_go_to_a_trusted_trainer_only_for_the_steps_asked_and_not_too_often():
    answers = RecallAnswers([TRAINER.peer_id], per_worker=3, interval_s=30.0)
    for step in range(5):  # the oldest two fall out of the bound
        answers.sent(WORKER.peer_id, step, f"body{step}")
    assert answers.answer(0.0, recall(CHEAT, 0)) == []  # a stranger: nothing
    assert answers.answer(0.0, recall(TRAINER, 3)) == [Send(TRAINER.peer_id, "body3"), Send(TRAINER.peer_id, "body4")]
    assert answers.answer(10.0, recall(TRAINER, 0)) == []  # again within the interval: nothing
    assert [e.body for e in answers.answer(40.0, recall(TRAINER, 0))] == ["body2", "body3", "body4"]
    assert answers.stats == {"answered": 2, "refused_untrusted": 1, "refused_too_soon": 1, "sent": 5}
    assert RecallAnswers([], per_worker=3).answer(0.0, recall(TRAINER, 0)) == []  # none trusted: none answered


def test_one_workers_burst_pushes_out_only_its_own_and_an_answer_is_bounded():
    answers = RecallAnswers([TRAINER.peer_id], per_worker=8, workers=2 * MAX_ANSWER)
    answers.sent(WORKER.peer_id, 3, "honest")
    for step in range(10**4):  # claims on made-up future steps
        answers.sent(CHEAT.peer_id, 10**6 + step, "junk")
    bodies = [e.body for e in answers.answer(0.0, recall(TRAINER, 3))]
    assert bodies.count("honest") == 1 and bodies.count("junk") == 8
    for n in range(2 * MAX_ANSWER):
        answers.sent(f"w{n}", 5, "more")
    assert len(answers.answer(100.0, recall(TRAINER, 0))) == MAX_ANSWER


def test_a_validator_answers_with_its_claims_and_verdicts():
    core = ValidatorCore(ValidatorCoreConfig(claim_window_s=0, workers=(WORKER.peer_id,),
                                             validators=(VALIDATOR.peer_id,), trainers=(TRAINER.peer_id,)),
                         VALIDATOR, None)
    env = envelope(WORKER, submission(WORKER, 4))
    sid = submission_id(env)
    core.on_message(1.0, env)
    core.check_done(2.0, sid, True, (), 2, 0.1)
    bodies = [e.body for e in core.on_message(3.0, recall(TRAINER, 4))]
    assert [type(b) for b in bodies] == [Claim, Verdict] and all(b.submission_id == sid for b in bodies)
    assert bodies[1].accepted and core.on_message(50.0, recall(TRAINER, 5)) == []  # a later step: none


def test_a_recalled_frame_older_than_the_codec_allows_is_taken_and_trained_only_with_a_verdict():
    intake = make()
    frame = Codec(WORKER).encode(submission(WORKER, 2), WALL_S - 3600)  # an hour old: gossip would drop it
    intake.on_message(1.0, envelope(WORKER, Recalled(frame)))  # not asked: not taken
    assert intake.batches == {} and intake.dropped == {"recall_unasked": 1}
    intake.dropped.clear()
    intake.asking(WORKER.peer_id)
    intake.on_message(1.0, envelope(WORKER, Recalled(frame)))
    sid = submission_id_of(frame)
    assert intake.batches[sid].skewed and intake.dropped == {}  # never unchecked
    assert intake.admissible(100.0, 2) == []
    verdict(intake, sid, WORKER, 2, True, now=3.0)
    assert [b.sid for b in intake.admissible(4.0, 2)] == [sid]


def test_a_recalled_frame_must_be_the_senders_own_and_sound():
    intake = make()
    intake.asking(WORKER.peer_id)
    intake.asking(CHEAT.peer_id)
    theirs = Codec(WORKER).encode(submission(WORKER, 2), WALL_S)
    intake.on_message(1.0, envelope(CHEAT, Recalled(theirs)))  # another worker's batch as its own
    intake.on_message(1.0, envelope(WORKER, Recalled(theirs[:-1] + bytes([theirs[-1] ^ 1]))))  # a bad signature
    intake.on_message(1.0, envelope(WORKER, Recalled(Codec(WORKER).encode(Recall(0), WALL_S))))  # not a submission
    assert intake.batches == {} and intake.dropped == {"recall_bad": 3}


def test_a_verdict_that_comes_before_its_submission_counts_when_the_submission_comes():
    intake = make()
    env = envelope(WORKER, submission(WORKER, 1))
    sid = submission_id(env)
    verdict(intake, sid, WORKER, 1, True, now=1.0)  # the validator's answer overtook the worker's
    assert intake.dropped == {} and len(intake.early) == 1
    intake.on_message(2.0, env)
    assert [b.sid for b in intake.admissible(3.0, 1)] == [sid] and len(intake.early) == 0


def test_early_verdicts_are_bounded_in_number_per_validator_and_in_time():
    early = EarlyVerdicts(kept=3, per_sender=2, keep_s=10.0)
    honest, flooding = SimpleNamespace(sender="honest"), SimpleNamespace(sender="flooding")
    early.park(0.0, bytes([9]) * 32, honest)
    for i in range(5):  # one validator's share is full after two
        early.park(1.0, bytes([i]) * 32, flooding)
    assert len(early) == 3 and early.take(2.0, bytes([9]) * 32) == [honest]
    for i in range(3):
        early.park(3.0 + i, bytes([10 + i]) * 32, SimpleNamespace(sender=f"v{i}"))
    assert len(early) == 3 and early.take(6.0, bytes([0]) * 32) == []  # the oldest went for the bound
    assert early.take(20.0, bytes([12]) * 32) == [] and len(early) == 0  # and the rest with time


async def test_a_restarted_trainer_gets_back_a_batch_and_its_verdict_over_the_network(tmp_path):
    """Three real peers: the worker kept its frame from ten minutes ago, the validator its
    verdict; the trainer, whose intake heard neither, asks both and can train the batch."""
    body = submission(WORKER, 3)
    frame = Codec(WORKER).encode(body, time.time() - 600)
    sid = submission_id_of(frame)
    worker_core = RecallCore([TRAINER.peer_id])
    worker_core.answers.sent(WORKER.peer_id, 3, Recalled(frame))
    validator_core = ValidatorCore(ValidatorCoreConfig(workers=(WORKER.peer_id,), validators=(VALIDATOR.peer_id,),
                                                       trainers=(TRAINER.peer_id,)), VALIDATOR, None)
    validator_core.recall.sent(WORKER.peer_id, 3, Verdict(sid, WORKER.peer_id, 3, 3, True, (), 2, make_ticket(VALIDATOR, sid)))
    intake = Intake(IntakeConfig(workers=(WORKER.peer_id,), validators=(VALIDATOR.peer_id,)), TRAINER.peer_id, None)
    intake.asking(WORKER.peer_id)  # as the trainer role does when it sends the recall
    async with trio.open_nursery() as peers:
        trainer = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "t"), identity=TRAINER))
        worker = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "w"), identity=WORKER))
        validator = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "v"), identity=VALIDATOR))
        await peers.start(trainer.run_core, intake, "intake")
        await peers.start(worker.run_core, worker_core, "recall")
        await peers.start(validator.run_core, validator_core, "validator")
        for peer in (worker, validator):
            await trainer.host.connect(peer.host.addrs()[0])
        with trio.fail_after(60):
            await trainer.send(validator.peer_id, Recall(2))  # the validator's answer may come first
            await trainer.send(worker.peer_id, Recall(2))
            while not intake.admissible(trio.current_time(), 3):
                await trio.sleep(0.05)
        [batch] = intake.admissible(trio.current_time(), 3)
        assert batch.sid == sid and batch.submission == body and batch.skewed
        peers.cancel_scope.cancel()
