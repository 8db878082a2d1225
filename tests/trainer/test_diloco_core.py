"""DiLoCo's pure cores: int8 quantization, the outer Nesterov step, contribution checks, and the
all-reduce state machine driven in memory (several peers, a dead one, a cheating one), the global
state's durable writes, and how the role's enums read. The membership decision (`Membership`,
`_decide`) is tests/trainer/test_diloco_membership.py's; whose reduced value a shard takes,
tests/trainer/test_diloco_gather.py's."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
import trio
import trio.testing

import trainer.diloco_role as diloco_role
from trainer.allreduce import AllReduce, AllReduceConfig, Finished, Penalise, Send, shard_bounds
from trainer.diloco import (Encoding, OuterConfig, OuterOptimizer, Packed, Rejection, check_contribution,
                            max_quantization_error, norm_limit, pack, packed_bytes, screen, unpack)
from trainer.diloco_messages import PIECE_VALUES
from trainer.diloco_role import JoinPath, Phase


def test_int8_error_is_within_half_a_block_scale_and_bytes_are_a_quarter():
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(300_001, generator=gen) * torch.linspace(0.01, 3.0, 300_001)
    packed = pack(v, Encoding.INT8, 4096)
    back = unpack(packed)
    err = (back - v).abs()
    # per block: at most half that block's scale
    for start in range(0, v.numel(), 4096):
        block = v[start:start + 4096]
        assert float(err[start:start + 4096].max()) <= float(block.abs().max()) / 127 / 2 * 1.0001
    assert float(err.max()) <= max_quantization_error(v, 4096)
    assert packed.nbytes == packed_bytes(v.numel(), Encoding.INT8, 4096)
    assert 3.9 < packed_bytes(v.numel(), Encoding.FP32) / packed.nbytes < 4.0
    assert torch.equal(unpack(pack(v, Encoding.FP32)), v)


def test_unpack_refuses_sizes_that_do_not_add_up():
    packed = pack(torch.ones(10), Encoding.INT8, 4096)
    with pytest.raises(ValueError):
        unpack(type(packed)(packed.encoding, 11, packed.block, packed.values, packed.scales))


def test_outer_step_matches_torch_sgd_nesterov():
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(50, generator=gen)
    param = torch.nn.Parameter(weights.clone())
    sgd = torch.optim.SGD([param], lr=0.7, momentum=0.9, nesterov=True)
    outer = OuterOptimizer(OuterConfig(), 50)
    g = weights.clone()
    for _ in range(4):
        delta = torch.randn(50, generator=gen)
        param.grad = delta.clone()
        sgd.step()
        g = outer.step(g, delta)
    assert torch.allclose(g, param.detach(), atol=1e-5)


def test_contribution_checks_name_the_fault():
    limit = norm_limit([1.0, 1.1, 0.9, 2.0])  # 10 x the lower median of all the norms, 1.0
    assert limit == 10.0
    assert check_contribution(torch.ones(4) / 2, 4, limit) is None
    assert check_contribution(torch.ones(5), 4, limit) is Rejection.WRONG_SHAPE
    assert check_contribution(torch.tensor([1.0, math.nan, 0, 0]), 4, limit) is Rejection.NOT_FINITE
    assert check_contribution(torch.tensor([1.0, math.inf, 0, 0]), 4, limit) is Rejection.NOT_FINITE
    assert check_contribution(torch.ones(4) * 100, 4, limit) is Rejection.NORM_OUTLIER
    assert norm_limit([1.0, 1e9]) == math.inf  # two: no majority to judge by


def test_the_screen_decides_the_same_whatever_order_the_contributions_came_in():
    """The screen is part of the protocol (one peer reduces a shard, every member applies its
    mean): over every order of the same contributions (two honest, a zero, an outsized one, a
    NaN) it rejects and takes the same, keyed in peer order, and the all-reduce's mean of a shard
    is the same to the bit (float sums depend on their order)."""
    gen = torch.Generator().manual_seed(9)
    parts = {"p0": torch.randn(64, generator=gen), "p1": torch.randn(64, generator=gen),
             "p2": torch.randn(64, generator=gen), "p3": torch.zeros(64), "p4": torch.randn(64, generator=gen) * 1e4,
             "p5": torch.full((64,), math.nan)}
    decided = set()
    for order in itertools.permutations(parts):
        accepted, rejected = screen({p: parts[p] for p in order}, 64)
        mean = torch.stack(list(accepted.values())).mean(dim=0)
        decided.add((tuple(accepted), tuple(rejected.items()), mean.numpy().tobytes()))
    assert len(decided) == 1
    [(accepted_in_order, rejected_in_order, _)] = decided
    assert accepted_in_order == ("p0", "p1", "p2", "p3")
    assert rejected_in_order == (("p4", Rejection.NORM_OUTLIER), ("p5", Rejection.NOT_FINITE))


def _peers(n: int) -> list[str]:
    return [f"peer{i}" for i in range(n)]


def _run(reducers: dict[str, AllReduce], *, dead: set[str] = frozenset(), drop_to: set[str] = frozenset(),
         learns: set[str] | None = None, max_time: float = 1000.0,
         finished_at: dict[str, float] | None = None) -> tuple[dict[str, Finished], list[tuple[str, Penalise]]]:
    """Deliver every Send in memory, in order; a `dead` peer neither sends nor receives, and its
    senders learn it at once when `drop_to` lists it (a refused connection) and they are of
    `learns` (None: all), else by deadlines. `finished_at` gets the virtual time each finished."""
    now = 0.0
    queue: list[tuple[str, object]] = []
    finished: dict[str, Finished] = {}
    finished_at = {} if finished_at is None else finished_at
    penalties: list[tuple[str, Penalise]] = []
    for peer, r in reducers.items():
        if peer not in dead:
            queue += [(peer, e) for e in r.start(now)]
    while len(finished) < len(reducers) - len(dead) and now < max_time:
        while queue:
            origin, effect = queue.pop(0)
            if isinstance(effect, Send):
                if effect.peer in dead:
                    if effect.peer in drop_to and (learns is None or origin in learns):
                        queue += [(origin, e) for e in reducers[origin].peer_failed(now, effect.peer)]
                    continue
                queue += [(effect.peer, e) for e in reducers[effect.peer].receive(now, origin, effect.body)]
            elif isinstance(effect, Finished):
                finished[origin] = effect
                finished_at[origin] = now
            elif isinstance(effect, Penalise):
                penalties.append((origin, effect))
        live = [r for p, r in reducers.items() if p not in dead]
        now = max(now, min(r.next_deadline() for r in live)) if live else max_time
        for peer, r in reducers.items():
            if peer not in dead:
                queue += [(peer, e) for e in r.tick(now)]
    return finished, penalties


def _vectors(n: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {p: torch.randn(length, generator=gen) for p in _peers(n)}


@pytest.mark.parametrize("encoding", [Encoding.INT8, Encoding.FP32])
def test_all_reduce_gives_everyone_the_same_mean_within_int8_error(encoding):
    vectors = _vectors(4, PIECE_VALUES * 2 + 123)  # shards of several pieces
    members = tuple(sorted(vectors))
    cfg = AllReduceConfig(encoding=encoding)
    reducers = {p: AllReduce(p, 3, members, v, cfg) for p, v in vectors.items()}
    finished, penalties = _run(reducers)
    assert set(finished) == set(members) and not penalties
    exact = torch.stack(list(vectors.values())).mean(0)
    means = [f.mean for f in finished.values()]
    assert all(torch.equal(m, means[0]) for m in means)  # bit-identical on every peer
    bound = 2 * max_quantization_error(torch.stack(list(vectors.values())).abs().amax(0)) + 1e-6
    tolerance = bound if encoding is Encoding.INT8 else 1e-6
    assert float((means[0] - exact).abs().max()) <= tolerance
    assert all(f.contributors == (members,) * 4 for f in finished.values())
    # reduce-scatter + all-gather: 2 (N-1)/N of the vector per peer, not (N-1) x the vector
    one = packed_bytes(exact.numel(), encoding)
    for r in reducers.values():
        assert r.bytes_sent <= 2 * 3 / 4 * one * 1.01 + 64


def test_a_dead_peer_s_shard_is_redone_by_its_successor():
    vectors = _vectors(4, 10_000, seed=2)
    members = tuple(sorted(vectors))
    reducers = {p: AllReduce(p, 0, members, v, AllReduceConfig(deadline_s=5.0)) for p, v in vectors.items()}
    # peer1 dies before the round: nobody can reach it (some learn by a refused send, all by deadlines)
    finished, _ = _run(reducers, dead={"peer1"})
    assert set(finished) == {"peer0", "peer2", "peer3"}
    means = [f.mean for f in finished.values()]
    assert all(torch.equal(m, means[0]) for m in means)
    survivors = ("peer0", "peer2", "peer3")
    exact = torch.stack([vectors[p] for p in survivors]).mean(0)
    assert float((means[0] - exact).abs().max()) < 0.05
    for f in finished.values():
        assert all(c == survivors for c in f.contributors)
    assert all(r.shards[1].owner == "peer2" for p, r in reducers.items() if p != "peer1")  # the next in the chain


def test_a_refused_connection_reassigns_at_once():
    vectors = _vectors(3, 999, seed=3)
    members = tuple(sorted(vectors))
    reducers = {p: AllReduce(p, 0, members, v, AllReduceConfig(deadline_s=5.0)) for p, v in vectors.items()}
    finished, _ = _run(reducers, dead={"peer2"}, drop_to={"peer2"})
    assert set(finished) == {"peer0", "peer1"}
    assert reducers["peer0"].shards[2].owner == "peer0"  # the chain wraps around
    assert all(torch.equal(finished["peer0"].mean, f.mean) for f in finished.values())


def test_bad_contributions_are_rejected_penalised_and_left_out():
    vectors = _vectors(4, 5000, seed=4)
    vectors["peer3"] = vectors["peer3"] * 1000  # a norm far outside the others'
    vectors["peer2"][7] = math.nan
    members = tuple(sorted(vectors))
    reducers = {p: AllReduce(p, 0, members, v, AllReduceConfig(encoding=Encoding.FP32)) for p, v in vectors.items()}
    finished, penalties = _run(reducers)
    assert {(p.peer, p.why) for _, p in penalties} >= {("peer3", Rejection.NORM_OUTLIER), ("peer2", Rejection.NOT_FINITE)}
    good = ("peer0", "peer1")
    exact = torch.stack([vectors[p] for p in good]).mean(0)
    mean = finished["peer0"].mean
    assert finished["peer0"].contributors[0] == good  # shard 0 holds the NaN
    assert finished["peer0"].contributors[1] == ("peer0", "peer1", "peer2")  # shard 1 does not: peer2 counts
    # shard 0 (which holds the NaN) is the mean of the honest two
    start, end = shard_bounds(5000, 4)[0]
    assert torch.allclose(mean[start:end], exact[start:end], atol=1e-6)
    assert bool(torch.isfinite(mean).all())


def test_a_shard_reduced_from_the_same_contributions_is_the_same_to_the_bit_whatever_their_order():
    """A shard's owner averages what came in peer order: the same contributions arriving in any
    order give the same reduced shard, to the bit: what a shard's reducer sends is a function of
    what came, not of when. (Not that an owner and a successor agree: a successor that adopts a
    dead owner's shard lacks the owner's contribution and holds its own unquantized, where the
    owner held it int8-quantized.)"""
    vectors = _vectors(4, 5000, seed=11)
    members = tuple(sorted(vectors))
    cfg = AllReduceConfig(encoding=Encoding.FP32)
    to_owner = {p: [e.body for e in AllReduce(p, 0, members, v, cfg).start(0.0) if isinstance(e, Send)
                    and e.peer == "peer0"] for p, v in vectors.items() if p != "peer0"}
    reduced = set()
    for order in itertools.permutations(to_owner):
        owner = AllReduce("peer0", 0, members, vectors["peer0"], cfg)
        owner.start(0.0)
        for sender in order:
            for part in to_owner[sender]:
                owner.receive(0.0, sender, part)
        assert owner.shards[0].contributors == members
        reduced.add(owner.shards[0].reduced.numpy().tobytes())
    assert len(reduced) == 1


def test_parts_of_another_view_or_round_are_ignored_and_bad_shapes_penalised():
    vectors = _vectors(2, 100)
    members = tuple(sorted(vectors))
    a = AllReduce("peer0", 5, members, vectors["peer0"], AllReduceConfig())
    b = AllReduce("peer1", 5, members, vectors["peer1"], AllReduceConfig())
    sends = [e for e in b.start(0.0) if isinstance(e, Send)]
    part = sends[0].body
    from dataclasses import replace

    assert a.receive(0.0, "peer1", replace(part, round=4)) == []
    assert a.receive(0.0, "stranger", part) == []
    assert a.receive(0.0, "peer1", replace(part, shard_length=part.shard_length + 1)) == [
        Penalise("peer1", Rejection.WRONG_SHAPE)]
    with pytest.raises(ValueError, match="value bytes"):  # refused as the frame is decoded (`Part`)
        replace(part, values=part.values[:-1])


def test_a_part_with_a_block_far_beyond_its_length_is_one_block_and_allocates_nothing_more():
    """`block` is the sender's (a Part checks only block >= 1): a piece shorter than its block is
    one block whatever the number says. Before, unpack materialised one scale per value of the
    whole block: 2^34 asked for 64 GiB (RuntimeError out of the core, which stopped the role) and
    2^62 overflowed torch's size check."""
    vectors = _vectors(2, 100)
    members = tuple(sorted(vectors))
    b = AllReduce("peer1", 5, members, vectors["peer1"], AllReduceConfig())
    part = next(e for e in b.start(0.0) if isinstance(e, Send)).body
    assert part.length <= part.block  # one block: its scales stay 4 bytes whatever the block says
    from dataclasses import replace

    honest = AllReduce("peer0", 5, members, vectors["peer0"], AllReduceConfig())
    expected = honest.receive(0.0, "peer1", part)
    for block in (2**34, 2**62):
        a = AllReduce("peer0", 5, members, vectors["peer0"], AllReduceConfig())
        assert a.receive(0.0, "peer1", replace(part, block=block)) == expected
        assert torch.equal(unpack(Packed(Encoding.INT8, 3, block, b"\x01\x02\x7f", b"\x00\x00\x80\x3f")),
                           torch.tensor([1.0, 2.0, 127.0]))


