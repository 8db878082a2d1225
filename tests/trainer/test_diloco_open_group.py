"""Who is of an open DiLoCo group after a real round: a peer whose contribution every shard of the
last round we finished took (`Finished.whole_contributors`, `DilocoRole.contributed`), read by the
held state requests' places (`trainer.diloco_state_answer`, `_of_group`). Not a peer one shard's
owner turned away: it is among the round's members and the contributors of its other shards, and
a stranger for the places. And a joiner's first round, whose table still holds a lower id the
group gave up on, is one with the group (`trainer.diloco_decide._passed_over`). And what zero,
tiny or huge contributions from identities that did no training do on the norm screen, as the
role's docstring, `trainer.diloco` and the README say: fewer than half of a shard's get no honest
one rejected, in the pure screen and in a real round. And a member that sends its own value of
another's shard changes no one's update (a shard's value is its owner's: `trainer.allreduce_gather`).

Real roles (`tests.trainer.test_diloco_inbox.Trainer`: `DilocoRole._round` on real data planes on
loopback, no model) average one round; then real connections ask one of them for the state after
its round, as joiners left out of a round do. No timing asserts: waits are for events, bounded.
"""

from __future__ import annotations

import time
from typing import Sequence

import pytest
import torch
import trio

from p2pnet.dataplane import FrameReader, open_data_stream, send_frame
from p2pnet.identity import Identity
from p2pnet.wire import Codec
import trainer.diloco_role as diloco_role
from tests.trainer.test_diloco_inbox import SLACK_S, VALUES, Trainer, _a_round, _started, _until
from trainer.allreduce import AllReduce, Send, shard_bounds
from trainer.diloco import Encoding, OuterConfig, OuterOptimizer, Rejection, digest, pack, screen
from trainer.diloco_messages import CHANNEL, PIECE_VALUES, STAGE_REDUCED, HoldsFull, Part, StateRequest
from trainer.diloco_role import MAX_FRAME_BYTES
from trainer.diloco_state_answer import STATE_HOLDS, STRANGER_HOLDS


def _outsized_in_one_shard(trainer: Trainer, shard: tuple[int, int]) -> None:
    """`trainer`'s pseudo-gradient is its own step everywhere but in `shard`, where it is a
    thousand times that: the shard's owner screens it out (a norm far above the others'), the
    other shards' owners take it."""
    role = trainer.role
    step = role.state.weights - role.inner.weights()
    step[shard[0]:shard[1]] *= 1000.0
    role.inner.weights = lambda: role.state.weights - step


def _no_penalties(trainer: Trainer) -> list[str]:
    """The peers `trainer`'s round penalised (a contribution it screened out), noted: its peer
    table here is the test's."""
    penalised: list[str] = []

    def penalise(now: float, peer: str, amount: float) -> list[object]:
        penalised.append(peer)
        return []
    trainer.role.node.peertable.penalise = penalise
    trainer.role.node.carry_out = lambda core, effect: None
    return penalised


async def _round_at_each(nursery: trio.Nursery, trainers: Sequence[Trainer]) -> list[str]:
    """Each of `trainers` runs its round, all at once, until every one is done; their peer ids, sorted."""
    done: list[str] = []
    async with trio.open_nursery() as rounds:
        for trainer in trainers:
            rounds.start_soon(_a_round, trainer, nursery, done)
    return sorted(t.peer_id for t in trainers)


async def _ask_after(trainer: Trainer, who: Identity, round: int) -> trio.SocketStream:
    """`who` asks `trainer` for the state after `round` (a joiner left out of it), taking `HoldsFull`."""
    stream = await open_data_stream(trainer.address, CHANNEL, codec=Codec(who), peer=trainer.peer_id)
    await send_frame(stream, Codec(who).encode(StateRequest(round, round, True), time.time()))
    return stream


