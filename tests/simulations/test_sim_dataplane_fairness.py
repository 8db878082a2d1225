"""The data plane shares uploads and downloads max-min fairly on both sides, as TCP flows do.

A sink's download is shared by its flows, but what one flow cannot use (its source is slow, or
its connection is window-limited) goes to the sink's other flows, and a source's upload that one
sink cannot take goes to the source's other flows. With `pace_uploads` a source paces what it
serves chunk by chunk, as the relay role does, and the wait counts as queue time. A request
waiting for the budget ends as the relay's would when its source crashes or stops, when its sink
gives up on the source, crashes or stops, or when a partition cuts it. Each case is a few peers
with a known answer.
"""

from __future__ import annotations

import math

from p2pnet.identity import Identity
from relay.effects import DropSource, Fetch, FetchFailure
from relay.serving import ServingConfig
from simulations.dataplane import RelayWorld
from simulations.engine import Engine
from simulations.world import NetworkModel


class _Core:
    kinds, topics = (), ()

    def __init__(self, name: str, done: dict[str, float], log: list[tuple] | None = None) -> None:
        self.name, self.done, self.log = name, done, log  # `log`: failures are expected, not errors

    def start(self, now):  # type: ignore[no-untyped-def]
        return []

    def has(self, version: int, index: int) -> bool:
        return True  # every source holds every chunk: no long polls

    def fetched(self, now, peer, version, index, elapsed_s):  # type: ignore[no-untyped-def]
        self.done[f"{peer}/{index}"] = now
        if self.log is not None:
            self.log.append((round(now, 9), self.name, "fetched", index, round(elapsed_s, 9)))
        return []

    def fetch_failed(self, now, peer, version, index, reason):  # type: ignore[no-untyped-def]
        if self.log is not None:
            self.log.append((round(now, 9), self.name, "failed", index, reason))
            return []
        raise AssertionError(f"{self.name}: fetch of {index} from {peer} failed: {reason}")


def _world(peers: dict[str, tuple[float, float]], pace: bool = False, slots: int = 8,
           log: list[tuple] | None = None) -> tuple[Engine, RelayWorld, dict[str, str], dict[str, float]]:
    """Peers by name with (upload, download) in bytes/s; no latency, no windows."""
    engine = Engine(1)
    world = RelayWorld(engine, NetworkModel(local_latency_s=0.0), serving=ServingConfig(slots=slots, per_peer=slots),
                       pace_uploads=pace)
    done: dict[str, float] = {}
    ids = {}
    for name, (upload, download) in peers.items():
        ident = Identity.from_seed_text(f"fair/{name}")
        ids[name] = ident.peer_id
        world.add_relay_peer(ident, [_Core(name, done, log)], upload_bps=upload, download_bps=download)
    return engine, world, ids, done


def _fetch(world: RelayWorld, ids: dict[str, str], sink: str, source: str, index: int, size: int) -> None:
    world.apply(ids[sink], [Fetch(ids[source], 1, index, b"\0" * 32, size, False)])


def test_a_sinks_spare_download_goes_to_its_other_flows() -> None:
    # the sink downloads 100 B/s from a slow source (10 B/s up) and a fast one (1,000 B/s up):
    # the slow flow moves 10 B/s and the fast one takes the other 90, not half the download (50)
    engine, world, ids, done = _world({"sink": (1.0, 100.0), "slow": (10.0, math.inf), "fast": (1000.0, math.inf)})
    _fetch(world, ids, "sink", "slow", 0, 100)
    _fetch(world, ids, "sink", "fast", 1, 900)
    engine.run(until=1.0)
    rates = sorted(flow.rate for flow in world.ports[ids["sink"]].down)
    assert rates == [10.0, 90.0]
    engine.run()
    assert math.isclose(done[f"{ids['slow']}/0"], 10.0) and math.isclose(done[f"{ids['fast']}/1"], 10.0)


