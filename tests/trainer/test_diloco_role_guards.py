"""The `diloco` role around the all-reduce, against what members and strangers can send it: a
round's mean that is finite but makes the outer step overflow, Parts read before the round's
members are decided (whose, how many bytes, and for how long), and the states taken that the role
remembers. Roles hold only what the code under test reads (no model, no network); time is trio's
mock clock."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio

import trainer.diloco_decide as diloco_decide
from tests.trainer.test_diloco_core import _run, _vectors
from trainer.allreduce import AllReduce, AllReduceConfig, Finished
from trainer.diloco import Encoding, OuterConfig, OuterOptimizer, OuterStepNotFinite, digest
from trainer.diloco_catchup import FETCHED
from trainer.diloco_decide import _Behind
from trainer.diloco_inbox import RoundInbox, frame_bytes
from trainer.diloco_links import Received
from trainer.diloco_local import GlobalState
from trainer.diloco_messages import STAGE_CONTRIBUTION, STAGE_REDUCED, Members, NoRoom, Part
from trainer.diloco_role import STEP_NOT_FINITE, DilocoRole, JoinPath

VALUES = 4000


# -- a mean that overflows the outer step -----------------------------------------------------------


def test_an_outer_step_that_would_leave_a_value_not_finite_raises_and_changes_nothing() -> None:
    outer = OuterOptimizer(OuterConfig(), 3, torch.tensor([1.0, 2.0, 3.0]))
    weights = torch.tensor([0.5, 0.5, 0.5])
    with pytest.raises(OuterStepNotFinite) as overflow:
        outer.step(weights, torch.tensor([0.1, 2.5e38, 0.1]))  # finite; 1.9 x it is not
    assert overflow.value.where.tolist() == [False, True, False]
    assert outer.momentum_buffer.tolist() == [1.0, 2.0, 3.0]
    stepped = outer.step(weights, torch.tensor([0.1, 0.1, 0.1]))  # an ordinary step goes on from there
    assert bool(torch.isfinite(stepped).all()) and outer.momentum_buffer.tolist() == pytest.approx([1.0, 1.9, 2.8])


class _HugeMean(AllReduce):
    """An owner that sends, for its shard, a mean of 2.5e38 everywhere: finite in float32 and in
    int8 (127 x a finite scale), so every receiver takes it."""

    def _parts(self, index, stage, values, to, contributors):  # type: ignore[no-untyped-def]
        if stage == STAGE_REDUCED:
            values = torch.full_like(values, 2.5e38)
        return super()._parts(index, stage, values, to, contributors)


def _stepping_role(peer_id: str, state: GlobalState, result: Finished, penalised: list[str]) -> DilocoRole:
    """A role at `state` whose next round's members decide and all-reduce to `result` (its inner
    steps, decision and reduction stubbed: what `_round` does with their outcome is the test's)."""
    role = object.__new__(DilocoRole)
    members = tuple(sorted({*result.reducers, peer_id}))
    role.node = SimpleNamespace(
        peer_id=peer_id, carry_out=lambda core, effect: None,
        peertable=SimpleNamespace(penalise=lambda now, peer, amount: penalised.append(peer) or []))
    role.config = SimpleNamespace(deadline_s=5.0, trainers=(), publish=False, inner_steps=1)
    role.state = state
    role.outer = OuterOptimizer(OuterConfig(), VALUES, state.momentum)
    loaded: list[torch.Tensor] = []
    role.inner = SimpleNamespace(train=lambda steps: 0.0, weights=lambda: state.weights - 0.01,
                                 load=loaded.append, eval_loss=lambda: 0.0)
    role.loaded = loaded  # type: ignore[attr-defined]
    role.inbox = RoundInbox()
    role.history, role.rejected, role.state_askers = [], {}, {}

    async def decide(*args: Any) -> tuple[str, ...]:
        return members

    async def all_reduce(*args: Any) -> Finished:
        return result

    async def checkpoint(new_state: GlobalState) -> None:
        pass

    role._decide, role._all_reduce, role._checkpoint = decide, all_reduce, checkpoint  # type: ignore[method-assign]
    return role


