"""The data plane: direct trio TCP connections for bulk bytes, with length-prefixed frames.

libp2p streams move 13-18x fewer bytes per second than plain TCP here (DESIGN.md), so bulk
transfers open a direct TCP connection to the address a peer advertises in its heartbeat. The
first frame on every connection names the channel (for example `relay/chunks`) so one listener
serves all roles. Nothing here is trusted: receivers hash everything they read.

Frames are `u32 big-endian length || bytes`. `FrameReader` refuses frames over its limit and
reports a connection that ends inside a frame as `TruncatedStream`, never as a short frame.
Bulk payloads (`exactly_into`) are received straight into one fresh buffer with `recv_into`:
no intermediate bytes objects, no copies out of a shared buffer.
"""

from __future__ import annotations

import logging
import struct
from typing import Awaitable, Callable

import trio

from p2pnet.addresses import advertised_data_addr, interface_ips, join_host_port
from p2pnet.errors import ConfigError, MessageRejected, PeerUnavailable

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
HELLO_MAX_BYTES = 4096

DataHandler = Callable[[trio.SocketStream, "FrameReader"], Awaitable[None]]


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

    async def exactly_into(self, n: int) -> bytearray:
        """The next `n` raw bytes in a new bytearray of their own (for bulk payloads).

        Whatever is already buffered is copied once; the rest is received in place. A
        connection that ends (or breaks) first raises `TruncatedStream`.
        """
        out = bytearray(n)
        view = memoryview(out)
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


def frame_header(length: int) -> bytes:
    return _LEN.pack(length)


class DataPlane:
    """A TCP listener whose connections are routed by their first frame, the channel name."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, announce: str = "") -> None:
        self.host = host
        self.port = port
        self.announce = announce
        self._handlers: dict[str, DataHandler] = {}
        self.address = ""  # what other peers dial (see p2pnet.addresses)
        self.bound = ""  # what we listen on

    def register(self, channel: str, handler: DataHandler) -> None:
        if channel in self._handlers:
            raise ValueError(f"data channel {channel!r} registered twice")
        self._handlers[channel] = handler

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

    async def _on_connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            reader = FrameReader(stream, max_frame_bytes=HELLO_MAX_BYTES)
            try:
                with trio.fail_after(10):
                    hello = await reader.frame()
            except (trio.TooSlowError, MessageRejected, PeerUnavailable, trio.BrokenResourceError) as exc:
                log.info("data connection dropped before hello: %s", exc)
                return
            channel = (hello or b"").decode("utf-8", "replace")
            handler = self._handlers.get(channel)
            if handler is None:
                log.info("data connection for unknown channel %r dropped", channel[:64])
                return
            try:
                await handler(stream, reader)
            except (trio.BrokenResourceError, trio.ClosedResourceError, PeerUnavailable, MessageRejected) as exc:
                log.info("data connection on %s ended: %s", channel, exc)


async def open_data_stream(address: str, channel: str, *, timeout_s: float = 10.0) -> trio.SocketStream:
    """Connect to a peer's data plane at `host:port` and select `channel`."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise PeerUnavailable(f"bad data address {address!r}")
    try:
        with trio.fail_after(timeout_s):
            stream = await trio.open_tcp_stream(host, int(port))
            await send_frame(stream, channel.encode())
    except (OSError, trio.TooSlowError) as exc:
        raise PeerUnavailable(f"data plane {address}: {exc}") from exc
    return stream