def test_a_freed_download_share_goes_to_the_flows_left_and_a_sources_spare_upload_to_its_other_sinks() -> None:
    # source A (120 B/s up) serves sinks X (download 30) and Y (unlimited); Y also downloads from B
    # (50 B/s up). A gives X 30 (X's download) and Y the other 90. When X's chunk is done, Y takes
    # all of A's 120.
    engine, world, ids, done = _world({"A": (120.0, math.inf), "B": (50.0, math.inf), "X": (1.0, 30.0),
                                       "Y": (1.0, math.inf)})
    _fetch(world, ids, "X", "A", 0, 30)  # 1 s at 30 B/s
    _fetch(world, ids, "Y", "A", 1, 90 + 120)  # 90 B in the first second, then 120 B/s: done at 2 s
    _fetch(world, ids, "Y", "B", 2, 100)  # 50 B/s throughout: done at 2 s
    engine.run(until=0.5)
    by_sink = {flow.dst is world.ports[ids["X"]]: flow.rate for flow in world.ports[ids["A"]].up}
    assert by_sink == {True: 30.0, False: 90.0}
    engine.run()
    assert math.isclose(done[f"{ids['A']}/0"], 1.0)
    assert math.isclose(done[f"{ids['A']}/1"], 2.0) and math.isclose(done[f"{ids['B']}/2"], 2.0)


def test_no_upload_or_download_is_oversubscribed_while_flows_come_and_go() -> None:
    # 6 peers, each fetching chunks of every other at once with uneven links: at every event no
    # resource carries more than its capacity, and every chunk arrives
    links = {f"p{i}": (10.0 * (i + 1), 15.0 * (6 - i)) for i in range(6)}
    engine, world, ids, done = _world(links)
    wanted = 0
    for i, sink in enumerate(links):
        for j, source in enumerate(links):
            if sink != source:
                for k in range(3):
                    _fetch(world, ids, sink, source, 100 * i + 10 * j + k, 20 + 7 * ((i + j + k) % 5))
                    wanted += 1
    while engine.pending():
        engine.run(until=engine.now + 0.05)
        for port in world.ports.values():
            assert sum(f.rate for f in port.up) <= port.upload_bps * (1 + 1e-6)
            assert sum(f.rate for f in port.down) <= port.download_bps * (1 + 1e-6)
            assert all(f.rate > 0 for f in port.up)
    assert len(done) == wanted


def test_a_paced_source_sends_its_chunks_one_after_another_instead_of_sharing_its_upload() -> None:
    # 100 B/s up, two 100-byte chunks to two sinks: shared, both end at 2 s; paced as the relay
    # role paces (a token bucket with one second of burst), the first ends at 1 s, the second
    # waits for the budget and ends at 2 s
    for pace, expected in ((False, [2.0, 2.0]), (True, [1.0, 2.0])):
        engine, world, ids, done = _world({"src": (100.0, math.inf), "a": (1.0, math.inf), "b": (1.0, math.inf)},
                                          pace=pace)
        _fetch(world, ids, "a", "src", 0, 100)
        _fetch(world, ids, "b", "src", 1, 100)
        engine.run()
        assert [round(t, 9) for t in sorted(done.values())] == expected


def test_a_sinks_download_freed_by_a_finished_flow_goes_to_its_other_flow() -> None:
    # the sink downloads 100 B/s from two fast sources: 50 B/s each until the 100-byte chunk ends
    # at 2 s, then the 900-byte one takes the whole 100 B/s (800 B left: done at 10 s, not 18)
    engine, world, ids, done = _world({"sink": (1.0, 100.0), "s1": (1000.0, math.inf), "s2": (1000.0, math.inf)})
    _fetch(world, ids, "sink", "s1", 0, 100)
    _fetch(world, ids, "sink", "s2", 1, 900)
    engine.run()
    assert [round(t, 9) for t in sorted(done.values())] == [2.0, 10.0]


def test_the_wait_for_the_upload_budget_counts_as_queue_time() -> None:
    # the second chunk waits 1 s for the budget, then moves for 1 s: the relay's answer header
    # reports the wait as queue time, so the requester measures 2 s, not 1
    log: list[tuple] = []
    engine, world, ids, _ = _world({"src": (100.0, math.inf), "a": (1.0, math.inf), "b": (1.0, math.inf)},
                                   pace=True, log=log)
    _fetch(world, ids, "a", "src", 0, 100)
    _fetch(world, ids, "b", "src", 1, 100)
    engine.run()
    assert log == [(1.0, "a", "fetched", 0, 1.0), (2.0, "b", "fetched", 1, 2.0)]


