"""One running peer: identity, libp2p host, data plane, peer table, roles and control socket.

`run_node` owns every task of the peer in one nursery and returns only when the peer is
stopped (cancelled by the CLI on SIGINT/SIGTERM); nothing outside `run_node` starts tasks in it.

Cores: whoever runs a core runs it in its own nursery, `runner = await nursery.start(node.run_core,
core, name)`, and the core lives exactly as long as that task: `run_core` routes the core's kinds
to its runner while it runs and no longer once it ends, so a frame of a kind no running core
handles is dropped (and not forwarded by gossip). The gossip topics cores want are asked of the
node's own subscriber task (one `host.subscribe` per topic, shared by every core that wants it),
which leaves a topic once no running core wants it: a peer subscribed to a topic nobody reads
stayed in its GossipSub mesh, and its neighbours sent it every message of the topic (each
decoded and signature-checked twice over) that it then forwarded to no one, a dead end in the
mesh (measured through two real peers: 20 of 20 messages published after the last core stopped).
The peer table and notices run in `run_node`'s nursery; each role runs its cores in its own.

The node is also the `EffectSink` of its cores: publishes and sends are queued on a bounded
outbox and carried out by a few sender tasks, so a slow peer never stalls a core; connects go to a
bounded queue of their own with their own few dialer tasks (`DIALER_TASKS`), so that dials to
addresses that never answer (any new identity's heartbeat asks for one, at no cost to it) never
hold up our heartbeat or a send: eight made-up peers with 16 silent addresses each held every
sender task for 160 s. A `Connect` gives up after `CONNECT_BUDGET_S` in all, and tries the
peer's addresses in order, taking the first that reaches that very peer: an
address that names another peer, or where another peer answers (a stale address, reused after a
NAT rebinding or by a machine restarted with a new key), fails as no longer that peer's, and the
next is tried (`Host.connect(addr, peer)`; Noise proves whom a dial reached).
Inbound frames are decoded once, dropped if they are our own, routed by message kind to the
cores that handle it; rejected frames penalise the claimed sender (or the forwarding peer when
no sender could be read) in the peer table, except stale ones: a skewed clock (ours or theirs)
is reported as a WARNING, not scored, or one wrong clock would ban every neighbour within
seconds.

Introductions: a peer whose data plane refused us as unknown (`p2pnet.handshake.NotAdmitted`)
is sent our latest heartbeat directly by whoever was refused (`Node.introduce`: the relay's
chunk and manifest fetches), so it admits us at the next try instead of after our next heartbeat reaches it (up to
`max_interval_s`); a heartbeat arriving as a direct frame is routed to the table like a gossiped
one (by kind, in `_on_frame`), and replays are dropped by the table either way.

Waiting for peers: `Node.wait_for_peers(predicate, timeout_s)` (and `peers_changed()`) wake on
every change of the peer table that could matter to someone waiting for a peer: a join, a
leave, and a known peer's new addresses, data address, roles or reachability (`PeerNews`, fed
from the table's events in `carry_out`). No wait for a peer polls the table (the relay's
membership and the DiLoCo round still re-read it on their own clocks, for what emits no event).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import trio

from p2pnet.addresses import is_wildcard, listen_host, parse_host_port
from p2pnet.config import validated
from p2pnet.connectivity import Backoff, keep_connected
from p2pnet.control import ControlServer, Reply
from p2pnet.core import Connect, Core, Effect, Emit, Publish, Send
from p2pnet.dataplane import DataPlane
from p2pnet.driver import CoreRunner
from p2pnet.errors import ConfigError, LocalStateError, MessageRejected, PeerUnavailable
from p2pnet.host import CONNECT_TIMEOUT_S, Host, dialable_problem, open_host
from p2pnet.identity import Identity, ensure_data_dir, load_or_create_identity
from p2pnet.logformat import set_log_context
from p2pnet.messages import MAX_ADDRS, ROLE_NAMES, Capacity
from p2pnet.notices import Notice, Notices
from p2pnet.peertable import PEER_TABLE_CORE, LocalInfo, PeerChanged, PeerJoined, PeerLeft, PeerTable, PeerTableConfig
from p2pnet.reachability import Reachability
from p2pnet.web_limits import trusted_network, wide_network_warnings
from p2pnet.wire import MAX_FRAME_BYTES, Codec, Envelope

log = logging.getLogger(__name__)

SENDER_TASKS = 8
OUTBOX_SIZE = 4096
DIALER_TASKS = 4  # connects carried out at once (apart from the senders: see the top)
DIAL_QUEUE = 256  # connects waiting; past it one is dropped (the peer table asks again at its next heartbeat)
CONNECT_BUDGET_S = 3 * CONNECT_TIMEOUT_S  # one Connect, all its addresses: three that never answer
MAX_ANNOUNCED_CHARS = 200  # an announced multiaddr with its /p2p/ID suffix must fit a heartbeat's 256


@validated
@dataclass(frozen=True)
class PeerConfig:
    data_dir: Path
    listen: str = "/ip4/127.0.0.1/tcp/0"
    announce: tuple[str, ...] = ()  # multiaddrs to advertise instead of the listen addresses
    bootstrap: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    data_host: str = ""  # the data plane binds this IP; "" means the listen address's IP
    data_port: int = 0
    data_announce: str = ""  # HOST:PORT to advertise for the data plane instead of the bound one
    upload_bps: int = 1_000_000_000
    download_bps: int = 1_000_000_000
    max_message_bytes: int = MAX_FRAME_BYTES
    max_message_age_s: float = 300.0
    max_future_s: float = 30.0
    send_timeout_s: float = 10.0
    bootstrap_backoff_max_s: float = 30.0
    reachability_interval_s: float = 60.0
    gossip_degree: int = 6  # GossipSub mesh degree D (D_low = 2D/3, D_high = 2D)
    gossip_heartbeat_s: float = 1.0  # GossipSub's own mesh upkeep, not the peer table's heartbeats
    display_name: str = ""  # shown beside this peer's id on dashboards and leaderboards (at most 64 characters)
    metrics_listen: str = ""  # HOST:PORT serving /metrics (Prometheus), /healthz and the dashboard; "" is off
    metrics_trusted_networks: tuple[str, ...] = ()

    def check(self) -> dict[str, str]:
        problems = {}
        if not self.listen.startswith("/"):
            problems["listen"] = "must be a multiaddr such as /ip4/127.0.0.1/tcp/0"
        for addr in self.announce:
            if len(addr) > MAX_ANNOUNCED_CHARS:
                problems["announce"] = f"{addr[:40]!r}... is longer than {MAX_ANNOUNCED_CHARS} characters"
            elif (problem := dialable_problem(addr, with_peer=False)) is not None:
                problems["announce"] = f"{problem}; give a concrete multiaddr such as /ip4/203.0.113.7/tcp/4001"
        if len(self.announce) > MAX_ADDRS:
            problems["announce"] = f"at most {MAX_ADDRS} addresses (a heartbeat carries no more)"
        if self.data_announce:
            try:
                host, port = parse_host_port(self.data_announce, "data_announce")
            except ConfigError:
                host, port = "", 0
            if not port or is_wildcard(host):
                problems["data_announce"] = "must be a concrete HOST:PORT such as 203.0.113.7:4002"
        for addr in self.bootstrap:
            if (problem := dialable_problem(addr, with_peer=True)) is not None:
                problems["bootstrap"] = (f"{problem}: give the full address a peer prints when it starts "
                                         "(/ip4/IP/tcp/PORT/p2p/12D3KooW...)")
        unknown = [r for r in self.roles if r not in ROLE_NAMES]
        if unknown:
            problems["roles"] = f"unknown role(s) {unknown}; known: {list(ROLE_NAMES)}"
        if len(self.display_name) > 64 or not self.display_name.isprintable():
            problems["display_name"] = "must be at most 64 printable characters"
        if self.metrics_listen:
            try:
                parse_host_port(self.metrics_listen, "metrics_listen")
            except ConfigError:
                problems["metrics_listen"] = "must be HOST:PORT such as 127.0.0.1:9100 (port 0 picks one)"
        for network in self.metrics_trusted_networks:
            try:
                trusted_network(network)
            except ValueError as exc:
                problems["metrics_trusted_networks"] = str(exc)
        if not 1 <= self.gossip_degree <= 32:
            problems["gossip_degree"] = "must be in [1, 32]"
        if not 0 <= self.data_port < 65536:
            problems["data_port"] = "must be a TCP port (0 picks one)"
        if self.upload_bps <= 0 or self.download_bps <= 0:
            problems["upload_bps" if self.upload_bps <= 0 else "download_bps"] = "must be > 0"
        if not 1024 <= self.max_message_bytes <= MAX_FRAME_BYTES:
            problems["max_message_bytes"] = f"must be in [1024, {MAX_FRAME_BYTES}]"
        for name in ("max_message_age_s", "max_future_s", "send_timeout_s", "bootstrap_backoff_max_s",
                     "reachability_interval_s", "gossip_heartbeat_s"):
            if not getattr(self, name) > 0:
                problems[name] = "must be > 0"
        return problems


class PeerNews:
    """One trio Event per change of the peer table, renewed at each: every waiter wakes, looks at
    the table again, and the next change finds a fresh Event (nothing stored but the Event)."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self.changes = 0

    def on_event(self, origin: str, event: Any) -> None:
        """Feed one core event; the table's joins, leaves and changed entries wake the waiters."""
        if origin == PEER_TABLE_CORE and isinstance(event, (PeerJoined, PeerLeft, PeerChanged)):
            self.changes += 1
            self._event.set()
            self._event = trio.Event()

    async def next(self) -> None:
        """Return at the next change."""
        await self._event.wait()

    async def until(self, predicate: Callable[[], bool], timeout_s: float = math.inf) -> bool:
        """True as soon as `predicate()` holds (checked now and after every change), False when
        `timeout_s` passed first."""
        with trio.move_on_after(timeout_s):
            while not predicate():
                await self._event.wait()
            return True
        return False