async def test_a_peer_one_shard_turned_away_is_no_member_of_the_group_for_the_held_places(
        nursery: trio.Nursery) -> None:
    """Three trainers average a round; one's contribution is outsized in the last shard only. The
    last shard's owner screens it out, the other two take it: it is among the round's members and
    (the other shards') contributors, but not a whole contributor, so no trainer counts it of the
    group (`contributed`). Then strangers hold the places they may take at an honest trainer:
    the partial contributor asking for the state after the round is refused as a stranger
    (`HoldsFull`), while the other honest trainer, a whole contributor, is held."""
    deadline_s = 2 * SLACK_S  # far above what the round's work needs
    trainers = [Trainer(name, 2, deadline_s) for name in ("a", "bb", "ccc")]
    await _started(nursery, *trainers)
    cheat = trainers[0]  # not the last shard's owner (an owner's screen of its own contribution penalises nobody)
    honest = [t for t in trainers if t is not cheat]
    last = shard_bounds(VALUES, len(trainers))[-1]
    _outsized_in_one_shard(cheat, last)
    penalised = {t.peer_id: _no_penalties(t) for t in trainers}
    everyone = await _round_at_each(nursery, trainers)
    whole = frozenset(t.peer_id for t in honest)
    last_owner = next(t for t in trainers if t.peer_id == everyone[-1])
    assert last_owner is not cheat
    assert penalised[last_owner.peer_id] == [cheat.peer_id]  # screened out at the last shard's owner only
    assert all(not penalised[t.peer_id] for t in trainers if t is not last_owner)
    for trainer in honest:
        row = trainer.role.history[-1]
        # its parts of the other shards were taken: a contributor of the round, and one of its members
        assert (row["round"], row["members"], row["contributors"]) == (2, everyone, everyone)
        assert trainer.role.contributed == whole  # but not a whole contributor: not of the group
        assert trainer.role.state.round == 3

    asked = honest[0]
    strangers = [Identity.from_seed_text(f"diloco open group stranger {i}") for i in range(STRANGER_HOLDS)]
    held: list[trio.SocketStream] = []
    try:
        for stranger in strangers:
            held.append(await _ask_after(asked, stranger, 3))
            await _until(lambda: stranger.peer_id in asked.role.holding, "a stranger's request held")  # noqa: B023
        async with await _ask_after(asked, cheat.identity, 3) as refused:
            with trio.fail_after(SLACK_S):
                frame = await FrameReader(refused, max_frame_bytes=MAX_FRAME_BYTES).frame()
        assert Codec(None).decode(frame or b"", time.time()).body == HoldsFull(3, STRANGER_HOLDS,
                                                                             STATE_HOLDS - STRANGER_HOLDS)
        assert cheat.peer_id not in asked.role.holding
        assert (asked.role.refused_strangers, asked.role.refused_members) == (1, 0)
        member = honest[1]
        held.append(await _ask_after(asked, member.identity, 3))  # a whole contributor: a member's place
        await _until(lambda: member.peer_id in asked.role.holding, "the member's request held")
        assert asked.role.strangers_held == frozenset(s.peer_id for s in strangers)
    finally:
        for stream in held:
            await stream.aclose()
    nursery.cancel_scope.cancel()


async def test_a_joiners_first_round_passes_over_a_lower_id_the_group_gave_up_on(nursery: trio.Nursery) -> None:
    """A joiner's first round in an open group (no round of its own behind it): its table still
    holds FIRST, the lowest id, which the group took for dead (each of the group's trainers
    suspects it) but which is alive enough to take Joins and never answers. The group's Joins to
    the joiner name no FIRST: the joiner passes FIRST over as leader (`_passed_over`) and takes
    the group's leader's Members as it comes, so the round is one of all three, every shard taking
    each one's contribution, and all end on the same weights. Before, the joiner followed FIRST to
    its leader timeout (2 x deadline_s) while the group averaged without it (a member whose
    contributions came after the shards were reduced). FIRST is not suspected at the joiner."""
    deadline_s = 2 * SLACK_S  # far above what the round's work needs: the leader timeout twice that
    made = sorted((Trainer(name, 2, deadline_s) for name in ("first", "g", "h", "joiner")), key=lambda t: t.peer_id)
    first, group, joiner = made[0], made[1:3], made[3]  # by id: FIRST lowest, then the group, the joiner last
    await _started(nursery, *made)
    for trainer in group:
        trainer.role.history = [{"round": 1}]  # a round of theirs behind them, with each other
        trainer.role.inbox.reserve([g.peer_id for g in group])
        trainer.role.heard = {p.peer_id for p in (*group, joiner)} - {trainer.peer_id}  # the joiner fetched a state
        trainer.role.suspects = {first.peer_id}  # the group gave up on FIRST
    # FIRST runs no round: its data plane takes frames, answers none
    everyone = await _round_at_each(nursery, (*group, joiner))
    for trainer in (*group, joiner):
        row = trainer.role.history[-1]
        assert (row["round"], row["members"], row["contributors"]) == (2, everyone, everyone)
        assert trainer.role.contributed == frozenset(everyone)  # every shard took the joiner's too
    assert len({digest(t.role.state.weights) for t in (*group, joiner)}) == 1
    assert first.peer_id not in joiner.role.suspects
    nursery.cancel_scope.cancel()


