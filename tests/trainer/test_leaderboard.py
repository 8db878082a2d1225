"""The leaderboard counts only what validators' signed verdicts and the trainer's intake admitted:
a peer that claims more about itself gains nothing. And the trainer's metrics.jsonl survives a
crash mid-line."""

from p2pnet.identity import Identity
from p2pnet.messages import Capacity, Heartbeat
from p2pnet.peertable import LocalInfo, PeerTable, PeerTableConfig
from relay.messages import Holding, HeldVersion
from dataclasses import replace

from tests.trainer.test_intake import CHEAT, VALIDATOR, WORKER, Entry, envelope, make, submission, submit, verdict
from trainer.metricsfile import MetricsFile, read_metrics
from verify.assign import make_ticket
from verify.messages import Verdict, submission_id


def row_of(rows, identity):
    return next(r for r in rows if r["peer_id"] == identity.peer_id)


def test_a_lying_worker_gains_nothing_and_honest_work_counts():
    intake = make(ban_after_failures=2)
    intake.published(0, 10.0)
    intake.published(1, 20.0)
    # the honest worker: holds version 0 at 11 s, its batch arrives at 15 s and is accepted, then trained on
    intake.on_message(11.0, envelope(WORKER, Holding((HeldVersion(0, b"\x01" * 32),))))
    _, honest = submit(intake, WORKER, 0, now=15.0)
    verdict(intake, honest, WORKER, 0, True, now=16.0)
    intake.mark_trained(intake.admissible(16.0, 0))

    # the liar: claims to hold version 0 long before it was published (to look busy for longer),
    # heartbeats whatever it likes, signs a verdict accepting its own batch, replays its submission,
    # and reuses the validator's ticket under its own signature
    intake.on_message(0.5, envelope(CHEAT, Holding((HeldVersion(0, b"\x02" * 32),))))
    boast = envelope(CHEAT, Heartbeat(1, 1, (), "127.0.0.1:1", ("worker", "validator"),
                                      Capacity(10**12, 10**12, 10**15), True, "top: 10M tokens, 5k checks"))
    intake.on_message(1.0, boast)
    table = PeerTable(PeerTableConfig(), "trainer-id", LocalInfo((), "", ("trainer",), Capacity(1, 1, 1)), 0)
    table.on_message(1.0, boast)
    names = {e.peer_id: e.name for e in table.peers()}
    sub_env, cheat = submit(intake, CHEAT, 0, now=30.0)
    intake.on_message(30.5, sub_env)  # the same signed submission again
    own = Verdict(cheat, CHEAT.peer_id, 0, 0, True, (), 2, make_ticket(CHEAT, cheat))
    intake.on_message(31.0, envelope(CHEAT, own))
    stolen = Verdict(cheat, CHEAT.peer_id, 0, 0, True, (), 2, make_ticket(VALIDATOR, cheat))
    intake.on_message(31.5, envelope(CHEAT, stolen))
    rows = intake.contributions.rows(names=names)
    liar = row_of(rows, CHEAT)
    assert liar["name"] == "top: 10M tokens, 5k checks"  # shown as its name, counted for nothing
    assert liar["accepted_tokens"] == liar["accepted_rollouts"] == liar["accepted_batches"] == 0
    assert liar["checks"] == 0 and liar["compute_s"] == 0.0 and liar["submitted"] == 1
    assert all(b.worker != CHEAT.peer_id for b in intake.admissible(32.0, 0))

    # the real validator rejects the liar's batch twice: it is banned, and the reasons say why
    verdict(intake, cheat, CHEAT, 0, False, now=33.0)
    _, cheat2 = submit(intake, CHEAT, 1, now=34.0)
    verdict(intake, cheat2, CHEAT, 1, False, now=35.0)
    rows = intake.contributions.rows()
    liar, honest_row, validator = row_of(rows, CHEAT), row_of(rows, WORKER), row_of(rows, VALIDATOR)
    assert liar["banned"] and liar["rejected_batches"] == 2 and liar["rejection_reasons"] == {"sampling_mismatch": 2}
    assert liar["accepted_tokens"] == 0
    # honest: two rollouts of two tokens, accepted and trained on; compute from max(publish 10, holding 11) to 15
    assert (honest_row["accepted_batches"], honest_row["accepted_rollouts"], honest_row["accepted_tokens"]) == (1, 2, 4)
    assert honest_row["trained_batches"] == 1 and honest_row["trained_tokens"] == 4
    assert honest_row["compute_s"] == 4.0
    assert (validator["checks"], validator["checks_accepting"], validator["checks_rejecting"]) == (3, 1, 2)
    assert [r["peer_id"] for r in rows][0] == WORKER.peer_id and rows[0]["rank"] == 1
    log = list(intake.contributions.verdict_log)
    assert [(e["worker"], e["accepted"]) for e in log] == [(WORKER.peer_id, True), (CHEAT.peer_id, False),
                                                          (CHEAT.peer_id, False)]


