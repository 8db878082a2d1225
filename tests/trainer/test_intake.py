"""The trainer's intake admits only batches that validators accepted, within the async window;
unchecked only what was not drawn, never a copy that validators may have refused unclaimed."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from p2pnet.core import Emit, Publish, SetTimer
from p2pnet.errors import StaleMessage
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from trainer.intake import BatchesSkewed, Intake, IntakeConfig
from verify.validator import TIMER_SWEEP, Penalise, SubmissionRejected, ValidatorCore, ValidatorCoreConfig
from verify.assign import is_eligible, make_ticket
from verify.messages import Claim, Submission, Verdict, rollout_record, submission_id
from verify.reputation import WorkerBanned

WALL_S = 1_800_000_000.0
VALIDATOR, WORKER, CHEAT, STRANGER = (Identity.from_seed_text(n) for n in ("val", "w", "cheat", "stranger"))


@dataclass(frozen=True)
class Entry:
    peer_id: str
    roles: tuple[str, ...]


class Directory:
    def __init__(self) -> None:
        self.entries = {VALIDATOR.peer_id: Entry(VALIDATOR.peer_id, ("validator",)),
                        WORKER.peer_id: Entry(WORKER.peer_id, ("worker",)),
                        CHEAT.peer_id: Entry(CHEAT.peer_id, ("worker",))}

    def get(self, peer):
        return self.entries.get(peer)

    def with_role(self, role):
        return [e for e in self.entries.values() if role in e.roles]


def envelope(identity, body, ts=WALL_S):
    return Codec(None).decode(Codec(identity).encode(body, ts), ts)


def submission(worker, step, version=None, nonce=None):
    rollouts = tuple(rollout_record(prompt_ids=[1, 5], output_ids=[7, 2], logprobs=[-0.5, -0.1],
                                    proofs=[b"\x01" * 258], stop_reason="eos", row=r) for r in range(2))
    return Submission(model="tiny", model_version=step if version is None else version, step=step, seed=1,
                      task_seed=0, prompts_per_submission=1, group_size=2, temperature=1.0, max_new_tokens=3,
                      rollouts=rollouts, nonce=nonce or random.Random(f"{worker.peer_id}{step}").randbytes(16))


def submit(intake, worker, step, version=None, now=1.0):
    env = envelope(worker, submission(worker, step, version))
    intake.on_message(now, env)
    return env, submission_id(env)


def verdict(intake, sid, worker, step, accepted, sender=VALIDATOR, now=2.0, version=None):
    body = Verdict(sid, worker.peer_id, step if version is None else version, step, accepted,
                   () if accepted else ("row0:sampling_mismatch",), 2, make_ticket(sender, sid))
    return intake.on_message(now, envelope(sender, body))


def make(**kw) -> Intake:
    return Intake(IntakeConfig(**kw), "trainer-id", Directory())


def test_unverified_batches_are_not_admitted_and_accepted_ones_are():
    intake = make()
    _, sid = submit(intake, WORKER, 0)
    assert intake.admissible(3.0, 0) == []
    assert set(intake.undecided_workers(3.0, 0)) == {WORKER.peer_id, CHEAT.peer_id}
    verdict(intake, sid, WORKER, 0, True)
    assert [b.sid for b in intake.admissible(3.0, 0)] == [sid]
    assert intake.undecided_workers(3.0, 0) == [CHEAT.peer_id]


def test_rejected_batches_never_reach_training_and_repeat_offenders_are_banned():
    intake = make(ban_after_failures=2)
    _, sid0 = submit(intake, CHEAT, 0)
    verdict(intake, sid0, CHEAT, 0, False)
    assert intake.admissible(3.0, 0) == []
    _, sid1 = submit(intake, CHEAT, 1)
    effects = verdict(intake, sid1, CHEAT, 1, False, now=4.0)
    assert any(isinstance(e, Emit) and isinstance(e.event, WorkerBanned) for e in effects)
    _, sid2 = submit(intake, CHEAT, 2, now=5.0)  # a banned worker's later batches are dropped
    assert intake.dropped.get("banned_worker") == 1
    assert intake.admissible(6.0, 2) == []
    [ledger] = [w for w in intake.workers_json() if w["peer_id"] == CHEAT.peer_id]
    assert ledger["banned"] and ledger["rejected"] == 2 and ledger["trained_batches"] == 0


def test_one_rejection_outweighs_an_acceptance():
    intake = make()
    _, sid = submit(intake, WORKER, 0)
    verdict(intake, sid, WORKER, 0, True)
    other = Identity.from_seed_text("val2")
    intake.membership.directory.entries[other.peer_id] = Entry(other.peer_id, ("validator",))
    verdict(intake, sid, WORKER, 0, False, sender=other)
    assert intake.admissible(3.0, 0) == []


def test_the_async_window_is_respected():
    intake = make(async_level=2)
    _, sid = submit(intake, WORKER, 1, version=1)
    verdict(intake, sid, WORKER, 1, True)
    assert [b.sid for b in intake.admissible(3.0, 3)] == [sid]  # 2 steps behind: allowed
    assert intake.admissible(3.0, 4) == []                        # 3 behind: too stale
    assert intake.admissible(3.0, 0) == []                        # from the future: no


def test_trained_batches_are_counted_once():
    intake = make()
    _, sid = submit(intake, WORKER, 0)
    verdict(intake, sid, WORKER, 0, True)
    batches = intake.admissible(3.0, 0)
    intake.mark_trained(batches)
    assert intake.admissible(3.0, 0) == []
    [ledger] = [w for w in intake.workers_json() if w["peer_id"] == WORKER.peer_id]
    assert ledger["trained_batches"] == 1 and ledger["accepted"] == 1


def test_closed_steps_are_forgotten_but_what_they_earned_and_a_late_failure_count():
    intake = make(async_level=2, ban_after_failures=1)
    for step in range(200):  # a long run: the trainer forgets each step whose window closed
        _, sid = submit(intake, WORKER, step)
        verdict(intake, sid, WORKER, step, True)
        intake.mark_trained(intake.admissible(3.0, step))
        intake.forget_before_step(step + 1 - 2)
    assert len(intake.batches) == 2 and len(intake.workers[WORKER.peer_id].outcomes) == 2
    assert len(intake.holders) <= 3
    [ledger] = [w for w in intake.workers_json() if w["peer_id"] == WORKER.peer_id]
    assert ledger["accepted"] == 200 and ledger["trained_batches"] == 200 and ledger["submitted"] == 200
    env, old_sid = submit(intake, CHEAT, 198)  # still in the window
    intake.forget_before_step(199 + 1)
    intake.on_message(4.0, env)  # a late echo of a forgotten batch is not counted again
    assert intake.dropped["stale_step"] == 1 and intake.workers[CHEAT.peer_id].submitted == 1
    submit(intake, CHEAT, 150)  # a batch for a closed step: too late to train on
    assert intake.dropped["stale_step"] == 2 and intake.workers[CHEAT.peer_id].submitted == 1
    effects = verdict(intake, old_sid, CHEAT, 198, False)  # its failure arrives after it was forgotten
    assert any(isinstance(e.event, WorkerBanned) for e in effects) and intake.workers[CHEAT.peer_id].banned


def test_forged_and_foreign_verdicts_are_penalised_not_believed():
    intake = make()
    _, sid = submit(intake, WORKER, 0)
    effects = verdict(intake, sid, WORKER, 0, True, sender=STRANGER)  # not a validator
    assert [e.event for e in effects] == [Penalise(STRANGER.peer_id, "not_validator")]
    body = Verdict(sid, WORKER.peer_id, 0, 0, True, (), 2, make_ticket(STRANGER, sid))  # someone else's ticket
    effects = intake.on_message(2.0, envelope(VALIDATOR, body))
    assert [e.event.reason for e in effects] == ["bad_ticket"]
    assert intake.admissible(3.0, 0) == []


@pytest.mark.parametrize("validators", [None, "listed"])
def test_a_peer_running_both_roles_cannot_accept_its_own_batch(validators):
    """A peer may be a worker and a validator at once (its heartbeat says so, or the trainer lists
    it), but a verdict it signs on its own submission is refused: not credited, not trained on."""
    intake = make(validators=(VALIDATOR.peer_id, CHEAT.peer_id)) if validators else make()
    intake.membership.directory.entries[CHEAT.peer_id] = Entry(CHEAT.peer_id, ("worker", "validator"))
    _, sid = submit(intake, CHEAT, 0)
    effects = verdict(intake, sid, CHEAT, 0, True, sender=CHEAT)
    assert [e.event for e in effects] == [Penalise(CHEAT.peer_id, "self_verdict")]
    assert intake.admissible(3.0, 0) == []
    row = next(r for r in intake.contributions.rows() if r["peer_id"] == CHEAT.peer_id)
    assert row["accepted_batches"] == row["accepted_tokens"] == row["checks"] == 0
    _, honest = submit(intake, WORKER, 0)  # and the same peer checking someone else's work counts
    assert verdict(intake, honest, WORKER, 0, True, sender=CHEAT) == []
    assert [b.sid for b in intake.admissible(3.0, 0)] == [honest]


def test_submissions_from_non_workers_are_dropped():
    intake = make()
    submit(intake, STRANGER, 0)
    assert intake.dropped == {"unknown_worker": 1} and intake.batches == {}


def test_unclaimed_batches_pass_unchecked_only_below_full_sample_rate():
    intake = make(sample_rate=0.5, unchecked_after_s=10.0)
    _, sid = submit(intake, WORKER, 0, now=1.0)
    assert intake.admissible(5.0, 0) == []
    assert [b.sid for b in intake.admissible(11.5, 0)] == [sid]
    claimed = make(sample_rate=0.5, unchecked_after_s=10.0)
    drawn = undrawn = None  # a submission the validator is drawn for, and one it is not
    for step in range(64):
        _, sid = submit(claimed, WORKER, step, now=1.0)
        if is_eligible(make_ticket(VALIDATOR, sid), 0.5, 1):
            drawn = drawn or (step, sid)
        else:
            undrawn = undrawn or (step, sid)
    assert drawn is not None and undrawn is not None
    claimed.on_message(1.5, envelope(VALIDATOR, Claim(drawn[1], make_ticket(VALIDATOR, drawn[1]))))
    assert drawn[1] not in {b.sid for b in claimed.admissible(11.5, drawn[0])}  # claimed: wait for the verdict
    # a claim the validator was not drawn for, or a ticket it did not sign, holds nothing back: no
    # verdict would ever come for it (the validators refuse such claims as well)
    claimed.on_message(1.5, envelope(VALIDATOR, Claim(undrawn[1], make_ticket(VALIDATOR, undrawn[1]))))
    claimed.on_message(1.5, envelope(VALIDATOR, Claim(undrawn[1], bytes(64))))
    assert undrawn[1] in {b.sid for b in claimed.admissible(11.5, undrawn[0])}
    assert claimed.dropped == {"claim_not_selected": 1, "claim_bad_ticket": 1}
    assert make().admissible(100.0, 0) == []



def test_a_step_no_honest_worker_can_be_at_yet_is_refused_not_kept_for_ever():
    """A worker runs at most async_level steps ahead of the newest version it holds; a batch for a
    later step would never be forgotten (`forget_before_step` forgets only earlier steps)."""
    intake = make(async_level=2)
    submit(intake, WORKER, 50)  # nothing published yet: the intake cannot tell, and keeps it
    intake.published(4, 1.0)
    for step in (4, 6, 7):  # the newest version, a worker two and three steps ahead
        submit(intake, WORKER, step)
    submit(intake, WORKER, 8)
    submit(intake, WORKER, 10**9)
    assert sorted(b.submission.step for b in intake.batches.values()) == [4, 6, 7, 50]
    assert intake.dropped == {"future_step": 2}
    intake.published(7, 2.0)
    submit(intake, WORKER, 8)  # the window moved with the newest version
    assert 8 in {b.submission.step for b in intake.batches.values()}

# -- siblings: a worker's batches that share a step or a nonce are never admitted unchecked --------

RATE = 0.5


def signed(worker, body, drawn=None, after=WALL_S):
    """The first frame of `body` signed at a whole second after `after` whose id VALIDATOR is
    (drawn=True) or is not (drawn=False) eligible to check at RATE; any when drawn is None."""
    for k in range(1, 200):
        env = envelope(worker, body, after + k)
        if drawn is None or is_eligible(make_ticket(VALIDATOR, submission_id(env)), RATE, 1) == drawn:
            return env
    raise AssertionError("no frame with that draw in 200 seconds")


def validator_core():
    return ValidatorCore(ValidatorCoreConfig(sample_rate=RATE, claim_window_s=0, workers=(WORKER.peer_id,),
                                             validators=(VALIDATOR.peer_id,)), VALIDATOR, None)


def refused_unclaimed(vcore, env):
    """The validator core's reason for refusing `env` at admission, asserting it claimed nothing."""
    effects = vcore.on_message(5.0, env)
    assert not [e for e in effects if isinstance(e, Publish) and isinstance(e.body, Claim)]
    [reason] = [e.event.reason for e in effects if isinstance(e, Emit) and isinstance(e.event, SubmissionRejected)]
    return reason


