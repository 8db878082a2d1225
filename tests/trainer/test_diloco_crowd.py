"""More identities than a round holds, in an open group, where identities cost nothing: real
roles (`DilocoRole` with only what its rounds and `_serve` read: the `Trainer` of
`test_diloco_inbox`) serving the diloco channel on real data planes on loopback, sent Joins on
real connections by hundreds of fresh identities.

A round holds at most `MAX_MEMBERS` (what a Members lists): the leader decides no more, the
last round's members first (`trainer.allreduce.room_for`), and keeps at most that many Joins of
the next round it reads during its all-reduce, of the next round only. A trainer peer whose Join
it turned away is not waited for (`Membership.refused`), and what the role remembers of the
identities that spoke to it or failed it (`heard`, `suspects`) stays bounded (`_forget`). No timing
asserts: the waits are for events, bounded by a slack that scales with the frames sent; a round's
deadline is far above what its work needs. The joiners it has no room for, told so or not:
tests/trainer/test_diloco_crowd_joiners.py, on these helpers.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import trio

import pytest

import trainer.diloco_role as diloco_role
from p2pnet.dataplane import DataPlane, FrameReader, open_data_stream, send_frame
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from tests.trainer.test_diloco_membership import _leader_as_the_shell_sees_it
from tests.trainer.test_diloco_inbox import SLACK_S, Trainer, _a_round, _noting_reads, _started
from trainer.diloco import digest
from trainer.diloco_inbox import RoundInbox
from trainer.diloco_links import Links, Received
from trainer.diloco_messages import CHANNEL, MAX_MEMBERS, STAGE_CONTRIBUTION, Join, Members, NoRoom, Part
from trainer.diloco_role import DilocoRole, Phase

CROWD = [Identity.from_seed_text(f"diloco crowd {i}") for i in range(300)]  # more than a round holds
SEED = 43


def _leader_first(a: Trainer, b: Trainer) -> tuple[Trainer, Trainer]:
    """The round's leader (the lowest id) and the other."""
    return (a, b) if a.peer_id < b.peer_id else (b, a)


async def _send_each(target: Trainer, frames: list[tuple[Identity, Join]]) -> None:
    """Each frame on a connection of its sender's own, one after the other."""
    for who, body in frames:
        stream = await open_data_stream(target.address, CHANNEL, codec=Codec(who), peer=target.peer_id)
        async with stream:
            await send_frame(stream, Codec(who).encode(body, time.time()))


async def _read_all(read: list[Any], frames: list[tuple[Identity, Join]]) -> None:
    """Until the round read every one of `frames` (a bound per frame sent: the work scales with them)."""
    want = {(who.peer_id, body.round) for who, body in frames}
    with trio.fail_after(SLACK_S * (1 + len(frames) / 50)):
        while not want <= {(e.peer, e.body.round) for e in read if isinstance(e, Received)}:
            await trio.sleep(0.01)


async def _round_together(lead: Trainer, other: Trainer, nursery: trio.Nursery, done: list[str]) -> None:
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, lead, nursery, done)
        rounds.start_soon(_a_round, other, nursery, done)


async def _paired(nursery: trio.Nursery) -> tuple[Trainer, Trainer, list[str], list[str]]:
    """Two trainers, the round's leader (the lowest id) first, that averaged round 2 together; the
    list their rounds' ends go into, and their ids. Their deadline is far above what the rounds'
    work needs."""
    deadline_s = 6 * SLACK_S
    lead, other = _leader_first(Trainer("a", 2, deadline_s), Trainer("b", 2, deadline_s))
    await _started(nursery, lead, other)
    done: list[str] = []
    await _round_together(lead, other, nursery, done)
    return lead, other, done, sorted([lead.peer_id, other.peer_id])


@asynccontextmanager
async def _crowded_during_all_reduce(lead: Trainer, other: Trainer, nursery: trio.Nursery, done: list[str],
                                     frames: list[tuple[Identity, Join]]) -> AsyncIterator[list[Any]]:
    """Round 3 of `lead` and `other`, `lead`'s all-reduce held back (`_held_back`) while `frames`
    are sent to `lead` and read; the block runs then (given what `lead`'s round read), the
    all-reduce goes on at its end, and `other`'s own all-reduce is put back once the round is over."""
    decided, release, all_reduce = _held_back(other)
    read = _noting_reads(lead)
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, lead, nursery, done)
        rounds.start_soon(_a_round, other, nursery, done)
        with trio.fail_after(SLACK_S):
            await decided.wait()
        await _send_each(lead, frames)
        await _read_all(read, frames)
        yield read
        release.set()
    other.role._all_reduce = all_reduce


