"""The intake's verification memory survives a trainer restart: validators keep their bans and
nonces across it and refuse those submissions without a claim, so a fresh intake would admit
them unchecked. Pure core (snapshot, JSON, restore) and the file the trainer role keeps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import trio

from p2pnet.core import Emit, Publish
from p2pnet.errors import LocalStateError
from relay.messages import HeldVersion, Holding
from tests.trainer.test_intake import (CHEAT, RATE, VALIDATOR, WALL_S, WORKER, Directory, envelope, make, signed,
                                       submission, submit, validator_core, verdict)
from trainer.intake import Intake, IntakeConfig
from trainer.intake_state import IntakeStateFile, load_into
from trainer.roles import TrainerRole
from verify.messages import Claim, Verdict, submission_id
from verify.verdicts import Outcome
from verify.reputation import Reputation, ReputationConfig, WorkerBanned
from verify.validator import SubmissionRejected, ValidatorCore, ValidatorCoreConfig


def restarted(intake: Intake, *, saved_at: float, wall_at_save: float, now: float, wall_s: float, **kw) -> Intake:
    """A new intake (as a restarted trainer builds it) given `intake`'s snapshot through JSON."""
    state = json.loads(json.dumps(intake.snapshot(saved_at, wall_at_save), allow_nan=False))
    fresh = make(**kw)
    fresh.restore(state, now, wall_s)
    return fresh


def validator_refusal(vcore: ValidatorCore, now: float, env) -> str | None:
    effects = vcore.on_message(now, env)
    reasons = [e.event.reason for e in effects if isinstance(e, Emit) and isinstance(e.event, SubmissionRejected)]
    assert not reasons or not [e for e in effects if isinstance(e, Publish) and isinstance(e.body, Claim)]
    return reasons[0] if reasons else None


def test_a_worker_validators_banned_before_a_restart_is_not_admitted_unchecked_after_it():
    """The probe: validators ban a cheater, the trainer restarts, the cheater sends a new batch;
    validators refuse it `banned` without a claim. A fresh intake admits it unchecked; a restored one
    drops it."""
    vcore = ValidatorCore(ValidatorCoreConfig(sample_rate=RATE, claim_window_s=0,
                                              workers=(WORKER.peer_id, CHEAT.peer_id),
                                              validators=(VALIDATOR.peer_id,)), VALIDATOR, None)
    before = make(sample_rate=RATE, unchecked_after_s=10.0)
    for step in (1, 2):  # drawn, checked, failed: the validator publishes its verdicts, the intake hears them
        env = signed(CHEAT, submission(CHEAT, step), drawn=True, after=WALL_S + 10 * step)
        sid = submission_id(env)
        before.on_message(float(step), env)
        for effect in vcore.on_message(float(step), env) + vcore.check_done(float(step), sid, False, ("row0:x",), 2, 0.1):
            if isinstance(effect, Publish) and isinstance(effect.body, (Claim, Verdict)):
                before.on_message(float(step), envelope(VALIDATOR, effect.body, env.ts_ms / 1000))
    assert vcore.reputation.is_banned(CHEAT.peer_id, 10.0) and before.reputation.is_banned(CHEAT.peer_id, 10.0)

    after = restarted(before, saved_at=10.0, wall_at_save=WALL_S + 30, now=0.0, wall_s=WALL_S + 60,
                      sample_rate=RATE, unchecked_after_s=10.0)
    fresh = make(sample_rate=RATE, unchecked_after_s=10.0)  # what a restart gave before: nothing remembered
    new = envelope(CHEAT, submission(CHEAT, 5), WALL_S + 61)
    assert validator_refusal(vcore, 20.0, new) == "banned"
    fresh.on_message(1.0, new)
    after.on_message(1.0, new)
    assert [b.submission.step for b in fresh.admissible(40.0, 5)] == [5]  # the hole
    assert after.admissible(40.0, 5) == [] and after.dropped == {"banned_worker": 1}
    assert after.reputation.failures(CHEAT.peer_id) == 2
    [ledger] = [w for w in after.workers_json() if w["peer_id"] == CHEAT.peer_id]
    assert ledger["banned"] and after.contributions.workers[CHEAT.peer_id].banned


