"""The simulated world: peers whose pure cores talk over a modeled network in virtual time.

Each simulated peer holds the same cores a real peer runs (`p2pnet.core.Core`). The world
carries their effects out on the engine: `Publish` reaches every live peer in the publisher's
connected component of the connection graph (respecting partitions), each after hops x link
latency; `Send` reaches one peer after the link latency; both are lost with probability `loss`.
`Connect` adds an edge. Timers are engine events, replaced per key. With `sign=True` every
message is really encoded, signed, decoded and checked with the peers' codecs, so rejection
paths run exactly as in a real peer; without it bodies are handed over directly (fast).

Latency comes from regions: `latency_s[(a, b)]` one way, symmetric, same-region default
`local_latency_s`. Bulk data transfer is modeled in `simulations.dataplane`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from p2pnet.core import Connect, Core, Effect, Emit, Publish, Send, SetTimer
from p2pnet.errors import MessageRejected
from p2pnet.identity import Identity
from p2pnet.wire import Codec, Envelope, spec_of
from simulations.engine import Engine, Handle

EPOCH_S = 1_800_000_000.0  # virtual time 0, as wall-clock seconds, for message timestamps


@dataclass
class SimPeer:
    peer_id: str
    identity: Identity
    region: str
    cores: list[Core]
    codec: Codec
    routes: dict[str, list[Core]] = field(default_factory=dict)
    topics: set[str] = field(default_factory=set)
    timers: dict[tuple[int, str], Handle] = field(default_factory=dict)
    alive: bool = True
    group: int = 0  # partition group


@dataclass(frozen=True)
class NetworkModel:
    local_latency_s: float = 0.005
    latency_s: tuple[tuple[str, str, float], ...] = ()
    loss: float = 0.0

    def latency(self, a: str, b: str) -> float:
        if a == b:
            return self.local_latency_s
        for x, y, value in self.latency_s:
            if (x, y) == (a, b) or (y, x) == (a, b):
                return value
        return self.local_latency_s


class SimWorld:
    def __init__(self, engine: Engine, model: NetworkModel | None = None, *, sign: bool = False) -> None:
        self.engine = engine
        self.model = model or NetworkModel()
        self.sign = sign
        self.peers: dict[str, SimPeer] = {}
        self.edges: dict[str, set[str]] = {}
        self._reach_cache: dict[str, list[tuple[str, int]]] = {}
        self.events: list[tuple[float, str, Any]] = []
        self.listeners: list[Callable[[float, str, Any], None]] = []
        self.stats = {"published": 0, "delivered": 0, "lost": 0, "rejected": 0}

    # -- building the world ---------------------------------------------------------------

    def add_peer(self, identity: Identity, cores: list[Core], *, region: str = "eu") -> SimPeer:
        peer = SimPeer(identity.peer_id, identity, region, cores, Codec(identity))
        for core in cores:
            for kind in core.kinds:
                peer.routes.setdefault(kind, []).append(core)
            peer.topics.update(core.topics)
        self.peers[peer.peer_id] = peer
        self.edges.setdefault(peer.peer_id, set())
        self._reach_cache.clear()
        for index, core in enumerate(cores):
            self._apply(peer, index, core.start(self.engine.now))
        return peer

    def connect(self, a: str, b: str) -> None:
        if a == b or b in self.edges.get(a, ()):
            return
        self.edges.setdefault(a, set()).add(b)
        self.edges.setdefault(b, set()).add(a)
        self._reach_cache.clear()

    def crash(self, peer_id: str) -> None:
        peer = self.peers[peer_id]
        peer.alive = False
        for handle in peer.timers.values():
            handle.cancel()
        peer.timers.clear()
        self._reach_cache.clear()

    def partition(self, groups: list[list[str]]) -> None:
        """Split the network: peers in different groups cannot reach each other."""
        for number, members in enumerate(groups, start=1):
            for peer_id in members:
                self.peers[peer_id].group = number
        self._reach_cache.clear()

    def heal(self) -> None:
        for peer in self.peers.values():
            peer.group = 0
        self._reach_cache.clear()

    def deliver_frame(self, to: str, frame: bytes, via: str) -> None:
        """Hand raw bytes to a peer as if `via` had sent them (fuzzing and attack scenarios)."""
        self._receive_frame(self.peers[to], frame, via)

    # -- effects --------------------------------------------------------------------------

    def _apply(self, peer: SimPeer, index: int, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, SetTimer):
                key = (index, effect.key)
                old = peer.timers.get(key)
                if old is not None:
                    old.cancel()
                peer.timers[key] = self.engine.at(effect.at, self._fire, peer, index, effect.key)
            elif isinstance(effect, Publish):
                self._publish(peer, effect)
            elif isinstance(effect, Send):
                self._send(peer, effect)
            elif isinstance(effect, Connect):
                if effect.peer in self.peers:
                    self.connect(peer.peer_id, effect.peer)
            elif isinstance(effect, Emit):
                self.events.append((self.engine.now, peer.peer_id, effect.event))
                for listener in self.listeners:
                    listener(self.engine.now, peer.peer_id, effect.event)

    def _fire(self, peer: SimPeer, index: int, key: str) -> None:
        peer.timers.pop((index, key), None)
        if peer.alive:
            self._apply(peer, index, peer.cores[index].on_timer(self.engine.now, key))

    def _envelope(self, sender: SimPeer, body: Any) -> Envelope[Any] | bytes:
        now_s = EPOCH_S + self.engine.now
        if self.sign:
            return sender.codec.encode(body, now_s)
        return Envelope(spec_of(body).kind, sender.peer_id, sender.identity.peer_id_bytes,
                        int(now_s * 1000), body, 0)

    def _publish(self, sender: SimPeer, effect: Publish) -> None:
        self.stats["published"] += 1
        message = self._envelope(sender, effect.body)
        hop_s = self.model.local_latency_s
        for peer_id, hops in self._reach(sender.peer_id):
            target = self.peers[peer_id]
            if effect.topic not in target.topics:
                continue
            delay = hops * hop_s + self.model.latency(sender.region, target.region)
            self._schedule(target, message, sender.peer_id, delay)

    def _send(self, sender: SimPeer, effect: Send) -> None:
        target = self.peers.get(effect.peer)
        if target is None:
            return
        delay = self.model.latency(sender.region, target.region)
        self._schedule(target, self._envelope(sender, effect.body), sender.peer_id, delay)

    def _schedule(self, target: SimPeer, message: Envelope[Any] | bytes, via: str, delay: float) -> None:
        if self.model.loss and self.engine.random.random() < self.model.loss:
            self.stats["lost"] += 1
            return
        self.engine.after(delay, self._arrive, target, message, via)

    def _arrive(self, target: SimPeer, message: Envelope[Any] | bytes, via: str) -> None:
        if not target.alive or not self._reachable(via, target.peer_id):
            return
        if isinstance(message, bytes):
            self._receive_frame(target, message, via)
        else:
            self._dispatch(target, message)

    def _receive_frame(self, target: SimPeer, frame: bytes, via: str) -> None:
        try:
            envelope = target.codec.decode(frame, EPOCH_S + self.engine.now)
        except MessageRejected as exc:
            self.stats["rejected"] += 1
            culprit = exc.sender or via
            for index, core in enumerate(target.cores):
                self._apply(target, index, core.on_rejected(self.engine.now, culprit, exc.reason))
            return
        self._dispatch(target, envelope)

    def _dispatch(self, target: SimPeer, envelope: Envelope[Any]) -> None:
        if envelope.sender == target.peer_id:
            return
        self.stats["delivered"] += 1
        for core in target.routes.get(envelope.kind, ()):
            index = target.cores.index(core)
            self._apply(target, index, core.on_message(self.engine.now, envelope))

    # -- reachability ---------------------------------------------------------------------

    def _reachable(self, a: str, b: str) -> bool:
        pa, pb = self.peers.get(a), self.peers.get(b)
        return pa is not None and pb is not None and pa.group == pb.group

    def _reach(self, source: str) -> list[tuple[str, int]]:
        """Live peers reachable from `source` over the connection graph, with hop counts."""
        cached = self._reach_cache.get(source)
        if cached is not None:
            return cached
        group = self.peers[source].group
        seen = {source: 0}
        queue = deque([source])
        while queue:
            current = queue.popleft()
            for neighbour in sorted(self.edges.get(current, ())):  # sorted: set order varies by hash seed
                peer = self.peers[neighbour]
                if neighbour not in seen and peer.alive and peer.group == group:
                    seen[neighbour] = seen[current] + 1
                    queue.append(neighbour)
        del seen[source]
        result = list(seen.items())
        self._reach_cache[source] = result
        return result