def checked(intake, env, accepted, now=2.0):
    sid = submission_id(env)
    intake.on_message(now, envelope(VALIDATOR, Claim(sid, make_ticket(VALIDATOR, sid))))
    return verdict(intake, sid, WORKER, env.body.step, accepted, now=now)


def test_a_rejected_batch_sent_again_is_not_admitted_unchecked():
    intake, vcore = make(sample_rate=RATE, unchecked_after_s=10.0), validator_core()
    body = submission(WORKER, 3)
    first = signed(WORKER, body, drawn=True)
    vcore.on_message(1.0, first)
    intake.on_message(1.0, first)
    assert not [e for e in checked(intake, first, accepted=False) if isinstance(e.event, Penalise)]
    again = signed(WORKER, body, after=first.ts_ms / 1000)  # the same body, later: a new id, refused unclaimed
    assert submission_id(again) != submission_id(first) and refused_unclaimed(vcore, again) == "replay"
    intake.on_message(3.0, again)
    assert intake.admissible(100.0, 3) == [] and intake.dropped == {"sibling": 1}
    assert intake.admissible(200.0, 3) == [] and intake.dropped == {"sibling": 1}  # counted once


def test_a_second_submission_for_a_step_with_a_new_nonce_is_not_admitted_unchecked():
    intake, vcore = make(sample_rate=RATE, unchecked_after_s=10.0), validator_core()
    first = signed(WORKER, submission(WORKER, 3), drawn=True)
    vcore.on_message(1.0, first)
    intake.on_message(1.0, first)
    checked(intake, first, accepted=False)
    again = signed(WORKER, submission(WORKER, 3, nonce=b"n" * 16), after=first.ts_ms / 1000)
    assert refused_unclaimed(vcore, again) == "replay_step"
    intake.on_message(3.0, again)
    assert intake.admissible(100.0, 3) == [] and intake.dropped == {"sibling": 1}


