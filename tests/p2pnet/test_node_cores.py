"""`Node.run_core`: a core runs in its caller's nursery and lives exactly as long as that task.
Cancelling the nursery stops the core and its kinds are no longer routed to it (a frame of its
kind that arrives afterwards reaches the cores still running, or no one, and the node takes it in
its stride); the node and its other cores run on, and a core started later is routed to again.
A gossip topic is left with the last core that wanted it (its neighbours send it nothing more),
and subscribed again when a core wants it again. Two real peers over loopback TCP; every wait is
on a frame arriving, or on GossipSub's mesh taking a peer in, under a deadline."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from libp2p.peer.id import ID

from p2pnet.core import Effect, ReactiveCore
from p2pnet.identity import Identity
from p2pnet.node import Node, PeerConfig, run_node
from p2pnet.wire import Envelope, message

TOPIC = "p2pnet/test/probes"
A = Identity.from_seed_text("cores-a")
B = Identity.from_seed_text("cores-b")


@message("test/probe", max_bytes=256)
@dataclass(frozen=True)
class Probe:
    n: int


class Catcher(ReactiveCore):
    """Hands the number of every probe it is routed to the test."""

    topics = (TOPIC,)
    kinds = (Probe.KIND,)  # type: ignore[attr-defined]

    def __init__(self, out: trio.MemorySendChannel[int]) -> None:
        self.out = out

    def on_message(self, now: float, envelope: Envelope[Any]) -> list[Effect]:
        self.out.send_nowait(envelope.body.n)
        return []


async def _send(b: Node, a: Node, n: int, *heard_by: trio.MemoryReceiveChannel[int]) -> None:
    """B sends probe `n` to A directly; returns once each of `heard_by` got it."""
    with trio.fail_after(30):
        await b.send(a.peer_id, Probe(n))
        for channel in heard_by:
            assert await channel.receive() == n


async def test_a_core_stops_with_the_nursery_it_runs_in_and_is_routed_to_no_more(tmp_path: Path) -> None:
    witness_out, witness_heard = trio.open_memory_channel[int](8)
    probe_out, probe_heard = trio.open_memory_channel[int](8)
    late_out, late_heard = trio.open_memory_channel[int](8)
    async with trio.open_nursery() as peers:
        a: Node = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "a"), identity=A))
        b: Node = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "b"), identity=B))
        await b.host.connect(a.host.addrs()[0])

        async with trio.open_nursery() as witness_cores:
            witness = await witness_cores.start(a.run_core, Catcher(witness_out), "witness")
            async with trio.open_nursery() as probe_cores:  # the test's own, as a role's would be
                probe = await probe_cores.start(a.run_core, Catcher(probe_out), "probe")
                await _send(b, a, 1, probe_heard, witness_heard)
                probe_cores.cancel_scope.cancel()
            assert probe.stopped and not witness.stopped
            await _send(b, a, 2, witness_heard)  # the node runs on; the other core still hears the kind
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.WouldBlock):
                probe_heard.receive_nowait()  # the stopped core heard nothing more
            assert TOPIC in a.host._pubsub.topic_ids  # the two cores' topic, subscribed once by the node
            witness_cores.cancel_scope.cancel()
        assert witness.stopped

        # No core handles the kind now: its frames are not forwarded by gossip, and one arriving
        # directly is counted and dropped (nothing raises, no stopped runner is fed).
        frame = b.codec.encode(Probe(3), time.time())
        assert not a._gossip_ok(frame, b.peer_id)
        received = a.stats["received"]
        await a._on_direct(frame, b.peer_id)
        await a._on_gossip(frame, b.peer_id)
        assert a.stats["received"] == received + 2 and a.stats["rejected"] == 0

        async with trio.open_nursery() as later:  # a core started afterwards is routed to again
            await later.start(a.run_core, Catcher(late_out), "late")
            assert a._gossip_ok(frame, b.peer_id)
            await _send(b, a, 4, late_heard)
            later.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        heard = (witness_heard, probe_heard, late_heard)
        assert all(c.statistics().current_buffer_used == 0 for c in heard)  # nothing else reached any of them
        assert TOPIC not in a.host._pubsub.topic_ids  # left with the last core that wanted it
        peers.cancel_scope.cancel()


MARKERS = "p2pnet/test/markers"


@message("test/marker", max_bytes=256)
@dataclass(frozen=True)
class Marker:
    n: int


class MarkerCatcher(Catcher):
    topics = (MARKERS,)
    kinds = (Marker.KIND,)  # type: ignore[attr-defined]


async def meshed(node: Node, peer: Node, *topics: str) -> None:
    """Until `peer` is in `node`'s GossipSub mesh of each of `topics`, whom `node` publishes to
    then (a publish before reaches no one, on a topic `node` is subscribed to). GossipSub sets an
    event when it takes a peer into a mesh (`wait_for_mesh`); the caller's deadline bounds the
    wait, not py-libp2p's own 5 s (a topic left and wanted again waits out its 10 s back-off)."""
    router, peer_id = node.host._pubsub.router, ID.from_base58(peer.peer_id)
    for topic in topics:
        await router.wait_for_mesh(peer_id, topic, timeout=math.inf)