def test_copies_of_a_batch_heard_before_a_restart_are_siblings_after_it():
    vcore, before = validator_core(), make(sample_rate=RATE, unchecked_after_s=10.0)
    body = submission(WORKER, 3)
    first = signed(WORKER, body)
    assert validator_refusal(vcore, 1.0, first) is None
    before.on_message(1.0, first)
    after = restarted(before, saved_at=2.0, wall_at_save=WALL_S + 2, now=0.0, wall_s=WALL_S + 3,
                      sample_rate=RATE, unchecked_after_s=10.0)
    assert after.batches == {}  # batches are not carried, their keys are
    resent = signed(WORKER, body, after=WALL_S + 3)  # the same body again: a new id, the old nonce
    other_nonce = signed(WORKER, submission(WORKER, 3, nonce=b"n" * 16), after=WALL_S + 3)  # the step again
    assert validator_refusal(vcore, 5.0, resent) == "replay"
    assert validator_refusal(vcore, 5.0, other_nonce) == "replay_step"
    honest = signed(WORKER, submission(WORKER, 4), after=WALL_S + 3)
    for env in (resent, other_nonce, honest):
        after.on_message(1.0, env)
    assert [b.submission.step for b in after.admissible(100.0, 4)] == [4]  # the next step, as before
    assert after.dropped == {"sibling": 2}


def test_a_restored_copy_still_passes_with_a_verdict_of_its_own():
    before = make(sample_rate=RATE, unchecked_after_s=10.0)
    before.on_message(1.0, signed(WORKER, submission(WORKER, 3)))
    after = restarted(before, saved_at=2.0, wall_at_save=WALL_S + 2, now=0.0, wall_s=WALL_S + 3,
                      sample_rate=RATE, unchecked_after_s=10.0)
    copy = signed(WORKER, submission(WORKER, 3, nonce=b"c" * 16), drawn=True, after=WALL_S + 3)
    sid = submission_id(copy)
    after.on_message(1.0, copy)
    after.on_message(2.0, envelope(VALIDATOR, Claim(sid, make_ticket_for(sid))))
    after.on_message(3.0, envelope(VALIDATOR, Verdict(sid, WORKER.peer_id, 3, 3, True, (), 2, make_ticket_for(sid))))
    assert [b.sid for b in after.admissible(100.0, 3)] == [sid]


def test_a_verdict_heard_after_the_restart_on_a_batch_heard_before_it_still_counts():
    before = make(sample_rate=RATE, unchecked_after_s=10.0, ban_after_failures=2)
    sids = []
    for step in (1, 2):
        env = signed(CHEAT, submission(CHEAT, step), drawn=True, after=WALL_S + 10 * step)
        before.on_message(float(step), env)
        sids.append(submission_id(env))
    failed = [Verdict(sid, CHEAT.peer_id, step, step, False, ("row0:x",), 2, make_ticket_for(sid))
              for step, sid in zip((1, 2), sids)]
    before.on_message(3.0, envelope(VALIDATOR, failed[0]))  # the first failure, before the restart
    after = restarted(before, saved_at=4.0, wall_at_save=WALL_S + 30, now=0.0, wall_s=WALL_S + 60,
                      sample_rate=RATE, unchecked_after_s=10.0, ban_after_failures=2)
    effects = after.on_message(1.0, envelope(VALIDATOR, failed[1]))  # the second, after it
    assert any(isinstance(e, Emit) and isinstance(e.event, WorkerBanned) for e in effects)
    assert after.reputation.is_banned(CHEAT.peer_id, 1.0) and "unknown_submission" not in after.dropped
    assert after.ledger.submission(sids[1]).seen_at == pytest.approx(0.0 + 2.0 - 4.0 - 30.0)