def test_two_copies_of_a_step_pass_only_with_a_verdict_of_their_own():
    for accepted_copy in (None, 0, 1):  # none checked; the first heard checked; the second heard checked
        intake = make(sample_rate=RATE, unchecked_after_s=10.0)
        honest = signed(WORKER, submission(WORKER, 3), drawn=accepted_copy == 0)
        forged = signed(WORKER, submission(WORKER, 3, nonce=b"f" * 16), drawn=accepted_copy == 1)
        intake.on_message(1.0, honest)
        intake.on_message(1.5, forged)
        copies = (honest, forged)
        if accepted_copy is not None:
            assert not [e for e in checked(intake, copies[accepted_copy], accepted=True) if isinstance(e.event, Penalise)]
        admitted = [b.sid for b in intake.admissible(100.0, 3)]
        assert admitted == ([] if accepted_copy is None else [submission_id(copies[accepted_copy])])
        assert intake.dropped == {"sibling": 2 if accepted_copy is None else 1}


def test_a_sibling_heard_later_still_keeps_the_first_copy_from_unchecked_admission():
    intake = make(sample_rate=RATE, unchecked_after_s=10.0)
    _, first = submit(intake, WORKER, 3, now=1.0)
    intake.on_message(5.0, envelope(WORKER, submission(WORKER, 3, nonce=b"x" * 16), WALL_S + 4))
    assert intake.admissible(100.0, 3) == [] and intake.batches[first].sibling


