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
event costs O(slots), never O(N). At the last byte the sink's core is told `fetched` (or
`fetch_failed("corrupt")` when the source is a byzantine peer, see `corrupt_peers`).

Failures: `crash(p)` is a killed process: flows from p fail at once as `unreachable` (a reset
connection), requests queued at p fail, later requests to p fail after one latency.
`hang(p)` is a stopped process: p answers nothing and its flows freeze, so only the requester's
stall detection can notice.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from p2pnet.identity import Identity
from relay.transfer import DropSource, Fetch, FetchManifest, Penalise
from simulations.engine import Engine, Handle
from simulations.world import NetworkModel, SimPeer, SimWorld



class _Request:
    __slots__ = ("sink", "core_index", "fetch", "issued")

    def __init__(self, sink: str, core_index: int, fetch: Fetch, issued: float) -> None:
        self.sink = sink
        self.core_index = core_index
        self.fetch = fetch
        self.issued = issued


class _Flow:
    __slots__ = ("source", "request", "remaining", "rate", "since", "handle")

    def __init__(self, source: str, request: _Request, now: float) -> None:
        self.source = source
        self.request = request
        self.remaining = float(request.fetch.size)
        self.rate = 0.0
        self.since = now
        self.handle: Handle | None = None


@dataclass
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


class RelayWorld(SimWorld):
    def __init__(self, engine: Engine, model: NetworkModel | None = None, *, sign: bool = False,
                 max_concurrent_uploads: int = 4, corrupt_peers: frozenset[str] = frozenset()) -> None:
        super().__init__(engine, model, sign=sign)
        self.max_concurrent_uploads = max_concurrent_uploads
        self.corrupt_peers = set(corrupt_peers)
        self.ports: dict[str, _Port] = {}
        self.penalties: list[tuple[float, str, str, float]] = []  # (t, by, peer, amount)
        self.transfer_stats = {"fetches": 0, "flows": 0, "corrupt_served": 0, "failed": 0, "bytes": 0}

    def add_relay_peer(self, identity: Identity, cores: list[Any], *, upload_bps: float,
                       download_bps: float = math.inf, region: str = "eu", core_index: int = 0) -> SimPeer:
        """A peer whose `cores[core_index]` is its `TransferCore`. Ports exist before cores start."""
        self.ports[identity.peer_id] = _Port(float(upload_bps), float(download_bps), self.max_concurrent_uploads,
                                             core_index)
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

    # -- effects --------------------------------------------------------------------------

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
        request = _Request(sink.peer_id, index, fetch, self.engine.now)
        source = self.peers.get(fetch.peer)
        delay = self.model.latency(sink.region, source.region) if source else self.model.local_latency_s
        self.engine.after(delay, self._request_arrives, request)

    def _request_arrives(self, request: _Request) -> None:
        source_id = request.fetch.peer
        port = self.ports.get(source_id)
        source = self.peers.get(source_id)
        if port is not None and port.hung:
            return  # a stopped process reads nothing
        if source is None or port is None or not source.alive:
            self._fail(request, source_id, "unreachable", delay=self._latency(request.sink, source_id))
            return
        core = source.cores[port.core_index]
        fetch = request.fetch
        if core.has(fetch.version, fetch.index):
            (port.urgent if fetch.urgent else port.ready).append(request)
            self._start_flows(source_id, port)
        else:
            port.waiting.setdefault((fetch.version, fetch.index), []).append(request)

    def _start_flows(self, source_id: str, port: _Port) -> None:
        now = self.engine.now
        started = []
        while (port.urgent or port.ready) and len(port.up) < port.slots:
            request = port.urgent.popleft() if port.urgent else port.ready.popleft()
            sink_port = self.ports.get(request.sink)
            sink = self.peers.get(request.sink)
            if sink_port is None or sink is None or not sink.alive:
                continue
            flow = _Flow(source_id, request, now)
            port.up.append(flow)
            sink_port.down.append(flow)
            started.append(sink_port)
            self.transfer_stats["flows"] += 1
        if port.up:
            self._rerate(port.up)
        if started:
            for sink_port in started:
                if sink_port.download_bps != math.inf:
                    self._rerate(sink_port.down)

    def _rerate(self, flows: list[_Flow]) -> None:
        now = self.engine.now
        for flow in flows:
            source = self.ports[flow.source]
            sink = self.ports[flow.request.sink]
            rate = source.upload_bps / len(source.up)
            if sink.download_bps != math.inf:
                rate = min(rate, sink.download_bps / len(sink.down))
            if flow.handle is not None:
                if rate == flow.rate:
                    continue
                flow.remaining -= (now - flow.since) * flow.rate
                flow.handle.cancel()
            flow.since = now
            flow.rate = rate
            flow.handle = self.engine.at(now + max(flow.remaining, 0.0) / rate, self._finish, flow)

    def _end_flow(self, flow: _Flow, rerate_source: bool = True) -> None:
        if flow.handle is not None:
            flow.handle.cancel()
            flow.handle = None
        source = self.ports[flow.source]
        sink = self.ports[flow.request.sink]
        source.up.remove(flow)
        sink.down.remove(flow)
        if source.up and rerate_source:
            self._rerate(source.up)
        if sink.down and sink.download_bps != math.inf:
            self._rerate(sink.down)

    def _finish(self, flow: _Flow) -> None:
        flow.handle = None
        self._end_flow(flow, rerate_source=False)  # _start_flows below re-rates the source
        request, fetch = flow.request, flow.request.fetch
        source_port = self.ports[flow.source]
        sink_port = self.ports[request.sink]
        source_port.bytes_up += fetch.size
        sink_port.bytes_down += fetch.size
        self.transfer_stats["bytes"] += fetch.size
        sink = self.peers[request.sink]
        core = sink.cores[request.core_index]
        now = self.engine.now
        if flow.source in self.corrupt_peers:
            self.transfer_stats["corrupt_served"] += 1
            self._apply(sink, request.core_index, core.fetch_failed(now, flow.source, fetch.version, fetch.index,
                                                                    "corrupt"))
        else:
            had = core.has(fetch.version, fetch.index)
            self._apply(sink, request.core_index, core.fetched(now, flow.source, fetch.version, fetch.index,
                                                               now - request.issued))
            if not had and core.has(fetch.version, fetch.index):
                self._release_waiting(request.sink, sink_port, (fetch.version, fetch.index))
        self._start_flows(flow.source, source_port)

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
        if not sink.alive or source is None or port is None or not source.alive or port.hung:
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
