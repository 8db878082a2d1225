"""Joiners a crowded open group has no room for, on the same real roles and data planes as
tests/trainer/test_diloco_crowd.py (whose helpers these use): a joiner the flooded leader could
not tell is no suspect, a newcomer it turned away does not hold the round, and one told there is
no room joins the round after, fetching that round's state once. Moved out of
test_diloco_crowd.py, unchanged. No timing asserts: the waits are for events, bounded by a slack
that scales with the frames sent."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import trio

import pytest

from p2pnet.dataplane import DataPlane, FrameReader, open_data_stream, send_frame
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from tests.trainer.test_diloco_crowd import (CROWD, _crowd_then, _crowded_during_all_reduce, _paired, _read_all,
                                             _refusing_and_told, _send_each)
from tests.trainer.test_diloco_inbox import SLACK_S, Trainer, _a_round, _noting_reads
from trainer.allreduce import Membership
from trainer.diloco import digest
from trainer.diloco_links import PeerFailed
from trainer.diloco_messages import CHANNEL, Join, NoRoom, StatePiece, StateRequest
from trainer.diloco_decide import _Behind
from trainer.diloco_role import JoinPath, Phase
from trainer.diloco_serving import MAX_FRAME_BYTES


async def _sink(nursery: trio.Nursery, who: Identity) -> str:
    """A data plane of `who` that takes every frame sent to its diloco channel and answers none:
    a trainer peer we can send to (never a suspect for a failed send) that never leads."""
    plane = DataPlane("127.0.0.1", 0, codec=Codec(who), self_id=who.peer_id, admit=lambda peer: None)

    async def take(stream: trio.SocketStream, reader: FrameReader, peer: str) -> None:
        while await reader.frame() is not None:
            pass
    plane.register(CHANNEL, take)
    return await nursery.start(plane.serve)


async def _fetch_state(source: Trainer, who: Identity) -> StatePiece:
    """`who` fetches `source`'s global state (a direct join): one piece, the whole state here."""
    codec = Codec(who)
    stream = await open_data_stream(source.address, CHANNEL, codec=codec, peer=source.peer_id)
    async with stream:
        await send_frame(stream, codec.encode(StateRequest(0), time.time()))
        with trio.fail_after(SLACK_S):
            frame = await FrameReader(stream, max_frame_bytes=MAX_FRAME_BYTES).frame()
    assert frame is not None
    piece = codec.decode(frame, time.time()).body
    assert isinstance(piece, StatePiece) and piece.offset + piece.length == piece.total
    return piece


async def test_a_joiner_the_leader_could_not_tell_it_had_no_room_is_no_suspect(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """During the leader's join of round 3, 300 fresh identities' Joins fill the places it has; then
    a trainer peer of its table Joins, saying it reads a `NoRoom`, and its data plane refuses the
    leader's connections (as one whose table lost the leader's heartbeat): telling it fails, as
    the leader's own Join to it does. That best-effort notice makes it no suspect, as that Join
    does not (before, the failed notice did: not waited for, nor a leader candidate, in a later
    round until it spoke again), and the round goes on as before."""
    lead, other, done, pair = await _paired(nursery)
    joiner = next(who for who in (Identity.from_seed_text(f"diloco gone {i}") for i in range(100))
                  if who.peer_id > max(pair))
    told, tried = await _refusing_and_told(lead, joiner, nursery, monkeypatch)
    frames = [(who, Join(3, who.peer_id.encode()[:16], ())) for who in CROWD]
    frames.append((joiner, Join(3, b"j" * 16, (), hears_no_room=True)))  # the last: no room left for it
    read = _noting_reads(lead)
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, lead, nursery, done)
        await _send_each(lead, frames)
        await _read_all(read, frames)
        with trio.fail_after(SLACK_S):
            await told.wait()
        assert tried == [(joiner.peer_id, NoRoom(3), False)] and lead.role.phase == Phase.JOIN
        # a failure reported is in the round's inbox before the send returns, or read from it already
        failed = PeerFailed(joiner.peer_id)
        assert failed not in read and all(failed not in lane for lane in lead.role.inbox.core.lanes.values())
        assert joiner.peer_id not in lead.role.suspects
        rounds.start_soon(_a_round, other, nursery, done)
    for trainer in (lead, other):
        row = trainer.role.history[-1]
        assert (row["round"], row["members"], row["contributors"]) == (3, pair, pair)
    assert joiner.peer_id not in lead.role.suspects
    nursery.cancel_scope.cancel()