def make_ticket_for(sid: bytes):
    from verify.assign import make_ticket

    return make_ticket(VALIDATOR, sid)


def test_nonce_and_step_windows_carry_across_the_clock_change():
    """Times are written as wall-clock seconds: a nonce heard 100 s before the save, with a restart
    taking 50 s, has 150 s less of its window left on the new clock (which starts elsewhere)."""
    window = 300.0
    before = make(sample_rate=RATE, unchecked_after_s=10.0, replay_window_s=window, async_level=2)
    before.on_message(1000.0, envelope(WORKER, submission(WORKER, 7, nonce=b"r" * 16), WALL_S))
    before.on_message(1000.0, envelope(WORKER, submission(WORKER, 2, nonce=b"s" * 16), WALL_S))
    before.forget_before_step(5)
    assert (WORKER.peer_id, 2) not in before.by_step and before.forgotten_before == 5

    def reuse_at(new_now: float, step: int = 50, nonce: bytes = b"r" * 16) -> Intake:
        after = restarted(before, saved_at=1100.0, wall_at_save=WALL_S + 100, now=-7.0, wall_s=WALL_S + 150,
                          sample_rate=RATE, unchecked_after_s=10.0, replay_window_s=window, async_level=2)
        after.on_message(new_now, envelope(WORKER, submission(WORKER, step, nonce=nonce), WALL_S + 151))
        return after

    heard = -7.0 - 150.0  # the nonce's time on the new clock
    inside, outside = reuse_at(heard + window - 1.0), reuse_at(heard + window + 1.0)
    assert inside.admissible(heard + window + 50.0, 50) == [] and inside.dropped == {"sibling": 1}
    assert [b.submission.step for b in outside.admissible(heard + window + 50.0, 50)] == [50]
    assert [k for k in outside.by_nonce] == [(WORKER.peer_id, b"r" * 16)]  # the expired one was not restored
    step_copy = reuse_at(0.0, step=7, nonce=b"t" * 16)  # a step still indexed: a sibling
    assert step_copy.admissible(100.0, 7) == [] and step_copy.dropped == {"sibling": 1}
    down_too_long = restarted(before, saved_at=1100.0, wall_at_save=WALL_S + 100, now=0.0,
                              wall_s=WALL_S + 100 + window, replay_window_s=window)
    assert not down_too_long.by_nonce and set(down_too_long.by_step) == {(WORKER.peer_id, 7)}
    stale = reuse_at(0.0, step=2, nonce=b"u" * 16)  # a step forgotten before the restart stays forgotten
    assert stale.dropped == {"stale_step": 1} and stale.forgotten_before == 5


def test_a_bans_end_is_carried_in_wall_clock_time_and_a_permanent_ban_stays_permanent():
    rep = Reputation(ReputationConfig(ban_after_failures=1, ban_s=100.0))
    forever = Reputation(ReputationConfig(ban_after_failures=1))
    for r in (rep, forever):
        assert any(isinstance(e, WorkerBanned) for e in r.record(10.0, "w", b"s", "v", False, ("x",)))
    state = json.loads(json.dumps(rep.snapshot(50.0, WALL_S), allow_nan=False))  # 60 s left at WALL_S
    assert state["banned_until"] == {"w": WALL_S + 60.0}
    later = Reputation(ReputationConfig(ban_after_failures=1, ban_s=100.0))
    later.restore(state, 1000.0, WALL_S + 30.0)  # a 30 s restart, a new clock: 30 s left
    assert later.is_banned("w", 1029.0) and not later.is_banned("w", 1030.0)
    assert later.failures("w") == 0  # a served ban starts a clean record, as without a restart
    permanent = json.loads(json.dumps(forever.snapshot(50.0, WALL_S), allow_nan=False))
    assert permanent["banned_until"] == {"w": None}
    restored = Reputation()
    restored.restore(permanent, -5.0, WALL_S + 10**6)
    assert restored.is_banned("w", 10.0**9) and restored.is_invalidated("w", b"s")
    over = Reputation()
    over.restore(state, 0.0, WALL_S + 61.0)  # ended while the trainer was down
    assert over.banned(0.0) == [] and over.failures("w") == 0