def _paced_three() -> tuple[Engine, RelayWorld, dict[str, str], list[tuple]]:
    """`src` (100 B/s up, paced, 2 slots) at 0.5 s: a's 100-byte chunk moving (done at 1 s), b's
    granted and waiting for the budget until 1 s, c's queued for a slot."""
    log: list[tuple] = []
    engine, world, ids, _ = _world({"src": (100.0, math.inf), "a": (1.0, math.inf), "b": (1.0, math.inf),
                                    "c": (1.0, math.inf)}, pace=True, slots=2, log=log)
    for index, sink in enumerate("abc"):
        _fetch(world, ids, sink, "src", index, 100)
    engine.run(until=0.5)
    src = world.ports[ids["src"]]
    assert len(src.up) == 1 and [r.sink for r in src.paced] == [ids["b"]]
    assert src.serving.status()["queued"] == 1
    return engine, world, ids, log


def test_a_crashed_source_fails_its_moving_paced_and_queued_requests_at_once() -> None:
    # the relay's connections reset: every requester hears "unreachable" at once, nothing arrives
    engine, world, ids, log = _paced_three()
    world.crash(ids["src"])
    engine.run()
    assert sorted(log) == [(0.5, sink, "failed", i, FetchFailure.UNREACHABLE) for i, sink in enumerate("abc")]
    assert world.transfer_stats["flows"] == 1
    assert not any(world.ports[ids[s]].paced_to for s in "abc")


def test_a_stopped_source_answers_nothing_and_sends_nothing() -> None:
    # a stopped process tells nobody: only the requesters' stall detection notices
    engine, world, ids, log = _paced_three()
    world.hang(ids["src"])
    engine.run()
    assert log == [] and world.transfer_stats["flows"] == 1
    assert not world.ports[ids["src"]].paced and not any(world.ports[ids[s]].paced_to for s in "abc")


def test_a_sink_that_gives_up_on_a_paced_source_frees_its_slot_for_the_next_requester() -> None:
    # b's DropSource cancels its paced answer; c takes the slot at once, and starts when the
    # budget allows: b's reserved bytes are given back (as in the relay role), so at 1 s, 0.5 s
    # after its grant, and moves for 1 s (3 s without the refund)
    engine, world, ids, log = _paced_three()
    world.apply(ids["b"], [DropSource(ids["src"])])
    src = world.ports[ids["src"]]
    assert [r.sink for r in src.paced] == [ids["c"]] and src.serving.status()["queued"] == 0
    engine.run()
    assert log == [(1.0, "a", "fetched", 0, 1.0), (2.0, "c", "fetched", 2, 2.0)]
    assert world.transfer_stats["flows"] == 2


def test_a_sink_that_crashes_or_stops_frees_its_paced_slot_at_once() -> None:
    # the relay's reader loop ends with the broken connection and cancels the paced answer: the
    # slot goes to c at once, not when b's wait would have ended, and no byte is sent to b
    for fail in ("crash", "hang"):
        engine, world, ids, log = _paced_three()
        getattr(world, fail)(ids["b"])
        src = world.ports[ids["src"]]
        assert [r.sink for r in src.paced] == [ids["c"]] and src.serving.status()["queued"] == 0
        assert not world.ports[ids["b"]].paced_to
        engine.run()
        assert log == [(1.0, "a", "fetched", 0, 1.0), (2.0, "c", "fetched", 2, 2.0)]
        assert world.transfer_stats["flows"] == 2


def test_a_partition_drops_a_paced_request_across_the_cut_even_if_it_heals_before_its_start() -> None:
    # b is cut off at 0.5 s and the network heals at 0.9 s, before b's paced start at 1 s: the cut
    # request is gone (b is told nothing: its stall detection asks again), c takes the slot
    engine, world, ids, log = _paced_three()
    world.partition([[ids["src"], ids["a"], ids["c"]], [ids["b"]]])
    src = world.ports[ids["src"]]
    assert [r.sink for r in src.paced] == [ids["c"]] and src.serving.status()["queued"] == 0
    engine.run(until=0.9)
    world.heal()
    engine.run()
    assert log == [(1.0, "a", "fetched", 0, 1.0), (2.0, "c", "fetched", 2, 2.0)]
    assert world.transfer_stats["flows"] == 2