async def test_a_joiner_the_leader_could_not_tell_during_its_all_reduce_is_no_suspect(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """The all-reduce's `NoRoom` is as best effort as the join's: while the leader's all-reduce of
    round 3 waits for its partner, 300 fresh identities' Joins of round 4 fill the places it keeps
    for round 4; then a trainer peer of its table Joins round 4, saying it reads a `NoRoom`, and its
    data plane refuses the leader's connections. Telling it fails, and the failure is not put into
    the round's inbox (where the all-reduce would read it as a failed peer): the round finishes
    with the two trainers and the joiner is no suspect."""
    lead, other, done, pair = await _paired(nursery)
    joiner = Identity.from_seed_text("diloco late joiner gone")
    told, tried = await _refusing_and_told(lead, joiner, nursery, monkeypatch)
    async with _crowded_during_all_reduce(lead, other, nursery, done, _crowd_then(joiner)) as read:
        with trio.fail_after(SLACK_S):
            await told.wait()
        assert tried == [(joiner.peer_id, NoRoom(4), False)] and lead.role.phase == Phase.REDUCE
        # a failure reported is in the round's inbox before the send returns, or read from it already
        failed = PeerFailed(joiner.peer_id)
        assert failed not in read and all(failed not in lane for lane in lead.role.inbox.core.lanes.values())
    assert failed not in read
    for trainer in (lead, other):
        row = trainer.role.history[-1]
        assert (row["round"], row["members"], row["contributors"]) == (3, pair, pair)
    assert lead.role.turned_away == {4: {joiner.peer_id}} and joiner.peer_id not in lead.role.suspects
    nursery.cancel_scope.cancel()


async def test_a_newcomer_whose_join_the_flooded_leader_turned_away_does_not_hold_the_round(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two trainers average round 2. A newcomer, a trainer peer of both tables with a higher id,
    fetches the leader's state: the leader waits for its Join from then on. In round 3, 300
    fresh identities Join first, each on weights of its own, and fill the places the round has:
    the newcomer's Join, on the round's weights, is turned away (it sits the round out). The
    leader decides as soon as its partner's Join is in, not at the join deadline (before, it
    waited for the newcomer's Join, already turned away, until then), and both trainers end the
    round on the same weights, the newcomer no member."""
    decisions: list[bool] = []  # each decision of a round: taken with every Join it waits for in?
    decided = Membership.decided

    def noting(self: Membership, now: float) -> Any:
        result = decided(self, now)
        if result is not None and self.round == 3:
            decisions.append(self.expected <= set(self.joins))
        return result
    monkeypatch.setattr(Membership, "decided", noting)
    lead, other, done, pair = await _paired(nursery)

    newcomer = next(who for who in (Identity.from_seed_text(f"diloco newcomer {i}") for i in range(100))
                    if who.peer_id > max(pair))  # it does not lead: the leader is the one that decides
    entry = SimpleNamespace(peer_id=newcomer.peer_id, data_addr=await _sink(nursery, newcomer))
    lead.entries.append(entry)
    other.entries.append(entry)
    piece = await _fetch_state(lead, newcomer)
    assert piece.round == 3 and newcomer.peer_id in lead.role.heard  # waited for from now on

    same = digest(lead.role.state.weights)
    frames = [(who, Join(3, who.peer_id.encode()[:16], ())) for who in CROWD]
    frames.append((newcomer, Join(3, same, tuple(pair))))  # the last: no room left for it
    read = _noting_reads(lead)
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, lead, nursery, done)
        await _send_each(lead, frames)
        await _read_all(read, frames)
        rounds.start_soon(_a_round, other, nursery, done)
    assert decisions == [True]
    for trainer in (lead, other):
        row = trainer.role.history[-1]
        assert (row["round"], row["members"], row["contributors"]) == (3, pair, pair)
    assert digest(lead.role.state.weights) == digest(other.role.state.weights) and lead.role.state.round == 4
    nursery.cancel_scope.cancel()


async def _a_joiner_of_the_pair(nursery: trio.Nursery, lead: Trainer, other: Trainer, pair: list[str]) -> Trainer:
    """A third trainer with a higher id than the pair's (it does not lead), on the round's
    weights, serving, in both tables and knowing both."""
    deadline_s = lead.role.config.deadline_s
    joiner = next(t for t in (Trainer(f"joiner {i}", 3, deadline_s) for i in range(100)) if t.peer_id > max(pair))
    joiner.role.state = lead.role.state  # the round's weights (a state is never mutated)
    joiner.address = await nursery.start(joiner.plane.serve)
    joiner.knows(lead, other)
    for trainer in (lead, other):
        trainer.entries.append(SimpleNamespace(peer_id=joiner.peer_id, data_addr=joiner.address))
    return joiner


async def test_a_joiner_the_flooded_leader_had_no_room_for_is_told_and_joins_the_round_after(
        nursery: trio.Nursery) -> None:
    """Two trainers average round 2. A third trainer, in both tables with a higher id than theirs
    (it does not lead), joins round 3 on the round's weights after 300 fresh identities' Joins
    filled the places the leader's round has: the leader turns it away and tells it (`NoRoom`),
    and it sits the round out as soon as it reads that, sure of its leader (no suspect), before
    the leader's partner has even joined (before, nothing told it: it waited out the leader
    timeout, twice a deadline far above this test's waits). The two trainers end round 3 without
    it; it takes the state of round 4 from its leader and the three average round 4."""
    lead, other, done, pair = await _paired(nursery)
    joiner = await _a_joiner_of_the_pair(nursery, lead, other, pair)

    frames = [(who, Join(3, who.peer_id.encode()[:16], ())) for who in CROWD]
    read = _noting_reads(lead)
    told, behind = trio.Event(), []

    async def joiner_round() -> None:
        try:
            await joiner.role._round(nursery)
        except _Behind as exc:
            behind.append(exc.peer)
        told.set()
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, lead, nursery, done)
        await _send_each(lead, frames)
        await _read_all(read, frames)  # every place of round 3 is taken
        rounds.start_soon(joiner_round)
        with trio.fail_after(SLACK_S):  # (its leader timeout: 2 x deadline_s, 12 slacks)
            await told.wait()
        assert behind == [lead.peer_id] and joiner.role.suspects == set() and joiner.role.history == []
        assert lead.role.phase == Phase.JOIN  # still waiting for its partner's Join
        rounds.start_soon(_a_round, other, nursery, done)
    for trainer in (lead, other):
        row = trainer.role.history[-1]
        assert (row["round"], row["members"], row["contributors"]) == (3, pair, pair)

    # it takes a later state (its catch-up, directly from the peer that told it), and joins round 4
    joiner.role.config.outer_lr, joiner.role.config.outer_momentum = 0.7, 0.9
    joiner.role.fetched, joiner.role.state_via_counts = [], {path: 0 for path in JoinPath}
    await joiner.role._catch_up_directly(lead.peer_id)
    assert joiner.role.state.round == 4
    async with trio.open_nursery() as rounds:
        for trainer in (lead, other, joiner):
            rounds.start_soon(_a_round, trainer, nursery, done)
    trio_ids = sorted([*pair, joiner.peer_id])
    for trainer in (lead, other, joiner):
        row = trainer.role.history[-1]
        assert (row["round"], row["members"], row["contributors"]) == (4, trio_ids, trio_ids)
    assert digest(lead.role.state.weights) == digest(joiner.role.state.weights) and joiner.role.state.round == 5
    nursery.cancel_scope.cancel()


async def test_a_joiner_told_there_is_no_room_fetches_the_state_of_the_round_after_once(
        nursery: trio.Nursery) -> None:
    """As above, the joiner (on the direct path) is told `NoRoom` while the leader waits for its
    partner's Join of round 3, and catches up at once, as `run` does. It asks the leader for a
    later round's state: the leader answers when its round 3 is over, and the joiner takes the
    state of round 4, in one fetch (before, it fetched the leader's state of round 3 at once, its
    own round's weights, ran round 3's inner steps again, and, told it was behind, fetched the
    state again)."""
    lead, other, done, pair = await _paired(nursery)
    joiner = await _a_joiner_of_the_pair(nursery, lead, other, pair)
    joiner.role.config.outer_lr, joiner.role.config.outer_momentum, joiner.role.config.join_via = 0.7, 0.9, "direct"
    joiner.role.fetched, joiner.role.state_via_counts = [], {path: 0 for path in JoinPath}
    served: list[int] = []  # the round of each state the leader sent
    send_state = lead.role._send_state

    async def noting(stream: Any, peer: str, start: float) -> None:
        served.append(lead.role.state.round)
        await send_state(stream, peer, start)
    lead.role._send_state = noting

    frames = [(who, Join(3, who.peer_id.encode()[:16], ())) for who in CROWD]
    read = _noting_reads(lead)
    told = trio.Event()

    async def joiner_round() -> None:
        try:
            await joiner.role._round(nursery)
        except _Behind as behind:
            told.set()
            await joiner.role._catch_up(behind.peer, behind.past)  # as `run` does
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, lead, nursery, done)
        await _send_each(lead, frames)
        await _read_all(read, frames)  # every place of round 3 is taken
        rounds.start_soon(joiner_round)
        with trio.fail_after(SLACK_S):
            await told.wait()
        assert lead.role.phase == Phase.JOIN  # still waiting for its partner's Join
        rounds.start_soon(_a_round, other, nursery, done)
    assert served == [4] and [f["round"] for f in joiner.role.fetched] == [4] and joiner.role.state.round == 4
    assert digest(lead.role.state.weights) == digest(joiner.role.state.weights)
    nursery.cancel_scope.cancel()