def test_copies_of_one_step_beyond_two_are_dropped_not_kept():
    """Each copy is up to 2 MiB, and all were kept until the step's window closed; two already
    make every copy a sibling (validators admit one copy a step)."""
    intake = make(sample_rate=RATE, unchecked_after_s=10.0)
    _, first = submit(intake, WORKER, 3, now=1.0)
    for i in range(50):
        intake.on_message(2.0, envelope(WORKER, submission(WORKER, 3, nonce=bytes([i]) * 16), WALL_S + 1))
    assert sum(1 for b in intake.batches.values() if b.submission.step == 3) == 2
    assert intake.dropped["copies_per_step"] == 49
    assert intake.admissible(100.0, 3) == [] and intake.batches[first].sibling


def test_an_honest_workers_unclaimed_batches_still_pass_unchecked():
    intake = make(sample_rate=RATE, unchecked_after_s=10.0, async_level=2)
    sent = [submit(intake, worker, step, now=1.0) for step in (1, 2, 3) for worker in (WORKER, CHEAT)]
    for env, _ in sent:  # gossip echoes of the same frames (same ids) are not siblings
        intake.on_message(2.0, env)
    assert sorted(b.sid for b in intake.admissible(11.0, 3)) == sorted(sid for _, sid in sent)
    assert "sibling" not in intake.dropped



