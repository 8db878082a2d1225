"""The libp2p side of a real peer: host, gossip, direct frames and request streams.

Built on py-libp2p with Noise as the only security transport and yamux as the only muxer, so a
plaintext peer fails the handshake. Gossip is GossipSub; direct messages are length-prefixed
frames on `MSG_PROTOCOL`, one stream kept per peer we send to (`p2pnet.direct`); a request and
its answer take a stream of their own. Frames are opaque here: the node decodes and checks them
with the codec.

py-libp2p leaks sockets, tasks and a thread unless the host is closed inside `run()` and the
pubsub seen-message cache is stopped; `open_host` does both on the way out. It also blocks
every dial to a peer for 60 s after one failed (a negative cache); `connect` lifts that block,
since the callers pace their retries themselves. It dials only the first TCP address it knows of
a peer, so `connect(addr)` puts `addr` first; with the peer expected, an address that names or
answers as another peer fails as no longer that peer's (and is dropped from what py-libp2p
knows of it). Its AutoConnector (which re-dials every peer
it ever met, forever) is turned off: whom to dial is p2pnet's decision. It listens with
SO_REUSEPORT and runs on, listening on nothing, when a listen fails; `open_host` probes the
address first and checks what was bound, so both are a `ConfigError("peer.listen")`. Its ERROR
lines for a failed dial or handshake, which its callers are told of and we report, are DEBUG
lines (`adopt_libp2p_logging`); a failed security handshake is named in `connect`'s error. Bulk
bytes never travel here (see `p2pnet.dataplane`).

Yamux flow control: py-libp2p 0.8.1 by default returns receive credit after every read
(`PY_YAMUX_RELEASE_ON_READ`), and its gossip reader reads each RPC's length prefix one byte at a
time, so every gossip RPC received cost the receiver three WINDOW_UPDATE frames (each
Noise-encrypted, sent, then decrypted and handled by the sender). `open_host` sets that variable
to "0" unless the environment already sets it: one update per RPC (its first read still credits
the new data), the rest batched until half the window was read, as go-yamux does (measured: 9
idle relay peers' CPU 0.24 -> 0.18 CPU-s per second). Gossip streams are also read through a
read-ahead buffer (`_ReadAheadStream`), so that reader's byte-wise prefix reads no longer each
reach yamux; with the peer record left unbuilt and repeated signature checks remembered
(`p2pnet.identity.SignatureChecker`), 9 idle relay peers use about 0.87x the CPU they did
(benchmarks/results/relay_loopback.md).
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import multiaddr
import trio

from p2pnet.addresses import advertised_addrs, interface_ips, is_wildcard
from p2pnet.direct import KeptStreams, bounded_reset as _bounded_reset, quiet_close as _quiet_close, \
    quiet_reset as _quiet_reset
from p2pnet.direct import FrameHandler, pack_frame, read_frame, receive_frames
from p2pnet.errors import ConfigError, MessageRejected, PeerUnavailable
from p2pnet.identity import Identity, peer_id_to_str

log = logging.getLogger(__name__)

MSG_PROTOCOL = "/p2pnet/msg/1.0.0"
GOSSIP_PROTOCOL = "/meshsub/1.0.0"
YAMUX_RELEASE_ON_READ = "PY_YAMUX_RELEASE_ON_READ"  # py-libp2p's switch: "0" batches receive credit
_PEERSTORE_TTL_S = 120  # what py-libp2p's own `connect` gives the addresses it is handed
CONNECT_TIMEOUT_S = 10.0  # a dial and its security handshake (a real one takes well under a second)

RequestHandler = Callable[[bytes, str, "str | None"], Awaitable["bytes | None"]]


def parse_multiaddr(text: str, field: str) -> multiaddr.Multiaddr:
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:  # multiaddr raises a zoo of types for malformed text
        raise ConfigError(field, f"not a multiaddr: {text!r} ({exc})") from exc


def dialable_problem(text: str, *, with_peer: bool) -> str | None:
    """Why `text` is not an address another host can dial (None if it is): a multiaddr with an
    IP that is not a wildcard (or a DNS name) and a TCP port above 0, with a valid /p2p/<peer
    id> when `with_peer` (a bootstrap address)."""
    from libp2p.peer.peerinfo import info_from_p2p_addr

    try:
        addr = multiaddr.Multiaddr(text)
    except Exception as exc:  # multiaddr raises a zoo of types for malformed text
        return f"{text!r} is not a multiaddr ({exc})"
    values = {p.name: addr.value_for_protocol(p.code) for p in addr.protocols()}
    host = next((values[n] for n in ("ip4", "ip6", "dns", "dns4", "dns6") if n in values), None)
    if host is None or "tcp" not in values:
        return f"{text!r} names no IP (or DNS name) and TCP port, as /ip4/203.0.113.7/tcp/4001 does"
    if is_wildcard(str(host)) or int(values["tcp"]) == 0:
        return f"{text!r} is a wildcard or port 0: nobody can dial it"
    if with_peer and "p2p" not in values:
        return f"{text!r} has no /p2p/<peer id>"
    if with_peer:
        try:
            info_from_p2p_addr(addr)
        except Exception:  # (as above)
            return f"{text!r} does not end in /p2p/<peer id>"
    return None


class Host:
    """A started libp2p host with gossip. Use `open_host`; do not construct directly."""

    def __init__(self, host, pubsub, identity: Identity, max_frame_bytes: int, announce: tuple[str, ...] = ()) -> None:
        self._host = host
        self._pubsub = pubsub
        self.identity = identity
        self.max_frame_bytes = max_frame_bytes
        self.announce = announce
        self._frame_handler: FrameHandler | None = None
        self._advertised: list[str] | None = None
        self._direct = KeptStreams(self._open_message_stream)

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def bound_addrs(self) -> list[str]:
        """What the host listens on, ports resolved (may be a wildcard such as 0.0.0.0)."""
        return [str(a) for a in self._host.get_addrs()]

    def addrs(self) -> list[str]:
        """Full multiaddrs (with the /p2p/ id) that other hosts can dial: see `p2pnet.addresses`."""
        if self._advertised is None:
            self._advertised = advertised_addrs(self.bound_addrs(), self.announce, interface_ips(), self.peer_id)
        return list(self._advertised)

    def connected_peers(self) -> list[str]:
        return [p.to_base58() for p in self._host.get_connected_peers()]

    # -- gossip ---------------------------------------------------------------------------

    async def publish(self, topic: str, frame: bytes) -> None:
        await self._pubsub.publish(topic, frame)

    async def subscribe(self, topic: str, handler: FrameHandler,
                        validator: Callable[[bytes, str], bool] | None = None, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Deliver every frame gossiped on `topic` to `handler(frame, forwarding_peer)` until
        `unsubscribe(topic)`; `task_status.started()` once subscribed.

        `validator(frame, forwarding_peer)`, if given, runs before GossipSub forwards a frame to
        anyone: a frame it refuses is neither forwarded nor delivered."""
        if validator is not None:
            self._pubsub.set_topic_validator(
                topic, lambda forwarder, msg: validator(msg.data, _peer_text(forwarder.to_bytes())), False)
        subscription = await self._pubsub.subscribe(topic)
        task_status.started()
        async for msg in subscription:  # ends when `unsubscribe` closes it
            source = _peer_text(msg.from_id)
            await handler(msg.data, source)

    async def unsubscribe(self, topic: str) -> None:
        """Leave `topic`: our peers are told (and take us out of its mesh), and its `subscribe`
        returns once it has handed on what it had received."""
        await self._pubsub.unsubscribe(topic)
        self._pubsub.remove_topic_validator(topic)

    # -- direct frames --------------------------------------------------------------------

    def set_gossip_heartbeat_s(self, seconds: float) -> None:
        """Space GossipSub's own heartbeats (mesh upkeep, IHAVE gossip) `seconds` apart from the
        next one on: its loop reads the interval anew each time."""
        self._pubsub.router.heartbeat_interval = seconds

    def set_frame_handler(self, handler: FrameHandler) -> None:
        self._frame_handler = handler

    async def send_frame(self, peer: str, frame: bytes, *, timeout_s: float = 10.0) -> None:
        """Send one frame to `peer` on the stream kept for it (`p2pnet.direct`); PeerUnavailable
        if it cannot be within `timeout_s`."""
        await self._direct.send(peer, frame, timeout_s=timeout_s)

    async def connect(self, addr: str, peer: str | None = None, *, timeout_s: float = CONNECT_TIMEOUT_S) -> str:
        """Dial a full multiaddr (with /p2p/); returns the peer id reached (Noise proved it).
        PeerUnavailable when it has not within `timeout_s`: py-libp2p's dial and handshake have no
        deadline, and an address that accepts and says nothing (or drops our SYNs) held the dial,
        and with it one of the node's few senders, for good.

        With `peer`, the address must belong to that peer: one whose /p2p/ names another peer is
        not dialled, and one where another peer answers (Noise refuses its key) fails the dial;
        both raise `PeerUnavailable` saying the address no longer belongs to `peer` (a stale
        address, one reused by another peer after a NAT rebinding or a restart with a new key)."""
        from libp2p.peer.peerinfo import info_from_p2p_addr

        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as exc:
            if peer is not None:  # an address that peer advertised, not one of our settings
                raise PeerUnavailable(f"{addr!r}, advertised by {peer}: not a full multiaddr with /p2p/") from exc
            raise ConfigError("bootstrap", f"not a full multiaddr with /p2p/: {addr!r}") from exc
        named = info.peer_id.to_base58()
        if peer is not None and named != peer:
            raise PeerUnavailable(f"{addr}: the address no longer belongs to {peer} (it names {named}); not dialled")
        # py-libp2p refuses to dial a peer for 60 s after a failed dial (its negative cache);
        # our callers pace their own retries (p2pnet.connectivity), so a dial here is a real one
        negative = getattr(self._host.get_network(), "_negative_peer_cache", None)
        if negative is not None:
            negative.evict(str(info.peer_id))
        # py-libp2p dials only the first TCP address it knows of a peer: `addr` goes first
        self._known_addrs(info.peer_id, first=info.addrs)
        try:
            with trio.fail_after(timeout_s):
                await self._host.connect(info)
        except trio.TooSlowError:
            raise PeerUnavailable(f"{addr}: no connection within {timeout_s:g} s") from None
        except Exception as exc:
            if _another_key_answered(exc):
                self._known_addrs(info.peer_id, drop=info.addrs)  # not that peer's: never dialled for it again
                raise PeerUnavailable(f"{addr}: the address no longer belongs to {named} "
                                      "(another peer answers there)") from exc
            handshake = _security_failure(exc)
            if handshake is not None:  # py-libp2p's own ERROR line said this, and is a DEBUG one now
                raise PeerUnavailable(f"{addr}: the security handshake failed: {handshake}") from exc
            raise PeerUnavailable(f"{addr}: {type(exc).__name__}: {exc}") from exc
        return named

    def _known_addrs(self, peer_id: Any, *, first: Any = (), drop: Any = ()) -> None:
        """Rewrite the addresses py-libp2p's peerstore keeps for `peer_id`: `first` ahead of the
        others, `drop` removed."""
        from libp2p.peer.peerstore import PeerStoreError

        store = self._host.get_peerstore()
        try:
            known = list(store.addrs(peer_id))
        except PeerStoreError:  # none, or expired
            known = []
        wanted = [a for a in dict.fromkeys([*first, *known]) if a not in drop]
        if wanted != known:  # (a clear also drops the peer's signed record, if py-libp2p holds one)
            store.clear_addrs(peer_id)
            store.add_addrs(peer_id, wanted, _PEERSTORE_TTL_S)

    # -- request/response streams ------------------------------------------------------------

    def set_request_handler(self, protocol: str, handler: RequestHandler, *, timeout_s: float = 30.0) -> None:
        """Serve `protocol`: one request frame in, one answer frame out, per stream.

        `handler(frame, peer, observed_ip)` gets the IP the requester's connection comes from
        (None when unknown); it returns the answer frame, or None to close without one."""

        async def on_stream(stream) -> None:
            try:
                peer = stream.muxed_conn.peer_id.to_base58()
                with trio.fail_after(timeout_s):
                    frame = await read_frame(stream, peer, self.max_frame_bytes)
                    remote = stream.get_remote_address()
                    answer = await handler(frame, peer, remote[0] if remote else None)
                    if answer is not None:
                        await stream.write(pack_frame(answer))
                await stream.close()
            except MessageRejected as exc:
                log.info("%s request rejected: %s", protocol, exc)
                await _bounded_reset(stream)
            except Exception as exc:  # noqa: BLE001 - a broken inbound stream is the remote's problem
                log.debug("%s inbound stream failed: %s: %s", protocol, type(exc).__name__, exc)
                await _bounded_reset(stream)

        self._host.set_stream_handler(protocol, on_stream)

    async def request(self, peer: str, protocol: str, frame: bytes, *, timeout_s: float = 10.0) -> bytes:
        """Send one frame on a new `protocol` stream to `peer` and return the answer frame."""
        from libp2p.peer.id import ID

        try:
            with trio.fail_after(timeout_s):
                stream = await self._host.new_stream(ID.from_base58(peer), [protocol])
                try:
                    await stream.write(pack_frame(frame))
                    return await read_frame(stream, peer, self.max_frame_bytes)
                finally:
                    await _quiet_close(stream)
        except trio.TooSlowError as exc:
            raise PeerUnavailable(f"{peer}: no answer on {protocol} within {timeout_s}s") from exc
        except MessageRejected:
            raise
        except Exception as exc:  # libp2p signals unreachable peers with many exception types
            raise PeerUnavailable(f"{peer}: {protocol}: {type(exc).__name__}: {exc}") from exc

    async def _on_stream(self, stream) -> None:
        """An inbound message stream: its frames, until it ends (`p2pnet.direct`)."""
        try:
            peer = stream.muxed_conn.peer_id.to_base58()
        except Exception as exc:  # a stream whose connection is already gone: the remote's problem
            log.debug("inbound stream without a peer: %s: %s", type(exc).__name__, exc)
            await _bounded_reset(stream)
            return
        await receive_frames(stream, peer, self.max_frame_bytes, self._deliver)

    async def _deliver(self, frame: bytes, peer: str) -> None:
        if self._frame_handler is not None:
            await self._frame_handler(frame, peer)

    async def _open_message_stream(self, peer: str):
        from libp2p.peer.id import ID

        return await self._host.new_stream(ID.from_base58(peer), [MSG_PROTOCOL])


