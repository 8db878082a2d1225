"""Churn, partitions and byzantine relays: every surviving honest relay ends with the right checkpoint."""

from __future__ import annotations

import dataclasses

from relay.effects import DropReason
from simulations.hostile import run_broadcast
from simulations.models import Churn, Partition
from simulations.scenarios import EXACT_WORLD, BroadcastScenario, broadcast


def _small(**changes: object) -> BroadcastScenario:
    return dataclasses.replace(broadcast(120), checkpoint_bytes=200_000_000, chunk_bytes=4 * 2**20, **changes)


def test_churn_and_byzantine_relays_every_surviving_honest_relay_gets_the_genuine_checkpoint() -> None:
    sc = _small(byzantine=0.15, forge=True, loss=0.01, seed=3,
                churn=Churn(departures=0.25, joins=0.1, end_s=1.5, leave_share=1, crash_share=1, hang_share=1))
    s, rows, run = run_broadcast(sc)
    assert s["byzantine"] == 18 and sum(s["departed"].values()) > 10 and s["joined"] > 0
    assert s["survivors_complete"] == s["survivors"] > 0
    assert s["survivors_right_checkpoint"] == s["survivors"]
    assert s["joiners_right_checkpoint"] == s["joined"] == s["joiners_complete"]
    for row in rows:  # and individually, with the genuine manifest and every chunk
        if row["kind"] != "byzantine" and row["fate"] == "stayed":
            core = run.cores[row["peer_id"]]
            assert core.signed(1).manifest_id == run.signed.manifest_id
            assert core.complete_versions() == [1]
    # the attack happened and was answered by the cores: corrupt chunks caught, forged manifests refused,
    # and only byzantine relays were penalised
    assert s["transfer"]["corrupt_served"] > 0 and s["byzantine_penalised"] > 0 and s["honest_penalised"] == 0
    assert s["forged_manifests_rejected"] > 0 and s["chunks_accepted_from_byzantine"] == 0
    dropped = s["sources_dropped"]
    assert dropped.get(DropReason.CORRUPT, 0) > 0 and dropped.get(DropReason.UNREACHABLE, 0) > 0
    assert s["messages"]["lost"] > 0


def test_byzantine_relays_at_a_rate_serve_some_genuine_chunks() -> None:
    s, _, _ = run_broadcast(_small(byzantine=0.2, corrupt_rate=0.3, seed=1))
    assert s["survivors_right_checkpoint"] == s["survivors"]
    assert s["chunks_accepted_from_byzantine"] > 0 and s["transfer"]["corrupt_served"] > 0


def test_a_hung_relay_is_noticed_by_stall_detection() -> None:
    churn = Churn(departures=0.1, end_s=0.5, leave_share=0, crash_share=0, hang_share=1)
    s, _, _ = run_broadcast(_small(churn=churn, stall_timeout_s=2.0, seed=2))
    assert s["departed"]["hang"] > 0 and s["survivors_right_checkpoint"] == s["survivors"]
    assert s["sources_dropped"].get(DropReason.STALLED, 0) > 0


def test_a_partitioned_region_catches_up_after_the_heal() -> None:
    sc = _small(partition=Partition(start_s=0.3, end_s=4.0, region="asia"), stall_timeout_s=1.0, seed=4,
                **EXACT_WORLD)  # the timings below assume links as fast as advertised
    s, rows, _ = run_broadcast(sc)
    assert s["survivors_right_checkpoint"] == s["survivors"] == 120
    asia = [r["completed_s"] for r in rows if r["region"] == "asia"]
    others = [r["completed_s"] for r in rows if r["region"] != "asia"]
    assert asia and min(asia) > 4.0  # nobody across the cut could finish before the heal
    assert max(others) < 4.0 or sorted(others)[len(others) // 2] < 4.0
    baseline, _, _ = run_broadcast(_small(seed=4, **EXACT_WORLD))
    assert baseline["time_to_all_s"] < 4.0 < s["time_to_all_s"]


def test_build_broadcast_takes_regions_downloads_a_world_class_and_a_corruption_rate() -> None:
    from simulations.broadcast import build_broadcast, run_broadcast_sim
    from simulations.dataplane import RelayWorld

    class Marked(RelayWorld):
        pass

    sim = build_broadcast(30, 40 * 2**20, seed=2, chunk_bytes=2**20, regions=["us", "eu", "asia"] * 10,
                          origin_region="us", download_bps=lambda rng: rng.uniform(1e8, 1e9), world_class=Marked,
                          stall_timeout_s=3.0, corrupt_rate=0.5)
    assert isinstance(sim.world, Marked) and sim.config.stall_timeout_s == 3.0 and sim.config.exclude_s == 9.0
    assert sim.world.peers[sim.peer_ids[2]].region == "asia" and sim.regions[sim.origin] == "us"
    assert len({sim.world.ports[p].download_bps for p in sim.peer_ids}) == 30
    liar = sim.peer_ids[0]
    sim.world.corrupt_peers.add(liar)
    result = run_broadcast_sim(sim, seed=2)
    assert result.stats["corrupt_served"] > 0 and sim.world.genuine_from_corrupt_peers > 0


def test_the_data_plane_goes_silent_across_a_partition_and_resumes_after_the_heal() -> None:
    from simulations.broadcast import build_broadcast

    sim = build_broadcast(20, 40 * 2**20, seed=3, chunk_bytes=2**20, stall_timeout_s=1.0)
    cut = sim.peer_ids[:5]
    sim.engine.at(0.05, sim.world.partition, [cut])  # after the manifest reached everyone
    sim.engine.at(3.0, sim.world.heal)
    sim.publish()
    sim.engine.run(until=2.9)
    assert not any(p in sim.completed for p in cut) and sim.world.transfer_stats["failed"] == 0
    sim.engine.run(until=60.0, stop=lambda: sim.done())
    assert sim.done() and min(sim.completed[p] for p in cut) > 3.0