def test_a_batch_that_reached_us_far_from_its_timestamp_is_admitted_only_with_its_own_verdict():
    """Validators drop, unclaimed, a frame past the codec's age or future margins by their clocks;
    a worker can aim at those edges, so only a batch heard near its timestamp passes unchecked."""
    intake = make(sample_rate=RATE, unchecked_after_s=10.0, async_level=3)
    heard = {}
    for step, (signed_at, heard_at) in enumerate([(WALL_S, WALL_S + 250.0), (WALL_S + 25.0, WALL_S),
                                                 (WALL_S, WALL_S + 4.0), (WALL_S + 3.0, WALL_S)]):
        for ms in range(200):  # step 0 in a frame VALIDATOR is drawn for, to be checked below
            frame = Codec(WORKER).encode(submission(WORKER, step), signed_at + ms / 1000)
            env = Codec(None).decode(frame, heard_at)
            if step or is_eligible(make_ticket(VALIDATOR, submission_id(env)), RATE, 1):
                break
        intake.on_message(1.0, env)
        heard[step] = (frame, heard_at, submission_id(env))
    with pytest.raises(StaleMessage):  # a validator whose clock runs a minute ahead never sees step 0
        Codec(None).decode(heard[0][0], heard[0][1] + 60.0)
    with pytest.raises(StaleMessage):  # nor one 10 s behind the trainer step 1
        Codec(None).decode(heard[1][0], heard[1][1] - 10.0)
    admitted = sorted(b.submission.step for b in intake.admissible(100.0, 3))
    assert admitted == [2, 3] and intake.dropped == {"skewed": 2}
    intake.on_message(101.0, envelope(VALIDATOR, Claim(heard[0][2], make_ticket(VALIDATOR, heard[0][2]))))
    verdict(intake, heard[0][2], WORKER, 0, True, now=101.0)
    assert sorted(b.submission.step for b in intake.admissible(102.0, 3)) == [0, 2, 3]
    assert intake.dropped == {"skewed": 2}  # counted once each