_RECORDLESS_HOSTS: "weakref.WeakSet" = weakref.WeakSet()


def _leave_records_unbuilt(host) -> None:
    """py-libp2p builds its signed peer record for every message GossipSub forwards and every
    control RPC (listing and re-parsing the host's addresses, then serialising the envelope: a
    millisecond each under a profiler, the largest single item of an idle peer's gossip
    forwarding) before `SerialPubsub.write_msg` strips it again. For `host`, the pubsub modules'
    record builder returns an empty record instead, which that strip removes all the same."""
    import libp2p.pubsub.gossipsub as gossipsub_module
    import libp2p.pubsub.pubsub as pubsub_module

    _RECORDLESS_HOSTS.add(host)
    for module in (gossipsub_module, pubsub_module):
        build = module.env_to_send_in_RPC
        if getattr(build, "p2pnet_recordless", False):
            continue

        def env_to_send_in_RPC(host, _build=build) -> tuple[bytes, bool]:
            if host in _RECORDLESS_HOSTS:
                return b"", False
            return _build(host)

        env_to_send_in_RPC.p2pnet_recordless = True  # type: ignore[attr-defined]
        module.env_to_send_in_RPC = env_to_send_in_RPC


def _serial_pubsub(pubsub_class: Any) -> Any:  # (py-libp2p's Pubsub, imported lazily)
    """py-libp2p's Pubsub with one writer at a time per gossip stream.

    yamux writes a message over 64 KiB as several frames and takes the stream's lock per frame,
    and py-libp2p 0.8.1 writes to a peer's gossip stream from more than one task (its outbound
    queue, and the flush of messages held until the peer's subscriptions arrive), so two large
    messages interleaved and the receiver dropped the stream as "not a pubsub RPC": a manifest
    over 64 KiB published at start-up cut a relay off from the trainer's gossip for good. A
    write that fails or is cancelled part way leaves a message cut short, so the stream is
    reset then rather than left to be misread."""

    class SerialPubsub(pubsub_class):
        def __init__(self, *args, send_peer_record: bool = True, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._write_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
            self._send_peer_record = send_peer_record

        def get_hello_packet(self):
            return self._without_record(super().get_hello_packet())

        def _build_announce_rpc(self, topic_id: str, subscribe: bool):
            packet, subopt = super()._build_announce_rpc(topic_id, subscribe)
            return self._without_record(packet), subopt

        def _without_record(self, rpc_msg):
            """py-libp2p puts its signed peer record on every RPC, and every receiver checks its
            Ed25519 signature and rewrites its peerstore entry; p2pnet's frames carry their own
            signatures and its peer table carries addresses, so by default the record is left off."""
            if not self._send_peer_record and rpc_msg.HasField("senderRecord"):
                rpc_msg.ClearField("senderRecord")
            return rpc_msg

        async def write_msg(self, stream, rpc_msg) -> bool:
            self._without_record(rpc_msg)
            lock = self._write_locks.get(stream)
            if lock is None:
                lock = self._write_locks[stream] = trio.Lock()
            async with lock:
                try:
                    return await super().write_msg(stream, rpc_msg)
                except BaseException:
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        await _quiet_reset(stream)
                    raise

    return SerialPubsub


class _ReadAheadStream:
    """A gossip stream as py-libp2p's pubsub reads it, with reads served from one buffer.

    Its reader takes each RPC's varint length prefix one `read(1)` at a time and then the body,
    and every read of a yamux stream takes three locks and runs yamux's credit bookkeeping. Here
    one read of the underlying stream takes whatever has arrived (up to `READ_AHEAD` bytes: a
    whole RPC, often several) and the prefix and body come out of that buffer. Anything else
    (`muxed_conn`, `reset`, ...) is the stream's own."""

    READ_AHEAD = 64 * 1024

    def __init__(self, stream) -> None:
        self._stream = stream
        self._buf = b""
        self._pos = 0

    async def read(self, n: int | None = None) -> bytes:
        if self._pos >= len(self._buf):
            self._buf, self._pos = await self._stream.read(self.READ_AHEAD), 0
        end = len(self._buf) if n is None or n < 0 else self._pos + n
        out = self._buf[self._pos:end]
        self._pos += len(out)
        return out

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _guarded_gossip_handler(pubsub):
    """py-libp2p's pubsub lets a protobuf DecodeError from a peer's garbage RPC escape its stream
    handler, which takes the whole host down. Drop that peer's stream instead. The stream is read
    through `_ReadAheadStream`."""
    from google.protobuf.message import DecodeError

    async def handler(stream) -> None:
        try:
            await pubsub.stream_handler(_ReadAheadStream(stream))
        except DecodeError as exc:
            peer = stream.muxed_conn.peer_id
            log.info("gossip from %s is not a pubsub RPC (%s); stream dropped", peer, exc)
            await _bounded_reset(stream)
            pubsub._handle_dead_peer(peer)

    return handler


def _peer_text(raw: bytes) -> str:
    """A libp2p peer id's base58 text (`p2pnet.identity.peer_id_to_str`, which remembers the
    ids it has seen): called for every gossiped copy, by the validator and by the subscriber."""
    return peer_id_to_str(raw)


@asynccontextmanager
async def open_host(
    identity: Identity,
    listen: str,
    *,
    max_frame_bytes: int = 4 * 1024 * 1024,
    gossip_heartbeat_s: float = 1.0,
    gossip_degree: int = 6,
    announce: tuple[str, ...] = (),
    send_peer_record: bool = False,
) -> AsyncIterator[Host]:
    """Start a Noise+yamux libp2p host with GossipSub on `listen`; close everything on exit.

    `send_peer_record` puts py-libp2p's signed peer record on every gossip RPC (its default);
    p2pnet leaves it off (see `_serial_pubsub`)."""
    from libp2p import new_host
    from libp2p.crypto.x25519 import create_new_key_pair as new_x25519
    from libp2p.pubsub.gossipsub import GossipSub
    from libp2p.pubsub.pubsub import Pubsub
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux
    from libp2p.tools.anyio_service import background_trio_service

    adopt_libp2p_logging()
    os.environ.setdefault(YAMUX_RELEASE_ON_READ, "0")  # read per call by py-libp2p; see the module docstring
    listen_addr = parse_multiaddr(listen, "peer.listen")
    ip, port = _tcp_listen_target(listen_addr, listen)
    _probe_bind(ip, port, listen)
    key_pair = identity.libp2p_key_pair()
    security = {NOISE_ID: NoiseTransport(key_pair, noise_privkey=new_x25519().private_key)}
    raw_host = new_host(
        key_pair=key_pair,
        sec_opt=security,
        muxer_opt={YAMUX_ID: Yamux},
        listen_addrs=[listen_addr],
    )
    _disable_auto_connector(raw_host.get_network())
    if not send_peer_record:
        _leave_records_unbuilt(raw_host)
    gossip = GossipSub(
        protocols=[GOSSIP_PROTOCOL],
        degree=gossip_degree,
        degree_low=max(1, gossip_degree * 2 // 3),
        degree_high=2 * gossip_degree,
        heartbeat_interval=gossip_heartbeat_s,
        heartbeat_initial_delay=0.1,
        max_messages_per_topic_per_second=1000.0,
    )
    pubsub = _serial_pubsub(Pubsub)(raw_host, gossip, max_inbound_rpc_size=max_frame_bytes + 64 * 1024,
                                    send_peer_record=send_peer_record)
    host = Host(raw_host, pubsub, identity, max_frame_bytes, announce)
    raw_host.set_stream_handler(MSG_PROTOCOL, host._on_stream)
    raw_host.set_stream_handler(GOSSIP_PROTOCOL, _guarded_gossip_handler(pubsub))
    async with raw_host.run(listen_addrs=[listen_addr]):
        try:
            _check_listening(host.bound_addrs(), port, listen)
            async with background_trio_service(pubsub), background_trio_service(gossip):
                await pubsub.wait_until_ready()
                yield host
        finally:
            with trio.CancelScope(shield=True):
                pubsub.seen_messages.stop()  # its sweeper thread outlives the host otherwise
                with trio.move_on_after(5):
                    await raw_host.close()


def adopt_libp2p_logging() -> None:
    """Send libp2p's log records through our handlers, levels and format.

    Importing py-libp2p 0.8.1 makes its `libp2p` logger stop propagating, at WARNING, with no
    handler (so its lines reach stderr bare, through logging's last resort), unless LIBP2P_DEBUG
    is set, in which case its own setup stands. Its ERROR lines for a failed TCP dial or handshake
    become DEBUG ones (`_QuietDialFailures`)."""
    if os.environ.get("LIBP2P_DEBUG"):
        return
    root = logging.getLogger("libp2p")
    root.handlers.clear()
    root.setLevel(logging.NOTSET)
    root.propagate = True
    quiet = {"libp2p.transport.tcp.tcp": ("Failed to open TCP stream",), **HANDSHAKE_FAILURES}
    for name, prefixes in quiet.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietDialFailures) for f in logger.filters):
            logger.addFilter(_QuietDialFailures(prefixes))