def _honest(count: int, rng: torch.Generator) -> dict[str, torch.Tensor]:
    """`count` honest contributions to a shard of 4,096 values whose norms differ up to 4-fold."""
    return {f"h{i}": torch.randn(4096, generator=rng) * 1e-3 * (1 + i % 4) for i in range(count)}


def _attack(kind: str, count: int, rng: torch.Generator) -> dict[str, torch.Tensor]:
    """`count` contributions of identities that did no training: all zeros, faint noise, huge
    values, or those three in turn."""
    made = {"zero": lambda: torch.zeros(4096), "tiny": lambda: torch.randn(4096, generator=rng) * 1e-12,
            "huge": lambda: torch.randn(4096, generator=rng) * 1e3}
    kinds = list(made) if kind == "mixed" else [kind]
    return {f"x{i}": made[kinds[i % len(kinds)]]() for i in range(count)}


def test_a_minority_of_zero_tiny_or_huge_contributions_gets_no_honest_one_rejected() -> None:
    """What the role's docstring ("What being of an open group costs"), `trainer.diloco` and the
    README say of the norm screen (`trainer.diloco.screen`): beside h honest contributions, up to
    h - 1 from identities that did no training (one beside two, two beside three: fewer than
    half), whatever they send, leave every honest contribution taken. Zeros and faint noise are
    taken too (no check from below: they dilute the mean); a huge one is still rejected once
    there are three contributions to judge by. Before, each contribution was judged against the
    lower median of the OTHERS' norms, and h - 1 zeros made every honest one an outlier."""
    rng = torch.Generator().manual_seed(5)
    for honest in range(1, 7):
        for attackers in range(honest):
            for kind in ("zero", "tiny", "huge", "mixed"):
                parts = _honest(honest, rng) | _attack(kind, attackers, rng)
                accepted, rejected = screen(parts, 4096)
                case = (honest, attackers, kind)
                assert {f"h{i}" for i in range(honest)} <= set(accepted), case
                judged = len(parts) >= 3
                huge = {p for p, v in parts.items() if p.startswith("x") and float(v.norm()) > 1}
                assert rejected == ({p: Rejection.NORM_OUTLIER for p in huge} if judged else {}), case


def test_half_or_more_of_the_contributions_can_do_what_the_docstring_says() -> None:
    """The limits the docstrings state, pinned: beside h honest contributions (h >= 2: four or more
    to judge by), h zeros (half) get every honest one rejected, the zeros alone taken; h huge ones
    (half) are still rejected; h + 1 huge ones (a majority) set the median and are taken. Nothing
    stops a majority: closing the group does."""
    rng = torch.Generator().manual_seed(6)
    for honest in range(2, 7):
        names = {f"h{i}" for i in range(honest)}
        accepted, rejected = screen(_honest(honest, rng) | _attack("zero", honest, rng), 4096)
        assert set(rejected) == names and set(accepted) == {f"x{i}" for i in range(honest)}, honest
        accepted, rejected = screen(_honest(honest, rng) | _attack("huge", honest, rng), 4096)
        assert set(accepted) == names and set(rejected) == {f"x{i}" for i in range(honest)}, honest
        accepted, rejected = screen(_honest(honest, rng) | _attack("huge", honest + 1, rng), 4096)
        assert {f"x{i}" for i in range(honest + 1)} <= set(accepted), honest


@pytest.mark.parametrize("honest", [2, 3])
async def test_zero_contributions_beside_more_honest_ones_leave_the_honest_whole_contributors(
        nursery: trio.Nursery, honest: int) -> None:
    """Real roles average a round: h honest trainers and h - 1 identities that did no training
    (their pseudo-gradient all zeros). Every shard's owner takes every contribution: no one is
    penalised, every honest trainer (and every zero one: zeros are not refused) is a whole
    contributor of the group, all end on the same weights, and the mean is the honest steps
    diluted by the zeros. Before, every honest contribution was a norm outlier at every shard:
    penalised, the mean all zeros, and the zero identities alone of the group."""
    deadline_s = 2 * SLACK_S  # far above what the round's work needs
    names = [f"honest{i}" for i in range(honest)] + [f"zero{i}" for i in range(honest - 1)]
    trainers = [Trainer(name, 2, deadline_s) for name in names]
    await _started(nursery, *trainers)
    zeros = trainers[honest:]
    for trainer in zeros:
        role = trainer.role
        role.inner.weights = lambda role=role: role.state.weights.clone()  # moved nothing
    start = trainers[0].role.state.weights.clone()
    steps = [t.role.state.weights - t.role.inner.weights() for t in trainers]
    penalised = {t.peer_id: _no_penalties(t) for t in trainers}
    everyone = await _round_at_each(nursery, trainers)
    assert not any(penalised.values())
    for trainer in trainers:
        row = trainer.role.history[-1]
        assert (row["round"], row["members"], row["contributors"]) == (2, everyone, everyone)
        assert trainer.role.contributed == frozenset(everyone)
    assert len({digest(t.role.state.weights) for t in trainers}) == 1
    mean = torch.stack(steps).mean(dim=0)  # fp32 on the wire: the outer step of the exact mean
    expected = OuterOptimizer(OuterConfig(), VALUES).step(start, mean)
    assert torch.allclose(trainers[0].role.state.weights, expected, atol=1e-6)
    nursery.cancel_scope.cancel()