def test_batches_withheld_for_their_timestamps_are_reported_at_most_once_a_minute():
    """A clock off by more than unchecked_max_skew_s (a worker's, or ours when many agree) leaves
    only sampled batches to train on: said, not only counted."""
    intake = make(sample_rate=RATE, unchecked_after_s=10.0)

    def heard(worker, step, now, age_s):
        frame = Codec(worker).encode(submission(worker, step), WALL_S - age_s)
        return [e.event for e in intake.on_message(now, Codec(None).decode(frame, WALL_S))
                if isinstance(e, Emit) and isinstance(e.event, BatchesSkewed)]

    assert heard(WORKER, 0, 1.0, 5.0) == [] and heard(WORKER, 1, 2.0, -15.0) == []  # within the margin
    assert heard(CHEAT, 0, 3.0, 40.0) == [BatchesSkewed(1, 40.0)]
    assert heard(WORKER, 2, 4.0, 45.0) == []  # within the minute: counted, not said again
    assert heard(WORKER, 3, 63.0, 50.0) == [BatchesSkewed(2, 50.0)]  # both off within the minute (last ages)
    assert heard(CHEAT, 1, 200.0, -25.0) == [BatchesSkewed(1, -25.0)]  # WORKER's last one too old to count


def test_the_sibling_index_is_forgotten_with_its_steps_and_nonces_after_the_replay_window():
    intake = make(sample_rate=RATE, unchecked_after_s=10.0, replay_window_s=100.0, async_level=2)
    for step in range(200):  # one batch a step, 10 s apart: steps kept 3 steps, nonces 100 s
        submit(intake, WORKER, step, now=10.0 * step)
        intake.mark_trained(intake.admissible(10.0 * step + 10.0, step))
        intake.forget_before_step(step + 1 - 2)
    assert intake.workers[WORKER.peer_id].trained_batches == 200 and "sibling" not in intake.dropped
    assert len(intake.by_step) == 2 and len(intake.by_nonce) == 11
    # a nonce reused after its batch was forgotten, inside the replay window: validators refuse it
    reused = submission(WORKER, 200, nonce=random.Random(f"{WORKER.peer_id}{195}").randbytes(16))
    intake.on_message(2000.0, envelope(WORKER, reused, WALL_S + 1))
    assert intake.admissible(2100.0, 200) == [] and intake.dropped == {"sibling": 1}
    # and one reused after the window: validators have forgotten it too, and draw it as any other
    late = submission(WORKER, 201, nonce=random.Random(f"{WORKER.peer_id}{100}").randbytes(16))
    intake.on_message(2000.0, envelope(WORKER, late, WALL_S + 2))
    assert [b.submission.step for b in intake.admissible(2100.0, 201)] == [201]


