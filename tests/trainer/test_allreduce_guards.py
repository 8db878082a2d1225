"""The all-reduce core against what a member (or any sender) can put in a Part: a contribution
sent to a peer that does not reduce its shard, contributors that are not members, value bytes that
do not match a Part's length, and the edges of its own arithmetic and settings (an int8 block at
float32's largest value, a block setting out of range, an owner's own contribution rejected).
The `AllReduce` core alone, in memory, in virtual time (`tests.trainer.test_diloco_core._run`)."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from p2pnet.errors import ConfigError, MessageRejected
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from tests.trainer.test_diloco_core import _run, _vectors
from trainer.allreduce import AllReduce, AllReduceConfig, Penalise, Send, shard_bounds
from trainer.diloco import Encoding, Rejection, max_quantization_error, pack, unpack
from trainer.diloco_messages import PIECE_VALUES, STAGE_CONTRIBUTION, STAGE_REDUCED, Part
from trainer.diloco_role import DilocoConfig

INT8 = AllReduceConfig(encoding=Encoding.INT8, deadline_s=5.0)
FLT_MAX = torch.finfo(torch.float32).max


def _reducers(vectors: dict[str, torch.Tensor], config: AllReduceConfig = INT8,
              kinds: dict[str, type[AllReduce]] | None = None) -> dict[str, AllReduce]:
    members = tuple(sorted(vectors))
    kinds = kinds or {}
    return {p: kinds.get(p, AllReduce)(p, 0, members, v, config) for p, v in vectors.items()}


def _contribution(core: AllReduce, index: int, values: torch.Tensor) -> Part:
    """A contribution to shard `index` of `core`'s round carrying `values` (one piece)."""
    packed = pack(values, Encoding.INT8, core.config.block)
    return Part(core.round, core.digest, STAGE_CONTRIBUTION, index, values.numel(), 0, packed.length,
                packed.encoding.value, packed.block, packed.values, packed.scales, ())


class _SendsShardZeroToPeer1(AllReduce):
    """A member that sends peer1 a huge 'contribution' to shard 0 (peer0's, alive) at the round's
    start, as if it saw peer0 die, and nothing else: no contribution to any owner, no reduction."""

    def start(self, now):  # type: ignore[no-untyped-def]
        a, b = shard_bounds(self.vector.numel(), len(self.members))[0]
        return [Send("peer1", _contribution(self, 0, torch.full((b - a,), 1e6)))]

    def receive(self, now, sender, part):  # type: ignore[no-untyped-def]
        return []

    def tick(self, now):  # type: ignore[no-untyped-def]
        return []

    def next_deadline(self) -> float:
        return math.inf


def test_a_contribution_sent_to_a_peer_that_does_not_reduce_its_shard_does_not_set_it_there() -> None:
    """peer3 sends peer1 a contribution to shard 0, whose owner, peer0, is alive: peer1 keeps it
    and takes peer0's mean, like every member, which ends the round on one mean whose shard 0 is
    the honest three's. (Before, peer1 adopted shard 0 on peer3's word and reduced it from its own
    contribution and peer3's alone, two: no norm screen; it ended the round on other weights.)"""
    vectors = _vectors(4, 4000, seed=5)
    reducers = _reducers(vectors, kinds={"peer3": _SendsShardZeroToPeer1})
    finished, penalties = _run(reducers, max_time=60)
    honest = ("peer0", "peer1", "peer2")
    assert set(finished) == set(honest) and not penalties
    means = [finished[p].mean for p in honest]
    assert all(torch.equal(m, means[0]) for m in means)
    assert all(finished[p].contributors[0] == honest for p in honest)
    assert reducers["peer1"].shards[0].owner == "peer0"
    a, b = shard_bounds(4000, 4)[0]
    exact = torch.stack([vectors[p] for p in honest]).mean(0)
    assert float((means[0][a:b] - exact[a:b]).abs().max()) < 0.1


def test_a_contribution_that_came_early_counts_once_our_own_view_makes_us_the_reducer() -> None:
    """peer0 is dead. peer3 learns it at once (a refused send) and sends its contribution to shard
    0 to peer1, next in the chain; peer1 and peer2 learn it at peer0's gather deadline. peer1
    holds peer3's contribution until then, and reduces shard 0 from all three survivors', as every
    survivor then takes it. (Before, peer1 adopted the shard at once and reduced it at its reduce
    deadline from its own and peer3's, peer2's still on its way to peer0.)"""
    vectors = _vectors(4, 4000, seed=6)
    reducers = _reducers(vectors)
    finished, penalties = _run(reducers, dead={"peer0"}, drop_to={"peer0"}, learns={"peer3"})
    survivors = ("peer1", "peer2", "peer3")
    assert set(finished) == set(survivors) and not penalties
    means = [finished[p].mean for p in survivors]
    assert all(torch.equal(m, means[0]) for m in means)
    assert all(finished[p].contributors[0] == survivors for p in survivors)
    assert all(finished[p].reducers[0] == "peer1" for p in survivors)


class _NamesStrangers(AllReduce):
    """An owner whose reduced Parts name contributors that are no members of the round."""

    def _parts(self, index, stage, values, to, contributors):  # type: ignore[no-untyped-def]
        if stage == STAGE_REDUCED:
            contributors = tuple(sorted({*contributors, "made-up-1", "made-up-2"}))
        return super()._parts(index, stage, values, to, contributors)