async def test_a_peer_leaves_a_topic_once_no_running_core_wants_it(tmp_path: Path) -> None:
    """A topic's subscription outlived the cores that wanted it: the peer stayed in the topic's
    GossipSub mesh, and its neighbour sent it every message of the topic (20 of 20 here), each
    decoded and signature-checked, then forwarded to no one (no core handles its kind). The peer
    now leaves the topic with its last core; a core wanting it again subscribes again. Markers on
    a topic both peers keep order the waits: a peer's RPCs to another travel, and are handled, in
    the order sent."""
    a_out, a_heard = trio.open_memory_channel[int](64)
    b_out, b_heard = trio.open_memory_channel[int](64)
    a_marks_out, a_marks = trio.open_memory_channel[int](8)
    b_marks_out, b_marks = trio.open_memory_channel[int](8)
    async with trio.open_nursery() as peers:
        a: Node = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "a"), identity=A))
        b: Node = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "b"), identity=B))
        probes_taken = 0  # frames of the probes' topic B's GossipSub took in (its validator checks each)
        gossip_ok = b._gossip_ok

        def counting_gossip_ok(frame: bytes, forwarder: str) -> bool:
            nonlocal probes_taken
            probes_taken += b.codec.precheck(frame)[0] == Probe.KIND  # type: ignore[attr-defined]
            return gossip_ok(frame, forwarder)

        b._gossip_ok = counting_gossip_ok  # type: ignore[method-assign]
        await b.host.connect(a.host.addrs()[0])
        await peers.start(a.run_core, Catcher(a_out), "a-probes")
        await peers.start(a.run_core, MarkerCatcher(a_marks_out), "a-markers")
        await peers.start(b.run_core, MarkerCatcher(b_marks_out), "b-markers")
        async with trio.open_nursery() as b_probes:
            await b_probes.start(b.run_core, Catcher(b_out), "b-probes")
            with trio.fail_after(60):
                await meshed(a, b, TOPIC, MARKERS)
                await meshed(b, a, MARKERS)
                await a.publish(TOPIC, Probe(0))
                assert await b_heard.receive() == 0
            b_probes.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()  # B's subscriber has left the topic, or never will
        assert TOPIC not in b.host._pubsub.topic_ids
        with trio.fail_after(60):
            await b.publish(MARKERS, Marker(1))  # after B's leave, on the same stream to A
            assert await a_marks.receive() == 1
            taken = probes_taken
            for n in range(1, 21):
                await a.publish(TOPIC, Probe(n))
            await a.publish(MARKERS, Marker(2))  # after the probes, on the same stream to B
            assert await b_marks.receive() == 2
        assert probes_taken == taken, f"B took in {probes_taken - taken} of 20 probes after its last core stopped"

        async with trio.open_nursery() as b_again:  # wanted again: subscribed again
            await b_again.start(b.run_core, Catcher(b_out), "b-probes-again")
            with trio.fail_after(60):
                await meshed(a, b, TOPIC)
                await a.publish(TOPIC, Probe(21))
                while await b_heard.receive() != 21:  # earlier probes may come first: GossipSub offers
                    pass  # its recent messages (IHAVE) to a peer that joins a topic
            b_again.cancel_scope.cancel()
        peers.cancel_scope.cancel()