def test_an_accepted_batch_rejected_later_loses_its_tokens():
    intake = make()
    _, sid = submit(intake, WORKER, 0, now=1.0)
    verdict(intake, sid, WORKER, 0, True, now=2.0)
    assert row_of(intake.contributions.rows(), WORKER)["accepted_tokens"] == 4
    other = Identity.from_seed_text("val2")
    from tests.trainer.test_intake import Entry

    intake.membership.directory.entries[other.peer_id] = Entry(other.peer_id, ("validator",))
    verdict(intake, sid, WORKER, 0, False, sender=other, now=3.0)
    row = row_of(intake.contributions.rows(), WORKER)
    assert row["accepted_tokens"] == 0 and row["accepted_batches"] == 0 and row["rejected_batches"] == 1


def test_two_copies_of_one_step_are_credited_once():
    """A worker sends one step twice (a new nonce, so two ids) and two validators, each hearing a
    different copy first, accept one each: the learner trains one batch per (worker, step), and
    the leaderboard credits one. If the credited copy is rejected later, the other stands in."""
    intake = make()
    second = Identity.from_seed_text("val2")
    intake.membership.directory.entries[second.peer_id] = Entry(second.peer_id, ("validator",))
    intake.published(0, 0.5)
    sids = []
    for i, (nonce, rows) in enumerate(((b"\x01" * 16, 2), (b"\x02" * 16, 1))):
        base = submission(WORKER, 0, nonce=nonce)
        env = envelope(WORKER, replace(base, rollouts=base.rollouts[:rows], group_size=rows))
        intake.on_message(1.0 + i, env)
        sids.append(submission_id(env))
    verdict(intake, sids[0], WORKER, 0, True, sender=VALIDATOR, now=3.0)
    verdict(intake, sids[1], WORKER, 0, True, sender=second, now=3.5)
    row = row_of(intake.contributions.rows(), WORKER)
    assert (row["submitted"], row["accepted_batches"], row["accepted_rollouts"]) == (2, 1, 2)
    assert row["compute_s"] == 0.5  # the credited copy's: published at 0.5, arrived at 1.0
    verdict(intake, sids[0], WORKER, 0, False, sender=second, now=4.0)  # the first copy fails after all
    row = row_of(intake.contributions.rows(), WORKER)
    assert (row["accepted_batches"], row["accepted_rollouts"], row["rejected_batches"]) == (1, 1, 1)
    assert row["compute_s"] == 1.5  # now the second copy's: arrived at 2.0
    verdict(intake, sids[1], WORKER, 0, False, sender=VALIDATOR, now=5.0)
    row = row_of(intake.contributions.rows(), WORKER)
    assert (row["accepted_batches"], row["accepted_tokens"], row["compute_s"]) == (0, 0, 0.0)


def test_metrics_file_appends_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    MetricsFile(path).append({"step": 0, "loss": 0.5})
    with open(path, "a") as fh:
        fh.write('{"step": 1, "lo')  # the process died mid-line
    again = MetricsFile(path)  # a restart
    again.append({"step": 1, "loss": 0.25})
    again.append({"step": 2, "loss": 0.125})
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]
    assert [r["step"] for r in read_metrics(path, last=2)] == [1, 2]
    assert read_metrics(tmp_path / "none.jsonl") == []


def test_holdings_count_only_from_workers_and_only_for_versions_published():
    """A Holding is anyone's gossip: made-up future versions, or any peer's, were kept until
    training reached them (32,000 versions from one peer in a helper's repro)."""
    intake = make()
    intake.published(0, 10.0)
    intake.on_message(11.0, envelope(WORKER, Holding(tuple(HeldVersion(v, b"\x01" * 32) for v in range(0, 16)))))
    intake.on_message(11.0, envelope(VALIDATOR, Holding((HeldVersion(0, b"\x01" * 32),))))
    assert intake.holders == {0: {WORKER.peer_id: 11.0}}
    intake.published(1, 20.0)
    intake.on_message(21.0, envelope(WORKER, Holding((HeldVersion(1, b"\x01" * 32),))))
    assert intake.holders[1] == {WORKER.peer_id: 21.0}
