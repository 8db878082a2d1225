"""Whose reduced value a shard of the all-reduce takes (`trainer.allreduce_gather`): only the
member we hold to reduce it, whole, never pieces of two senders joined; a value from another
member waits until our own view makes its sender the reducer (an honest successor whose view ran
ahead of ours), and is else dropped, unpenalised. The `AllReduce` core alone, in memory, in
virtual time (`tests.trainer.test_diloco_core._run`); real roles: test_diloco_open_group.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_diloco_core import _run, _vectors
from trainer.allreduce import AllReduce, AllReduceConfig, Finished, Send, shard_bounds
from trainer.allreduce_gather import Offers, heard, reducer
from trainer.diloco import Encoding, Rejection, pack
from trainer.diloco_messages import PIECE_VALUES, STAGE_CONTRIBUTION, STAGE_REDUCED, Part

FP32 = AllReduceConfig(encoding=Encoding.FP32, deadline_s=5.0)


def _forged(core: AllReduce, index: int, values: torch.Tensor, contributors: tuple[str, ...]) -> list[Part]:
    """Reduced Parts of shard `index` carrying `values`, as `core`'s round would frame them."""
    length = values.numel()
    parts = []
    for offset in range(0, length, PIECE_VALUES):
        packed = pack(values[offset:offset + PIECE_VALUES], Encoding.FP32, core.config.block)
        parts.append(Part(core.round, core.digest, STAGE_REDUCED, index, length, offset, packed.length,
                          packed.encoding.value, packed.block, packed.values, packed.scales, contributors))
    return parts


def _reducers(vectors: dict[str, torch.Tensor], config: AllReduceConfig = FP32) -> dict[str, AllReduce]:
    members = tuple(sorted(vectors))
    return {p: AllReduce(p, 0, members, v, config) for p, v in vectors.items()}


def _one_mean(finished: dict, peers) -> torch.Tensor:
    means = [finished[p].mean for p in peers]
    assert all(torch.equal(m, means[0]) for m in means)
    return means[0]


def test_the_chain_reducer_is_the_first_member_we_do_not_take_for_dead() -> None:
    members = ("a", "b", "c", "d")
    assert reducer(members, 1, set()) == "b"
    assert reducer(members, 1, {"b", "c"}) == "d"
    assert reducer(members, 3, {"d"}) == "a"  # wraps around
    assert reducer(members, 0, set(members)) is None
    assert heard(members, 1, set()) == ("b",)
    assert heard(members, 1, {"b", "c"}) == ("b", "c", "d")  # before the reducer: dead for us, yet heard
    assert heard(members, 1, {"c"}) == ("b",)  # never one after it
    assert heard(members, 3, {"d"}) == ("d", "a")


def test_a_forgers_value_for_another_members_shard_is_not_taken_the_owners_is() -> None:
    """peer2, the owner of shard 2 only, sends peer1 its own value of shard 0 (contributors and
    all) before peer0, the owner, sends its screened mean: peer1 keeps it and takes peer0's,
    unpenalised, and every member ends the round on the same mean. (Before, the first value to
    come was taken: peer1 applied the forgery, peer0 and peer2 the mean.)"""
    vectors = _vectors(3, 3000, seed=12)
    members = tuple(sorted(vectors))
    reducers = _reducers(vectors)
    start, end = shard_bounds(3000, 3)[0]
    forged = torch.full((end - start,), 1e3)
    for part in _forged(reducers["peer1"], 0, forged, ("peer2",)):
        reducers["peer1"].receive(0.0, "peer2", part)
    assert reducers["peer1"].shards[0].reduced is None
    finished, penalties = _run(reducers)
    assert not penalties
    mean = _one_mean(finished, members)
    assert all(f.contributors == (members,) * 3 for f in finished.values())
    exact = torch.stack(list(vectors.values())).mean(0)
    assert torch.allclose(mean, exact, atol=1e-6)