def row(**counts: bytes) -> bytes:
    """A leaderboard worker row as JSON, every field valid unless given (raw JSON bytes)."""
    fields = {"submitted": b"1", "accepted_batches": b"1", "rejected_batches": b"0", "accepted_rollouts": b"2",
              "accepted_tokens": b"8", "trained_batches": b"1", "trained_tokens": b"8", "banned": b"false",
              "ban_reasons": b"{}", "compute_s": b"2.5", **counts}
    return b"{" + b", ".join(b'"%s": %s' % (k.encode(), v) for k, v in fields.items()) + b"}"


def format_2(worker_row: bytes, nonces: bytes = b"{}") -> bytes:
    """A format 2 state file whose leaderboard has one worker row, `worker_row`."""
    return (b'{"format": 2, "forgotten_before": 0, "reputation": {"workers": {}, "banned_until": {}}, "steps": {},'
            b' "nonces": %s, "submissions": {}, "leaderboard": {"workers": {"w": %s}, "validators": {}}}'
            % (nonces, worker_row))


def test_the_damaged_file_cases_differ_from_a_sound_file_only_where_they_say(tmp_path):
    path = tmp_path / "intake_state.json"
    path.write_bytes(format_2(row()))
    intake = make()
    assert load_into(intake, path, 0.0, WALL_S) is True
    assert intake.contributions.compute_s("w") == 2.5 and intake.contributions.workers["w"].accepted_tokens == 8


@pytest.mark.parametrize("damage", [b"{\"format\": 1, \"forgo", b"[]", b"\xff\xfe",
                                    b'{"format": 1, "forgotten_before": 0, "reputation": {"workers": {},'
                                    b' "banned_until": {"w": 1e999}}, "steps": {}, "nonces": {}, "submissions": {}}',
                                    b'{"format": 99}', b"[" * 100_000,
                                    b'{"format": 2, "forgotten_before": 0, "reputation": {"workers": {},'
                                    b' "banned_until": {}}, "steps": {}, "nonces": {}, "submissions": {}}',  # no leaderboard
                                    b'{"format": 2, "forgotten_before": 0, "reputation": {"workers": {},'
                                    b' "banned_until": {}}, "steps": {}, "nonces": {}, "submissions": {},'
                                    b' "leaderboard": {"workers": {"w": {"submitted": -1}}, "validators": {}}}',
                                    format_2(row(submitted=b"-1")), format_2(row(compute_s=b"1" + b"0" * 400)),
                                    format_2(row(), nonces=b'{"w": [["00", 1' + b"0" * 400 + b']]}')])
def test_a_damaged_file_stops_the_start_unless_told_to_start_empty(tmp_path, damage):
    path = tmp_path / "intake_state.json"
    path.write_bytes(damage)
    with pytest.raises(LocalStateError, match="intake_state.json"):
        load_into(make(), path, 0.0, WALL_S)
    intake = make()
    assert load_into(intake, path, 0.0, WALL_S, discard_damaged=True) is False
    assert not path.exists() and (tmp_path / "intake_state.json.damaged").read_bytes() == damage
    assert intake.reputation.banned(0.0) == [] and intake.by_step == {}
    assert load_into(make(), path, 0.0, WALL_S) is False  # missing: a first start


def leaderboard_run():
    """An intake whose leaderboard has every kind of count: accepted, trained and timed, rejected
    with a reason and banned, a validator's checks, a batch still pending."""
    intake = make(ban_after_failures=1)
    intake.published(0, 10.0)
    intake.on_message(11.0, envelope(WORKER, Holding((HeldVersion(0, b"\x01" * 32),))))
    _, honest = submit(intake, WORKER, 0, now=15.0)
    verdict(intake, honest, WORKER, 0, True, now=16.0)
    intake.mark_trained(intake.admissible(16.0, 0))
    _, cheat = submit(intake, CHEAT, 0, now=17.0)
    verdict(intake, cheat, CHEAT, 0, False, now=18.0)
    submit(intake, WORKER, 1, now=19.0)
    return intake


