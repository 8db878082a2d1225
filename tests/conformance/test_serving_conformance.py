"""The serving core in both of its worlds: the relay role's trio shell (`relay.uploads.Uploads`,
MockClock) and the simulator's data plane (`simulations.dataplane.RelayWorld`, virtual time).

One script, run in each world: a source with 2 upload slots (1 per requester) that holds some
chunks; requests arrive, urgent and not, for chunks held, arriving later, and never arriving;
each answer takes one second to send. Both worlds must serve the same requests in the same
order at the same times, tell each requester the same time spent in the source's queue (what
the real answer's header carries, and what the requester's delivery measure adds to the time
the bytes took), and refuse the same one at the wait limit, because both run the same
`relay.serving.ServingCore`: a serving decision that lived in only one world would show here.
Two more scripts: the transfer core asking for more slots, and slow receivers whose chunks
stop holding their slot (`ServingConfig.linger_factor`), which each world must notice at the
time the core names (`next_deadline`), not only when a slot is freed.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.testing

from p2pnet.identity import Identity
from relay.effects import Fetch, FetchFailure, ServeAtOnce
from relay.serving import ServingConfig
from relay.uploads import Uploads
from simulations.dataplane import RelayWorld
from simulations.engine import Engine
from simulations.world import NetworkModel

CONFIG = ServingConfig(slots=2, per_peer=1, wait_limit_s=5.0)
SEND_S = 1.0
# (requester, chunk index, urgent, asked at); chunk 9 arrives at the source at ARRIVES_AT, 8 never
SCRIPT = [("a", 0, False, 0.0), ("b", 1, False, 0.5), ("c", 2, False, 0.1), ("d", 3, True, 0.6),
          ("e", 9, False, 0.3), ("f", 8, False, 0.4)]
HELD = {0, 1, 2, 3}
ARRIVES_AT = 1.5
# served: (requester, when its answer was complete, seconds it queued for a slot once the chunk
# was held); refused: (requester, when). a and c take the slots; when a's ends at 1.0, urgent d
# (asked at 0.6) goes before b, who asked first (0.5); e waits for its chunk (held from 1.5: the
# long poll is not queueing), then for a slot until 2.0; f is refused at its wait limit
EXPECTED = {"served": [("a", 1.0, 0.0), ("c", 1.1, 0.0), ("d", 2.0, 0.4), ("b", 2.1, 0.6), ("e", 3.0, 0.5)],
            "refused": [("f", 5.4)]}


async def run_trio(script: list[tuple], event_at: float, event, config: ServingConfig = CONFIG,
                   send_s: dict[str, float] | None = None, held_at_start: set[int] = HELD) -> dict[str, list[tuple]]:
    """`script` answered by the relay role's shell; at `event_at`, `event(uploads, held)`.
    `send_s`: seconds an answer takes to send, by requester (else SEND_S)."""
    uploads = Uploads(config)
    send_s = send_s or {}
    held = set(held_at_start)
    out: dict[str, list[tuple]] = {"served": [], "refused": []}

    async def answer(name: str, index: int, urgent: bool, at: float) -> None:
        await trio.sleep_until(at)
        async with uploads.turn(name, 1, index, urgent, index in held) as queued_s:
            if queued_s is not None:
                await trio.sleep(send_s.get(name, SEND_S))
                out["served"].append((name, trio.current_time(), queued_s))
            else:
                out["refused"].append((name, trio.current_time()))

    async def scripted() -> None:
        await trio.sleep_until(event_at)
        event(uploads, held)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(uploads.run)
        for step in script:
            nursery.start_soon(answer, *step)
        nursery.start_soon(scripted)
        await trio.sleep(40)
        nursery.cancel_scope.cancel()
    return out


class _Source:
    kinds, topics = (), ()

    def __init__(self, held: set[int] = HELD) -> None:
        self.held = set(held)

    def start(self, now):
        return []

    def has(self, version: int, index: int) -> bool:
        return index in self.held

    def asked_for(self, now, version, index):  # a request for a chunk not held: nothing else to fetch here
        return []

    def asking(self, version, index):  # whom we asked for the chunk ourselves (`ServingCore.ask`): nobody here
        return None


class _Sink(_Source):
    def __init__(self, name: str, out: dict, send_s: float = SEND_S) -> None:
        self.name, self.out, self.held, self.send_s = name, out, set(), send_s

    def fetched(self, now, peer, version, index, elapsed_s):
        self.out["served"].append((self.name, now, elapsed_s - self.send_s))  # the bytes took send_s
        return []

    def fetch_failed(self, now, peer, version, index, reason):
        assert reason is FetchFailure.UNAVAILABLE
        self.out["refused"].append((self.name, now))
        return []


def run_sim(script: list[tuple], event_at: float, event, config: ServingConfig = CONFIG,
            send_s: dict[str, float] | None = None, held_at_start: set[int] = HELD) -> dict[str, list[tuple]]:
    """`script` answered by the simulator's data plane; at `event_at`, `event(world, source_id, core)`.
    `send_s`: seconds an answer takes to send, by requester (else SEND_S: the requester's
    download is the chunk over that)."""
    engine = Engine(1)
    world = RelayWorld(engine, NetworkModel(local_latency_s=0.0), serving=config)
    send_s = send_s or {}
    out: dict[str, list[tuple]] = {"served": [], "refused": []}
    source, chunk_bytes = Identity.from_seed_text("source"), 1000
    core = _Source(held_at_start)
    world.add_relay_peer(source, [core], upload_bps=math.inf)
    for name, index, urgent, at in script:
        sink = Identity.from_seed_text(name)
        seconds = send_s.get(name, SEND_S)
        world.add_relay_peer(sink, [_Sink(name, out, seconds)], upload_bps=1.0, download_bps=chunk_bytes / seconds)
        fetch = Fetch(source.peer_id, 1, index, b"\0" * 32, chunk_bytes, urgent)
        engine.at(at, lambda sink_id=sink.peer_id, f=fetch: world.apply(sink_id, [f]))
    engine.at(event_at, lambda: event(world, source.peer_id, core))
    engine.run(until=40.0)
    return out


def _arrive_trio(uploads: Uploads, held: set[int]) -> None:
    held.add(9)
    uploads.arrived(1, 9)


def _arrive_sim(world: RelayWorld, source_id: str, core: _Source) -> None:
    core.held.add(9)
    world._release_waiting(source_id, world.ports[source_id], (1, 9))  # as a stored chunk does


def _rounded(out: dict[str, list[tuple]]) -> dict[str, list[tuple]]:
    return {kind: sorted((name, *(round(t, 6) for t in times)) for name, *times in events)
            for kind, events in out.items()}


async def _served_in(world: str, script: list, event_at: float, in_trio: Any, in_sim: Any,
                     **kwargs: Any) -> dict[str, list[tuple]]:
    """`script` served by one world, with its scripted event at `event_at` (`in_trio` or `in_sim`)."""
    if world == "trio":
        return await run_trio(script, event_at, in_trio, **kwargs)
    return run_sim(script, event_at, in_sim, **kwargs)


@pytest.mark.parametrize("world", ["trio", "sim"])
async def test_both_worlds_serve_the_same_requests_in_the_same_order_at_the_same_times(world, autojump_clock):
    out = await _served_in(world, SCRIPT, ARRIVES_AT, _arrive_trio, _arrive_sim)
    assert _rounded(out) == _rounded(EXPECTED)


# The transfer core asks for more slots (`ServeAtOnce`: all its children at once) at WIDEN_AT:
# four requesters of held chunks, 2 slots; the two waiting start then, having queued 0.3 and 0.2 s.
WIDE_SCRIPT = [(f"w{i}", i, False, i / 10) for i in range(4)]
WIDEN_AT = 0.5
WIDE_EXPECTED = {"served": [("w0", 1.0, 0.0), ("w1", 1.1, 0.0), ("w2", 1.5, 0.3), ("w3", 1.5, 0.2)], "refused": []}


def _widen_trio(uploads: Uploads, held: set[int]) -> None:
    uploads.set_slots(4)


def _widen_sim(world: RelayWorld, source_id: str, core: _Source) -> None:
    world.apply(source_id, [ServeAtOnce(4)])  # as the source's core asks


@pytest.mark.parametrize("world", ["trio", "sim"])
async def test_both_worlds_serve_every_child_at_once_when_the_core_asks_for_more_slots(world, autojump_clock):
    out = await _served_in(world, WIDE_SCRIPT, WIDEN_AT, _widen_trio, _widen_sim)
    assert _rounded(out) == _rounded(WIDE_EXPECTED)


# Lingering serves: 1 slot, a serve lingers after 2 x the typical serving time, 1 at most. Eight
# requests of 1 s each (q0-q7, one after the other from 0) give a typical time of 1 s. Then the
# slow requester s (10 s to send) takes the slot at 8.0; x, asking at 8.5, gets it at 10.0, when
# s lingers (queued 1.5 s), until 11.0; slow t (asked at 9.0) follows at 11.0 and is due to linger
# at 13.0, but s still lingers (the cap): y (asked at 11.5) waits until s ends at 18.0, when t
# lingers at once and y is served (queued 6.5 s).
LINGER_CONFIG = ServingConfig(slots=1, per_peer=1, wait_limit_s=5.0, linger_factor=2.0, linger_cap=1)
LINGER_SCRIPT = [(f"q{i}", i, False, float(i)) for i in range(8)] + [
    ("s", 10, False, 7.5), ("x", 11, False, 8.5), ("t", 12, False, 9.0), ("y", 13, False, 11.5)]
LINGER_SEND_S = {"s": 10.0, "t": 10.0}
LINGER_EXPECTED = {"served": [*((f"q{i}", i + 1.0, 0.0) for i in range(8)), ("s", 18.0, 0.5), ("x", 11.0, 1.5),
                              ("t", 21.0, 2.0), ("y", 19.0, 6.5)], "refused": []}


def _nothing_trio(uploads: Uploads, held: set[int]) -> None:
    pass


def _nothing_sim(world: RelayWorld, source_id: str, core: _Source) -> None:
    pass


@pytest.mark.parametrize("world", ["trio", "sim"])
async def test_both_worlds_hand_a_slow_receivers_slot_on_when_its_chunk_lingers(world, autojump_clock):
    out = await _served_in(world, LINGER_SCRIPT, 0.0, _nothing_trio, _nothing_sim, config=LINGER_CONFIG,
                           send_s=LINGER_SEND_S, held_at_start={index for _, index, _, _ in LINGER_SCRIPT})
    assert _rounded(out) == _rounded(LINGER_EXPECTED)
