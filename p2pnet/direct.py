"""Direct frames between two peers: one kept libp2p stream per peer we send to.

Opening a libp2p stream costs py-libp2p about 2.9 ms of CPU at the two ends together (yamux's
SYN and ACK, multistream-select's protocol negotiation, a handler task at the receiver);
writing a frame on an open one about 0.32 ms (`benchmarks/bench_direct.py`). A relay that
completes a version tells each of its children with one frame, while the last peers of the
version still receive on the same cores; so frames are not sent one stream each.

`KeptStreams` (the sending side, owned by `p2pnet.host.Host`) keeps one outbound stream per
peer and writes each frame, length-prefixed, on it under that peer's lock, so frames to one
peer are never interleaved, and those on one stream arrive in the order they were sent. A stream that fails a write
(the remote reset it, the connection went) is dropped and the frame is sent once more on a new
stream; a failure there is the peer's (`PeerUnavailable`). A write that is cancelled part-way
(the caller's timeout) ends the stream: a half-written frame would garble the next. Ended, not
reset: a yamux reset makes the receiver drop what it has not read yet, the frames before the cut
one included, while after an end (FIN) it reads them and drops only the cut frame. Ending a
stream writes on its connection, which may be what stalled: it waits `END_S` at most (then a
reset is tried, as long), so a stalled connection never holds a peer's lock for good. At most
`MAX_KEPT` streams are kept; opening one more closes the one used longest ago (one a send is
writing on is spared, so for a while there may be more).

Idle streams. The receiver (`receive_frames`, the handler of every inbound stream) reads frames
until the stream ends, and resets a stream on which nothing arrived for `INBOUND_IDLE_S`; the
sender never writes on a stream idle for `OUTBOUND_IDLE_S`, half that: it closes it and opens a
new one. So a frame is never written onto a stream its receiver is giving up on (a reset that
crossed a write would lose the frame unnoticed). Frames stay best-effort, as before: a frame
delivered to the receiver's handler may still be dropped there (a full inbox), and the sender
is not told.

A frame longer than the receiver's `max_frame_bytes`, or one that does not arrive whole within
`FRAME_S` of its first bytes, resets the stream: the sender's fault, logged, never raised. What
the receiver's handler raises resets the stream (nobody reads it any more) and is raised. Every
reset the receiver makes waits `END_S` at most, as the sender's end does: a stalled connection
never holds the receiving task.
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import trio

from p2pnet.errors import MessageRejected, PeerUnavailable

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_KEPT = 256  # outbound streams kept open at once (one per peer we send to)
OUTBOUND_IDLE_S = 60.0  # a kept stream idle this long is replaced, never written on
INBOUND_IDLE_S = 2 * OUTBOUND_IDLE_S  # the receiver resets a stream silent this long
FRAME_S = 10.0  # a frame's bytes arrive within this of its first ones
END_S = 1.0  # ending a stream (FIN, else a reset) waits this long at most for the connection

FrameHandler = Callable[[bytes, str], Awaitable[None]]
OpenStream = Callable[[str], Awaitable[Any]]  # a new outbound stream to the peer


@dataclass
class _Kept:
    lock: trio.Lock = field(default_factory=trio.Lock)
    stream: Any = None
    used_at: float = 0.0


class KeptStreams:
    """The sending side (see the module docstring). `open_stream(peer)` opens a new stream on
    the message protocol; any exception it raises is taken as the peer being unreachable."""

    def __init__(self, open_stream: OpenStream, max_kept: int = MAX_KEPT) -> None:
        self._open = open_stream
        self._max_kept = max_kept
        self._kept: OrderedDict[str, _Kept] = OrderedDict()  # least recently used first
        self.opened = 0  # streams opened (the tests read it)

    def __len__(self) -> int:
        return sum(1 for k in self._kept.values() if k.stream is not None)

    async def send(self, peer: str, frame: bytes, *, timeout_s: float) -> None:
        """Write `frame` to `peer` within `timeout_s`; PeerUnavailable if it cannot be.

        A peer's entry leaves `_kept` only in the hands of a task holding its lock (a send whose
        stream failed, or `_make_room`); a send that waited for the lock of an entry dropped
        meanwhile takes the peer's current entry instead, so one peer never has two streams."""
        data = pack_frame(frame)
        try:
            with trio.fail_after(timeout_s):
                while True:
                    kept = self._kept.setdefault(peer, _Kept())
                    async with kept.lock:
                        if self._kept.get(peer) is not kept:
                            continue
                        self._kept.move_to_end(peer)
                        try:
                            await self._write(peer, kept, data)
                        finally:  # a peer we hold no stream to is not remembered
                            if kept.stream is None:
                                del self._kept[peer]
                    return
        except trio.TooSlowError as exc:
            raise PeerUnavailable(f"{peer}: frame not sent within {timeout_s}s") from exc

    async def _write(self, peer: str, kept: _Kept, data: bytes) -> None:
        if kept.stream is not None and trio.current_time() - kept.used_at >= OUTBOUND_IDLE_S:
            stream, kept.stream = kept.stream, None
            await end_stream(stream)  # its receiver may be giving up on it: never write there
        for fresh in (kept.stream is None, True):
            if kept.stream is None:
                await self._make_room(peer)
                kept.stream = await self._new_stream(peer)
            try:
                await kept.stream.write(data)
            except BaseException as exc:
                stream, kept.stream = kept.stream, None
                # part of the frame may be out: the stream is done, but ended (FIN), not reset,
                # so that the frames before it, still unread at the receiver, are read (a yamux
                # reset drops them); the receiver drops the cut frame at the end
                with trio.CancelScope(shield=True):
                    await end_stream(stream)
                if isinstance(exc, Exception) and not fresh:
                    log.debug("kept stream to %s failed (%s: %s): a new one", peer, type(exc).__name__, exc)
                    continue
                if isinstance(exc, Exception):
                    raise PeerUnavailable(f"{peer}: {type(exc).__name__}: {exc}") from exc
                raise
            kept.used_at = trio.current_time()
            return

    async def _new_stream(self, peer: str) -> Any:
        try:
            stream = await self._open(peer)
        except Exception as exc:  # libp2p signals unreachable peers with many exception types
            raise PeerUnavailable(f"{peer}: {type(exc).__name__}: {exc}") from exc
        self.opened += 1
        return stream

    async def _make_room(self, sending_to: str) -> None:
        """Close the streams used longest ago while `max_kept` or more are open, sparing
        `sending_to`'s and any a send holds (it is in use)."""
        while len(self) >= self._max_kept:
            for peer, kept in self._kept.items():
                if peer == sending_to or kept.stream is None:
                    continue
                try:
                    kept.lock.acquire_nowait()
                except trio.WouldBlock:
                    continue
                break
            else:
                return
            try:
                del self._kept[peer]
                stream, kept.stream = kept.stream, None
                await end_stream(stream)
            finally:
                kept.lock.release()