def test_global_state_is_written_atomically_and_read_back(tmp_path):
    from trainer.diloco_local import STATE_FILE, GlobalState, read_state, write_state

    assert read_state(tmp_path, 10) is None
    first = GlobalState(3, torch.arange(10.0), torch.ones(10))
    write_state(tmp_path, first)
    (tmp_path / f".{STATE_FILE}.999.tmp").write_bytes(b"half a write")  # a crash mid-write leaves only this
    back = read_state(tmp_path, 10)
    assert back.round == 3 and torch.equal(back.weights, first.weights) and torch.equal(back.momentum, first.momentum)
    write_state(tmp_path, GlobalState(4, torch.zeros(10), torch.zeros(10)))
    assert read_state(tmp_path, 10).round == 4
    with pytest.raises(ValueError):
        read_state(tmp_path, 11)  # another model's state is refused, not loaded


@pytest.mark.parametrize("waiting", [(2, 3), (3, 2)], ids=["older_waits_first", "newer_waits_first"])
async def test_checkpoints_are_written_one_at_a_time_and_never_step_back_a_round(tmp_path, monkeypatch, waiting):
    """Round 1's write outlasts two rounds; rounds 2 and 3 wait for it, queued for the lock in the
    order `waiting` pins (it is fair: they take it in that order; trio would start them in either,
    and each order catches its own mistake). Round 3 is written, once, either way: older first,
    the first to take the lock writes the newest pending state, not its own; newer first, the
    older round does not replace the newer one pending. A round older than the one written,
    coming after it, is not written."""
    import threading
    from types import SimpleNamespace

    import trio
    import trio.testing

    import trainer.diloco_catchup as diloco_catchup  # `_checkpoint` (mixed into the role) writes from there
    import trainer.diloco_role as diloco_role
    from trainer.diloco_local import GlobalState

    started, release = threading.Event(), threading.Event()
    written: list[int] = []

    def slow_write(out_dir, state) -> None:  # the first write outlasts two rounds
        if not written and not started.is_set():
            started.set()
            assert release.wait(60.0)
        written.append(state.round)

    monkeypatch.setattr(diloco_catchup, "write_state", slow_write)
    role = SimpleNamespace(checkpointing=trio.Lock(), pending_checkpoint=None, checkpointed_round=-1,
                           config=SimpleNamespace(out_dir=tmp_path))
    state = {r: GlobalState(r, torch.zeros(2), torch.zeros(2)) for r in (1, 2, 3)}
    checkpoint = diloco_role.DilocoRole._checkpoint
    async with trio.open_nursery() as nursery:
        nursery.start_soon(checkpoint, role, state[1])
        await trio.to_thread.run_sync(started.wait)
        for queued, r in enumerate(waiting, 1):
            nursery.start_soon(checkpoint, role, state[r])
            await trio.testing.wait_all_tasks_blocked()  # it waits for the first write, behind those before it
            assert role.checkpointing.statistics().tasks_waiting == queued
        release.set()
    assert written == [1, 3] and role.checkpointed_round == 3  # round 2 waited, round 3 came: 3 written once
    await checkpoint(role, state[2])  # late: the file never steps back a round
    assert written == [1, 3] and role.checkpointed_round == 3