def test_the_successor_of_a_live_owner_cannot_set_its_shard_by_sending_first() -> None:
    """peer1 comes next after peer0 in shard 0's chain: the member that would reduce it were peer0
    dead. Its value of shard 0, sent to peer2 while peer0 lives (for peer2), is only its claim
    that peer0 died: peer2 takes peer0's. Taken sooner than our own view says, every member
    could set its predecessor's shard as well as its own."""
    vectors = _vectors(3, 3000, seed=13)
    members = tuple(sorted(vectors))
    reducers = _reducers(vectors)
    start, end = shard_bounds(3000, 3)[0]
    for part in _forged(reducers["peer2"], 0, torch.full((end - start,), -7.0), ("peer1",)):
        reducers["peer2"].receive(0.0, "peer1", part)
    finished, penalties = _run(reducers)
    assert not penalties
    mean = _one_mean(finished, members)
    assert finished["peer2"].contributors[0] == members
    assert torch.allclose(mean, torch.stack(list(vectors.values())).mean(0), atol=1e-6)


def _owners_reduced(reducers: dict[str, AllReduce], owner: str, to: str) -> list[Part]:
    """The reduced Parts `owner` sends `to` once every other member's contribution reached it."""
    core = reducers[owner]
    sends = core.start(0.0)
    for peer, r in reducers.items():
        if peer != owner:
            for effect in r.start(0.0):
                if isinstance(effect, Send) and effect.peer == owner:
                    sends += core.receive(0.0, peer, effect.body)
    return [e.body for e in sends if isinstance(e, Send) and e.peer == to and e.body.stage == STAGE_REDUCED]


def test_pieces_of_two_senders_are_never_joined_into_one_value() -> None:
    """Shard 0 is two pieces. The forger's second piece comes first, then the owner's first: no
    value is whole (a value keyed by offset alone would be, half forged); the owner's second
    piece makes the owner's value whole, and that alone is the shard's."""
    vectors = _vectors(3, 6 * PIECE_VALUES, seed=14)  # shards of two pieces each
    reducers = _reducers(vectors)
    owners = _owners_reduced(reducers, "peer0", "peer1")
    assert [p.offset for p in owners] == [0, PIECE_VALUES]
    receiver = AllReduce("peer1", 0, tuple(sorted(vectors)), vectors["peer1"], FP32)
    receiver.start(0.0)
    start, end = shard_bounds(6 * PIECE_VALUES, 3)[0]
    forged = _forged(receiver, 0, torch.full((end - start,), 1e3), ("peer2",))
    assert receiver.receive(0.0, "peer2", forged[1]) == []
    assert receiver.receive(0.0, "peer0", owners[0]) == []
    assert receiver.shards[0].reduced is None
    receiver.receive(0.0, "peer0", owners[1])
    assert torch.equal(receiver.shards[0].reduced, reducers["peer0"].shards[0].reduced)
    assert receiver.shards[0].contributors == ("peer0", "peer1", "peer2")
    receiver.receive(0.0, "peer2", forged[0])  # the forger's value, whole too late: nothing changes
    assert torch.equal(receiver.shards[0].reduced, reducers["peer0"].shards[0].reduced)


def test_an_honest_successor_whose_view_ran_ahead_is_taken_once_ours_reassigns() -> None:
    """peer1 (owner of shard 1) is dead. peer2, next in the chain, learns it at once (a refused
    send), adopts shard 1 and sends its mean at its reduce deadline (5 s); peer0 and peer3, which
    learn it only at gather_at (10 s), still hold peer1 the owner: they keep peer2's value, then
    take it as they reassign (sending peer2 nothing more, as it would drop it). The round ends
    then at every survivor, on one mean."""
    vectors = _vectors(4, 10_000, seed=15)
    reducers = _reducers(vectors)
    at: dict[str, float] = {}
    finished, penalties = _run(reducers, dead={"peer1"}, drop_to={"peer1"}, learns={"peer2"}, finished_at=at)
    survivors = ("peer0", "peer2", "peer3")
    assert set(finished) == set(survivors) and not penalties
    mean = _one_mean(finished, survivors)
    assert all(f.contributors[1] == ("peer2",) for f in finished.values())  # its own: the rest went to peer1
    start, end = shard_bounds(10_000, 4)[1]
    assert torch.equal(mean[start:end], vectors["peer2"][start:end])
    # peer2 has every shard at 5 s; the others not before 10 s: peer2 was not yet their reducer
    assert at == {"peer0": 10.0, "peer2": 5.0, "peer3": 10.0}
    for peer in ("peer0", "peer3"):
        assert reducers[peer].shards[1].owner == "peer2" and reducers[peer].dead == {"peer1"}