def test_the_leaderboard_survives_a_restart():
    before = leaderboard_run()
    rows = before.contributions.rows()
    worker, cheat, validator = (next(r for r in rows if r["peer_id"] == p.peer_id)
                                for p in (WORKER, CHEAT, VALIDATOR))
    assert (worker["accepted_tokens"], worker["trained_batches"], worker["submitted"],
            worker["compute_s"]) == (4, 1, 2, 4.0)
    assert cheat["banned"] and cheat["rejection_reasons"] == {"sampling_mismatch": 1} and validator["checks"] == 2
    after = restarted(before, saved_at=20.0, wall_at_save=WALL_S + 20, now=0.0, wall_s=WALL_S + 30,
                      ban_after_failures=1)
    assert after.contributions.rows() == rows
    assert list(after.contributions.verdict_log) == []  # not carried: the dashboard's recent activity
    _, sid = submit(after, WORKER, 2, now=1.0)  # and it counts on from there
    verdict(after, sid, WORKER, 2, True, now=2.0)  # version 2 not published in this run: untimed
    [row] = [r for r in after.contributions.rows() if r["peer_id"] == WORKER.peer_id]
    assert (row["accepted_batches"], row["submitted"], row["compute_s"]) == (2, 3, 4.0)


def test_a_compute_total_comes_back_to_the_last_bit():
    """Saved as it is, not rounded: rounded twice (in the file, then for the dashboard) a total
    near a rounding edge would show a thousandth more after the restart than before it."""
    before = make()
    before.published(0, 10.0)
    _, sid = submit(before, WORKER, 0, now=13.3884997114350517)  # 3.3884997...: 3.388 shown, 3.3885 at 6 places
    verdict(before, sid, WORKER, 0, True, now=14.0)
    after = restarted(before, saved_at=20.0, wall_at_save=WALL_S + 20, now=0.0, wall_s=WALL_S + 30)
    assert after.contributions.compute_s(WORKER.peer_id) == before.contributions.compute_s(WORKER.peer_id)
    assert after.contributions.rows() == before.contributions.rows()


def test_a_state_file_from_before_the_leaderboard_was_carried_still_loads(tmp_path):
    path = tmp_path / "intake_state.json"
    state = leaderboard_run().snapshot(20.0, WALL_S + 20)
    path.write_text(json.dumps(state))
    current = make(ban_after_failures=1)
    assert load_into(current, path, 0.0, WALL_S + 30) is True and len(current.contributions.rows()) == 3
    del state["leaderboard"]
    path.write_text(json.dumps({**state, "format": 1}))
    older = make(ban_after_failures=1)
    assert load_into(older, path, 0.0, WALL_S + 30) is True  # an empty leaderboard, bans and keys as before
    assert older.reputation.is_banned(CHEAT.peer_id, 0.0) and (WORKER.peer_id, 1) in older.by_step
    [row] = older.contributions.rows()
    assert row["peer_id"] == CHEAT.peer_id and row["banned"] and row["rejected_batches"] == 0


def test_restore_refuses_an_intake_that_already_heard_something():
    intake = make()
    intake.on_message(1.0, envelope(WORKER, submission(WORKER, 1)))
    with pytest.raises(RuntimeError):
        intake.restore(make().snapshot(0.0, WALL_S), 0.0, WALL_S)


def fail_once(intake: Intake, worker) -> list:
    """`worker`'s batch of step 1, heard now and failed by VALIDATOR: the intake's effects."""
    env = envelope(worker, submission(worker, 1))
    intake.on_message(trio.current_time(), env)
    sid = submission_id(env)
    body = Verdict(sid, worker.peer_id, 1, 1, False, ("row0:x",), 2, make_ticket_for(sid))
    return intake.on_message(trio.current_time(), envelope(VALIDATOR, body))