def test_phase_and_join_path_read_as_their_text_wherever_they_are_shown():
    """status() carries `phase` and `state_via` as enums: JSON (the control socket, the devnet),
    logs and comparisons with the text see exactly the words they saw as bare strings."""
    assert [str(p) for p in Phase] == ["starting", "inner", "join", "reduce", "done"]
    assert [str(p) for p in JoinPath] == ["relay", "direct"]
    shown = {"phase": Phase.REDUCE, "state_via": JoinPath.DIRECT, "state_via_counts": {p: 1 for p in JoinPath}}
    assert json.loads(json.dumps(shown)) == {"phase": "reduce", "state_via": "direct",
                                             "state_via_counts": {"relay": 1, "direct": 1}}
    assert f"{Phase.JOIN} {JoinPath.RELAY}" == "join relay" and Phase.DONE == "done"


def test_the_whole_contributors_are_the_peers_every_shard_took():
    """What marks a peer of an open group (`AnsweringState._of_group`): a contribution every shard
    took, not one part of it (a peer whose part reached one shard's owner only), nor none."""
    shards = (("a", "b", "c"), ("a", "c"), ("c", "d", "a"))
    assert Finished(torch.zeros(1), shards).whole_contributors() == {"a", "c"}
    assert Finished(torch.zeros(1), (("a",),)).whole_contributors() == {"a"}
    assert Finished(torch.zeros(0), ()).whole_contributors() == frozenset()