@dataclass
class Node:
    """The handle roles and tests get: everything a role needs, nothing of libp2p's insides.

    A role runs its cores with `nursery.start(node.run_core, core, name)` in a nursery it owns;
    the node keeps no nursery of its own on hand for anyone to start tasks in."""

    config: PeerConfig
    identity: Identity
    codec: Codec
    host: Host
    dataplane: DataPlane
    control: ControlServer
    peertable: PeerTable
    started_at: float
    _outbox: trio.MemorySendChannel[tuple[str, Effect]]
    _dials: trio.MemorySendChannel[tuple[str, Effect]] | None = None  # connects (None: through the outbox)
    _runners: list[CoreRunner] = field(default_factory=list)
    _routes: dict[str, list[CoreRunner]] = field(default_factory=dict)
    _topic_users: dict[str, int] = field(default_factory=dict)  # running cores that want each topic
    _topics_changed: trio.Event = field(default_factory=trio.Event)  # `_topic_users` changed: `_subscriber` wakes
    _topics: set[str] = field(default_factory=set)  # subscribed (written by `_subscriber` only)
    _listeners: list[Callable[[str, Any], None]] = field(default_factory=list)
    _gates: dict[str, Callable[[bytes], str | None]] = field(default_factory=dict)
    roles: dict[str, Any] = field(default_factory=dict)
    reachability: Reachability | None = None
    roles_running: bool = False  # every role started (what /healthz reports)
    busy_with: set[str] = field(default_factory=set)  # roles moving bulk data now (see `set_busy`)
    metrics_url: str = ""  # http://HOST:PORT of /metrics and /healthz, when metrics_listen is set
    rejections: dict[str, int] = field(default_factory=dict)  # rejected frames by reason (metrics)
    stats: dict[str, int] = field(default_factory=lambda: {"received": 0, "rejected": 0, "sent": 0, "send_failed": 0})
    peer_news: PeerNews = field(default_factory=PeerNews)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    # -- cores ----------------------------------------------------------------------------

    async def run_core(self, core: Core, name: str, *,
                       task_status: trio.TaskStatus[CoreRunner] = trio.TASK_STATUS_IGNORED) -> None:
        """Drive `core` until cancelled, in the caller's nursery: `runner = await
        nursery.start(node.run_core, core, name)`. Its kinds are routed to it from before it
        starts (frames wait in its inbox) until it stops; its gossip topics are asked of the
        subscriber before `start` returns (subscribed soon after, not yet: a frame gossiped before
        is missed, as any frame gossiped before we joined the topic's mesh), and given up when it
        stops (the subscriber leaves a topic no running core wants)."""
        runner, kinds = CoreRunner(core, self, name=name), tuple(core.kinds)
        topics: tuple[str, ...] = ()
        self._runners.append(runner)
        for kind in kinds:
            self._routes.setdefault(kind, []).append(runner)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(runner.run)
                topics = tuple(set(core.topics))
                self._want_topics(topics, 1)
                task_status.started(runner)
        finally:
            self._want_topics(topics, -1)
            self._runners.remove(runner)
            for kind in kinds:
                routed = self._routes[kind]
                routed.remove(runner)
                if not routed:  # no core handles the kind now: `_gossip_ok` stops forwarding it
                    del self._routes[kind]

    def _want_topics(self, topics: tuple[str, ...], change: int) -> None:
        """One running core more (`change` 1) or fewer (-1) wants each of `topics`."""
        for topic in topics:
            users = self._topic_users.get(topic, 0) + change
            if users:
                self._topic_users[topic] = users
            else:
                del self._topic_users[topic]
        if topics:
            self._topics_changed.set()

    async def _subscriber(self) -> None:
        """Subscribe to every topic some running core wants (`run_core`), each once, and leave one
        once none does. One task does both, one at a time, so that a topic left and wanted again is
        subscribed after it was left, never before (py-libp2p keeps one subscription per topic,
        which a late leave would end); a topic wanted again before it was left stays."""
        async with trio.open_nursery() as nursery:
            while True:
                await self._topics_changed.wait()
                self._topics_changed = trio.Event()  # what changes while this one subscribes wakes the next
                for topic in [t for t in self._topic_users if t not in self._topics]:
                    self._topics.add(topic)
                    await nursery.start(self.host.subscribe, topic, self._on_gossip, self._gossip_ok)
                for topic in [t for t in self._topics if t not in self._topic_users]:
                    self._topics.remove(topic)
                    await self.host.unsubscribe(topic)

    def add_gossip_gate(self, kind: str, gate: Callable[[bytes], str | None]) -> None:
        """Check gossiped frames of `kind` before they are forwarded or decoded in full:
        `gate(frame)` returns None to let the frame on, or why it must be dropped."""
        self._gates[kind] = gate

    def _gossip_ok(self, frame: bytes, forwarder: str) -> bool:
        """GossipSub's validator: forward only frames that are signed by their sender, of a kind
        some core handles, from a sender we have not banned, and that pass their kind's gate.
        Costs a header parse and one signature check, never a body decode."""
        try:
            kind, sender = self.codec.precheck(frame)
        except MessageRejected as exc:
            log.info("gossip from %s not forwarded: %s", forwarder, exc)
            return False
        if sender == self.peer_id:
            return True
        if kind not in self._routes or self.peertable.is_banned(sender, trio.current_time()):
            return False
        gate = self._gates.get(kind)
        refusal = gate(frame) if gate is not None else None
        if refusal is not None:
            self.stats["gated"] = self.stats.get("gated", 0) + 1
            log.info("gossip %s from %s not forwarded: %s", kind, sender, refusal)
            return False
        return True

    def set_busy(self, role: str, busy: bool) -> None:
        """`role` moves bulk data now (or no longer): while any role does, the peer table's
        heartbeats and GossipSub's are spaced further apart (`PeerTable.spacing_s`), since
        every delivered message costs every peer CPU that the transfer needs."""
        was = bool(self.busy_with)
        (self.busy_with.add if busy else self.busy_with.discard)(role)
        now = bool(self.busy_with)
        if now == was:
            return
        timers = self.peertable.set_busy(now)  # the heartbeat already due moves with it
        for runner in self._runners:
            if runner.core is self.peertable:
                runner.command_soon(lambda _now: timers)
        factor = self.peertable.config.busy_heartbeat_factor if now else 1.0  # mesh upkeep: no expiry to respect
        self.host.set_gossip_heartbeat_s(self.config.gossip_heartbeat_s * factor)
        log.info("%s: heartbeats every %.1f s, GossipSub's every %.1f s", "busy" if now else "no longer busy",
                 self.peertable.spacing_s(), self.config.gossip_heartbeat_s * factor)

    def on_event(self, listener: Callable[[str, Any], None]) -> None:
        """Call `listener(core_name, event)` for every `Emit` of every core."""
        self._listeners.append(listener)

    async def peers_changed(self) -> None:
        """Return at the next change of the peer table: a peer joined or left, or a known peer's
        addresses, data address, roles or reachability changed."""
        await self.peer_news.next()

    async def wait_for_peers(self, predicate: Callable[[], bool], timeout_s: float = math.inf) -> bool:
        """Wait until `predicate()` (which reads the peer table, and anything else) holds: True
        then, False after `timeout_s`. Rechecked at every change of the table, never polled;
        something else `predicate` reads that changes on its own is seen at the next change only."""
        return await self.peer_news.until(predicate, timeout_s)

    def carry_out(self, origin: str, effect: Effect) -> None:
        if isinstance(effect, Emit):
            self.peer_news.on_event(origin, effect.event)  # the table changed before it emitted
            for listener in self._listeners:
                listener(origin, effect.event)
            return
        queue = self._dials if isinstance(effect, Connect) and self._dials is not None else self._outbox
        try:
            queue.send_nowait((origin, effect))
        except trio.WouldBlock:
            self.stats["send_failed"] += 1
            log.warning("%s full: dropped %s from %s", "outbox" if queue is self._outbox else "dial queue",
                        type(effect).__name__, origin)

    # -- inbound --------------------------------------------------------------------------

    async def _on_gossip(self, frame: bytes, forwarder: str) -> None:
        self._on_frame(frame, forwarder)

    async def _on_direct(self, frame: bytes, peer: str) -> None:
        if not self._from_banned(peer):  # (it carries it: its own or another's)
            self._on_frame(frame, peer)

    def _from_banned(self, peer: str) -> bool:
        """A frame from a peer we banned, dropped and counted (gossip's are not forwarded either:
        `_gossip_ok`)."""
        if not self.peertable.is_banned(peer, trio.current_time()):
            return False
        self.stats["banned_dropped"] = self.stats.get("banned_dropped", 0) + 1
        return True

    def _on_frame(self, frame: bytes, via: str) -> None:
        try:
            envelope = self.codec.decode(frame, time.time())
        except MessageRejected as exc:
            self.stats["rejected"] += 1
            self.rejections[exc.reason] = self.rejections.get(exc.reason, 0) + 1
            culprit = exc.sender or via
            log.info("rejected %s from %s", exc, culprit)
            if culprit != self.peer_id:
                if (skew := self.peertable.clock_skew.observe(trio.current_time(), culprit, exc)) is not None:
                    log.warning("%s", skew)
                if exc.reason == "stale":
                    return  # a clock off (theirs or ours) is no misbehaviour: dropped, not scored
                for runner in self._runners:
                    runner.rejected(culprit, exc.reason)
            return
        if envelope.sender == self.peer_id:
            return
        if self._from_banned(envelope.sender):  # (signed by it)
            return
        self.stats["received"] += 1
        for runner in self._routes.get(envelope.kind, ()):
            runner.deliver(envelope)

    def inject(self, envelope: Envelope[Any]) -> None:
        """Route an already-decoded envelope (one that arrived some other way, e.g. a reply)."""
        for runner in self._routes.get(envelope.kind, ()):
            runner.deliver(envelope)

    # -- outbound -------------------------------------------------------------------------

    async def _sender(self, outbox: trio.MemoryReceiveChannel[tuple[str, Effect]]) -> None:
        async for origin, effect in outbox:
            try:
                await self._perform(effect)
                self.stats["sent"] += 1
            except PeerUnavailable as exc:
                self.stats["send_failed"] += 1
                log.info("%s: %s failed: %s", origin, type(effect).__name__, exc)

    async def _perform(self, effect: Effect) -> None:
        if isinstance(effect, Publish):
            await self.host.publish(effect.topic, self.codec.encode(effect.body, time.time()))
        elif isinstance(effect, Send):
            frame = self.codec.encode(effect.body, time.time())
            await self.host.send_frame(effect.peer, frame, timeout_s=self.config.send_timeout_s)
        elif isinstance(effect, Connect):
            if effect.peer in self.host.connected_peers():
                return
            errors = []
            deadline = trio.current_time() + CONNECT_BUDGET_S
            for addr in effect.addrs:  # the first that reaches `effect.peer` itself, not whoever listens there
                left_s = deadline - trio.current_time()
                if left_s <= 0:
                    errors.append(f"gave up after {CONNECT_BUDGET_S:g} s")
                    break
                try:
                    await self.host.connect(addr, effect.peer, timeout_s=min(CONNECT_TIMEOUT_S, left_s))
                except (PeerUnavailable, ConfigError) as exc:
                    errors.append(str(exc))
                    continue
                if errors:
                    log.info("connected to %s at %s, not at its addresses before: %s", effect.peer, addr, "; ".join(errors))
                return
            raise PeerUnavailable(f"connect {effect.peer}: {'; '.join(errors) or 'no addresses'}")

    async def publish(self, topic: str, body: object) -> bytes:
        """Gossip `body`, signed now; the frame sent (a worker keeps its submissions' frames)."""
        frame = self.codec.encode(body, time.time())
        await self.host.publish(topic, frame)
        return frame

    async def send(self, peer: str, body: object) -> None:
        await self.host.send_frame(peer, self.codec.encode(body, time.time()), timeout_s=self.config.send_timeout_s)

    async def introduce(self, peer: str) -> bool:
        """Send our latest heartbeat straight to `peer`, whose data plane refused us because it has
        not heard us yet (`NotAdmitted`): it would otherwise wait for our next heartbeat, up to the
        table's `max_interval_s`. What to send is the table's decision (`PeerTable.introduce`, run
        in its runner between its inputs: at most once per heartbeat interval per peer); it is
        carried out here, in the caller's task and in order: a libp2p stream to a peer not
        connected dials only addresses libp2p already knows (none, for a peer we know from its
        gossiped heartbeat alone: the `Send` fails without the `Connect`), and the outbox's
        sender tasks carry effects out concurrently, nothing ordering the two.
        True once sent; False when there was nothing to send, or `peer` could not be reached
        within `send_timeout_s` (counted in `send_failed`, logged: the caller reports the
        refusal as it would have anyway). Call it only on a refusal: it may dial."""
        runner = next((r for r in self._runners if r.core is self.peertable), None)
        if runner is None:
            return False
        effects: list[Effect] = []

        def decide(now: float) -> list[Effect]:
            effects.extend(self.peertable.introduce(now, peer))
            return []  # carried out below, in order

        await runner.command(decide)
        if not effects:
            return False
        try:
            with trio.fail_after(self.config.send_timeout_s):
                for effect in effects:
                    await self._perform(effect)
        except (PeerUnavailable, trio.TooSlowError) as exc:
            self.stats["send_failed"] += 1
            log.info("could not introduce us to %s: %s", peer, str(exc) or f"not within {self.config.send_timeout_s:g} s")
            return False
        self.stats["sent"] += len(effects)  # as `_sender` counts: one per effect carried out
        log.info("introduced us to %s (it refused us as unknown)", peer)
        return True

    def admit_data_peer(self, peer: str) -> str | None:
        """Whom our data plane serves: peers in the peer table that are not banned. A peer refused
        here only because we have not heard it yet sends us its heartbeat directly (its
        `introduce`), so it is admitted at its next try, not after its next heartbeat."""
        if self.peertable.is_banned(peer, trio.current_time()):
            return "banned"
        if self.peertable.get(peer) is None:
            return "not in our peer table (no heartbeat heard)"
        return None

    # -- status ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = trio.current_time()
        return {
            "peer_id": self.peer_id,
            "name": self.config.display_name,
            "addrs": self.host.addrs(),
            "listen_addrs": self.host.bound_addrs(),
            "data_addr": self.dataplane.address,
            "data_listen": self.dataplane.bound,
            "data_connections": self.dataplane.connections(),
            "data_refused": dict(self.dataplane.refused),
            "reachable": self.peertable.local.reachable,
            "heartbeat_interval_s": round(self.peertable.spacing_s(), 3),
            "reachability": self.reachability.status() if self.reachability else None,
            "roles": list(self.config.roles),
            "uptime_s": round(now - self.started_at, 3),
            "connected": sorted(self.host.connected_peers()),
            "peers": [entry.to_json(now) for entry in self.peertable.peers()],
            "messages": dict(self.stats),
            "metrics_url": self.metrics_url,
            "warnings": wide_network_warnings(self.config.metrics_trusted_networks) if self.metrics_url else [],
            "role_status": {name: role.status() for name, role in self.roles.items()},
        }


