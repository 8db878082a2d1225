"""The data plane shares uploads and downloads max-min fairly on both sides, as TCP flows do.

A sink's download is shared by its flows, but what one flow cannot use (its source is slow, or
its connection is window-limited) goes to the sink's other flows, and a source's upload that one
sink cannot take goes to the source's other flows. With `pace_uploads` a source paces what it
serves chunk by chunk, as the relay role does. Each case is a few peers with a known answer.
"""

from __future__ import annotations

import math

from p2pnet.identity import Identity
from relay.effects import Fetch
from relay.serving import ServingConfig
from simulations.dataplane import RelayWorld
from simulations.engine import Engine
from simulations.world import NetworkModel


class _Core:
    kinds, topics = (), ()

    def __init__(self, name: str, done: dict[str, float]) -> None:
        self.name, self.done = name, done

    def start(self, now):  # type: ignore[no-untyped-def]
        return []

    def has(self, version: int, index: int) -> bool:
        return True  # every source holds every chunk: no long polls

    def fetched(self, now, peer, version, index, elapsed_s):  # type: ignore[no-untyped-def]
        self.done[f"{peer}/{index}"] = now
        return []

    def fetch_failed(self, now, peer, version, index, reason):  # type: ignore[no-untyped-def]
        raise AssertionError(f"{self.name}: fetch of {index} from {peer} failed: {reason}")


def _world(peers: dict[str, tuple[float, float]],
           pace: bool = False) -> tuple[Engine, RelayWorld, dict[str, str], dict[str, float]]:
    """Peers by name with (upload, download) in bytes/s; no latency, no windows."""
    engine = Engine(1)
    world = RelayWorld(engine, NetworkModel(local_latency_s=0.0), serving=ServingConfig(slots=8, per_peer=8),
                       pace_uploads=pace)
    done: dict[str, float] = {}
    ids = {}
    for name, (upload, download) in peers.items():
        ident = Identity.from_seed_text(f"fair/{name}")
        ids[name] = ident.peer_id
        world.add_relay_peer(ident, [_Core(name, done)], upload_bps=upload, download_bps=download)
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
