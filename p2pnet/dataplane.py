"""The data plane: direct trio TCP connections for bulk bytes, with length-prefixed frames.

libp2p streams move 13-18x fewer bytes per second than plain TCP here (DESIGN.md), so bulk
transfers open a direct TCP connection to the address a peer advertises in its heartbeat. Every
connection starts with a handshake in which both ends prove their peer ids and the client names
the channel (for example `relay/chunks`), so one listener serves all roles and each handler
knows who it serves (`p2pnet.handshake`). Connections are bounded in all and per peer, and a
handshake must finish within a deadline (`DataPlaneLimits`). Bytes are still not trusted:
receivers hash everything they read.

Frames are `u32 big-endian length || bytes`. `FrameReader` refuses frames over its limit and
reports a connection that ends inside a frame as `TruncatedStream`, never as a short frame.
Bulk payloads (`exactly_into`) are received straight into a buffer (the caller's, reused, or a
fresh one) with `recv_into`: no intermediate bytes objects, no copies out of a shared buffer.
`send_file` sends a byte range of a file with `os.sendfile`: the kernel copies from the page
cache to the socket, and the bytes never enter Python.
"""

from __future__ import annotations

import errno
import math
import logging
import os
import struct
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

from p2pnet.addresses import advertised_data_addr, interface_ips, join_host_port, parse_host_port
from p2pnet.errors import ConfigError, LocalStateError, MessageRejected, PeerUnavailable
from p2pnet.handshake import WrongPeer, client_handshake, server_handshake  # noqa: F401 (WrongPeer re-exported)
from p2pnet.wire import Codec

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
HELLO_MAX_BYTES = 4096

DataHandler = Callable[[trio.SocketStream, "FrameReader", str], Awaitable[None]]  # stream, reader, peer id


class TruncatedStream(PeerUnavailable):
    """The remote closed the connection in the middle of a frame."""


