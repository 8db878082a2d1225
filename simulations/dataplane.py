"""The simulated data plane: a bandwidth model that carries out the relay's bulk-byte effects.

`RelayWorld` is a `SimWorld` whose peers also have upload and download capacities (bytes/s).
It carries out the transfer core's relay effects (`relay.transfer.Fetch`, `FetchManifest`,
`DropSource`, `Penalise`) in virtual time and hands everything else to `SimWorld`.

Theory of operation. A `Fetch` travels to the source in one link latency. The source serves at
most `max_concurrent_uploads` chunks at once, first come first served: a request for a chunk it
holds joins its ready queue; one for a chunk it does not hold yet waits until its own core
stores that chunk (the long poll of the real shell), then joins the queue. A running flow moves
bytes at min(source upload / its active uploads, sink download / its active downloads); when a
flow starts or ends, only the flows of its two endpoints are re-rated and rescheduled, so an
event costs O(slots), never O(N); when every download is unlimited and a finished flow is
replaced at once, the others' shares are unchanged and only the new flow is scheduled. Flows
and requests hold their endpoints' ports and peers, so the per-chunk path does no lookups by id
(10,000 peers x 150+ chunks is millions of chunks: see `simulations.scale`). At the last byte
the sink's core is told `fetched`, or `fetch_failed("corrupt")` when the source is one of
`corrupt_peers` (byzantine) and the chunk is corrupt: each chunk such a peer serves is corrupt
with probability `corrupt_rate` (1.0: always), drawn from a generator seeded by `corrupt_seed`.

Failures: `crash(p)` is a killed process: flows from p fail at once as `unreachable` (a reset
connection), requests queued at p fail, later requests to p fail after one latency.
`hang(p)` is a stopped process: p answers nothing and its flows freeze, so only the requester's
stall detection can notice. `partition(groups)` cuts the data plane too: flows and queued
requests across the cut are dropped silently, requests and manifest fetches across it are never
answered (again, only stall detection notices), until `heal()`.

Drivers hand a core's effects to `apply(peer_id, effects)`.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from p2pnet.identity import Identity
from relay.effects import DropSource, Fetch, FetchManifest, Penalise
from simulations.engine import Engine, Handle
from simulations.world import NetworkModel, SimPeer, SimWorld



class _Request:
    """A `Fetch` on its way to, or queued at, its source. `peer` and `port` are the sink's."""

    __slots__ = ("sink", "core_index", "fetch", "issued", "peer", "port")

    def __init__(self, sink: SimPeer, core_index: int, fetch: Fetch, issued: float, port: _Port | None) -> None:
        self.sink = sink.peer_id
        self.core_index = core_index
        self.fetch = fetch
        self.issued = issued
        self.peer = sink
        self.port = port


class _Flow:
    """A running chunk transfer; `src` and `dst` are the two endpoints' ports (no lookups per event)."""

    __slots__ = ("source", "request", "remaining", "rate", "since", "handle", "src", "dst")

    def __init__(self, source: str, request: _Request, now: float, src: _Port, dst: _Port) -> None:
        self.source = source
        self.request = request
        self.remaining = float(request.fetch.size)
        self.rate = 0.0
        self.since = now
        self.handle: Handle | None = None
        self.src = src
        self.dst = dst


@dataclass(slots=True)
class _Port:
    """One peer's data plane: capacities, upload slots, queues and active flows."""

    upload_bps: float
    download_bps: float
    slots: int
    core_index: int
    ready: deque[_Request] = field(default_factory=deque)
    urgent: deque[_Request] = field(default_factory=deque)  # served before `ready`
    waiting: dict[tuple[int, int], list[_Request]] = field(default_factory=dict)
    up: list[_Flow] = field(default_factory=list)
    down: list[_Flow] = field(default_factory=list)
    hung: bool = False
    bytes_up: int = 0
    bytes_down: int = 0
    rated_for: int = 0  # len(up) when `up` was last re-rated as a whole


