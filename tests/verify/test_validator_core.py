"""The validator core: admission, replays, forged verdicts, claims, reputation; then the simulated world."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

import pytest

from p2pnet.core import Emit, Publish, SetTimer
from p2pnet.errors import MessageRejected
from p2pnet.identity import Identity, SignatureChecker
from p2pnet.messages import Capacity
from p2pnet.peertable import LocalInfo, PeerTable, PeerTableConfig
from p2pnet.wire import Codec, Envelope
from simulations.engine import Engine
from simulations.world import SimWorld
from verify.assign import check_ticket, make_ticket, ticket_value
from verify.messages import (CLAIMS_TOPIC, SUBMISSIONS_TOPIC, VERDICTS_TOPIC, Claim, Submission, Verdict,
                             rollout_record, submission_id, unpack_u32)
from verify.reputation import BatchInvalidated, Reputation, ReputationConfig, WorkerBanned
from verify.validator import (CheckDropped, CheckRequested, DroppedBecause, InlineChecking, Penalise,
                              SubmissionRejected, ValidatorCore, ValidatorCoreConfig, VerdictAdmitted, VerdictIgnored)

WALL_S = 1_800_000_000.0
V1, V2, V3 = (Identity.from_seed_text(f"v{i}") for i in (1, 2, 3))
WORKER, STRANGER = Identity.from_seed_text("worker"), Identity.from_seed_text("stranger")


@dataclass(frozen=True)
class _Entry:
    peer_id: str
    roles: tuple[str, ...]


class FakeDirectory:
    def __init__(self, roles: dict[Identity, tuple[str, ...]]) -> None:
        self.entries = {i.peer_id: _Entry(i.peer_id, r) for i, r in roles.items()}

    def get(self, peer: str) -> _Entry | None:
        return self.entries.get(peer)

    def with_role(self, role: str) -> list[_Entry]:
        return [e for e in self.entries.values() if role in e.roles]


def envelope(identity: Identity, body: Any, wall_s: float = WALL_S) -> Envelope[Any]:
    return Codec(None).decode(Codec(identity).encode(body, wall_s), wall_s)


def submission(step: int = 0, nonce: bytes | None = None, *, task_seed: int = 7, bad: bool = False) -> Submission:
    proof = (b"\x00" if bad else b"\x01") * 258
    rollouts = tuple(rollout_record(prompt_ids=[1, 5, 6], output_ids=[7, 8, 2], logprobs=[-0.5, -1.0, -0.1],
                                    proofs=[proof], stop_reason="eos", row=r) for r in range(4))
    return Submission(model="tiny", model_version=0, step=step, seed=99, task_seed=task_seed,
                      prompts_per_submission=2, group_size=2, temperature=1.0, max_new_tokens=8,
                      rollouts=rollouts, nonce=nonce or random.Random(step).randbytes(16))


def core_for(identity: Identity, directory: FakeDirectory | None = None, **overrides: Any) -> ValidatorCore:
    directory = directory or FakeDirectory({WORKER: ("worker",), V1: ("validator",), V2: ("validator",)})
    config = ValidatorCoreConfig(**{"claim_window_s": 0.5, **overrides})
    core = ValidatorCore(config, identity, directory)
    core.start(0.0)
    return core


def events(effects: list[Any], kind: type) -> list[Any]:
    return [e.event for e in effects if isinstance(e, Emit) and isinstance(e.event, kind)]


def published(effects: list[Any], topic: str) -> list[Any]:
    return [e.body for e in effects if isinstance(e, Publish) and e.topic == topic]


# -- messages ---------------------------------------------------------------------------------------


def test_submission_roundtrip_and_invariants() -> None:
    sub = submission()
    env = envelope(WORKER, sub)
    assert env.body == sub and unpack_u32(env.body.rollouts[0].output_ids) == (7, 8, 2)
    assert submission_id(env) == submission_id(envelope(WORKER, sub))
    assert submission_id(env) != submission_id(envelope(WORKER, sub, WALL_S + 1))
    with pytest.raises(ValueError):
        replace(sub, rollouts=sub.rollouts[:3])
    with pytest.raises(ValueError):
        rollout_record(prompt_ids=[1], output_ids=[2] * 33, logprobs=[-1.0] * 33, proofs=[b"\x00" * 258],
                       stop_reason="eos", row=0)  # 33 tokens need 2 proofs
    with pytest.raises(ValueError):
        Verdict(bytes(32), WORKER.peer_id, 0, 0, True, ("oops",), 1, bytes(64))


def test_tampered_frame_is_rejected_by_the_codec() -> None:
    frame = bytearray(Codec(V2).encode(Verdict(bytes(32), WORKER.peer_id, 0, 0, True, (), 4, bytes(64)), WALL_S))
    frame[-65] ^= 1  # the last payload byte: a byte of the ticket
    with pytest.raises(MessageRejected) as info:
        Codec(None).decode(bytes(frame), WALL_S)
    assert info.value.reason == "bad_signature"


# -- admission ----------------------------------------------------------------------------------------


def test_submission_from_unknown_key_is_rejected() -> None:
    core = core_for(V1)
    effects = core.on_message(1.0, envelope(STRANGER, submission()))
    assert [e.reason for e in events(effects, SubmissionRejected)] == ["unknown_worker"]
    assert not events(effects, CheckRequested) and core.stats["seen"] == 0
    # a peer advertising another role is no worker either
    directory = FakeDirectory({STRANGER: ("relay",)})
    assert events(core_for(V1, directory).on_message(1.0, envelope(STRANGER, submission())), SubmissionRejected)
    # with an allowlist, the advertised role is not enough
    allow = core_for(V1, workers=(V3.peer_id,))
    assert [e.reason for e in events(allow.on_message(1.0, envelope(WORKER, submission())), SubmissionRejected)] \
        == ["unknown_worker"]


def test_replays_are_rejected() -> None:
    core = core_for(V1, task_seed=7)
    env = envelope(WORKER, submission(step=1, nonce=b"n" * 16))
    assert not events(core.on_message(1.0, env), SubmissionRejected)
    assert core.on_message(2.0, env) == []  # the very same signed frame again: silently dropped
    again = core.on_message(3.0, envelope(WORKER, submission(step=2, nonce=b"n" * 16), WALL_S + 5))
    assert [e.reason for e in events(again, SubmissionRejected)] == ["replay"]
    assert [p.reason for p in events(again, Penalise)] == ["replay"]
    same_step = core.on_message(4.0, envelope(WORKER, submission(step=1, nonce=b"m" * 16), WALL_S + 6))
    assert [e.reason for e in events(same_step, SubmissionRejected)] == ["replay_step"]
    wrong_seed = core.on_message(5.0, envelope(WORKER, submission(step=3, task_seed=8)))
    assert [e.reason for e in events(wrong_seed, SubmissionRejected)] == ["wrong_task_seed"]
    assert core.stats["seen"] == 1


def test_single_validator_checks_and_publishes_a_signed_verdict() -> None:
    directory = FakeDirectory({WORKER: ("worker",)})
    core = core_for(V1, directory)
    env = envelope(WORKER, submission())
    sid = submission_id(env)
    effects = core.on_message(1.0, env)
    [request] = events(effects, CheckRequested)
    assert request.rows == (0, 1, 2, 3) and request.worker == WORKER.peer_id
    [claim] = published(effects, CLAIMS_TOPIC)
    assert claim == Claim(sid, make_ticket(V1, sid))
    done = core.check_done(2.0, sid, False, ("row0:toploc_exp",), 4, 0.25)
    [verdict] = published(done, VERDICTS_TOPIC)
    assert verdict.accepted is False and verdict.reasons == ("row0:toploc_exp",)
    check_ticket(SignatureChecker(), V1.peer_id_bytes, sid, verdict.validator_ticket)
    assert [type(e) for e in (x.event for x in done if isinstance(x, Emit))][-1] is BatchInvalidated
    status = core.status(3.0)
    assert (status["checked"], status["rejected"], status["check_s_mean"]) == (1, 1, 0.25)


def test_our_own_check_failure_publishes_no_verdict() -> None:
    core = core_for(V1, FakeDirectory({WORKER: ("worker",)}))
    env = envelope(WORKER, submission())
    assert events(core.on_message(1.0, env), CheckRequested)
    failed = core.check_failed(2.0, submission_id(env), DroppedBecause.MODEL_UNAVAILABLE)
    assert [e.reason for e in events(failed, CheckDropped)] == [DroppedBecause.MODEL_UNAVAILABLE]
    assert not published(failed, VERDICTS_TOPIC)
    assert core.stats["check_errors"] == 1 and core.status(2.0)["in_flight"] == 0


def test_queue_bound_drops_checks() -> None:
    core = core_for(V1, FakeDirectory({WORKER: ("worker",)}), max_queue=1, one_submission_per_step=False)
    assert events(core.on_message(1.0, envelope(WORKER, submission(1))), CheckRequested)
    dropped = events(core.on_message(1.0, envelope(WORKER, submission(2))), CheckDropped)
    assert [e.reason for e in dropped] == [DroppedBecause.QUEUE_FULL] and str(dropped[0].reason) == "queue_full"
    assert core.stats["dropped"] == 1


# -- claims: the lowest ticket checks, the others stand by ---------------------------------------------


def test_lowest_claim_checks_and_standby_takes_over_without_a_verdict() -> None:
    cores = {v: core_for(v, takeover_after_s=60.0) for v in (V1, V2)}
    env = envelope(WORKER, submission())
    sid = submission_id(env)
    claims = {v: published(c.on_message(1.0, env), CLAIMS_TOPIC)[0] for v, c in cores.items()}
    for v, c in cores.items():
        other = V2 if v is V1 else V1
        assert c.on_message(1.1, envelope(other, claims[other])) == []
    low = min((V1, V2), key=lambda v: ticket_value(make_ticket(v, sid)))
    high = V2 if low is V1 else V1
    assert events(cores[low].on_timer(1.5, "verify/claim/" + sid.hex()), CheckRequested)
    standby = cores[high].on_timer(1.5, "verify/claim/" + sid.hex())
    assert not events(standby, CheckRequested) and any(isinstance(e, SetTimer) for e in standby)
    # the winner never answers: the standby takes over
    assert events(cores[high].on_timer(61.5, "verify/takeover/" + sid.hex()), CheckRequested)
    assert cores[high].stats["takeovers"] == 1


def test_standby_stands_down_when_the_winner_reports() -> None:
    cores = {v: core_for(v) for v in (V1, V2)}
    env = envelope(WORKER, submission())
    sid = submission_id(env)
    claims = {v: published(c.on_message(1.0, env), CLAIMS_TOPIC)[0] for v, c in cores.items()}
    low = min((V1, V2), key=lambda v: ticket_value(make_ticket(v, sid)))
    high = V2 if low is V1 else V1
    cores[high].on_message(1.1, envelope(low, claims[low]))
    cores[high].on_timer(1.5, "verify/claim/" + sid.hex())
    cores[low].on_timer(1.5, "verify/claim/" + sid.hex())
    [verdict] = published(cores[low].check_done(3.0, sid, True, (), 4, 1.0), VERDICTS_TOPIC)
    admitted = cores[high].on_message(3.1, envelope(low, verdict))
    assert events(admitted, VerdictAdmitted)
    assert cores[high].on_timer(200.0, "verify/takeover/" + sid.hex()) == []
    assert cores[high].ledger.outcome(sid) == "accepted"


# -- remote verdicts -------------------------------------------------------------------------------------


def _seen_by_v1(**overrides: Any) -> tuple[ValidatorCore, bytes]:
    core = core_for(V1, **overrides)
    env = envelope(WORKER, submission())
    core.on_message(1.0, env)
    return core, submission_id(env)


def _ignored(core: ValidatorCore, sender: Identity, verdict: Verdict) -> list[str]:
    return [e.reason for e in events(core.on_message(2.0, envelope(sender, verdict)), VerdictIgnored)]


def test_genuine_remote_verdict_is_admitted_once() -> None:
    core, sid = _seen_by_v1()
    verdict = Verdict(sid, WORKER.peer_id, 0, 0, True, (), 4, make_ticket(V2, sid))
    assert events(core.on_message(2.0, envelope(V2, verdict)), VerdictAdmitted)
    assert _ignored(core, V2, verdict) == ["duplicate"]


def test_forged_verdicts_are_rejected() -> None:
    core, sid = _seen_by_v1()
    other = bytes(32)
    good = Verdict(sid, WORKER.peer_id, 0, 0, False, ("x",), 4, make_ticket(V2, sid))
    # ticket made with someone else's key, or over another submission
    assert _ignored(core, V2, replace(good, validator_ticket=make_ticket(V3, sid))) == ["bad_ticket"]
    assert _ignored(core, V2, replace(good, validator_ticket=make_ticket(V2, other))) == ["bad_ticket"]
    # a sender that is not a validator, even with a genuine ticket of its own
    assert _ignored(core, WORKER, replace(good, validator_ticket=make_ticket(WORKER, sid))) == ["not_validator"]
    assert _ignored(core, STRANGER, replace(good, validator_ticket=make_ticket(STRANGER, sid))) == ["not_validator"]
    # a verdict about a submission we never saw, or naming another worker or step
    assert _ignored(core, V2, replace(good, submission_id=other, validator_ticket=make_ticket(V2, other))) \
        == ["unknown_submission"]
    assert _ignored(core, V2, replace(good, step=5)) == ["mismatch"]
    assert core.reputation.failures(WORKER.peer_id) == 0


def test_verdict_from_a_validator_not_drawn_is_rejected() -> None:
    rate = 0.01
    core = core_for(V1, sample_rate=rate)
    for step in range(50):  # find a submission V2 was not drawn for (p is ~0.5%)
        env = envelope(WORKER, submission(step, nonce=bytes([step]) * 16))
        core.on_message(1.0, env)
        sid = submission_id(env)
        ticket = make_ticket(V2, sid)
        if ticket_value(ticket) > (1 << 255):
            break
    verdict = Verdict(sid, WORKER.peer_id, 0, step, True, (), 4, ticket)
    assert _ignored(core, V2, verdict) == ["not_selected"]


# -- reputation -------------------------------------------------------------------------------------------


def test_reputation_bans_after_repeated_failures() -> None:
    rep = Reputation(ReputationConfig(ban_after_failures=2))
    w = WORKER.peer_id
    first = rep.record(1.0, w, b"a" * 32, "v1", False, ("x",))
    assert [type(e) for e in first] == [BatchInvalidated] and not rep.is_banned(w, 1.0)
    assert rep.record(1.5, w, b"a" * 32, "v2", False, ("x",)) == []  # the same batch counts once
    second = rep.record(2.0, w, b"b" * 32, "v1", False, ("x",))
    assert [type(e) for e in second] == [BatchInvalidated, WorkerBanned] and rep.is_banned(w, 2.0)


def test_ban_can_require_distinct_validators() -> None:
    rep = Reputation(ReputationConfig(ban_after_failures=2, ban_min_validators=2, ban_s=100.0))
    w = WORKER.peer_id
    rep.record(1.0, w, b"a" * 32, "v1", False, ("x",))
    rep.record(2.0, w, b"b" * 32, "v1", False, ("x",))
    assert not rep.is_banned(w, 2.0)  # one validator alone cannot ban
    banned = rep.record(3.0, w, b"c" * 32, "v2", False, ("x",))
    assert isinstance(banned[-1], WorkerBanned) and rep.is_banned(w, 50.0)
    assert not rep.is_banned(w, 104.0)  # bans end


def test_banned_worker_is_refused_by_the_core() -> None:
    core = core_for(V1, FakeDirectory({WORKER: ("worker",)}), one_submission_per_step=False)
    banned = []
    for step in range(3):
        env = envelope(WORKER, submission(step))
        effects = core.on_message(float(step), env)
        if events(effects, CheckRequested):
            banned += events(core.check_done(float(step), submission_id(env), False, ("bad",), 4, 0.1),
                             WorkerBanned)
    assert len(banned) == 1
    assert [e.reason for e in events(core.on_message(9.0, envelope(WORKER, submission(9))), SubmissionRejected)] \
        == ["banned"]


# -- the simulated world ---------------------------------------------------------------------------------------


class StubWorker:
    """Publishes `count` submissions, one every `every_s`, from t=start_s (a test double)."""

    topics = ()
    kinds = ()

    def __init__(self, count: int, *, bad: bool, start_s: float = 5.0, every_s: float = 5.0) -> None:
        self.count, self.bad, self.start_s, self.every_s = count, bad, start_s, every_s
        self.sent = 0
        self.rng = random.Random(int(bad))

    def start(self, now: float) -> list[Any]:
        return [SetTimer(self.start_s, "stub/next")]

    def on_timer(self, now: float, key: str) -> list[Any]:
        sub = submission(self.sent, self.rng.randbytes(16), bad=self.bad)
        self.sent += 1
        more = [SetTimer(now + self.every_s, "stub/next")] if self.sent < self.count else []
        return [Publish(SUBMISSIONS_TOPIC, sub), *more]

    def on_message(self, now: float, envelope: Any) -> list[Any]:
        return []

    def on_rejected(self, now: float, peer: str, reason: str) -> list[Any]:
        return []


def stub_checker(request: CheckRequested) -> tuple[bool, tuple[str, ...]]:
    bad = request.submission.rollouts[0].proofs[0][0] == 0
    return (False, ("row0:toploc_exp",)) if bad else (True, ())


def _table(identity: Identity, roles: tuple[str, ...]) -> PeerTable:
    local = LocalInfo(addrs=("/ip4/127.0.0.1/tcp/1",), data_addr="127.0.0.1:1", roles=roles,
                      capacity=Capacity(1, 1, 1))
    return PeerTable(PeerTableConfig(), identity.peer_id, local, 0)


def test_validators_in_the_simulated_world() -> None:
    engine = Engine(seed=11)
    world = SimWorld(engine, sign=True)
    validators: dict[str, ValidatorCore] = {}
    for v in (V1, V2, V3):
        table = _table(v, ("validator",))
        core = ValidatorCore(ValidatorCoreConfig(claim_window_s=0.5, task_seed=7), v, table)
        validators[v.peer_id] = core
        world.add_peer(v, [table, InlineChecking(core, stub_checker, check_s=2.0)])
    honest, cheat = Identity.from_seed_text("honest"), Identity.from_seed_text("cheat")
    world.add_peer(honest, [_table(honest, ("worker",)), StubWorker(4, bad=False)])
    world.add_peer(cheat, [_table(cheat, ("worker",)), StubWorker(3, bad=True, start_s=6.0)])
    world.add_peer(STRANGER, [_table(STRANGER, ()), StubWorker(1, bad=False)])  # no worker role
    ids = list(world.peers)
    for a in ids:
        for b in ids:
            world.connect(a, b)
    engine.run(until=60.0)

    published = [e for _, p, e in world.events if type(e).__name__ == "VerdictPublished"]
    by_sid: dict[bytes, list[Verdict]] = {}
    for event in published:
        by_sid.setdefault(event.verdict.submission_id, []).append(event.verdict)
    # 4 honest + 2 cheating submissions checked (the third cheat comes after its ban), each once
    assert len(by_sid) == 6 and all(len(v) == 1 for v in by_sid.values())
    outcomes = sorted((v[0].worker == cheat.peer_id, v[0].accepted) for v in by_sid.values())
    assert outcomes == [(False, True)] * 4 + [(True, False)] * 2
    for core in validators.values():
        assert core.reputation.banned(60.0) == [cheat.peer_id]
        assert core.stats["submissions_rejected"].get("unknown_worker") == 1
        assert core.stats["submissions_rejected"].get("banned") == 1
        for sid, verdicts in by_sid.items():
            assert core.ledger.outcome(sid) == ("accepted" if verdicts[0].accepted else "rejected")
    bans = [(p, e.worker) for _, p, e in world.events if isinstance(e, WorkerBanned)]
    assert sorted(bans) == sorted((v, cheat.peer_id) for v in validators)
    assert sum(c.stats["checked"] for c in validators.values()) == 6

    # a replayed signed submission frame is dropped without a second check
    target = validators[V1.peer_id]
    seen_before = target.stats["seen"]
    frame = Codec(honest).encode(submission(0, random.Random(0).randbytes(16)), 1_800_000_000.0 + engine.now)
    world.deliver_frame(V1.peer_id, frame, honest.peer_id)
    world.deliver_frame(V1.peer_id, frame, honest.peer_id)
    engine.run(until=70.0)
    assert target.stats["seen"] == seen_before  # nonce reuse: refused as a replay
    assert target.stats["submissions_rejected"]["replay"] == 1