async def receive_frames(stream: Any, peer: str, max_frame_bytes: int, handler: FrameHandler) -> None:
    """Hand every frame arriving on the inbound `stream` from `peer` to `handler`, in order,
    until the stream ends (see the module docstring for idle streams and bad frames). What
    `handler` raises is raised: a bug of ours is not the sender's fault."""
    while (frame := await _next_frame(stream, peer, max_frame_bytes)) is not None:
        try:
            await handler(frame, peer)
        except BaseException:  # nobody reads this stream any more: tell its sender
            with trio.CancelScope(shield=True):
                await bounded_reset(stream)
            raise


async def _next_frame(stream: Any, peer: str, max_frame_bytes: int) -> bytes | None:
    """The next frame, or None once the stream ended, idled out or broke (then reset)."""
    try:
        with trio.move_on_after(INBOUND_IDLE_S) as idle:
            first = await stream.read(_LEN.size)
    except Exception as exc:  # py-libp2p ends a stream its sender closed with an exception, between frames
        log.debug("inbound stream from %s ended: %s", peer, type(exc).__name__)
        await end_stream(stream)
        return None
    try:
        if idle.cancelled_caught:
            await bounded_reset(stream)
            return None
        if not first:  # the sender closed it between frames (a stream that reads b"" at its end)
            await end_stream(stream)
            return None
        with trio.fail_after(FRAME_S):
            return await read_frame(stream, peer, max_frame_bytes, first)
    except MessageRejected as exc:
        log.info("direct frame rejected: %s", exc)
    except (trio.TooSlowError, EOFError, Exception) as exc:  # noqa: B014 - a broken inbound stream is the remote's problem
        log.debug("inbound stream from %s failed: %s: %s", peer, type(exc).__name__, exc)
    await bounded_reset(stream)
    return None


async def end_stream(stream: Any) -> None:
    """Close (FIN) a stream we write no more on, within `END_S`; reset it if that fails or
    takes longer. Both write on the connection, which may be the stalled thing: bounded, so
    neither holds up the caller (one peer's lock, another peer's send) for long."""
    with trio.move_on_after(END_S):
        try:
            await stream.close()
            return
        except Exception as exc:  # a stream the remote already broke: nothing new to learn
            log.debug("close of broken stream failed: %s", exc)
    await bounded_reset(stream)


async def bounded_reset(stream: Any) -> None:
    """Reset a stream we give up on, waiting `END_S` at most: the reset writes on the
    connection, which may be the stalled thing, and the task resetting has more to do."""
    with trio.move_on_after(END_S):
        await quiet_reset(stream)


async def quiet_close(stream: Any) -> None:
    try:
        await stream.close()
    except Exception as exc:  # closing a stream the remote already broke tells us nothing new
        log.debug("close of broken stream failed: %s", exc)


async def quiet_reset(stream: Any) -> None:
    try:
        await stream.reset()
    except Exception as exc:  # the stream is already broken; nothing more to learn
        log.debug("reset of broken stream failed: %s", exc)


def pack_frame(frame: bytes) -> bytes:
    """`frame` as it goes on a stream: its length (u32, big-endian), then its bytes."""
    return _LEN.pack(len(frame)) + frame


async def read_frame(stream: Any, peer: str, max_frame_bytes: int, first: bytes = b"") -> bytes:
    """The next frame on `stream` from `peer`, of which `first` (part of its length prefix, or
    nothing) was read already. MessageRejected if it is longer than `max_frame_bytes` (then none
    of its body is read), EOFError if the stream ends inside it."""
    if len(first) < _LEN.size:
        first += await read_exactly(stream, _LEN.size - len(first))
    (length,) = _LEN.unpack(first)
    if length > max_frame_bytes:
        raise MessageRejected("oversized", f"{length} bytes", peer)
    return await read_exactly(stream, length)


async def read_exactly(stream: Any, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = await stream.read(n - got)
        if not chunk:
            raise EOFError(f"stream ended after {got} of {n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