class FrameReader:
    """Reads length-prefixed frames (and raw byte runs) from a trio stream, buffered."""

    def __init__(self, stream: trio.abc.ReceiveStream, *, max_frame_bytes: int, read_bytes: int = 64 << 10) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self.max_frame_bytes = max_frame_bytes
        self._read_bytes = read_bytes  # per read while looking for frames; bulk bytes bypass it
        sock = getattr(stream, "socket", None)  # a trio SocketStream: receive bulk bytes in place
        self._recv_into = getattr(sock, "recv_into", None)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet read out: the start of a frame under way (or more)."""
        return len(self._buffer)

    async def _fill(self, n: int) -> bool:
        while len(self._buffer) < n:
            data = await self._stream.receive_some(max(self._read_bytes, n - len(self._buffer)))
            if not data:
                return False
            self._buffer += data
        return True

    async def frame(self) -> bytes | None:
        """The next frame, or None at a clean end of stream between frames."""
        if not await self._fill(_LEN.size):
            if self._buffer:
                raise TruncatedStream(f"stream ended inside a frame header ({len(self._buffer)} bytes)")
            return None
        (length,) = _LEN.unpack_from(self._buffer)
        if length > self.max_frame_bytes:
            raise MessageRejected("oversized", f"frame of {length} bytes > {self.max_frame_bytes}")
        if not await self._fill(_LEN.size + length):
            raise TruncatedStream(f"stream ended after {len(self._buffer) - _LEN.size} of {length} bytes")
        data = bytes(self._buffer[_LEN.size : _LEN.size + length])
        del self._buffer[: _LEN.size + length]
        return data

    async def exactly(self, n: int) -> bytes:
        if not await self._fill(n):
            raise TruncatedStream(f"stream ended after {len(self._buffer)} of {n} bytes")
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    async def exactly_into(self, n: int, into: bytearray | None = None) -> bytearray:
        """The next `n` raw bytes (bulk payloads), in the first `n` bytes of `into` (a buffer the
        caller reuses) or in a new bytearray of their own.

        Whatever is already buffered is copied once; the rest is received in place. A
        connection that ends (or breaks) first raises `TruncatedStream`.
        """
        out = into if into is not None else bytearray(n)
        if len(out) < n:
            raise ValueError(f"a buffer of {len(out)} bytes cannot take {n}")
        view = memoryview(out)[:n]
        filled = min(len(self._buffer), n)
        view[:filled] = self._buffer[:filled]
        del self._buffer[:filled]
        while filled < n:
            if self._recv_into is not None:
                try:
                    got = await self._recv_into(view[filled:])
                except OSError as exc:
                    raise TruncatedStream(f"stream broke after {filled} of {n} bytes: {exc}") from exc
            else:
                data = await self._stream.receive_some(n - filled)
                got = len(data)
                view[filled:filled + got] = data
            if not got:
                raise TruncatedStream(f"stream ended after {filled} of {n} bytes")
            filled += got
        return out


async def send_frame(stream: trio.abc.SendStream, frame: bytes) -> None:
    await stream.send_all(_LEN.pack(len(frame)) + frame)


async def send_file(stream: trio.SocketStream, fd: int, offset: int, count: int, *,
                    idle_s: float = math.inf) -> None:
    """Send `count` bytes of the open file `fd` from `offset` with `os.sendfile` (no copy into
    Python). The caller must be the stream's only sender meanwhile (hold its send lock). A peer
    that hangs up raises `trio.BrokenResourceError`; a file shorter than asked, OSError; a peer
    that takes nothing for `idle_s` seconds, `trio.TooSlowError` (the time between two writes,
    as HTTP servers' send timeouts count, not the whole: a slow reader on a slow link is not a
    stalled one)."""
    sock = stream.socket
    with trio.CancelScope(deadline=trio.current_time() + idle_s) as stalled:
        while count:
            try:
                sent = os.sendfile(sock.fileno(), fd, offset, count)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                continue
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise trio.BrokenResourceError(f"the peer hung up: {exc}") from exc
            if sent == 0:
                raise OSError(errno.EIO, f"the file ended {count} bytes early")
            offset += sent
            count -= sent
            stalled.deadline = trio.current_time() + idle_s
            await trio.lowlevel.checkpoint()
    if stalled.cancelled_caught:
        raise trio.TooSlowError(f"the reader took nothing for {idle_s:g} s")


def frame_header(length: int) -> bytes:
    return _LEN.pack(length)


@dataclass(frozen=True)
class DataPlaneLimits:
    """What one remote peer, and everyone together, can make our data plane hold."""

    max_connections: int = 512  # authenticated connections in all
    max_connections_per_peer: int = 8  # authenticated connections of one peer
    max_handshaking: int = 128  # connections not yet authenticated, in all
    max_handshaking_per_ip: int = 16  # ... from one IP address (strangers cannot crowd out the rest)
    handshake_timeout_s: float = 5.0  # to finish the handshake after connecting
    # channels registered known_only=False admit any identity, and identities cost nothing:
    max_open_channel_connections: int = 64  # authenticated connections to them, in all (< max_connections)
    max_open_channel_connections_per_ip: int = 8  # ... from one IP address (a few peers behind one NAT)


class DataPlane:
    """A TCP listener whose connections prove their peer ids (`p2pnet.handshake`) and are then
    routed by channel. A channel registered `known_only` (the default) serves only peers that
    `admit` accepts (the node: present in the peer table and not banned); one open to all takes
    at most `max_open_channel_connections` of our connections (and a few per IP), so that
    strangers, whose identities cost nothing, cannot crowd the known peers out."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, announce: str = "", codec: Codec | None = None,
                 self_id: str = "", admit: Callable[[str], str | None] | None = None,
                 limits: DataPlaneLimits = DataPlaneLimits()) -> None:
        self.host = host
        self.port = port
        self.announce = announce
        self.codec = codec
        self.self_id = self_id
        self.admit_peer = admit or (lambda peer: "this peer is still starting")  # the node sets its own
        self.limits = limits
        self._handlers: dict[str, tuple[DataHandler, bool]] = {}
        self._open = 0
        self._handshaking: dict[str, int] = {}  # remote IP -> connections in the handshake
        self._per_peer: dict[str, int] = {}
        self._open_to_all: dict[str, int] = {}  # remote IP -> connections to channels open to all
        self.refused: dict[str, int] = {}  # why -> connections refused
        self.address = ""  # what other peers dial (see p2pnet.addresses)
        self.bound = ""  # what we listen on

    def register(self, channel: str, handler: DataHandler, *, known_only: bool = True) -> None:
        if channel in self._handlers:
            raise ValueError(f"data channel {channel!r} registered twice")
        self._handlers[channel] = (handler, known_only)

    def connections(self) -> dict[str, int]:
        return dict(self._per_peer)

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        except OSError as exc:
            raise ConfigError("peer.data_host", f"cannot listen on {self.host}:{self.port}: {exc}") from exc
        sockname = listeners[0].socket.getsockname()
        self.bound = join_host_port(sockname[0], sockname[1])
        self.address = advertised_data_addr(sockname[0], sockname[1], self.announce, interface_ips())
        task_status.started(self.address)
        await trio.serve_listeners(self._on_connection, listeners)

    def _admit(self, peer: str, channel: str) -> str | None:
        entry = self._handlers.get(channel)
        if entry is None:
            return f"unknown channel {channel[:64]!r}"
        if entry[1]:
            refusal = self.admit_peer(peer)
            if refusal is not None:
                return refusal
        if self._per_peer.get(peer, 0) >= self.limits.max_connections_per_peer:
            return f"already {self.limits.max_connections_per_peer} connections from this peer"
        return None

    def _refuse(self, why: str) -> None:
        self.refused[why] = self.refused.get(why, 0) + 1

    async def _on_connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            ip = _remote_ip(stream)
            if (sum(self._handshaking.values()) >= self.limits.max_handshaking
                    or self._handshaking.get(ip, 0) >= self.limits.max_handshaking_per_ip):
                self._refuse("too_many_handshakes")
                return
            self._handshaking[ip] = self._handshaking.get(ip, 0) + 1
            try:
                admitted = await self._authenticate(stream)
            finally:
                self._handshaking[ip] -= 1
                if not self._handshaking[ip]:
                    del self._handshaking[ip]
            if admitted is None:
                return
            if self._per_peer.get(admitted[0], 0) >= self.limits.max_connections_per_peer:
                # again, now that it is proven: `_admit` saw the count at the hello, and handshakes
                # held open side by side all passed it before any was counted (`_handle`, no checkpoint between)
                self._refuse("too_many_from_peer")
                return
            if self._open >= self.limits.max_connections:
                self._refuse("too_many_connections")
                return
            open_to_all = not self._handlers[admitted[1]][1]
            if open_to_all and (sum(self._open_to_all.values()) >= self.limits.max_open_channel_connections
                                or self._open_to_all.get(ip, 0) >= self.limits.max_open_channel_connections_per_ip):
                self._refuse("too_many_open")  # strangers cannot take the known peers' connections
                return
            self._open += 1
            if open_to_all:
                self._open_to_all[ip] = self._open_to_all.get(ip, 0) + 1
            try:
                await self._handle(stream, *admitted)
            finally:
                self._open -= 1
                if open_to_all:
                    self._open_to_all[ip] -= 1
                    if not self._open_to_all[ip]:
                        del self._open_to_all[ip]

    async def _authenticate(self, stream: trio.SocketStream) -> tuple[str, str] | None:
        """(peer, channel) once the handshake succeeds; None (counted, logged) otherwise."""
        if self.codec is None:
            raise LocalStateError("data plane started without an identity to prove")
        try:
            with trio.fail_after(self.limits.handshake_timeout_s):
                return await server_handshake(stream, self.codec, self.self_id, self._admit)
        except MessageRejected as exc:
            self._refuse(exc.reason)
            log.info("data connection refused: %s", exc)
        except (trio.TooSlowError, PeerUnavailable, trio.BrokenResourceError, OSError) as exc:
            self._refuse("handshake_failed")
            log.debug("data connection dropped in the handshake: %s", exc)
        return None

    async def _handle(self, stream: trio.SocketStream, peer: str, channel: str) -> None:
        handler = self._handlers[channel][0]
        self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
        try:
            await handler(stream, FrameReader(stream, max_frame_bytes=HELLO_MAX_BYTES), peer)
        except (trio.BrokenResourceError, trio.ClosedResourceError, PeerUnavailable, MessageRejected) as exc:
            log.info("data connection from %s on %s ended: %s", peer, channel, exc)
        finally:
            self._per_peer[peer] -= 1
            if not self._per_peer[peer]:
                del self._per_peer[peer]


def _remote_ip(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except (OSError, AttributeError, IndexError):
        return "?"


async def open_data_stream(address: str, channel: str, *, codec: Codec, peer: str,
                           timeout_s: float = 10.0) -> trio.SocketStream:
    """Connect to `peer`'s data plane at `host:port`, prove who we are and make sure it is
    `peer` (WrongPeer otherwise), and select `channel`."""
    try:
        host, port = parse_host_port(address, "data_addr")
    except ConfigError as exc:
        raise PeerUnavailable(f"bad data address {address!r}") from exc
    try:
        with trio.fail_after(timeout_s):
            stream = await trio.open_tcp_stream(host, port)
            try:
                await client_handshake(stream, codec, channel, peer)
            except BaseException:
                await stream.aclose()
                raise
    except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
        raise PeerUnavailable(f"data plane {address}: {type(exc).__name__}: {exc}") from exc
    except UnicodeError as exc:  # a host name no resolver takes (the IDNA codec's): the address is false
        raise PeerUnavailable(f"bad data address {address!r}: {exc}") from exc
    except MessageRejected as exc:
        raise PeerUnavailable(f"data plane {address}: handshake refused ({exc})") from exc
    return stream