def test_a_dead_owners_late_piece_is_not_joined_with_its_successors_value() -> None:
    """peer0 reduced shard 0 (two pieces) and died. At peer2, which saw it die, the successor
    peer1's first piece comes, then peer0's first piece (sent before it died, delivered late),
    then peer1's second: the shard is peer1's value whole, never peer0's piece beside peer1's.
    And peer0's second piece, after, changes nothing."""
    vectors = _vectors(3, 6 * PIECE_VALUES, seed=16)
    members = tuple(sorted(vectors))
    late = _owners_reduced(_reducers(vectors), "peer0", "peer2")
    peer1 = AllReduce("peer1", 0, members, vectors["peer1"], FP32)
    peer2 = AllReduce("peer2", 0, members, vectors["peer2"], FP32)
    to_peer1 = [e.body for e in peer2.start(0.0) if isinstance(e, Send) and e.peer == "peer1"]
    to_peer1 += [e.body for e in peer2.peer_failed(1.0, "peer0") if isinstance(e, Send) and e.peer == "peer1"]
    peer1.start(0.0)
    peer1.peer_failed(1.0, "peer0")  # adopts shard 0
    sent: list[Part] = []
    for part in to_peer1:
        sent += [e.body for e in peer1.receive(1.0, "peer2", part) if isinstance(e, Send) and e.peer == "peer2"
                 and e.body.stage == STAGE_REDUCED and e.body.shard == 0]
    assert [p.offset for p in sent] == [0, PIECE_VALUES] and [p.offset for p in late] == [0, PIECE_VALUES]
    assert peer2.shards[0].owner == "peer1"
    peer2.receive(1.0, "peer1", sent[0])
    peer2.receive(1.0, "peer0", late[0])
    assert peer2.shards[0].reduced is None
    peer2.receive(1.0, "peer1", sent[1])
    assert torch.equal(peer2.shards[0].reduced, peer1.shards[0].reduced)
    assert peer2.shards[0].contributors == ("peer1", "peer2")
    peer2.receive(1.0, "peer0", late[1])
    assert torch.equal(peer2.shards[0].reduced, peer1.shards[0].reduced)


def test_a_value_whose_sender_dies_before_it_reduces_for_us_is_not_taken() -> None:
    """peer3 sends peer0 a value of shard 1 (peer1's), then fails us (a refused send): for us
    it will never reduce the shard, so when peer1 dies too its shard goes to peer2, whose value
    alone is taken, not the one peer3 left behind."""
    vectors = _vectors(4, 4000, seed=17)
    members = tuple(sorted(vectors))
    core = AllReduce("peer0", 0, members, vectors["peer0"], FP32)
    core.start(0.0)
    start, end = shard_bounds(4000, 4)[1]
    core.receive(0.0, "peer3", _forged(core, 1, torch.full((end - start,), 1e3), ("peer3",))[0])
    assert core.shards[1].reduced is None
    core.peer_failed(0.5, "peer3")
    assert core.shards[1].reduced is None
    effects = core.peer_failed(1.0, "peer1")
    assert core.shards[1].owner == "peer2" and core.shards[1].reduced is None
    assert any(isinstance(e, Send) and e.peer == "peer2" and e.body.stage == STAGE_CONTRIBUTION for e in effects)
    honest = torch.full((end - start,), 0.5)
    core.receive(2.0, "peer2", _forged(core, 1, honest, ("peer0", "peer2"))[0])
    assert torch.equal(core.shards[1].reduced, honest) and core.shards[1].contributors == ("peer0", "peer2")