async def test_a_finite_mean_that_overflows_the_outer_step_discards_the_round_alike_at_every_member(
        autojump_clock) -> None:
    """peer0 sends every member a mean of 2.5e38 for its shard. Each honest member's outer step
    would overflow (Nesterov: 1.9 x the mean): each discards the round, goes on to the next from
    the same weights and momentum (one digest at all of them), and penalises peer0, the shard's
    reducer, once. (Before, every member went on from weights of -inf, all with one digest, so
    nobody noticed, and every later pseudo-gradient was NaN.)"""
    vectors = _vectors(4, VALUES, seed=3)
    members = tuple(sorted(vectors))
    config = AllReduceConfig(encoding=Encoding.INT8, deadline_s=5.0)
    reducers = {p: (_HugeMean if p == "peer0" else AllReduce)(p, 7, members, v, config) for p, v in vectors.items()}
    finished, _ = _run(reducers)
    weights = torch.randn(VALUES, generator=torch.Generator().manual_seed(0))
    momentum = torch.randn(VALUES, generator=torch.Generator().manual_seed(1)) * 0.01
    for peer in ("peer1", "peer2", "peer3"):
        assert finished[peer].reducers[0] == "peer0"
        penalised: list[str] = []
        role = _stepping_role(peer, GlobalState(7, weights.clone(), momentum.clone()), finished[peer], penalised)
        async with trio.open_nursery() as background:
            await role._round(background)
        assert role.state.round == 8
        assert digest(role.state.weights) == digest(weights) and torch.equal(role.state.momentum, momentum)
        assert torch.equal(role.outer.momentum_buffer, momentum)
        assert torch.equal(role.loaded[-1], weights)  # the next inner steps start from the same weights
        assert penalised == ["peer0"] and role.rejected == {STEP_NOT_FINITE: 1}
        assert role.history[-1]["step_discarded"] is True


async def test_an_ordinary_round_steps_and_blames_nobody(autojump_clock) -> None:
    vectors = _vectors(3, VALUES, seed=4)
    members = tuple(sorted(vectors))
    reducers = {p: AllReduce(p, 2, members, v, AllReduceConfig(deadline_s=5.0)) for p, v in vectors.items()}
    finished, _ = _run(reducers)
    weights, momentum = torch.zeros(VALUES), torch.zeros(VALUES)
    penalised: list[str] = []
    role = _stepping_role("peer1", GlobalState(2, weights, momentum), finished["peer1"], penalised)
    async with trio.open_nursery() as background:
        await role._round(background)
    expected = OuterOptimizer(OuterConfig(), VALUES).step(weights, finished["peer1"].mean)
    assert role.state.round == 3 and torch.equal(role.state.weights, expected)
    assert penalised == [] and role.history[-1]["step_discarded"] is False


# -- Parts read before the round's members are decided -------------------------------------------

LEADER, ME, STRANGER = "a_leader", "c_me", "z_stranger"
DIGEST = b"w" * 16


def _part(round: int, first: int = 0) -> Part:
    values = bytes([first % 128]) * 10
    return Part(round, b"d" * 16, STAGE_CONTRIBUTION, 0, 10, 0, 10, "int8", 4096, values, b"\x00\x00\x80?", ())


def _deciding_role() -> DilocoRole:
    """A role at ME that knows LEADER as a trainer peer (STRANGER is no peer of its table)."""
    role = object.__new__(DilocoRole)
    entries = [SimpleNamespace(peer_id=LEADER, data_addr="127.0.0.1:1")]
    role.node = SimpleNamespace(peer_id=ME, peertable=SimpleNamespace(
        with_role=lambda name: entries, is_banned=lambda peer, now: False))
    role.config = SimpleNamespace(deadline_s=10.0, trainers=())
    role.inbox = RoundInbox()
    role.suspects, role.heard, role.early_parts, role.history = set(), set(), [], []
    role.joins, role.turned_away = {}, {}
    return role