async def test_the_state_file_is_saved_at_once_on_a_ban_and_read_by_the_next_start(tmp_path, autojump_clock):
    path = tmp_path / "out" / "intake_state.json"
    intake = Intake(IntakeConfig(ban_after_failures=1), "trainer-id", Directory())
    saver = IntakeStateFile(path, intake, interval_s=3600.0, wall=lambda: WALL_S + trio.current_time())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(saver.keep)
        assert any(isinstance(e, Emit) and isinstance(e.event, WorkerBanned) for e in fail_once(intake, CHEAT))
        started = trio.current_time()
        saver.urgent()  # the role does this on the intake's BatchInvalidated / WorkerBanned
        await saver.wait_saved(intake.revision)
        assert trio.current_time() - started < saver.interval_s  # not left to the interval
        nursery.cancel_scope.cancel()
    later = Intake(IntakeConfig(ban_after_failures=1), "trainer-id", Directory())
    assert load_into(later, path, 0.0, WALL_S + 10**5) is True
    assert later.reputation.is_banned(CHEAT.peer_id, 0.0) and set(later.by_step) == {(CHEAT.peer_id, 1)}
    [batch] = later.batches.values()  # the batch came back, with the verdict that failed it
    assert batch.worker == CHEAT.peer_id and later.ledger.outcome(batch.sid) is Outcome.REJECTED


class FakeNode:
    """What `TrainerRole` reads of its peer, with the intake core left to the test to feed."""

    def __init__(self, data_dir) -> None:
        self.peer_id, self.peertable, self.roles = "trainer-id", Directory(), {"relay": object()}
        self.config = SimpleNamespace(data_dir=data_dir)
        self.listeners: list = []

    def on_event(self, listener) -> None:
        self.listeners.append(listener)

    def emit(self, effects) -> None:  # as `Node.carry_out` does with a core's `Emit`s
        for effect in effects:
            if isinstance(effect, Emit):
                for listener in self.listeners:
                    listener("intake", effect.event)

    async def run_core(self, core, name, *, task_status):
        task_status.started(None)
        await trio.sleep_forever()


async def test_the_trainer_role_keeps_its_intake_state_in_out_dir_across_a_restart(tmp_path, autojump_clock):
    section = {"model_dir": str(tmp_path / "model"), "out_dir": str(tmp_path / "out"), "sample_rate": RATE,
               "ban_after_failures": 1}
    node = FakeNode(tmp_path)
    role = TrainerRole(node, section)
    trained = trio.Event()

    async def train(runner, task_status):  # the learner is not what this test is about
        task_status.started()
        await trained.wait()

    role._train = train
    async with trio.open_nursery() as nursery:
        await nursery.start(role.run)
        cheat = signed(CHEAT, submission(CHEAT, 1), drawn=True)
        sid = submission_id(cheat)
        role.intake.on_message(trio.current_time(), cheat)
        body = Verdict(sid, CHEAT.peer_id, 1, 1, False, ("row0:x",), 2, make_ticket_for(sid))
        started = trio.current_time()
        node.emit(role.intake.on_message(trio.current_time(), envelope(VALIDATOR, body)))
        await role.intake_state.wait_saved(role.intake.revision)
        assert trio.current_time() - started < role.intake_state.interval_s  # at once: a ban, not at the interval
        assert role.intake_state.status()["saved_revision"] == role.intake.revision
        role.intake.on_message(trio.current_time(), envelope(WORKER, submission(WORKER, 2)))  # not urgent
        nursery.cancel_scope.cancel()  # the peer stops: the rest is saved on the way out
    again = TrainerRole(FakeNode(tmp_path), section)
    assert again.intake.reputation.is_banned(CHEAT.peer_id, trio.current_time())
    assert set(again.intake.by_step) == {(CHEAT.peer_id, 1), (WORKER.peer_id, 2)}
    board = {r["peer_id"]: r for r in again.intake.contributions.rows()}  # the leaderboard came back too
    assert board[CHEAT.peer_id]["rejected_batches"] == 1 and board[CHEAT.peer_id]["banned"]
    assert board[WORKER.peer_id]["submitted"] == 1 and board[VALIDATOR.peer_id]["checks"] == 1
    (tmp_path / "out" / "intake_state.json").write_text("{")
    with pytest.raises(LocalStateError, match="intake_state.json"):
        TrainerRole(FakeNode(tmp_path), section)
    empty = TrainerRole(FakeNode(tmp_path), {**section, "discard_damaged_intake_state": True})
    assert empty.intake.reputation.banned(trio.current_time()) == []