def _crowd_then(joiner: Identity) -> list[tuple[Identity, Join]]:
    """CROWD's Joins of round 4, which fill the places a round keeps for it, then `joiner`'s, saying it
    reads a `NoRoom`: no room is left for it."""
    frames = [(who, Join(4, who.peer_id.encode()[:16], ())) for who in CROWD]
    return frames + [(joiner, Join(4, b"j" * 16, (), hears_no_room=True))]


async def _refusing_and_told(lead: Trainer, joiner: Identity, nursery: trio.Nursery,
                             monkeypatch: pytest.MonkeyPatch) -> tuple[trio.Event, list[tuple[str, object, bool]]]:
    """`joiner`, a trainer peer of `lead`'s table whose data plane refuses `lead`'s connections
    (as one whose table lost its heartbeat); every `NoRoom` `lead` sends is noted (to whom, what,
    whether sent), and the event set."""
    plane = DataPlane("127.0.0.1", 0, codec=Codec(joiner), self_id=joiner.peer_id, admit=lambda peer: "unknown peer")
    lead.entries.append(SimpleNamespace(peer_id=joiner.peer_id, data_addr=await nursery.start(plane.serve)))
    told, tried = trio.Event(), []
    send = Links.send

    async def noting(self: Links, peer: str, body: object, **kwargs: Any) -> bool:
        sent = await send(self, peer, body, **kwargs)
        if isinstance(body, NoRoom):
            tried.append((peer, body, sent))
            told.set()
        return sent
    monkeypatch.setattr(Links, "send", noting)
    return told, tried


def _held_back(other: Trainer) -> tuple[trio.Event, trio.Event, Any]:
    """`other`'s next all-reduce starts once `release` is set; `decided` is set when the leader's
    Members reached it (the leader is in its all-reduce). Its own `_all_reduce`, to put back."""
    decided, release = trio.Event(), trio.Event()
    all_reduce = other.role._all_reduce

    async def held_back(*args: Any) -> Any:
        decided.set()
        await release.wait()
        return await all_reduce(*args)
    other.role._all_reduce = held_back
    return decided, release, all_reduce


async def test_a_leader_joined_by_300_fresh_identities_decides_at_most_max_members_its_group_in(
        nursery: trio.Nursery) -> None:
    """Two trainers average round 2. In round 3 the leader reads a Join from each of 300 fresh
    identities, on the round's weights, before its partner's: it still decides (it crashed
    building a Members of 302), at most `MAX_MEMBERS` members with both trainers among them; the
    strangers it takes never send their parts and are taken for dead, and both trainers end the
    round on the same weights."""
    lead, other, done, pair = await _paired(nursery)
    assert lead.role.history[-1]["members"] == pair

    same = digest(lead.role.state.weights)  # round 3's: what the leader's partner joins with
    frames = [(who, Join(3, same, ())) for who in CROWD]
    read = _noting_reads(lead)
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, lead, nursery, done)  # waits for its partner, reading the crowd's Joins
        await _send_each(lead, frames)
        await _read_all(read, frames)
        rounds.start_soon(_a_round, other, nursery, done)
    for trainer in (lead, other):
        row = trainer.role.history[-1]
        assert row["round"] == 3 and set(pair) <= set(row["members"]) and len(row["members"]) == MAX_MEMBERS
        assert row["contributors"] == pair
    assert lead.role.history[-1]["members"] == other.role.history[-1]["members"]
    assert digest(lead.role.state.weights) == digest(other.role.state.weights) and lead.role.state.round == 4
    nursery.cancel_scope.cancel()