def _forging(forger: str, index: int, values: torch.Tensor) -> type[AllReduce]:
    """An `AllReduce` that, at `forger`, also sends every other member, first thing, a reduced
    value of shard `index` (another's): `values`, the forger alone its contributor."""

    class Forging(AllReduce):
        def start(self, now: float) -> list[object]:
            effects = super().start(now)
            if self.self_id != forger:
                return effects
            forged: list[object] = []
            for offset in range(0, values.numel(), PIECE_VALUES):
                packed = pack(values[offset:offset + PIECE_VALUES], Encoding.FP32, self.config.block)
                body = Part(self.round, self.digest, STAGE_REDUCED, index, values.numel(), offset, packed.length,
                            packed.encoding.value, packed.block, packed.values, packed.scales, (forger,))
                forged += [Send(peer, body) for peer in self.members if peer != forger]
            return forged + effects
    return Forging


async def test_a_member_that_sends_its_own_value_of_anothers_shard_changes_no_ones_update(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real roles average a round; one of three also sends the two others, before anything else,
    its own reduced value of a shard another member owns (huge). Each takes that shard's value
    from its owner only (`trainer.allreduce_gather`): all three end on the outer step of the
    exact mean of their steps, the same weights, no one penalised (the forgery is dropped, not
    judged: an honest member whose view ran ahead sends such values too). Before, the member the
    forgery reached before the owner's mean applied it, and ended on other weights."""
    deadline_s = 2 * SLACK_S  # far above what the round's work needs
    trainers = [Trainer(name, 2, deadline_s) for name in ("a", "bb", "ccc")]
    await _started(nursery, *trainers)
    members = sorted(t.peer_id for t in trainers)
    forger = next(t for t in trainers if t.peer_id == members[1])
    start, end = shard_bounds(VALUES, 3)[0]  # members[0]'s: neither the forger's nor the third's
    monkeypatch.setattr(diloco_role, "AllReduce", _forging(forger.peer_id, 0, torch.full((end - start,), 1e3)))
    before = trainers[0].role.state.weights.clone()
    steps = [t.role.state.weights - t.role.inner.weights() for t in trainers]
    penalised = {t.peer_id: _no_penalties(t) for t in trainers}
    everyone = await _round_at_each(nursery, trainers)
    assert everyone == members and not any(penalised.values())
    for trainer in trainers:
        row = trainer.role.history[-1]
        assert (row["round"], row["members"], row["contributors"]) == (2, everyone, everyone)
    assert len({digest(t.role.state.weights) for t in trainers}) == 1
    expected = OuterOptimizer(OuterConfig(), VALUES).step(before, torch.stack(steps).mean(dim=0))
    assert torch.allclose(trainers[0].role.state.weights, expected, atol=1e-6)
    nursery.cancel_scope.cancel()


def test_malformed_contributions_are_left_out_of_the_median_so_sending_them_moves_nothing() -> None:
    """`trainer.diloco`: the median is of the well-formed contributions only. Beside two honest
    contributions and one zero (a minority of the well-formed), up to five more from the same
    identities that are not finite or of the wrong length are rejected and change nothing: both
    honest contributions are still taken. Counted in the median as nothing (norm zero), one of
    them would make it a zero and every honest contribution an outlier."""
    rng = torch.Generator().manual_seed(7)
    for malformed in range(6):
        parts = _honest(2, rng) | _attack("zero", 1, rng)
        parts |= {f"m{i}": torch.full((4096,), float("nan")) if i % 2 else torch.zeros(4095) for i in range(malformed)}
        accepted, rejected = screen(parts, 4096)
        assert set(accepted) == {"h0", "h1", "x0"}, malformed
        assert set(rejected) == {f"m{i}" for i in range(malformed)}, malformed