async def _decide(role: DilocoRole, round: int, frames: list[tuple[str, Any]]) -> tuple[str, ...] | _Behind:
    """`role._decide(round)` with `frames` put into its inbox in order: the members, or the
    `_Behind` it raised."""
    class Links:
        async def send(self, peer, body, *, report_refusal=True, report=True):  # type: ignore[no-untyped-def]
            return True

    async def world() -> None:
        for sender, body in frames:
            await role.inbox.put(Received(sender, body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(world)
        try:
            return await role._decide(round, DIGEST, Links(), nursery)
        except _Behind as behind:
            return behind
        finally:
            nursery.cancel_scope.cancel()


async def test_parts_read_before_the_members_are_kept_only_from_peers_that_may_be_members_and_within_bytes(
        autojump_clock, monkeypatch) -> None:
    """While we wait for the leader's Members, a stranger (no trainer peer of ours, no Join) and
    the leader send Parts of the round: the stranger's are dropped, the leader's kept up to the
    byte bound (here three Parts' worth), in the order they came. (Before, any sender's were
    kept, 1,024 frames whatever their bytes: 2 GiB.)"""
    monkeypatch.setattr(diloco_decide, "EARLY_BYTES", 3 * frame_bytes(_part(1)))
    frames: list[tuple[str, Any]] = [(STRANGER, _part(1, i)) for i in range(5)]
    frames += [(LEADER, _part(1, i)) for i in range(5)]
    frames.append((LEADER, Members(1, DIGEST, (LEADER, ME))))
    role = _deciding_role()
    assert await _decide(role, 1, frames) == (LEADER, ME)
    assert role.early_parts == [(LEADER, _part(1, i)) for i in range(3)]


async def test_parts_kept_for_a_round_we_sit_out_are_dropped_and_the_next_rounds_are_kept(autojump_clock) -> None:
    """The leader's Parts of round 1 come, then its NoRoom: we sit round 1 out, and hold none of
    them through the catch-up. In round 2 its Part, read before its Members, is kept for the
    all-reduce. (Before, round 1's stayed until an all-reduce of ours read them, and filled the
    frames kept before round 2's could be.)"""
    role = _deciding_role()
    behind = await _decide(role, 1, [*((LEADER, _part(1, i)) for i in range(3)), (LEADER, NoRoom(1))])
    assert isinstance(behind, _Behind) and behind.past == 1
    assert role.early_parts == []
    members = await _decide(role, 2, [(LEADER, _part(2)), (LEADER, Members(2, DIGEST, (LEADER, ME)))])
    assert members == (LEADER, ME) and role.early_parts == [(LEADER, _part(2))]


# -- states taken ----------------------------------------------------------------------------------


def test_the_states_taken_that_the_role_remembers_are_the_latest_few() -> None:
    """A peer that drifts takes a state every round: `fetched` (shown whole in `status()`) keeps
    the latest `FETCHED`, the newest last. (Before, one entry a catch-up, for as long as it ran.)"""
    role = object.__new__(DilocoRole)
    role.state, role.fetched = GlobalState(0, torch.zeros(2), torch.zeros(2)), []
    role.state_via_counts = {path: 0 for path in JoinPath}
    role._adopt = lambda state: setattr(role, "state", state)  # type: ignore[method-assign]
    taken = FETCHED + 50
    for round in range(1, taken + 1):
        role._took(GlobalState(round, torch.zeros(2), torch.zeros(2)), "peer", JoinPath.DIRECT)
    assert [f["round"] for f in role.fetched] == list(range(taken - FETCHED + 1, taken + 1))
    assert role.state_via_counts[JoinPath.DIRECT] == taken and role.state.round == taken