def test_owners_found_dead_at_one_deadline_pass_every_shard_they_hold_on_at_once() -> None:
    """peer1 and peer2 die unseen. At 10 s (gather_at) peer0 and peer3 take both for dead: shard 1
    passes over peer2 (dead too) to peer3 at once, not to peer2 for another 10 s (before, the
    shards were passed on one by one, peer2 not yet counted dead for shard 1). The round ends at
    10 s, on one mean of the two survivors."""
    vectors = _vectors(4, 4000, seed=18)
    reducers = _reducers(vectors)
    at: dict[str, float] = {}
    finished, penalties = _run(reducers, dead={"peer1", "peer2"}, finished_at=at)
    assert at == {"peer0": 10.0, "peer3": 10.0} and not penalties
    mean = _one_mean(finished, ("peer0", "peer3"))
    assert torch.allclose(mean, (vectors["peer0"] + vectors["peer3"]) / 2, atol=1e-6)
    assert reducers["peer0"].shards[1].owner == reducers["peer0"].shards[2].owner == "peer3"


def test_a_senders_offers_are_one_value_a_shards_length_whatever_it_resends() -> None:
    """What a member can make us hold: one value of a shard per sender, the first piece at each
    offset; sent again, nothing more is kept."""
    offers = Offers(2 * PIECE_VALUES)
    first, again = torch.ones(PIECE_VALUES), torch.zeros(PIECE_VALUES)
    offers.add("x", 0, first, ("x",))
    offers.add("x", 0, again, ("y",))
    assert offers.of("x") is None and len(offers.pieces["x"]) == 1
    offers.add("x", PIECE_VALUES, first, ("x",))
    offers.add("x", 0, again, ("y",))
    offers.add("x", PIECE_VALUES, again, ("y",))
    value, contributors = offers.of("x")
    assert torch.equal(value, torch.ones(2 * PIECE_VALUES)) and contributors == ("x",) and not offers.pieces


def _run_cut(reducers: dict[str, AllReduce], cut: set[tuple[str, str]], learn_after: float,
             finished_at: dict[str, float], max_time: float = 1000.0) -> dict[str, Finished]:
    """`_run`, every member alive, but a send from a to b fails for each (a, b) of `cut` (a link
    down one way only), and a learns it `learn_after` seconds later (a connection that times out)."""
    now = 0.0
    queue: list[tuple[str, object]] = [(p, e) for p, r in reducers.items() for e in r.start(now)]
    notices: dict[tuple[str, str], float] = {}
    finished: dict[str, Finished] = {}
    while len(finished) < len(reducers) and now < max_time:
        while queue:
            origin, effect = queue.pop(0)
            if isinstance(effect, Send):
                if (origin, effect.peer) in cut:
                    notices.setdefault((origin, effect.peer), now + learn_after)
                else:
                    queue += [(effect.peer, e) for e in reducers[effect.peer].receive(now, origin, effect.body)]
            elif isinstance(effect, Finished):
                finished.setdefault(origin, effect)
                finished_at.setdefault(origin, now)
        pending = [t for t in notices.values() if t > now]
        now = min([r.next_deadline() for r in reducers.values()] + pending)
        for (origin, peer), t in notices.items():
            if t == now:
                queue += [(origin, e) for e in reducers[origin].peer_failed(now, peer)]
        for peer, r in reducers.items():
            queue += [(peer, e) for e in r.tick(now)]
    return finished