class _QuietDialFailures(logging.Filter):
    """py-libp2p logs every failed TCP dial as an ERROR; our callers report dial failures
    themselves, so that line is a DEBUG one (dropped unless DEBUG is on for its logger).

    So are its ERROR lines for a failed security or muxer handshake (`HANDSHAKE_FAILURES`: on a
    dial, 2 lines for each of its 4 tries when what answers speaks no libp2p, 1 for each when
    another key answers): each is raised to its caller right after, and `Host.connect` names the
    cause in the `PeerUnavailable` its callers log (`_security_failure`). A failed inbound
    security handshake (a stranger, a port scanner) is already a DEBUG line of py-libp2p's."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and record.getMessage().startswith(self.prefixes):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


HANDSHAKE_FAILURES = {  # py-libp2p 0.8.1's ERROR lines for a handshake that failed, by logger
    "libp2p.network.swarm": ("failed to upgrade security for peer", "fail to upgrade mux for peer"),
    "libp2p.protocol_muxer.multiselect_client": ("MultiselectClient handshake: ", "MultiselectClient: invalid "
                                                 "handshake"),
    "libp2p.security.noise.patterns": ("Noise XX handshake_outbound: signature verification failed",),
    "libp2p.security.noise.messages": ("verify_handshake_payload_sig: verification exception",),
}


def _disable_auto_connector(network) -> None:
    """Turn off py-libp2p's AutoConnector, which dials every peer its peerstore ever held
    whenever we have fewer than 100 connections, forever (reported: 84 failed-dial ERROR lines per
    departed peer in 20 minutes, 3 attempts per dial). Whom we dial is p2pnet's business: peers
    that join our peer table (its Connect effects) and, when we are alone, bootstrap and known
    peers (`p2pnet.connectivity`); a peer that expired from the table is not dialled again."""
    from libp2p.network.auto_connector import AutoConnector

    class Disabled(AutoConnector):
        async def start(self) -> None:  # never started: maybe_connect and its task do nothing
            return

    network.auto_connector = Disabled(network, network.connection_config.auto_connect_interval)


def _tcp_listen_target(addr: multiaddr.Multiaddr, listen: str) -> tuple[str, int]:
    """The (ip, port) of an /ip4|ip6/.../tcp/PORT listen multiaddr; ConfigError for anything else."""
    names = [p.name for p in addr.protocols()]
    if len(names) != 2 or names[0] not in ("ip4", "ip6") or names[1] != "tcp":
        raise ConfigError("peer.listen", f"cannot listen on {listen}: only /ip4/IP/tcp/PORT or /ip6/IP/tcp/PORT "
                          "is supported")
    return addr.value_for_protocol(names[0]), int(addr.value_for_protocol("tcp"))


def _probe_bind(ip: str, port: int, listen: str) -> None:
    """Bind (ip, port) once, without SO_REUSEPORT, and let go: ConfigError when that fails.

    py-libp2p 0.8.1 listens with SO_REUSEADDR and SO_REUSEPORT (for hole punching), so a second
    peer on a port a running one holds would bind too, and the kernel would split incoming
    connections between them. A socket without SO_REUSEPORT cannot share a port with a listening
    one, so this probe refuses a taken port, and an IP this host does not have, before libp2p
    starts. SO_REUSEADDR keeps a port whose old connections linger in TIME_WAIT usable."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((ip, port))
            probe.listen(1)
        except OSError as exc:
            raise ConfigError("peer.listen", f"cannot listen on {listen}: {exc.strerror or exc}") from exc


