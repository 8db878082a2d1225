"""The simulated data plane: a bandwidth model that carries out the relay's bulk-byte effects.

`RelayWorld` is a `SimWorld` whose peers also have upload and download capacities (bytes/s).
It carries out the transfer core's relay effects (`relay.transfer.Fetch`, `FetchManifest`,
`DropSource`, `Penalise`, `ServeAtOnce`) in virtual time and hands everything else to `SimWorld`.

Theory of operation. A `Fetch` travels to the source in one link latency. What the source does
with it is decided by its serving core, the real relay's (`relay.serving.ServingCore`): at most
`slots` chunks served at once, urgent first, round robin across requesters; a request for a
chunk it does not hold yet waits until its own transfer core stores that chunk (the long poll)
and is answered "unavailable" after the wait limit; a chunk served for too long (a slow
receiver) stops holding its slot. The core is woken at its `next_deadline` for the wait limits,
and for those releases while requests are queued (`_arm_expiry`).

Bandwidth: two-sided max-min fairness, as TCP flows sharing links roughly get. Every upload
and every limited download is a resource; a flow uses its source's upload and its sink's
download and is also capped by window / round trip of its connection (TCP, with
`window_bytes`). A slow peer's upload is what it delivers, not what it advertises. Rates come
from progressive filling: all flows rise together, a flow stops at its cap, and every flow of a
resource stops when the resource is full; so what one flow cannot use (its source is slow, its
connection window-limited, its sink's download taken) goes to the other flows of the same
upload or download. Computed incrementally: when flows start or end, only the resources whose
flows changed are shared again (the source's upload, the sink's download, the downloads of
flows just started), with all their flows; the other flows of the uploads and downloads those
flows touch keep their rates and count as load (one hop: a resource is never oversubscribed,
and capacity a flow frees at a far resource goes to that resource's other flows when one of
them next starts or ends, about a chunk time later when it is busy). So an event costs O(flows of two resources), never O(N);
`reshare_hops` 2 also shares the resources one hop further (an experiment: measured, homogeneous
N = 1,023, 64 chunks 1.28x -> 1.22x the optimum, 256 chunks 1.37x either way, 4.4x the wall time).
When every download is unlimited and no connection is window-limited, a finished flow replaced
at once leaves the others' shares unchanged and only the new flow is rated. Each port caches
the sum of its uploads' and of its downloads' rates until one changes.

Pacing (`pace_uploads`, on by default as in the real peer): the relay role paces what it serves with a token bucket
at its advertised upload (`relay.serving.ByteBudget`, one second of burst): a served chunk
waits, holding its upload slot, until the budget allows, then moves at the link's rate. With
pacing on a source sends its chunks nearly one after another instead of sharing its upload
evenly among 16 at once; the wait counts as queue time in the answer. Off, a source shares its
upload among every chunk it serves at once (an experiment's baseline).

Flows and requests hold their endpoints' ports and peers, so the per-chunk path does no lookups by id (10,000 peers x 150+ chunks is millions
of chunks: see `simulations.scale`). At the last byte the sink's core is told `fetched` (with
the time the bytes took to move plus the time the request waited in the source's queue for an
upload slot, as the real shell measures: from the answer's header, plus the queue time the
header reports; waiting in a long poll for the chunk itself is not the source's slowness), or
`fetch_failed` (`FetchFailure.CORRUPT`) when the source is one of `corrupt_peers` (byzantine) and
the chunk is corrupt: each chunk such a peer serves is corrupt with probability `corrupt_rate`
(1.0: always), drawn from a generator seeded by `corrupt_seed`. A source in `hide_queue_peers`
reports no queue time in its answers (a liar: the header is its word alone).

Failures: `crash(p)` is a killed process: flows from p fail at once as `unreachable` (a reset
connection), requests queued at p fail, later requests to p fail after one latency.
`hang(p)` is a stopped process: p answers nothing and its flows freeze, so only the requester's
stall detection can notice. Either way p's own requests paced at other sources end at once and
free their slots (each port indexes its requests paced elsewhere: no scan over all ports); the
budget they reserved is given back (they sent nothing), as in the relay role. `partition(groups)` cuts the data
plane too: flows, queued and paced requests across the cut are dropped silently, requests and manifest fetches across it are never
answered (again, only stall detection notices), until `heal()`.

Drivers hand a core's effects to `apply(peer_id, effects)`.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from p2pnet.identity import Identity
from relay.effects import DropSource, Fetch, FetchFailure, FetchManifest, Penalise, ServeAtOnce
from relay.serving import ByteBudget, Refuse, ServingConfig, ServingCore
from simulations.engine import Engine, Handle
from simulations.fairshare import share
from simulations.world import NetworkModel, SimPeer, SimWorld

if TYPE_CHECKING:
    from relay.transfer import TransferCore



class _Request:
    """A `Fetch` on its way to, or queued at, its source. `peer` and `port` are the sink's."""

    __slots__ = ("sink", "core_index", "fetch", "peer", "port")

    def __init__(self, sink: SimPeer, core_index: int, fetch: Fetch, port: _Port | None) -> None:
        self.sink = sink.peer_id
        self.core_index = core_index
        self.fetch = fetch
        self.peer = sink
        self.port = port

    @property
    def sink_port(self) -> _Port:
        """The sink's port: every request that reached a source (queued, paced, served) has one."""
        assert self.port is not None, "a request without a sink port never reaches a source"
        return self.port