async def test_joins_of_later_rounds_read_during_an_all_reduce_are_kept_bounded(nursery: trio.Nursery) -> None:
    """While the leader's all-reduce of round 3 waits for its partner, 300 fresh identities send it
    Joins of round 4 (each on weights of its own) and others Joins of rounds far ahead. It keeps
    those of round 4 only (what an honest peer that ended round 3 first sends; one further ahead
    means we are behind, which the next round shows us again), of at most `MAX_MEMBERS` senders.
    Round 4 then completes with the two trainers: its partner's Join finds room among the kept."""
    lead, other, done, pair = await _paired(nursery)

    rng = random.Random(SEED)
    frames = [(who, Join(4, rng.randbytes(16), ())) for who in CROWD]
    frames += [(who, Join(5 + i, rng.randbytes(16), ())) for i, who in enumerate(CROWD[:40])]
    rng.shuffle(frames)
    async with _crowded_during_all_reduce(lead, other, nursery, done, frames):
        assert lead.role.phase == Phase.REDUCE  # all read during the all-reduce
    assert [row["members"] for row in lead.role.history] == [pair, pair]
    assert set(lead.role.joins) == {4} and len(lead.role.joins[4]) == MAX_MEMBERS
    assert set(lead.role.joins[4]) < {who.peer_id for who in CROWD}

    await _round_together(lead, other, nursery, done)  # round 4, with the kept Joins
    for trainer in (lead, other):
        assert (trainer.role.history[-1]["round"], trainer.role.history[-1]["members"]) == (4, pair)
    assert digest(lead.role.state.weights) == digest(other.role.state.weights) and lead.role.state.round == 5
    assert lead.role.joins == {}
    nursery.cancel_scope.cancel()


async def test_a_strangers_members_sent_to_a_follower_is_not_taken(nursery: trio.Nursery) -> None:
    """Two trainers average round 2. In round 3, before the leader decides, a fresh identity (in
    no table) sends the leader's partner Members of round 3 naming the partner and itself, on the
    round's weights: the partner does not take it (before, it averaged with the stranger, who
    never sends a contribution, while the leader averaged with it: the round split, or ended on
    other weights at each), and the round completes with the two trainers, on the same weights."""
    lead, other, done, pair = await _paired(nursery)
    stranger = CROWD[0]
    same = digest(other.role.state.weights)
    frames = [(stranger, Members(3, same, tuple(sorted([other.peer_id, stranger.peer_id]))))]
    read = _noting_reads(other)
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, other, nursery, done)  # its Join waits in the leader's inbox
        await _send_each(other, frames)  # type: ignore[arg-type]
        await _read_all(read, frames)  # type: ignore[arg-type]
        assert other.role.phase == Phase.JOIN  # read while it waits for its leader
        rounds.start_soon(_a_round, lead, nursery, done)
    for trainer in (lead, other):
        row = trainer.role.history[-1]
        assert (row["round"], row["members"], row["contributors"]) == (3, pair, pair)
    assert digest(lead.role.state.weights) == digest(other.role.state.weights) and lead.role.state.round == 4
    assert lead.role.inbox.reserved == other.role.inbox.reserved == set(pair)
    nursery.cancel_scope.cancel()


async def test_a_trainer_peer_whose_join_of_the_next_round_found_no_room_is_told_during_the_all_reduce(
        nursery: trio.Nursery) -> None:
    """While the leader's all-reduce of round 3 waits for its partner, 300 fresh identities' Joins
    of round 4 fill the places it keeps for round 4; then a trainer peer of its table Joins round
    4, saying it reads a `NoRoom`: it is told so at once, during the all-reduce, on a real
    connection to it (its leader's word: it sits round 4 out instead of waiting for Members)."""
    lead, other, done, pair = await _paired(nursery)
    joiner = Identity.from_seed_text("diloco late joiner")
    got: list[tuple[str, Any]] = []
    arrived = trio.Event()
    plane = DataPlane("127.0.0.1", 0, codec=Codec(joiner), self_id=joiner.peer_id, admit=lambda peer: None)

    async def take(stream: trio.SocketStream, reader: FrameReader, peer: str) -> None:
        while (frame := await reader.frame()) is not None:
            got.append((peer, Codec(joiner).decode(frame, time.time()).body))
            arrived.set()
    plane.register(CHANNEL, take)
    lead.entries.append(SimpleNamespace(peer_id=joiner.peer_id, data_addr=await nursery.start(plane.serve)))

    async with _crowded_during_all_reduce(lead, other, nursery, done, _crowd_then(joiner)):
        with trio.fail_after(SLACK_S):
            await arrived.wait()
        assert lead.role.phase == Phase.REDUCE  # told during the all-reduce
    assert got == [(lead.peer_id, NoRoom(4))] and lead.role.turned_away == {4: {joiner.peer_id}}
    nursery.cancel_scope.cancel()