def _check_listening(bound: list[str], port: int, listen: str) -> None:
    """py-libp2p logs a failed listen and runs on listening on nothing: refuse that here."""
    if not bound:
        raise ConfigError("peer.listen", f"cannot listen on {listen}: the libp2p host bound no address")
    if port and not any(a.split("/p2p/")[0].endswith(f"/tcp/{port}") for a in bound):
        raise ConfigError("peer.listen", f"cannot listen on {listen}: the libp2p host bound {', '.join(bound)} "
                          f"instead")


def _another_key_answered(exc: BaseException) -> bool:
    """Whether a failed dial failed because the peer that answered is not the one dialled (Noise's
    `PeerIDMismatchesPubkey`, somewhere in py-libp2p's chain of wrapped and gathered errors)."""
    from libp2p.security.noise.exceptions import PeerIDMismatchesPubkey

    return any(isinstance(err, PeerIDMismatchesPubkey) for err in _causes(exc))


def _security_failure(exc: BaseException) -> str | None:
    """What a dial's failed security handshake says (py-libp2p's `SecurityUpgradeFailure` in the
    chain, and the error it wraps), or None when the dial failed otherwise."""
    from libp2p.transport.exceptions import SecurityUpgradeFailure

    for err in _causes(exc):
        if isinstance(err, SecurityUpgradeFailure):
            return f"{err}: {err.__cause__}" if err.__cause__ is not None else str(err)
    return None


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every error in py-libp2p's chain of wrapped and gathered errors under it, once."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        err = todo.pop()
        if id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo.extend(e for e in (err.__cause__, err.__context__) if e is not None)
        todo.extend(e for e in getattr(err, "errors", ()) if isinstance(e, BaseException))