class _Flow:
    """A running chunk transfer; `src` and `dst` are the two endpoints' ports (no lookups per event).
    `cap` is the most one connection carries: TCP window / round-trip time (inf: no limit)."""

    __slots__ = ("source", "request", "remaining", "rate", "since", "handle", "src", "dst", "cap", "started",
                 "queued_s", "mark", "limit", "level")

    def __init__(self, source: str, request: _Request, now: float, src: _Port, dst: _Port,
                 cap: float = math.inf, queued_s: float = 0.0) -> None:
        self.source = source
        self.request = request
        self.remaining = float(request.fetch.size)
        self.rate = 0.0
        self.since = now
        self.started = now
        self.handle: Handle | None = None
        self.src = src
        self.dst = dst
        self.cap = cap
        self.queued_s = queued_s  # waited for the source's upload slot (told in the answer's header)
        self.mark = 0  # the `_share` call that last counted it among the flows it re-rates
        self.limit = 0.0  # scratch for `_share`: its cap and what the frozen rest leaves it
        self.level = 0.0  # scratch for `_share`: the rate it is frozen at (-1.0: still rising)


@dataclass(slots=True)
class _Port:
    """One peer's data plane: capacities, its serving core (the real one: who is served next, the
    long poll and its wait limit) and active flows. The serving core's tokens are `_Request`s."""

    upload_bps: float
    download_bps: float
    serving: ServingCore
    core_index: int
    expiry: Handle | None = None  # when the serving core next refuses a request or releases a slot (`_arm_expiry`)
    expiry_at: float = 0.0  # `expiry`'s time
    up: list[_Flow] = field(default_factory=list)
    down: list[_Flow] = field(default_factory=list)
    hung: bool = False
    bytes_up: int = 0
    bytes_down: int = 0
    rated_for: int = 0  # len(up) when `up` was last re-rated as a whole
    up_tag: int = 0  # scratch for `_share`: `up_count` and `up_use` are valid in the call with this tag
    down_tag: int = 0
    up_count: int = 0  # scratch for `_share`: how many of its flows use this upload
    down_count: int = 0
    up_use: Any = None  # scratch for `_share`: this upload as a resource two or more flows share
    down_use: Any = None
    budget: ByteBudget | None = None  # paces what it serves, as the relay role does (`pace_uploads`)
    paced: dict[Any, Handle] = field(default_factory=dict)  # served requests waiting for the budget
    paced_to: dict[Any, _Port] = field(default_factory=dict)  # its own requests in another's `paced`: that port
    up_load: float = -1.0  # sum of the rates of `up` (-1.0: not known, `fairshare.load` sums it afresh)
    down_load: float = -1.0  # the same for `down`