class SweptValidator:
    """A validator core with its default replay memory, its sweep timer run on time as its shell would."""

    def __init__(self) -> None:
        self.core = validator_core()
        self.timers = [e.at for e in self.core.start(0.0) if isinstance(e, SetTimer)]

    def hear(self, now, env):
        """The validator's reason for refusing `env` (it then claims nothing), or None when admitted."""
        while self.timers[0] <= now:
            at = self.timers.pop(0)
            self.timers += [e.at for e in self.core.on_timer(at, TIMER_SWEEP) if isinstance(e, SetTimer)]
        effects = self.core.on_message(now, env)
        reasons = [e.event.reason for e in effects if isinstance(e, Emit) and isinstance(e.event, SubmissionRejected)]
        assert not reasons or not [e for e in effects if isinstance(e, Publish)]
        return reasons[0] if reasons else None


def test_a_nonce_stays_a_sibling_while_validators_still_refuse_it_after_their_window():
    """Validators forget a nonce at their first sweep after replay_window_s, not at it: a reuse
    in between is refused unclaimed, and the intake's default memory must still link it."""
    validator, intake = SweptValidator(), make(sample_rate=RATE, unchecked_after_s=10.0)
    first = envelope(WORKER, submission(WORKER, 3, nonce=b"r" * 16), WALL_S + 10)
    assert validator.hear(10.0, first) is None
    intake.on_message(10.0, first)
    at = 10.0 + ValidatorCoreConfig.replay_window_s + ValidatorCoreConfig.sweep_interval_s / 2
    reused = envelope(WORKER, submission(WORKER, 50, nonce=b"r" * 16), WALL_S + at)  # a fresh step
    assert validator.hear(at, reused) == "replay"
    intake.on_message(at, reused)
    assert intake.admissible(at + 100.0, 50) == [] and intake.dropped == {"sibling": 1}


def test_a_nonce_is_remembered_from_its_last_copy_as_validators_may_keep_it_from_a_later_one():
    """Validators keep a nonce from the first copy they admitted, which need not be the first one
    heard: one refused for its step leaves the nonce unrecorded, and a later copy records it."""
    validator, intake = SweptValidator(), make(sample_rate=RATE, unchecked_after_s=10.0)
    window = intake.config.replay_window_s
    heard = [(10.0, submission(WORKER, 3)), (11.0, submission(WORKER, 3, nonce=b"r" * 16)),
             (10.0 + window - 100.0, submission(WORKER, 4, nonce=b"r" * 16)),
             (10.0 + window + 5.0, submission(WORKER, 5, nonce=b"r" * 16))]
    reasons = []
    for at, body in heard:
        env = envelope(WORKER, body, WALL_S + at)
        reasons.append(validator.hear(at, env))
        intake.on_message(at, env)
    assert reasons == [None, "replay_step", None, "replay"]
    last = submission_id(env)
    assert intake.batches[last].sibling and last not in [b.sid for b in intake.admissible(window + 200.0, 5)]


class CountingDict(dict):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.gets = 0

    def get(self, *args):
        self.gets += 1
        return super().get(*args)


def test_linking_a_copy_costs_the_same_however_many_copies_came_before():
    """A worker flooding copies of one step must not make each new copy revisit all the others."""
    intake = make(sample_rate=RATE, unchecked_after_s=10.0)
    intake.batches = CountingDict(intake.batches)
    for k in range(60):
        intake.on_message(1.0, envelope(WORKER, submission(WORKER, 3, nonce=bytes([k]) * 16), WALL_S + k))
    assert len(intake.batches) == 2 and all(b.sibling for b in intake.batches.values())  # the rest dropped
    assert intake.batches.gets <= 2 * 60


async def test_the_trainer_role_warns_of_batches_withheld_for_their_timestamps(tmp_path, autojump_clock, caplog):
    from tests.trainer.test_intake_restart import FakeNode
    from trainer.roles import TrainerRole

    role = TrainerRole(FakeNode(tmp_path), {"model_dir": str(tmp_path / "model"), "out_dir": str(tmp_path / "out")})
    role._on_event("intake", BatchesSkewed(3, -42.0))
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "3 worker(s)" in warning and "~42 s ahead of our clock" in warning and "NTP" in warning
