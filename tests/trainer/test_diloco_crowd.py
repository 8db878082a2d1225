"""More identities than a round holds, in an open group, where identities cost nothing: real
roles (`DilocoRole` with only what its rounds and `_serve` read: the `Trainer` of
`test_diloco_inbox`) serving the diloco channel on real data planes on loopback, sent Joins on
real connections by hundreds of fresh identities.

A round holds at most `MAX_MEMBERS` (what a Members lists): the leader decides no more, the
last round's members first (`trainer.allreduce.room_for`), and keeps at most that many Joins of
the next round it reads during its all-reduce, of the next round only. No timing asserts: the
waits are for events, bounded by a slack that scales with the frames sent; a round's deadline is
far above what its work needs.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace
from typing import Any

import trio

from p2pnet.dataplane import open_data_stream, send_frame
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from tests.trainer.test_diloco_inbox import SLACK_S, Trainer, _a_round, _noting_reads, _started
from trainer.diloco import digest
from trainer.diloco_inbox import RoundInbox
from trainer.diloco_links import Received
from trainer.diloco_messages import CHANNEL, MAX_MEMBERS, Join
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


async def test_a_leader_joined_by_300_fresh_identities_decides_at_most_max_members_its_group_in(
        nursery: trio.Nursery) -> None:
    """Two trainers average round 2. In round 3 the leader reads a Join from each of 300 fresh
    identities, on the round's weights, before its partner's: it still decides (it crashed
    building a Members of 302), at most `MAX_MEMBERS` members with both trainers among them; the
    strangers it takes never send their parts and are taken for dead, and both trainers end the
    round on the same weights."""
    deadline_s = 6 * SLACK_S  # far above what the rounds' work needs
    lead, other = _leader_first(Trainer("a", 2, deadline_s), Trainer("b", 2, deadline_s))
    await _started(nursery, lead, other)
    done: list[str] = []
    await _round_together(lead, other, nursery, done)
    pair = sorted([lead.peer_id, other.peer_id])
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
    deadline_s = 6 * SLACK_S
    lead, other = _leader_first(Trainer("a", 2, deadline_s), Trainer("b", 2, deadline_s))
    await _started(nursery, lead, other)
    done: list[str] = []
    await _round_together(lead, other, nursery, done)
    pair = sorted([lead.peer_id, other.peer_id])

    decided, release = trio.Event(), trio.Event()
    all_reduce = other.role._all_reduce

    async def held_back(*args: Any) -> Any:  # the partner's contributions come once the crowd's Joins are read
        decided.set()  # the leader's Members reached it: the leader is in its all-reduce
        await release.wait()
        return await all_reduce(*args)
    other.role._all_reduce = held_back
    rng = random.Random(SEED)
    frames = [(who, Join(4, rng.randbytes(16), ())) for who in CROWD]
    frames += [(who, Join(5 + i, rng.randbytes(16), ())) for i, who in enumerate(CROWD[:40])]
    rng.shuffle(frames)
    read = _noting_reads(lead)
    async with trio.open_nursery() as rounds:
        rounds.start_soon(_a_round, lead, nursery, done)
        rounds.start_soon(_a_round, other, nursery, done)
        with trio.fail_after(SLACK_S):
            await decided.wait()
        assert lead.role.phase == Phase.REDUCE
        await _send_each(lead, frames)
        await _read_all(read, frames)
        assert lead.role.phase == Phase.REDUCE  # all read during the all-reduce
        release.set()
    assert [row["members"] for row in lead.role.history] == [pair, pair]
    assert set(lead.role.joins) == {4} and len(lead.role.joins[4]) == MAX_MEMBERS
    assert set(lead.role.joins[4]) < {who.peer_id for who in CROWD}

    other.role._all_reduce = all_reduce
    await _round_together(lead, other, nursery, done)  # round 4, with the kept Joins
    for trainer in (lead, other):
        assert (trainer.role.history[-1]["round"], trainer.role.history[-1]["members"]) == (4, pair)
    assert digest(lead.role.state.weights) == digest(other.role.state.weights) and lead.role.state.round == 5
    assert lead.role.joins == {}
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
    role.joins = {}
    for who in CROWD:
        role._keep_join(who.peer_id, Join(4, b"s" * 16, ()))
    kept = [who.peer_id for who in CROWD[:MAX_MEMBERS]]
    assert list(role.joins[4]) == kept
    role._keep_join(member, Join(4, b"m" * 16, ()))
    assert list(role.joins[4]) == kept[:-1] + [member]
    role._keep_join(CROWD[-1].peer_id, Join(4, b"s" * 16, ()))
    assert list(role.joins[4]) == kept[:-1] + [member]