class RelayWorld(SimWorld):
    def __init__(self, engine: Engine, model: NetworkModel | None = None, *, sign: bool = False,
                 serving: ServingConfig | None = None, corrupt_peers: frozenset[str] = frozenset(),
                 corrupt_rate: float = 1.0, corrupt_seed: str = "", window_bytes: float = math.inf,
                 pace_uploads: bool = True) -> None:
        super().__init__(engine, model, sign=sign)
        if not 0.0 <= corrupt_rate <= 1.0:
            raise ValueError("corrupt_rate must be within [0, 1]")
        if not window_bytes > 0:
            raise ValueError("window_bytes must be > 0 (inf: no per-connection limit)")
        self.serving = serving or ServingConfig()
        self.window_bytes = float(window_bytes)
        self.pace_uploads = pace_uploads
        self.corrupt_peers = set(corrupt_peers)
        self.corrupt_rate = corrupt_rate
        self._corrupt_rng = random.Random(f"corrupt/{corrupt_seed}")
        self.genuine_from_corrupt_peers = 0  # chunks a corrupt peer served intact (corrupt_rate < 1)
        self.hide_queue_peers: set[str] = set()  # sources whose answers report no queue time (liars)
        self.ports: dict[str, _Port] = {}
        self.penalties: list[tuple[float, str, str, float]] = []  # (t, by, peer, amount)
        self.transfer_stats = {"fetches": 0, "flows": 0, "corrupt_served": 0, "failed": 0, "bytes": 0}
        self._unlimited_downloads = True  # then a flow's rate depends on its source's uploads alone
        self.reshare_hops = 1
        self._marks = 0  # numbers the `_reshare` calls (a flow's `mark`: it is in that call's set)
        self._arrives, self._finishes = self._request_arrives, self._finish  # bound once: engine callbacks
        self._latency_model: NetworkModel | None = None
        self._latency_cache: dict[tuple[str, str], float] = {}

    def add_relay_peer(self, identity: Identity, cores: list[Any], *, upload_bps: float,
                       download_bps: float = math.inf, region: str = "eu", core_index: int = 0) -> SimPeer:
        """A peer whose `cores[core_index]` is its `TransferCore`. Ports exist before cores start.
        With `pace_uploads` its serving is paced at `upload_bps` (what it advertises: a slow peer's
        link is lowered after this, its budget is not)."""
        port = self.ports[identity.peer_id] = _Port(float(upload_bps), float(download_bps),
                                                    ServingCore(self.serving), core_index)
        if self.pace_uploads:
            port.budget = ByteBudget(float(upload_bps))
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
            self._fail(flow.request, peer_id, FetchFailure.UNREACHABLE, delay=0.0)
        for flow in list(port.down):
            self._end_flow(flow)
            self._done(flow)
        self._cancel_paced_to(port)
        for request in port.serving.clear():
            self._fail(request, peer_id, FetchFailure.UNREACHABLE, delay=0.0)  # type: ignore[arg-type]
        for request in self._forget_paced(port):
            self._fail(request, peer_id, FetchFailure.UNREACHABLE, delay=0.0)
        port.serving = ServingCore(self.serving)

    def hang(self, peer_id: str) -> None:
        """The peer stops: no timers, no answers, its flows freeze (nobody is told)."""
        SimWorld.crash(self, peer_id)
        port = self.ports[peer_id]
        port.hung = True
        for flow in list(port.up):
            self._end_flow(flow)
        for flow in list(port.down):  # its sources stop sending to it: their slots serve others
            self._end_flow(flow)
            self._done(flow)
        self._cancel_paced_to(port)
        self._forget_paced(port)
        port.serving = ServingCore(self.serving)

    def _cancel_paced_to(self, sink: _Port) -> None:
        """`sink`'s peer crashed or stopped: its requests paced at other sources end now and free
        their upload slots (the relay's reader loop ends with the connection and cancels the
        paced answer). The budget they reserved is given back, as in the relay role."""
        for request, source in list(sink.paced_to.items()):
            self._cancel_paced(source, request)

    @staticmethod
    def _forget_paced(source: _Port) -> list[_Request]:
        """`source`'s peer crashed or stopped: the requests it was pacing are dropped with its
        serving core (no slot to hand on); returned for the caller to fail or leave silent."""
        paced, source.paced = source.paced, {}
        for request, handle in paced.items():
            handle.cancel()
            del request.sink_port.paced_to[request]
        return list(paced)

    def _cancel_paced(self, source: _Port, request: _Request) -> None:
        """Forget `request`, paced at `source`, and give its upload slot to the next request."""
        del request.sink_port.paced_to[request]
        source.paced.pop(request).cancel()
        if source.budget is not None:
            source.budget.refund(request.fetch.size)
        actions = source.serving.done(self.engine.now, request)
        if actions:
            self._serve(request.fetch.peer, source, actions)

    def partition(self, groups: list[list[str]]) -> None:
        """Split the network; flows, queued and paced requests across the cut go silent (see the top)."""
        super().partition(groups)
        reachable = self._reachable
        for peer_id in sorted(self.ports):
            port = self.ports[peer_id]
            for sink in sorted(port.serving.requesters()):
                if not reachable(peer_id, sink):
                    port.serving.drop_peer(sink)
            for request in [r for r in port.paced if not reachable(peer_id, r.sink)]:
                self._cancel_paced(port, request)
            for flow in [f for f in port.up if not reachable(peer_id, f.request.sink)]:
                self._end_flow(flow)
                self._done(flow)  # a cut flow goes silent; its slot serves a reachable requester

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
            elif kind is ServeAtOnce:
                port = self.ports.get(peer.peer_id)
                if port is not None:
                    actions = port.serving.set_slots(self.engine.now, effect.slots)
                    if actions:
                        self._serve(peer.peer_id, port, actions)
            else:
                plain.append(effect)
        if plain:
            super()._apply(peer, index, plain)

    def _fetch(self, sink: SimPeer, index: int, fetch: Fetch) -> None:
        self.transfer_stats["fetches"] += 1
        request = _Request(sink, index, fetch, self.ports.get(sink.peer_id))
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
            self._fail(request, source_id, FetchFailure.UNREACHABLE, delay=self._latency(request.sink, source_id))
            return
        fetch = request.fetch
        core = _transfer_core(source, port.core_index)
        held = core.has(fetch.version, fetch.index)
        if not held:  # the core decides whether to fetch it another way (`TransferCore.asked_for`), as the
            # relay role's server does before the request waits: then whom we asked for it is known
            self._apply(source, port.core_index, core.asked_for(self.engine.now, fetch.version, fetch.index))
        actions = port.serving.ask(self.engine.now, request, request.sink, fetch.version, fetch.index, fetch.urgent,
                                   held, None if held else core.asking(fetch.version, fetch.index))
        if actions:
            self._serve(source_id, port, actions)
        if not held or not actions:
            self._arm_expiry(source_id, port)

    def _arm_expiry(self, source_id: str, port: _Port) -> None:
        """Wake the serving core at its next deadline if that is earlier than the one armed: a
        waiting request's wait limit, or, while requests are queued, a long serve's release from
        its slot (`ServingConfig.linger_factor`; with nothing queued the next grant releases it
        as well, and nothing here watches `full`)."""
        serving = port.serving
        deadline = serving.next_deadline(releases=serving.queued > 0)
        if deadline is None or (port.expiry is not None and port.expiry_at <= deadline):
            return
        if port.expiry is not None:
            port.expiry.cancel()
        port.expiry_at = deadline
        port.expiry = self.engine.at(deadline, self._expire, source_id, port)

    def _expire(self, source_id: str, port: _Port) -> None:
        port.expiry = None
        if self.ports.get(source_id) is not port or port.hung:
            return
        actions = port.serving.expire(self.engine.now)
        if actions:
            self._serve(source_id, port, actions)
        self._arm_expiry(source_id, port)

    def _done(self, flow: _Flow) -> None:
        """`flow` ended without finishing (its sink crashed or gave up): its slot is free
        (`_end_flow` re-rated the source's other flows)."""
        port = flow.src
        actions = port.serving.done(self.engine.now, flow.request)
        if actions:
            self._serve(flow.source, port, actions)

    def _serve(self, source_id: str, port: _Port, actions: list[Any], ended: bool = False,
               sink: _Port | None = None) -> None:
        """Carry out the serving core's decisions: start a flow per `Serve`, answer each `Refuse`
        "unavailable" (the requester hears it one latency later). `ended`: one of the source's
        flows just ended (its sink's port is `sink`), so the source's upload and that download are
        shared again even if nothing new starts."""
        if port.serving.queued:
            self._arm_expiry(source_id, port)  # a slot may be released before one is freed
        now = self.engine.now
        up = port.up
        started = []
        for action in actions:  # `actions` may grow: a slot freed at once is given again
            request = action.token
            if type(action) is Refuse:
                self._fail(request, source_id, FetchFailure.UNAVAILABLE, delay=self._latency(request.sink, source_id))
                continue
            sink_port = request.port
            if sink_port is None or not request.peer.alive:
                actions.extend(port.serving.done(now, request))
                continue
            if port.budget is not None:
                paced_s = port.budget.reserve(now, request.fetch.size)
                if paced_s > 0.0:  # the slot is held while the budget refills, as in the relay role
                    port.paced[request] = self.engine.at(now + paced_s, self._paced_start, source_id, port, request,
                                                         action.queued_s + paced_s)
                    sink_port.paced_to[request] = port
                    continue
            flow = _Flow(source_id, request, now, port, sink_port, self._flow_cap(source_id, request),
                         action.queued_s)
            up.append(flow)
            sink_port.down.append(flow)
            sink_port.down_load = -1.0  # a new flow's rate is 0 until `_share` rates it: the sums hold
            started.append(flow)
            self.transfer_stats["flows"] += 1
        if not started:
            if ended:
                self._reshare(port, sink, started)
                port.rated_for = len(up)
            return
        if self._unlimited_downloads and self.window_bytes == math.inf and len(up) == port.rated_for:
            rate = port.upload_bps / len(up)  # a finished flow was replaced: the others keep their share
            for flow in started:
                self._set_rate(flow, rate)
            return
        self._reshare(port, sink, started)
        port.rated_for = len(up)

    def _paced_start(self, source_id: str, port: _Port, request: _Request, queued_s: float) -> None:
        """A served request's bytes start once the upload budget allows (`queued_s` includes that
        wait, as the relay tells it in the answer's header). Its sink is alive and reachable: a
        crash, a stop or a partition cancels the paced requests it touches."""
        del port.paced[request]
        now = self.engine.now
        sink_port = request.sink_port
        del sink_port.paced_to[request]
        flow = _Flow(source_id, request, now, port, sink_port, self._flow_cap(source_id, request), queued_s)
        port.up.append(flow)
        sink_port.down.append(flow)
        sink_port.down_load = -1.0
        self.transfer_stats["flows"] += 1
        self._reshare(port, None, [flow])
        port.rated_for = len(port.up)

    def _flow_cap(self, source_id: str, request: _Request) -> float:
        """What one TCP connection carries at most: window / round trip (two one-way latencies)."""
        if self.window_bytes == math.inf:
            return math.inf
        source = self.peers.get(source_id)
        one_way = self._region_latency(request.peer.region, source.region) if source else self.model.local_latency_s
        return self.window_bytes / max(2 * one_way, 1e-6)

    def _reshare(self, source: _Port | None, sink: _Port | None, started: list[_Flow]) -> None:
        """Share again the resources whose flows changed: `source`'s upload, `sink`'s download and
        the downloads of the `started` flows' sinks (an unlimited download is no resource)."""
        self._marks += 1
        tag = self._marks
        flows = source.up[:] if source is not None else []
        for flow in flows:
            flow.mark = tag
        inf = math.inf
        if sink is not None and sink.download_bps != inf:
            for flow in sink.down:
                if flow.mark != tag:
                    flow.mark = tag
                    flows.append(flow)
        for new in started:
            dst = new.dst
            if dst is not sink and dst.download_bps != inf:
                for flow in dst.down:
                    if flow.mark != tag:
                        flow.mark = tag
                        flows.append(flow)
        if self.reshare_hops > 1:
            for _ in range(self.reshare_hops - 1):
                more = []
                for flow in flows:
                    for other in flow.src.up:
                        if other.mark != tag:
                            other.mark = tag
                            more.append(other)
                    if flow.dst.download_bps != inf:
                        for other in flow.dst.down:
                            if other.mark != tag:
                                other.mark = tag
                                more.append(other)
                flows.extend(more)
        if not flows:
            return
        self._share(flows, tag)

    def _share(self, flows: list[_Flow], tag: int) -> None:
        """Rate `flows` afresh (`simulations.fairshare.share`) and reschedule their ends."""
        share(flows, tag, self.engine, self._finishes)

    def _set_rate(self, flow: _Flow, rate: float) -> None:
        """Move `flow` at `rate` from now on (0: it waits for its next re-rating), rescheduling its end.
        A running flow keeps its rate if the new one differs by at most a billionth: the same share
        summed in another order (29% of all re-ratings in a 600-relay run) is not worth an event."""
        handle = flow.handle
        if handle is not None:
            if abs(rate - flow.rate) <= 1e-9 * flow.rate:  # the same share summed in another order
                return
        elif rate == 0.0:
            return
        now = self.engine.now
        if handle is not None:
            flow.remaining -= (now - flow.since) * flow.rate
        flow.since = now
        flow.rate = rate
        flow.src.up_load = -1.0
        flow.dst.down_load = -1.0
        if rate > 0.0:
            remaining = flow.remaining
            when = now + (remaining if remaining > 0.0 else 0.0) / rate
            flow.handle = self.engine.at(when, self._finishes, flow) if handle is None else \
                self.engine.retime(handle, when, self._finishes, flow)
        elif handle is not None:
            handle.cancel()
            flow.handle = None

    def _end_flow(self, flow: _Flow, rerate_source: bool = True) -> None:
        if flow.handle is not None:
            flow.handle.cancel()
            flow.handle = None
        source, sink = flow.src, flow.dst
        source.up.remove(flow)
        sink.down.remove(flow)
        source.up_load = sink.down_load = -1.0
        self._reshare(source if rerate_source else None, sink, [])
        if rerate_source:
            source.rated_for = len(source.up)

    def _finish(self, flow: _Flow) -> None:
        flow.handle = None
        source_port, sink_port = flow.src, flow.dst
        source_port.up.remove(flow)  # `_end_flow` without re-sharing: `_serve` below does
        sink_port.down.remove(flow)
        source_port.up_load = sink_port.down_load = -1.0
        request, fetch = flow.request, flow.request.fetch
        size = fetch.size
        source_port.bytes_up += size
        sink_port.bytes_down += size
        self.transfer_stats["bytes"] += size
        sink = request.peer
        core = _transfer_core(sink, request.core_index)
        now = self.engine.now
        if flow.source in self.corrupt_peers and self._corrupts():
            self.transfer_stats["corrupt_served"] += 1
            self._apply(sink, request.core_index, core.fetch_failed(now, flow.source, fetch.version, fetch.index,
                                                                    FetchFailure.CORRUPT))
        else:
            queued_s = 0.0 if flow.source in self.hide_queue_peers else flow.queued_s
            self._apply(sink, request.core_index, core.fetched(now, flow.source, fetch.version, fetch.index,
                                                               now - flow.started + queued_s))
            key = (fetch.version, fetch.index)
            if core.has(fetch.version, fetch.index):
                self._release_waiting(request.sink, sink_port, key)  # long polls for it are answered
        self._serve(flow.source, source_port, source_port.serving.done(now, request), ended=True, sink=sink_port)

    def _corrupts(self) -> bool:
        """Whether a chunk a corrupt peer serves is corrupt (no draw at rate 1: replays stay exact)."""
        if self.corrupt_rate >= 1.0 or self._corrupt_rng.random() < self.corrupt_rate:
            return True
        self.genuine_from_corrupt_peers += 1
        return False

    def _release_waiting(self, peer_id: str, port: _Port, key: tuple[int, int]) -> None:
        actions = port.serving.arrived(self.engine.now, *key)
        if actions:
            self._serve(peer_id, port, actions)

    def _fail(self, request: _Request, source_id: str, reason: FetchFailure, delay: float) -> None:
        self.transfer_stats["failed"] += 1
        self.engine.after(delay, self._report_failure, request, source_id, reason)

    def _report_failure(self, request: _Request, source_id: str, reason: FetchFailure) -> None:
        sink = self.peers.get(request.sink)
        if sink is None or not sink.alive:
            return
        fetch = request.fetch
        core = _transfer_core(sink, request.core_index)
        self._apply(sink, request.core_index, core.fetch_failed(self.engine.now, source_id, fetch.version,
                                                                fetch.index, reason))

    def _drop_source(self, sink_id: str, source_id: str) -> None:
        """The sink gave up on the source: forget its queued requests and running flows."""
        port = self.ports.get(source_id)
        if port is None:
            return
        port.serving.drop_peer(sink_id)
        for request in [r for r in port.paced if r.sink == sink_id]:
            self._cancel_paced(port, request)
        for flow in [f for f in port.up if f.request.sink == sink_id]:
            self._end_flow(flow)
            self._done(flow)

    def _fetch_manifest(self, sink: SimPeer, index: int, effect: FetchManifest) -> None:
        delay = 2 * self._latency(sink.peer_id, effect.peer)
        self.engine.after(delay, self._answer_manifest, sink, index, effect)

    def _answer_manifest(self, sink: SimPeer, index: int, effect: FetchManifest) -> None:
        source = self.peers.get(effect.peer)
        port = self.ports.get(effect.peer)
        if not sink.alive or source is None or port is None or not source.alive or port.hung or \
                not self._reachable(sink.peer_id, effect.peer):
            return
        signed = _transfer_core(source, port.core_index).signed(effect.version)
        if signed is not None:
            core = _transfer_core(sink, index)
            self._apply(sink, index, core.manifest_frame(self.engine.now, effect.peer, signed.frame))

    def _latency(self, a: str, b: str) -> float:
        pa, pb = self.peers.get(a), self.peers.get(b)
        if pa is None or pb is None:
            return self.model.local_latency_s
        return self.model.latency(pa.region, pb.region)


def _transfer_core(peer: SimPeer, index: int) -> TransferCore:
    """`peer.cores[index]`, a relay peer's `TransferCore` (the only cores this data plane is given)."""
    return cast("TransferCore", peer.cores[index])
