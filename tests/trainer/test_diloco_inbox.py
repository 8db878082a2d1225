"""The round's inbox (`trainer.diloco_inbox`) in an open group, where identities cost nothing: the
members of the round have places of their own there, read first; every other sender (a joiner,
any fresh identity) shares a pool, so a flood of strangers delays joiners only.

The pure core first; then real roles (`DilocoRole` with only what its rounds and `_serve` read, no
model: its inner steps are the test's) serving the diloco channel on real data planes on
loopback, flooded by real connections of fresh identities. No timing asserts: the waits are for
events, bounded by a slack per wait; a round's deadline is far above what its work needs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
import trio
import trio.testing

from p2pnet.dataplane import DataPlane, open_data_stream, send_frame
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from tests.relay.test_hostile_listeners import drain_until_closed
from trainer.allreduce import AllReduceConfig
from trainer.diloco import Encoding, OuterConfig, OuterOptimizer, digest
from trainer.diloco_inbox import GROUP_BYTES, INBOX, PEER_INBOX, InboxCore, Lane, RoundInbox, frame_bytes
from trainer.diloco_links import PeerFailed, Received
from trainer.diloco_local import GlobalState
from trainer.diloco_messages import (CHANNEL, MAX_MEMBERS, PIECE_VALUES, STAGE_CONTRIBUTION, Join,
                                     Part)
from trainer.diloco_role import DilocoConfig, DilocoRole, Phase

SLACK_S = 10.0  # per wait
VALUES = 1000
# more strangers than the pool holds whole shares of: it stays full, and frames wait for it
STRANGERS = [Identity.from_seed_text(f"diloco stranger {i}") for i in range(INBOX // PEER_INBOX + 1)]


def _join(round: int) -> Join:
    return Join(round, b"w" * 16, ())


# -- the core -------------------------------------------------------------------------------


def _taken(core: InboxCore) -> list[tuple[Any, Lane]]:
    taken = []
    while (next_event := core.take()) is not None:
        taken.append(next_event)
    return taken


def test_the_groups_lane_is_read_first_and_each_lane_in_the_order_frames_came() -> None:
    """A member's frame (and our own report of it) is read before any stranger's that came before
    it; within a lane, frames keep their order. A report of a stranger comes after its frames that
    came before it, as every frame of a member: read after the report, one would clear the
    suspicion the report raised."""
    core = InboxCore({"member"})
    sent = [Received("s1", _join(1)), Received("member", _join(1)), PeerFailed("member"), Received("s2", _join(2)),
            PeerFailed("s1"), Received("member", _join(2))]
    for event in sent:
        core.report(event) if isinstance(event, PeerFailed) else core.put(event)
    assert _taken(core) == [(sent[1], Lane.GROUP), (sent[2], Lane.GROUP), (sent[5], Lane.GROUP),
                            (sent[0], Lane.POOL), (sent[3], Lane.POOL), (sent[4], Lane.POOL)]
    assert len(core) == 0 and core.queued == {} and core.reported == {Lane.GROUP: 0, Lane.POOL: 0} and core.held == 0


def test_a_new_members_frames_from_the_pool_are_read_before_its_later_ones() -> None:
    """A joiner's frames (and our report of it) taken in before our round's decision wait in the
    pool; once it is a member (`reserve`) they are read in the order they came, before the frames
    it sends from then on and before the strangers' frames, as its later ones: else its Parts
    taken in early could wait behind every member's later Parts, past the round's deadlines."""
    core = InboxCore({"member"})
    before = [Received("joiner", _join(3)), Received("s1", _join(3)), Received("joiner", _part(3)),
              PeerFailed("joiner"), Received("member", _join(3))]
    for event in before:
        core.report(event) if isinstance(event, PeerFailed) else core.put(event)
    core.reserve({"member", "joiner"})
    later = Received("joiner", dataclasses.replace(_part(3), shard=1))
    core.put(later)
    assert [event for event, _ in _taken(core)] == [before[4], before[0], before[2], before[3], later, before[1]]
    assert core.reported == {Lane.GROUP: 0, Lane.POOL: 0} and core.held == 0 and core.queued == {}


def test_the_groups_lane_holds_the_bytes_the_whole_inbox_held_and_an_honest_group_never_waits() -> None:
    """Every member's whole share of whole Parts would be gigabytes (`MAX_MEMBERS` x `PEER_INBOX`
    x 1 MiB, a piece in fp32): the group's lane takes frames up to `GROUP_BYTES` (the old inbox's
    256 Parts of the wire's largest), then a member's next Part waits for the lane though its own places are free, until a frame is read.
    A group of `MAX_MEMBERS` honest members, 2 frames each naming the whole group, fits with room
    to spare."""
    members = [Identity.from_seed_text(f"diloco inbox member {i}").peer_id for i in range(MAX_MEMBERS)]
    core = InboxCore(members)
    join = Join(3, b"w" * 16, tuple(sorted(members)))
    for member in members:
        for _ in range(2):
            assert core.blocked(member, frame_bytes(join)) is None
            core.put(Received(member, join))
    assert core.held < GROUP_BYTES // 16
    whole = bytes(4 * PIECE_VALUES)  # the most a Part holds: a piece in fp32 (one buffer, shared by every Part here)
    part = Part(3, b"x" * 16, STAGE_CONTRIBUTION, 0, PIECE_VALUES, 0, PIECE_VALUES, "fp32", 4096, whole, b"", ())
    size = frame_bytes(part)
    puts = 0
    while (full := core.blocked(members[puts % MAX_MEMBERS], size)) is None:
        core.put(Received(members[puts % MAX_MEMBERS], part))
        puts += 1
    assert full is Lane.GROUP and core.queued[members[puts % MAX_MEMBERS]] < PEER_INBOX
    assert core.held <= GROUP_BYTES and puts == (GROUP_BYTES - 2 * MAX_MEMBERS * frame_bytes(join)) // size
    while core.blocked(members[puts % MAX_MEMBERS], size) is not None:
        assert core.take() is not None  # the round reads: room comes back
    core.put(Received(members[puts % MAX_MEMBERS], part))
    assert core.held <= GROUP_BYTES


async def test_a_frame_waiting_for_the_groups_lane_goes_in_once_its_sender_is_no_member() -> None:
    """`reserve` wakes the frames that wait for either lane: a former member's frame waiting for a
    full group's lane then takes its place in the pool, with no read needed."""
    inbox = RoundInbox()
    inbox.core = InboxCore({"member"}, group=1)
    await inbox.put(Received("member", _join(3)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inbox.put, Received("member", _join(4)))
        await trio.testing.wait_all_tasks_blocked()
        assert inbox.queued("member") == 1  # waits for the group's lane
        inbox.reserve(set())  # the next round went on without it
        await trio.testing.wait_all_tasks_blocked()
        assert inbox.queued("member") == 2
        nursery.cancel_scope.cancel()
    assert [inbox.receive_nowait(), inbox.receive_nowait()] == [Received("member", _join(3)),
                                                                 Received("member", _join(4))]


def test_members_keep_their_places_when_strangers_fill_the_pool() -> None:
    """Each sender has `per_sender` places; senders outside the group share `pool` of them. Once
    strangers fill the pool, a member still has its places, a stranger or joiner waits for the
    pool; one that becomes a member (`reserve`) has its places at once."""
    core = InboxCore({"member"}, per_sender=2, pool=3)
    for peer in ("s1", "s1", "s2"):
        core.put(Received(peer, _join(1)))
    assert core.blocked("s1") == "s1"  # its own places taken
    assert core.blocked("joiner") is Lane.POOL  # the pool is full
    with pytest.raises(ValueError):
        core.put(Received("joiner", _join(1)))
    for _ in range(2):
        assert core.blocked("member") is None
        core.put(Received("member", _join(1)))
    assert core.blocked("member") == "member"  # a member too has only its own places
    core.reserve({"member", "joiner"})
    assert core.blocked("joiner") is None
    core.put(Received("joiner", _join(1)))
    assert [core.take() for _ in range(4)] == [(Received("member", _join(1)), Lane.GROUP)] * 2 + [
        (Received("joiner", _join(1)), Lane.GROUP), (Received("s1", _join(1)), Lane.POOL)]
    with pytest.raises(ValueError):
        core.reserve({f"peer {i}" for i in range(MAX_MEMBERS + 1)})


async def test_a_frame_waiting_for_the_pool_goes_in_once_its_sender_is_a_member() -> None:
    """No read needed: `reserve` wakes the frames that wait for the pool. A wait that is
    cancelled puts nothing."""
    inbox = RoundInbox()
    for i in range(INBOX):
        await inbox.put(Received(f"s{i // PEER_INBOX}", _join(1)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inbox.put, Received("joiner", _join(1)))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert inbox.queued("joiner") == 0 and len(inbox) == INBOX
    with trio.fail_after(SLACK_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(inbox.put, Received("joiner", _join(2)))
            await trio.testing.wait_all_tasks_blocked()
            assert inbox.queued("joiner") == 0
            inbox.reserve({"joiner"})
    assert inbox.receive_nowait() == Received("joiner", _join(2))


def test_a_closed_group_lists_at_most_as_many_trainers_as_a_round_holds(tmp_path) -> None:
    """Each listed trainer has places of its own in the round's inbox; a round's Members lists at
    most `MAX_MEMBERS`, so a longer list is refused at start (its inbox would be unbounded, and no
    round could hold the group)."""
    from p2pnet.config import from_mapping
    from p2pnet.errors import ConfigError

    section = {"model_dir": str(tmp_path), "out_dir": str(tmp_path)}
    ids = [Identity.from_seed_text(f"listed {i}").peer_id for i in range(MAX_MEMBERS + 1)]
    with pytest.raises(ConfigError, match="trainers"):
        from_mapping(DilocoConfig, {**section, "trainers": ids}, "diloco")
    assert len(from_mapping(DilocoConfig, {**section, "trainers": ids[:MAX_MEMBERS]}, "diloco").trainers) == MAX_MEMBERS


# -- real roles, real connections --------------------------------------------------------------


class Trainer:
    """A `DilocoRole` with only what its rounds (`_round`) and `_serve` read: an open group, at
    `round`, its peer table the other `Trainer`s, its inner steps a fixed change of the weights
    that end as soon as they start (the test says when a round starts), no durable writes."""

    def __init__(self, name: str, round: int, deadline_s: float) -> None:
        self.identity = Identity.from_seed_text(f"diloco inbox {name}")
        self.peer_id = self.identity.peer_id
        self.entries: list[SimpleNamespace] = []
        role = object.__new__(DilocoRole)
        role.node = SimpleNamespace(
            codec=Codec(self.identity), peer_id=self.peer_id,
            peertable=SimpleNamespace(with_role=lambda name: self.entries, is_banned=lambda peer, now: False,
                                      get=lambda peer: next((e for e in self.entries if e.peer_id == peer), None)),
            wait_for_peers=self._no_wait, introduce=self._no_introduction)
        role.config = SimpleNamespace(deadline_s=deadline_s, trainers=(), publish=False, rounds=10, inner_steps=1,
                                      state_min_bytes_per_s=DilocoConfig.state_min_bytes_per_s)
        role.reduce_config = AllReduceConfig(Encoding.FP32, 4096, deadline_s, 10.0)
        weights = torch.linspace(-1.0, 1.0, VALUES)
        role.state = GlobalState(round, weights, torch.zeros(VALUES))
        role.outer = OuterOptimizer(OuterConfig(), VALUES, torch.zeros(VALUES))
        step = torch.full((VALUES,), 0.01 * (1 + len(name)))  # each peer's own pseudo-gradient
        role.inner = SimpleNamespace(train=lambda steps: 0.0, weights=lambda: role.state.weights - step,
                                     load=lambda weights: None, eval_loss=lambda: 0.0)
        role.inbox = RoundInbox()  # an open group: nobody reserved until a round is decided
        role.suspects, role.heard, role.joins, role.early_parts = set(), set(), {}, []
        role.turned_away = {}
        role.history, role.rejected, role.state_askers, role.granted_at = [], {}, {}, {}
        role.outer_state_versions, role.phase = set(), Phase.STARTING
        role._checkpoint = self._no_checkpoint
        self.role = role
        self.plane = DataPlane("127.0.0.1", 0, codec=Codec(self.identity), self_id=self.peer_id,
                               admit=lambda peer: None)  # an open group: any peer in the table
        self.plane.register(CHANNEL, role._serve)
        self.address = ""

    @staticmethod
    async def _no_wait(check: Callable[[], bool], timeout_s: float) -> bool:
        return check()

    @staticmethod
    async def _no_introduction(peer: str) -> bool:
        return False

    @staticmethod
    async def _no_checkpoint(state: GlobalState) -> None:
        pass

    def knows(self, *others: Trainer) -> None:
        self.entries[:] = [SimpleNamespace(peer_id=o.peer_id, data_addr=o.address) for o in others]


async def _started(nursery: trio.Nursery, *trainers: Trainer) -> None:
    for trainer in trainers:
        trainer.address = await nursery.start(trainer.plane.serve)
    for trainer in trainers:
        trainer.knows(*(t for t in trainers if t is not trainer))


async def _until(predicate: Callable[[], bool], what: str) -> None:
    with trio.fail_after(SLACK_S):  # (a wait for an event, bounded; nothing here is timed)
        while not predicate():
            await trio.sleep(0.01)


def _waits_in(trainer: Trainer, lane: Lane, peer: str, kind: type, round: int) -> bool:
    return any(isinstance(e, Received) and e.peer == peer and isinstance(e.body, kind) and e.body.round == round
               for e in trainer.role.inbox.core.lanes[lane])


def _part(round: int) -> Part:
    """A contribution of no round's members (its members digest is no one's): what a flood sends
    that a round reads and passes over. 64 KiB, so that few wait in a socket's buffers."""
    length = 16384
    return Part(round, b"x" * 16, STAGE_CONTRIBUTION, 0, length, 0, length, "fp32", 4096, bytes(4 * length), b"", ())


async def _flood(target: Trainer, stranger: Identity, frames: int | None = None) -> None:
    """A fresh identity sends `target` Parts of its current round (what `_tell_ahead` tells anyone
    that sends an old Join), `frames` of them or, None, for ever, again on a new connection
    whenever `target` closes one (its frames found no room in time)."""
    codec = Codec(stranger)
    sent = 0
    while frames is None or sent < frames:
        stream = await open_data_stream(target.address, CHANNEL, codec=codec, peer=target.peer_id)
        async with stream:
            try:
                while frames is None or sent < frames:
                    await send_frame(stream, codec.encode(_part(target.role.state.round), time.time()))
                    sent += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                continue


async def _a_round(trainer: Trainer, background: trio.Nursery, done: list[str]) -> None:
    await trainer.role._round(background)
    done.append(trainer.peer_id)


def _noting_reads(trainer: Trainer) -> list[Any]:
    """What `trainer`'s round reads from its inbox, in order, from now on."""
    read: list[Any] = []
    receive = trainer.role.inbox.receive

    async def receive_and_note() -> Any:
        read.append(await receive())
        return read[-1]
    trainer.role.inbox.receive = receive_and_note
    return read


async def test_strangers_that_fill_the_pool_before_a_round_syncs_do_not_keep_its_members_out(
        nursery: trio.Nursery) -> None:
    """Two trainers average round 2; then 17 fresh identities flood one of them (a) with frames
    it must take in (Parts of its round, as a round could use), keeping the pool full while
    its inner steps of round 3 run, as they can in an open group. Its partner's Join of round 3
    arrives then: it finds the places the round's members have of their own (before, it found
    the 256 places of the whole inbox taken, and waited there, unread, until its connection was
    cut at the stall window, or, read at last, came after every stranger's frame before it). The
    round reads the members' frames first, Joins, Members and Parts: it completes with both, and
    both end on the same weights."""
    deadline_s = 2 * SLACK_S  # far above what the rounds' work needs: the flood must not make it
    a, b = Trainer("a", 2, deadline_s), Trainer("b", 2, deadline_s)
    await _started(nursery, a, b)
    done: list[str] = []
    async with trio.open_nursery() as rounds:  # round 2: no flood
        rounds.start_soon(_a_round, a, nursery, done)
        rounds.start_soon(_a_round, b, nursery, done)
    assert a.role.history[-1]["members"] == sorted([a.peer_id, b.peer_id])

    for stranger in STRANGERS:
        nursery.start_soon(_flood, a, stranger)
    await _until(lambda: len(a.role.inbox.core.lanes[Lane.POOL]) == INBOX, "the pool full")
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, b, nursery, done)  # b's inner steps ended first: it joins round 3
        await _until(lambda: _waits_in(a, Lane.GROUP, b.peer_id, Join, 3), "b's Join taken in at a")
        assert len(a.role.inbox.core.lanes[Lane.POOL]) == INBOX  # still full: nothing read it
        read = _noting_reads(a)
        rounds.start_soon(_a_round, a, nursery, done)  # then a's
    first = read[0]  # b's Join, before the strangers' frames that came first
    assert first.peer == b.peer_id and isinstance(first.body, Join) and first.body.round == 3
    for trainer in (a, b):
        row = trainer.role.history[-1]
        assert (row["round"], row["members"], row["contributors"]) == (3, sorted([a.peer_id, b.peer_id]),
                                                                       sorted([a.peer_id, b.peer_id]))
    assert digest(a.role.state.weights) == digest(b.role.state.weights) and a.role.state.round == 4
    nursery.cancel_scope.cancel()


async def test_a_joiners_join_waits_only_for_the_pool_and_a_members_frame_never_does(
        nursery: trio.Nursery, caplog: Any) -> None:
    """(b) A joiner (no round with us yet) shares the pool with the strangers: with room there,
    its Join is taken in and read, after the strangers' frames that came first; once strangers
    fill it, its Join waits, and after `STALL_WINDOWS` x `deadline_s` its connection is cut
    ("inbox_full"; it sends its Join again on a new one). A member's frame that comes meanwhile
    is taken in at once and read first, before the strangers' frames that came before it."""
    caplog.set_level(logging.INFO, logger="p2pnet.dataplane")
    a = Trainer("a", 3, 0.2)
    await _started(nursery, a)
    member, joiner = Identity.from_seed_text("diloco inbox member"), Identity.from_seed_text("diloco inbox joiner")
    a.role._reserve((a.peer_id, member.peer_id))  # they took part in a round together
    pool = a.role.inbox.core.lanes[Lane.POOL]

    async def send(who: Identity, body: Any) -> trio.SocketStream:
        stream = await open_data_stream(a.address, CHANNEL, codec=Codec(who), peer=a.peer_id)
        await send_frame(stream, Codec(who).encode(body, time.time()))
        return stream

    async with trio.open_nursery() as strangers:  # all but one of the pool's shares
        for stranger in STRANGERS[:INBOX // PEER_INBOX - 1]:
            strangers.start_soon(_flood, a, stranger, PEER_INBOX)
    await _until(lambda: len(pool) == INBOX - PEER_INBOX, "the strangers' frames taken in")
    stream = await send(joiner, _join(3))
    async with stream:
        await _until(lambda: a.role.inbox.queued(joiner.peer_id) == 1, "the joiner's Join taken in")
        read = [a.role.inbox.receive_nowait() for _ in range(INBOX - PEER_INBOX + 1)]
        assert read[-1] == Received(joiner.peer_id, _join(3))  # in the order they came
        assert {e.peer for e in read[:-1]} == {s.peer_id for s in STRANGERS[:INBOX // PEER_INBOX - 1]}

    for stranger in STRANGERS[:INBOX // PEER_INBOX]:
        nursery.start_soon(_flood, a, stranger, PEER_INBOX)
    await _until(lambda: len(pool) == INBOX, "the pool full")
    stream = await send(joiner, _join(3))
    async with stream:
        member_stream = await send(member, _join(3))
        async with member_stream:
            await _until(lambda: a.role.inbox.queued(member.peer_id) == 1, "the member's Join taken in")
            assert await drain_until_closed(stream, SLACK_S) == b""  # the joiner's: cut
            assert a.role.inbox.receive_nowait() == Received(member.peer_id, _join(3))
            assert a.role.inbox.receive_nowait().peer != joiner.peer_id
    assert a.role.inbox.queued(joiner.peer_id) == 0
    cut = [r.getMessage() for r in caplog.records if "inbox_full" in r.getMessage()]
    assert len(cut) == 1 and joiner.peer_id in cut[0] and "pool lane" in cut[0]
    nursery.cancel_scope.cancel()