class RelayWorld(SimWorld):
    def __init__(self, engine: Engine, model: NetworkModel | None = None, *, sign: bool = False,
                 max_concurrent_uploads: int = 4, corrupt_peers: frozenset[str] = frozenset(),
                 corrupt_rate: float = 1.0, corrupt_seed: str = "") -> None:
        super().__init__(engine, model, sign=sign)
        if not 0.0 <= corrupt_rate <= 1.0:
            raise ValueError("corrupt_rate must be within [0, 1]")
        self.max_concurrent_uploads = max_concurrent_uploads
        self.corrupt_peers = set(corrupt_peers)
        self.corrupt_rate = corrupt_rate
        self._corrupt_rng = random.Random(f"corrupt/{corrupt_seed}")
        self.genuine_from_corrupt_peers = 0  # chunks a corrupt peer served intact (corrupt_rate < 1)
        self.ports: dict[str, _Port] = {}
        self.penalties: list[tuple[float, str, str, float]] = []  # (t, by, peer, amount)
        self.transfer_stats = {"fetches": 0, "flows": 0, "corrupt_served": 0, "failed": 0, "bytes": 0}
        self._unlimited_downloads = True  # then a flow's rate depends on its source's uploads alone
        self._arrives, self._finishes = self._request_arrives, self._finish  # bound once: engine callbacks
        self._latency_model: NetworkModel | None = None
        self._latency_cache: dict[tuple[str, str], float] = {}

    def add_relay_peer(self, identity: Identity, cores: list[Any], *, upload_bps: float,
                       download_bps: float = math.inf, region: str = "eu", core_index: int = 0) -> SimPeer:
        """A peer whose `cores[core_index]` is its `TransferCore`. Ports exist before cores start."""
        self.ports[identity.peer_id] = _Port(float(upload_bps), float(download_bps), self.max_concurrent_uploads,
                                             core_index)
        if download_bps != math.inf:
            self._unlimited_downloads = False
        return self.add_peer(identity, cores, region=region)

    # -- failures -------------------------------------------------------------------------

    def crash(self, peer_id: str) -> None:
        super().crash(peer_id)
        port = self.ports.get(peer_id)
        if port is None:
            return
        for flow in list(port.up):
            self._end_flow(flow)
            self._fail(flow.request, peer_id, "unreachable", delay=0.0)
        for flow in list(port.down):
            self._end_flow(flow)
        for request in list(port.urgent) + list(port.ready) + [r for rs in port.waiting.values() for r in rs]:
            self._fail(request, peer_id, "unreachable", delay=0.0)
        port.urgent.clear()
        port.ready.clear()
        port.waiting.clear()

    def hang(self, peer_id: str) -> None:
        """The peer stops: no timers, no answers, its flows freeze (nobody is told)."""
        SimWorld.crash(self, peer_id)
        port = self.ports[peer_id]
        port.hung = True
        for flow in list(port.up) + list(port.down):
            self._end_flow(flow)
        port.urgent.clear()
        port.ready.clear()
        port.waiting.clear()

    def partition(self, groups: list[list[str]]) -> None:
        """Split the network; flows and queued requests across the cut go silent (see the top)."""
        super().partition(groups)
        reachable = self._reachable
        for peer_id in sorted(self.ports):
            port = self.ports[peer_id]
            for flow in [f for f in port.up if not reachable(peer_id, f.request.sink)]:
                self._end_flow(flow)
            port.ready = deque(r for r in port.ready if reachable(peer_id, r.sink))
            port.urgent = deque(r for r in port.urgent if reachable(peer_id, r.sink))
            for key in list(port.waiting):
                kept = [r for r in port.waiting[key] if reachable(peer_id, r.sink)]
                if kept:
                    port.waiting[key] = kept
                else:
                    del port.waiting[key]

    # -- effects --------------------------------------------------------------------------

    def apply(self, peer_id: str, effects: list[Any], core_index: int = 0) -> None:
        """Carry out `effects` returned by `peer_id`'s core number `core_index`."""
        self._apply(self.peers[peer_id], core_index, effects)

    def _apply(self, peer: SimPeer, index: int, effects: list[Any]) -> None:
        plain = []
        for effect in effects:
            kind = type(effect)
            if kind is Fetch:
                self._fetch(peer, index, effect)
            elif kind is FetchManifest:
                self._fetch_manifest(peer, index, effect)
            elif kind is DropSource:
                self._drop_source(peer.peer_id, effect.peer)
            elif kind is Penalise:
                self.penalties.append((self.engine.now, peer.peer_id, effect.peer, effect.amount))
            else:
                plain.append(effect)
        if plain:
            super()._apply(peer, index, plain)

    def _fetch(self, sink: SimPeer, index: int, fetch: Fetch) -> None:
        self.transfer_stats["fetches"] += 1
        request = _Request(sink, index, fetch, self.engine.now, self.ports.get(sink.peer_id))
        source = self.peers.get(fetch.peer)
        delay = self._region_latency(sink.region, source.region) if source else self.model.local_latency_s
        self.engine.at(self.engine.now + delay, self._arrives, request)

    def _region_latency(self, a: str, b: str) -> float:
        """`model.latency(a, b)`, memoised per region pair (the model is a pure function of them)."""
        if self._latency_model is not self.model:
            self._latency_model, self._latency_cache = self.model, {}
        key = (a, b)
        value = self._latency_cache.get(key)
        if value is None:
            value = self._latency_cache[key] = self.model.latency(a, b)
        return value

    def _request_arrives(self, request: _Request) -> None:
        source_id = request.fetch.peer
        port = self.ports.get(source_id)
        source = self.peers.get(source_id)
        if source is not None and source.group != request.peer.group:
            return  # across a partition: never answered
        if port is not None and port.hung:
            return  # a stopped process reads nothing
        if source is None or port is None or not source.alive:
            self._fail(request, source_id, "unreachable", delay=self._latency(request.sink, source_id))
            return
        fetch = request.fetch
        if source.cores[port.core_index].has(fetch.version, fetch.index):
            (port.urgent if fetch.urgent else port.ready).append(request)
            if len(port.up) < port.slots:
                self._start_flows(source_id, port)
        else:
            port.waiting.setdefault((fetch.version, fetch.index), []).append(request)

    def _start_flows(self, source_id: str, port: _Port) -> None:
        now = self.engine.now
        up = port.up
        started = []
        while (port.urgent or port.ready) and len(up) < port.slots:
            request = port.urgent.popleft() if port.urgent else port.ready.popleft()
            sink_port = request.port
            if sink_port is None or not request.peer.alive:
                continue
            flow = _Flow(source_id, request, now, port, sink_port)
            up.append(flow)
            sink_port.down.append(flow)
            started.append(flow)
            self.transfer_stats["flows"] += 1
        if not up:
            return
        if self._unlimited_downloads and len(up) == port.rated_for:
            self._rerate(started)  # a finished flow was replaced: the others keep their share
            return
        self._rerate(up)
        port.rated_for = len(up)
        for flow in started:
            if flow.dst.download_bps != math.inf:
                self._rerate(flow.dst.down)

    def _rerate(self, flows: list[_Flow]) -> None:
        """Give each flow min(source upload / its uploads, sink download / its downloads)."""
        now = self.engine.now
        at = self.engine.at
        finish = self._finishes
        for flow in flows:
            src, dst = flow.src, flow.dst
            rate = src.upload_bps / len(src.up)
            if dst.download_bps != math.inf:
                rate = min(rate, dst.download_bps / len(dst.down))
            handle = flow.handle
            if handle is not None:
                if rate == flow.rate:
                    continue
                flow.remaining -= (now - flow.since) * flow.rate
                handle.cancel()
            flow.since = now
            flow.rate = rate
            remaining = flow.remaining
            flow.handle = at(now + (remaining if remaining > 0.0 else 0.0) / rate, finish, flow)

    def _end_flow(self, flow: _Flow, rerate_source: bool = True) -> None:
        if flow.handle is not None:
            flow.handle.cancel()
            flow.handle = None
        source, sink = flow.src, flow.dst
        source.up.remove(flow)
        sink.down.remove(flow)
        if source.up and rerate_source:
            self._rerate(source.up)
            source.rated_for = len(source.up)
        if sink.down and sink.download_bps != math.inf:
            self._rerate(sink.down)

    def _finish(self, flow: _Flow) -> None:
        flow.handle = None
        source_port, sink_port = flow.src, flow.dst
        source_port.up.remove(flow)  # `_end_flow` without re-rating the source: _start_flows below does
        sink_port.down.remove(flow)
        if sink_port.down and sink_port.download_bps != math.inf:
            self._rerate(sink_port.down)
        request, fetch = flow.request, flow.request.fetch
        size = fetch.size
        source_port.bytes_up += size
        sink_port.bytes_down += size
        self.transfer_stats["bytes"] += size
        sink = request.peer
        core = sink.cores[request.core_index]
        now = self.engine.now
        if flow.source in self.corrupt_peers and self._corrupts():
            self.transfer_stats["corrupt_served"] += 1
            self._apply(sink, request.core_index, core.fetch_failed(now, flow.source, fetch.version, fetch.index,
                                                                    "corrupt"))
        else:
            self._apply(sink, request.core_index, core.fetched(now, flow.source, fetch.version, fetch.index,
                                                               now - request.issued))
            key = (fetch.version, fetch.index)
            if key in sink_port.waiting and core.has(fetch.version, fetch.index):
                self._release_waiting(request.sink, sink_port, key)  # long polls for it are answered
        self._start_flows(flow.source, source_port)

    def _corrupts(self) -> bool:
        """Whether a chunk a corrupt peer serves is corrupt (no draw at rate 1: replays stay exact)."""
        if self.corrupt_rate >= 1.0 or self._corrupt_rng.random() < self.corrupt_rate:
            return True
        self.genuine_from_corrupt_peers += 1
        return False

    def _release_waiting(self, peer_id: str, port: _Port, key: tuple[int, int]) -> None:
        waiters = port.waiting.pop(key, None)
        if waiters:
            for request in waiters:
                (port.urgent if request.fetch.urgent else port.ready).append(request)
            self._start_flows(peer_id, port)

    def _fail(self, request: _Request, source_id: str, reason: str, delay: float) -> None:
        self.transfer_stats["failed"] += 1
        self.engine.after(delay, self._report_failure, request, source_id, reason)

    def _report_failure(self, request: _Request, source_id: str, reason: str) -> None:
        sink = self.peers.get(request.sink)
        if sink is None or not sink.alive:
            return
        fetch = request.fetch
        core = sink.cores[request.core_index]
        self._apply(sink, request.core_index, core.fetch_failed(self.engine.now, source_id, fetch.version,
                                                                fetch.index, reason))

    def _drop_source(self, sink_id: str, source_id: str) -> None:
        """The sink gave up on the source: forget its queued requests and running flows."""
        port = self.ports.get(source_id)
        if port is None:
            return
        port.ready = deque(r for r in port.ready if r.sink != sink_id)
        port.urgent = deque(r for r in port.urgent if r.sink != sink_id)
        for key in list(port.waiting):
            kept = [r for r in port.waiting[key] if r.sink != sink_id]
            if kept:
                port.waiting[key] = kept
            else:
                del port.waiting[key]
        for flow in [f for f in port.up if f.request.sink == sink_id]:
            self._end_flow(flow)
        self._start_flows(source_id, port)

    def _fetch_manifest(self, sink: SimPeer, index: int, effect: FetchManifest) -> None:
        delay = 2 * self._latency(sink.peer_id, effect.peer)
        self.engine.after(delay, self._answer_manifest, sink, index, effect)

    def _answer_manifest(self, sink: SimPeer, index: int, effect: FetchManifest) -> None:
        source = self.peers.get(effect.peer)
        port = self.ports.get(effect.peer)
        if not sink.alive or source is None or port is None or not source.alive or port.hung or \
                not self._reachable(sink.peer_id, effect.peer):
            return
        signed = source.cores[port.core_index].signed(effect.version)
        if signed is not None:
            core = sink.cores[index]
            self._apply(sink, index, core.manifest_frame(self.engine.now, effect.peer, signed.frame))

    def _latency(self, a: str, b: str) -> float:
        pa, pb = self.peers.get(a), self.peers.get(b)
        if pa is None or pb is None:
            return self.model.local_latency_s
        return self.model.latency(pa.region, pb.region)