def test_a_members_join_of_the_next_round_is_kept_however_many_strangers_came_first() -> None:
    """`_keep_join` (what the all-reduce does with a Join of the next round) takes the round's
    members first, as `Membership` does: a member's Join, sent once, that came after the
    strangers' filled the kept Joins, replaces the last-come stranger's; another stranger's is
    turned away."""
    role = object.__new__(DilocoRole)
    me, member = "me", "member"
    role.node = SimpleNamespace(peer_id=me)
    role.inbox = RoundInbox()
    role.inbox.reserve((me, member))  # this round's members (`_reserve`)
    role.joins, role.turned_away = {}, {}
    for who in CROWD:
        role._keep_join(who.peer_id, Join(4, b"s" * 16, ()))
    kept = [who.peer_id for who in CROWD[:MAX_MEMBERS]]
    assert list(role.joins[4]) == kept
    role._keep_join(member, Join(4, b"m" * 16, ()))
    assert list(role.joins[4]) == kept[:-1] + [member]
    role._keep_join(CROWD[-1].peer_id, Join(4, b"s" * 16, ()))
    assert list(role.joins[4]) == kept[:-1] + [member]


def test_trainer_peers_whose_joins_of_the_next_round_find_no_room_are_named_to_be_told() -> None:
    """`_keep_join` names whom the all-reduce tells `NoRoom`: a trainer peer of our table whose Join
    of the next round it turns away, or whose kept Join a member's replaces, when that Join said it
    reads one; not an older peer (its Join did not say so), nor a stranger of no table."""
    role = object.__new__(DilocoRole)
    me, member = "me", "member"
    role.node = SimpleNamespace(peer_id=me)
    role.inbox = RoundInbox()
    role.inbox.reserve((me, member))
    role.joins, role.turned_away = {}, {}
    trainers = {"t_last", "t_new", "t_old"}
    for who in CROWD[:MAX_MEMBERS - 1]:
        assert role._keep_join(who.peer_id, Join(4, b"s" * 16, (), hears_no_room=True), trainers) == []
    assert role._keep_join("t_last", Join(4, b"s" * 16, (), hears_no_room=True), trainers) == []  # the last place
    assert role._keep_join("t_new", Join(4, b"s" * 16, (), hears_no_room=True), trainers) == ["t_new"]
    assert role._keep_join("t_new", Join(4, b"s" * 16, ("me",), hears_no_room=True), trainers) == []  # told once
    assert role._keep_join("t_old", Join(4, b"s" * 16, ()), trainers) == []
    assert role._keep_join(CROWD[-1].peer_id, Join(4, b"s" * 16, (), hears_no_room=True), trainers) == []
    assert role._keep_join(member, Join(4, b"m" * 16, ()), trainers) == ["t_last"]  # its place goes to a member
    assert role.turned_away == {4: {"t_last", "t_new", "t_old"}} and member in role.joins[4]