async def test_a_failed_write_is_logged_and_tried_again_while_the_bans_stay_in_memory(tmp_path, autojump_clock,
                                                                                      monkeypatch, caplog):
    """A full disk neither stops the trainer nor loses the ban: each failed write is logged as an
    error and counted, the next pass writes it once the disk recovers."""
    import errno

    import trainer.intake_state as intake_state

    path = tmp_path / "intake_state.json"
    intake = Intake(IntakeConfig(ban_after_failures=1), "trainer-id", Directory())
    saver = IntakeStateFile(path, intake, interval_s=5.0, wall=lambda: WALL_S + trio.current_time())
    disk_full = trio.Event()
    real_write = intake_state.atomic_write_bytes

    def write(target, data):
        if not disk_full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device", str(target))
        real_write(target, data)

    monkeypatch.setattr(intake_state, "atomic_write_bytes", write)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(saver.keep)
        fail_once(intake, CHEAT)
        saver.urgent()
        while saver.failed_writes < 2:  # tried at once, then again after the interval
            await trio.sleep(1.0)
        assert not path.exists() and intake.reputation.is_banned(CHEAT.peer_id, trio.current_time())
        assert saver.status()["failed_writes"] == 2 and "No space left" in saver.status()["last_error"]
        assert [r for r in caplog.records if r.levelname == "ERROR" and str(path) in r.getMessage()]
        disk_full.set()  # the disk recovers: the next pass writes it
        await saver.wait_saved(intake.revision)
        nursery.cancel_scope.cancel()
    later = Intake(IntakeConfig(ban_after_failures=1), "trainer-id", Directory())
    assert load_into(later, path, 0.0, WALL_S + 10**5) and later.reputation.is_banned(CHEAT.peer_id, 0.0)
    intake.on_message(trio.current_time(), envelope(WORKER, submission(WORKER, 2)))
    disk_full = trio.Event()  # full again
    with pytest.raises(LocalStateError, match="intake_state.json"):  # at shutdown nothing is left to retry
        saver.save()


def test_nonces_from_a_wall_clock_that_went_back_across_the_restart_are_kept_a_window_and_then_forgotten():
    """Saved at a wall time later than the restart's (the clock was set back): restored as heard at
    the restart, so the index is still pruned from its head, not held until the old clock is reached."""
    kw = dict(sample_rate=RATE, unchecked_after_s=10.0, replay_window_s=100.0, async_level=2)
    before = make(**kw)
    before.on_message(1.0, envelope(WORKER, submission(WORKER, 1)))
    after = restarted(before, saved_at=1.0, wall_at_save=WALL_S + 1, now=0.0, wall_s=WALL_S - 10**6, **kw)
    [(restored, (heard, _))] = after.by_nonce.items()
    assert heard == 0.0  # not 10**6 s ahead
    for step in range(3, 40):
        after.on_message(10.0 * step, envelope(WORKER, submission(WORKER, step)))
    assert restored not in after.by_nonce and len(after.by_nonce) <= 11  # the window's worth (100 s, one a 10 s)
    again = restarted(before, saved_at=1.0, wall_at_save=WALL_S + 1, now=0.0, wall_s=WALL_S - 10**6, **kw)
    reused = envelope(WORKER, submission(WORKER, 2, nonce=restored[1]))
    again.on_message(90.0, reused)
    assert again.batches[submission_id(reused)].sibling  # still a sibling inside the window