def test_a_reduced_part_naming_contributors_that_are_no_members_is_refused_and_penalised() -> None:
    """peer2's mean of its shard names two made-up contributors: peer0 and peer1 refuse it
    (WRONG_SHAPE, peer2 penalised by each), and the shard is reduced by the next in its chain;
    no member's round names anyone but members. (Before, the names were taken into every
    member's round, up to 1024 of them a Part, shown in the role's history.)"""
    vectors = _vectors(3, 3000, seed=7)
    reducers = _reducers(vectors, kinds={"peer2": _NamesStrangers})
    finished, penalties = _run(reducers)
    assert sorted({(who, p.peer, p.why) for who, p in penalties}) == [
        ("peer0", "peer2", Rejection.WRONG_SHAPE), ("peer1", "peer2", Rejection.WRONG_SHAPE)]
    for peer in ("peer0", "peer1"):
        assert {name for shard in finished[peer].contributors for name in shard} <= {"peer0", "peer1", "peer2"}
    assert torch.equal(finished["peer0"].mean, finished["peer1"].mean)


def test_a_contribution_naming_contributors_is_refused_and_contributors_must_be_sorted_and_unique() -> None:
    vectors = _vectors(2, 100)
    reducers = _reducers(vectors)
    owner = reducers["peer0"]
    part = _contribution(reducers["peer1"], 0, vectors["peer1"][:50])
    assert owner.receive(0.0, "peer1", replace(part, contributors=("peer1",))) == [
        Penalise("peer1", Rejection.WRONG_SHAPE)]
    with pytest.raises(ValueError, match="sorted and unique"):
        replace(part, stage=STAGE_REDUCED, contributors=("peer1", "peer0"))
    with pytest.raises(ValueError, match="contributors"):
        replace(part, stage=STAGE_REDUCED, contributors=tuple(f"p{i:04d}" for i in range(257)))


def test_a_part_whose_bytes_do_not_match_its_length_is_refused_when_decoded() -> None:
    """A Part of one int8 value carrying 2 MiB of value bytes (or fp32 bytes short by one, or a
    scale too many): the codec refuses the frame (`invalid_field`, its sender named), so no such
    Part is ever held. (Before, it decoded, and 1,024 of them waited for the round: 2 GiB.)"""
    sender = Identity.generate()
    good = Part(1, b"d" * 16, STAGE_CONTRIBUTION, 0, 10, 0, 1, "int8", 4096, b"\x01", b"\x00\x00\x80?", ())
    bad = []
    for values, scales, encoding in ((b"\x01" * (2 * 1024 * 1024), b"\x00\x00\x80?", "int8"),
                                     (b"\x01", b"\x00\x00\x80?" * 2, "int8"),
                                     (b"\x00" * 3, b"", "fp32")):
        part = object.__new__(Part)  # what a hostile sender's codec writes: no checks on its side
        for name, value in vars(good).items():
            object.__setattr__(part, name, value)
        object.__setattr__(part, "values", values)
        object.__setattr__(part, "scales", scales)
        object.__setattr__(part, "encoding", encoding)
        bad.append(part)
    codec = Codec(sender)
    assert Codec(None).decode(codec.encode(good, time.time()), time.time()).body == good
    for part in bad:
        with pytest.raises(MessageRejected) as refused:
            Codec(None).decode(codec.encode(part, time.time()), time.time())
        assert refused.value.reason == "invalid_field" and refused.value.sender == sender.peer_id


def test_an_int8_block_at_float32_s_largest_value_decodes_finite() -> None:
    """127 x (FLT_MAX / 127) rounds past FLT_MAX: the scale steps down until it does not, and
    decodes within half a scale. An int8 all-reduce of two such vectors ends finite at both
    members, nobody penalised. (Before, it decoded to inf: each owner applied inf and the other
    refused its mean, NOT_FINITE.)"""
    vector = torch.tensor([FLT_MAX, 1.0, -FLT_MAX / 2, -FLT_MAX])
    back = unpack(pack(vector, Encoding.INT8, 4096))
    assert bool(torch.isfinite(back).all())
    assert float((back.double() - vector.double()).abs().max()) <= max_quantization_error(vector, 4096)
    reducers = _reducers({p: torch.full((300,), FLT_MAX) for p in ("peer0", "peer1")})
    finished, penalties = _run(reducers, max_time=100)
    assert set(finished) == {"peer0", "peer1"} and not penalties
    assert all(bool(torch.isfinite(f.mean).all()) for f in finished.values())


@pytest.mark.parametrize("block", [0, -4096, 2 * PIECE_VALUES, 3000])
def test_a_block_setting_outside_1_to_piece_values_or_not_dividing_it_is_a_settings_error(tmp_path: Path,
                                                                                        block: int) -> None:
    with pytest.raises(ValueError, match="block must be from 1"):
        AllReduceConfig(block=block)
    with pytest.raises(ConfigError, match="block"):
        DilocoConfig(model_dir=tmp_path, out_dir=tmp_path, block=block)


def test_an_owner_whose_own_contribution_its_screen_rejects_penalises_nobody() -> None:
    """peer0's pseudo-gradient holds a NaN in its own shard: its screen leaves it out, records it,
    and reports no penalty (before, it penalised itself); no other member sees it."""
    vectors = _vectors(3, 3000, seed=8)
    vectors["peer0"][3] = math.nan
    reducers = _reducers(vectors)
    finished, penalties = _run(reducers)
    assert set(finished) == {"peer0", "peer1", "peer2"} and penalties == []
    assert reducers["peer0"].rejected == {"peer0": Rejection.NOT_FINITE.value}
    assert all(f.contributors[0] == ("peer1", "peer2") for f in finished.values())