def test_a_member_whose_link_to_the_owner_is_down_takes_the_owners_value_when_it_comes() -> None:
    """peer1's link to peer0 is down one way: its sends fail (it learns at 1 s), while peer0 and
    every other link work. peer1 takes peer0 for dead and adopts shard 0 (to reduce at 6 s),
    but peer0, alive, reduces shard 0 at 5 s (the deadline: peer1's contribution never came)
    and sends its mean to everyone, peer1 included. peer1 takes it: the owner, first of the
    shard's chain, is the one member that needs nobody's death to reduce it, so its value is
    never a claim on another's shard. peer1, peer2 and peer3 then end on one mean. (Taking
    values from our own reducer only, peer1 reduced shard 0 alone at 6 s, on other weights.)"""
    vectors = _vectors(4, 4000, seed=19)
    members = tuple(sorted(vectors))
    reducers = _reducers(vectors)
    at: dict[str, float] = {}
    finished = _run_cut(reducers, {("peer1", "peer0")}, 1.0, at)
    assert reducers["peer1"].dead == {"peer0"} and reducers["peer1"].shards[0].owner == "peer1"
    mean = _one_mean(finished, ("peer1", "peer2", "peer3"))
    assert all(finished[p].contributors[0] == ("peer0", "peer2", "peer3") for p in ("peer1", "peer2", "peer3"))
    assert at["peer1"] == 5.0
    start, end = shard_bounds(4000, 4)[0]
    assert torch.equal(mean[start:end], reducers["peer0"].shards[0].reduced)
    assert set(finished) == set(members)  # peer0 too, which never hears from peer1 (as before: not ours)


class _NaNReducer(AllReduce):
    """An owner whose reduced pieces carry a NaN (an int8 block's scale, or fp32 bytes): sent
    alike to every member."""

    def _parts(self, index, stage, values, to, contributors):  # type: ignore[no-untyped-def]
        if stage == STAGE_REDUCED:
            values = values.clone()
            values[0] = float("nan")
        return super()._parts(index, stage, values, to, contributors)


@pytest.mark.parametrize("encoding", [Encoding.INT8, Encoding.FP32])
def test_an_owner_whose_mean_is_not_finite_is_refused_and_its_shard_reduced_by_the_next(encoding) -> None:
    """peer0 screens its shard and sends a mean with a NaN in it to everyone: peer1 and peer2
    refuse it (peer0 penalised, NOT_FINITE, by both), wait for peer0 to its `gather_at`, and
    peer1, next in the chain, reduces shard 0; both end on one mean, finite, within the
    quantization of the exact one. (Before, a NaN piece was kept like any other: one owner put
    NaN into every member's weights.)"""
    config = AllReduceConfig(encoding=encoding, deadline_s=5.0)
    vectors = _vectors(3, 3000, seed=21)
    members = tuple(sorted(vectors))
    reducers = {p: (_NaNReducer if p == "peer0" else AllReduce)(p, 0, members, v, config) for p, v in vectors.items()}
    finished, penalties = _run(reducers)
    assert sorted((who, p.peer, p.why) for who, p in penalties) == [
        ("peer1", "peer0", Rejection.NOT_FINITE), ("peer2", "peer0", Rejection.NOT_FINITE)]
    mean = _one_mean(finished, ("peer1", "peer2"))
    assert bool(torch.isfinite(mean).all())
    start, end = shard_bounds(3000, 3)[0]
    exact = torch.stack(list(vectors.values())).mean(0)
    exact[start:end] = torch.stack([vectors["peer1"], vectors["peer2"]]).mean(0)[start:end]  # peer0's lost with it
    assert float((mean - exact).abs().max()) < 0.1
    assert finished["peer1"].contributors[0] == ("peer1", "peer2")


def test_a_mean_that_overflows_float32_is_sent_finite() -> None:
    """Two honest contributions near float32's largest value overflow a float32 sum; the owner's
    mean is taken again in float64 and sent finite, so nobody refuses an honest owner."""
    big = 3.0e38
    vectors = {p: torch.full((300,), big) for p in ("peer0", "peer1")}
    reducers = _reducers(vectors)
    finished, penalties = _run(reducers)
    assert not penalties
    mean = _one_mean(finished, ("peer0", "peer1"))
    assert bool(torch.isfinite(mean).all()) and torch.allclose(mean, torch.full((300,), big))