async def test_what_a_trainer_remembers_of_a_flood_of_identities_stays_bounded(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two trainers average round 2. During the leader's round 3, 300 fresh identities (more than
    `PEERS`, made 16 here) each send it a Join of round 3 while it decides and a contribution of
    other members while it averages: each spoke to it (`heard`), and each is a suspect (the
    Members it sends those it holds the Joins of finds no address, a contribution of other
    members makes its sender no member of this reduction). What it keeps of them stays within
    `PEERS` (before, every identity ever met stayed in both), its partner is still heard and no
    suspect, and the two trainers end rounds 3 and 4 on the same weights. A trainer peer of its
    table that spoke to it and failed it is kept in both; once it left the table (no longer
    heartbeating), round 4 forgets it as it begins, with the peers of the crowd left."""
    monkeypatch.setattr(diloco_role, "PEERS", 16)
    lead, other, done, pair = await _paired(nursery)

    decided, release, all_reduce = _held_back(other)  # the partner's contributions: once the crowd's frames are read
    # a trainer peer of the leader's table that we cannot reach: it Joins round 3 (spoke: heard)
    # on weights of its own, our Join to it fails (a suspect); it then leaves the table
    departed = Identity.from_seed_text("diloco departed")
    lead.entries.append(SimpleNamespace(peer_id=departed.peer_id, data_addr="127.0.0.1:1"))
    joins = [(who, Join(3, who.peer_id.encode()[:16], ())) for who in [departed] + CROWD]
    parts = [(who, Part(3, b"x" * 16, STAGE_CONTRIBUTION, 0, 16, 0, 16, "fp32", 4096, bytes(64), b"", ()))
             for who in CROWD]
    read = _noting_reads(lead)
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, lead, nursery, done)
        await _send_each(lead, joins)
        await _read_all(read, joins)
        assert len(lead.role.heard) <= 16
        rounds.start_soon(_a_round, other, nursery, done)
        with trio.fail_after(SLACK_S):
            await decided.wait()
        assert lead.role.phase == Phase.REDUCE
        await _send_each(lead, parts)  # type: ignore[arg-type]
        with trio.fail_after(SLACK_S * (1 + len(parts) / 50)):
            while not {who.peer_id for who in CROWD} <= {e.peer for e in read[len(joins):] if isinstance(e, Received)
                                                          and isinstance(e.body, Part)}:
                await trio.sleep(0.01)
        assert lead.role.phase == Phase.REDUCE  # all read during the all-reduce
        release.set()
    for trainer in (lead, other):
        assert len(trainer.role.heard) <= 16 and len(trainer.role.suspects) <= 16
    assert other.peer_id in lead.role.heard and other.peer_id not in lead.role.suspects
    assert departed.peer_id in lead.role.heard and departed.peer_id in lead.role.suspects  # in the table: kept
    lead.entries[:] = [e for e in lead.entries if e.peer_id != departed.peer_id]  # it stopped heartbeating
    other.role._all_reduce = all_reduce
    await _round_together(lead, other, nursery, done)  # round 4
    assert [row["members"] for row in lead.role.history] == [pair, pair, pair]
    assert [row["members"] for row in other.role.history] == [pair, pair, pair]
    assert digest(lead.role.state.weights) == digest(other.role.state.weights) and lead.role.state.round == 5
    # pruned as round 4 began: of the crowd and the departed peer, none of them in its table, nothing is left
    assert lead.role.heard == {other.peer_id} and lead.role.suspects == set()
    nursery.cancel_scope.cancel()


async def test_members_that_kept_other_joins_of_the_next_round_pick_the_same_leader() -> None:
    """During their all-reduce of round 3, the two members g1 and g2 read Joins of round 4 from
    300 trainer peers of their tables, all with lower ids, in other orders (`_keep_join`): each
    keeps those that came first, then its partner's. Round 4's `Membership` (`_membership`)
    counts the trainer peers each turned away for the leader choice, as it counts a Join it turns
    away itself: both pick the same leader (before, each the lowest it kept: two leaders), and
    neither waits for a peer it turned away), then the same next one as each is taken for dead
    (a kept Join a partner's replaced is remembered too), and, with every stranger dead, g1.
    What is remembered is for round 4 only."""
    same = b"a" * 16
    group = ("g1", "g2")
    strangers = [f"e{i:03d}" for i in range(300)]  # lower ids than the group's
    trainers = set(group) | set(strangers)
    leaders, held, at = {}, {}, {}
    for me, order in (("g1", strangers), ("g2", strangers[::-1])):
        role = object.__new__(DilocoRole)
        role.node = SimpleNamespace(peer_id=me)
        role.config = SimpleNamespace(deadline_s=10.0)
        role.inbox = RoundInbox()
        role.inbox.reserve(group)  # round 3's members (`_reserve`)
        role.joins, role.turned_away = {}, {}
        for p in order:
            role._keep_join(p, Join(4, p.encode().ljust(16, b"."), ()), trainers)
        (other,) = set(group) - {me}
        role._keep_join(other, Join(4, same, group), trainers)
        m = role._membership(4, same, trainers)
        assert role.joins == {} and role.turned_away == {}
        held[me], at[me] = set(m.joins), m
        leaders[me] = _leader_as_the_shell_sees_it(m, {other}, trainers, set())
        assert m.decided(m.deadline_at - 1.0) is not None  # every peer it waits for is in: none turned away
    assert held["g1"] != held["g2"] and leaders == {"g1": "e000", "g2": "e000"}
    suspects: set[str] = set()
    for dead in strangers:
        assert {me: _leader_as_the_shell_sees_it(m, set(group) - {me}, trainers, suspects)
                for me, m in at.items()} == {"g1": dead, "g2": dead}
        suspects.add(dead)  # it never sends Members: each member takes it for dead in turn
    assert {_leader_as_the_shell_sees_it(m, set(group) - {me}, trainers, suspects) for me, m in at.items()} == {"g1"}