def _lock_data_dir(data_dir: Path) -> int:
    ensure_data_dir(data_dir)
    try:
        fd = os.open(data_dir / "peer.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise LocalStateError(f"cannot open {data_dir / 'peer.lock'}: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LocalStateError(f"another peer is already running with data directory {data_dir}") from None
    return fd


def _write_peer_file(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, path)


async def run_node(
    config: PeerConfig,
    *,
    sections: dict[str, dict[str, Any]] | None = None,
    peertable_config: PeerTableConfig | None = None,
    identity: Identity | None = None,
    on_ready: Callable[[Node], None] | None = None,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a peer until cancelled. `task_status.started(node)` once it listens and gossips."""
    from p2pnet.roles import build_role

    sections = sections or {}
    lock_fd = _lock_data_dir(config.data_dir)
    peer_file = config.data_dir / "peer.json"
    try:
        identity = identity or load_or_create_identity(config.data_dir)
        set_log_context(identity.peer_id, config.roles)
        codec = Codec(identity, max_age_s=config.max_message_age_s, max_future_s=config.max_future_s)
        dataplane = DataPlane(config.data_host or listen_host(config.listen), config.data_port,
                              announce=config.data_announce, codec=codec, self_id=identity.peer_id)
        control = ControlServer(config.data_dir)
        async with open_host(identity, config.listen, max_frame_bytes=config.max_message_bytes,
                             announce=config.announce, gossip_degree=config.gossip_degree,
                             gossip_heartbeat_s=config.gossip_heartbeat_s) as host, \
                trio.open_nursery() as nursery:
            data_addr = await nursery.start(dataplane.serve)
            free_disk = shutil.disk_usage(config.data_dir).free
            addrs = tuple(host.addrs())
            if len(addrs) > MAX_ADDRS:  # a wildcard listen on a host of many interfaces: a heartbeat holds 16
                log.warning("advertising the first %d of this host's %d addresses (--announce chooses them)",
                            MAX_ADDRS, len(addrs))
                addrs = addrs[:MAX_ADDRS]
            local = LocalInfo(
                addrs=addrs,
                data_addr=data_addr,
                roles=config.roles,
                capacity=Capacity(config.upload_bps, config.download_bps, free_disk),
                name=config.display_name,
            )
            table = PeerTable(peertable_config or PeerTableConfig(), identity.peer_id, local, int(time.time() * 1000))
            outbox_send, outbox_receive = trio.open_memory_channel[tuple[str, Effect]](OUTBOX_SIZE)
            dials_send, dials_receive = trio.open_memory_channel[tuple[str, Effect]](DIAL_QUEUE)
            node = Node(config, identity, codec, host, dataplane, control, table, trio.current_time(), outbox_send,
                        dials_send)
            host.set_frame_handler(node._on_direct)
            dataplane.admit_peer = node.admit_data_peer
            node.reachability = Reachability(node, config.reachability_interval_s)
            for _ in range(SENDER_TASKS):
                nursery.start_soon(node._sender, outbox_receive.clone())
            for _ in range(DIALER_TASKS):
                nursery.start_soon(node._sender, dials_receive.clone())
            nursery.start_soon(node._subscriber)
            if config.metrics_listen:
                from p2pnet.web import serve_peer_http

                node.metrics_url = await nursery.start(serve_peer_http, node, config.metrics_listen)
            await nursery.start(node.run_core, table, PEER_TABLE_CORE)
            notices = Notices(lambda: int(time.time() * 1000))
            notice_runner = await nursery.start(node.run_core, notices, "notices")

            async def status_command(request: dict[str, Any], reply: Reply) -> dict[str, Any]:
                return node.status() | {"notices": notices.to_json()}

            async def announce_command(request: dict[str, Any], reply: Reply) -> dict[str, Any]:
                notice_id, text = str(request.get("notice_id") or os.urandom(8).hex()), str(request.get("text", ""))
                try:
                    notice = Notice(notice_id, text)
                except ValueError as exc:
                    return {"error": str(exc)}
                await notice_runner.command(lambda now: notices.announce(notice.notice_id, notice.text))
                return {"notice_id": notice_id}

            control.register("status", status_command)
            control.register("announce", announce_command)
            for role_name in sorted(config.roles, key=lambda r: r != "relay"):  # others build on relay
                role = build_role(role_name, node, sections.get(role_name, {}))
                node.roles[role_name] = role
                await nursery.start(role.run)
            node.roles_running = True
            await nursery.start(control.serve)
            await nursery.start(node.reachability.run)
            backoff = Backoff(0.2, config.bootstrap_backoff_max_s, random.Random())
            nursery.start_soon(keep_connected, node, config.bootstrap, backoff)
            _write_peer_file(peer_file, {"peer_id": node.peer_id, "addrs": host.addrs(),
                                          "data_addr": data_addr, "pid": os.getpid(),
                                          "metrics_url": node.metrics_url})
            if on_ready is not None:
                on_ready(node)
            task_status.started(node)
    finally:
        peer_file.unlink(missing_ok=True)
        os.close(lock_fd)
