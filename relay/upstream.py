"""Fetching chunks from one source peer: one authenticated data connection, many pipelined
requests, answers in any order, each chunk received into one of a few reused buffers.

`Upstream` is the relay role's connection to one source (`relay.role` creates one per peer it
fetches from and closes it when the core drops the source). A request is a `ChunkRequest`
frame (the urgent bit set when we forward that chunk's stripe); an answer is a `ChunkResponse`
frame followed by exactly `length` raw bytes. An answer is handed to the role only with the
expected length, received whole into a `Buffers` buffer (shared by every upstream, so a slow
disk slows the reading instead of filling memory); the role hashes and stores it while the
connection reads on. A connection that ends inside a chunk (a killed peer) fails every request
still outstanding as `unreachable`, never as a short chunk; a source that closes the connection
after our hello (it has not heard our heartbeat yet) fails them as `not_admitted`, and is sent our
latest heartbeat directly (`Node.introduce`, while the failures are reported), so that it admits
us when the core asks again after `not_admitted_s` instead of after our next heartbeat reaches it
(up to the peer table's `max_interval_s`); a source that answers with the wrong length broke the
protocol and is reported `corrupt`; one that answers a request we never sent, or sends a frame
longer than a response header, broke it too: the connection ends and its requests fail as
`unreachable` (raised, a source's garbage would stop the role). A connection that ended stays
its peer's upstream (`RelayRole._upstream`) until it has reported every request it carried,
those the role handed it meanwhile included, and then leaves the role's upstreams itself
(`upstream_done`): the core takes its failure for the peer's (an exclusion takes back every
request out there), so a newer connection to the peer must not carry requests yet. A source the
core dropped (`close`) reports no failure: the core took its requests back as it dropped it (a chunk
received whole by then is still stored and told, and its buffer given back). A bug of
ours (any other exception) is raised from `run()`, dropped source or not, into the role's
dispatcher, and stops the role and the peer with it, loudly, as every bug does
(`p2pnet.errors`). After `close` it comes out of a cancelled scope, where the connection's close
raises Cancelled over it and the scope would take that as its own and return quietly: `run`
keeps the bug aside before the close and raises it past the scope.

This module must not touch the store or the transfer core directly: it reports to the role.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import trio

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.errors import MessageRejected, PeerUnavailable
from p2pnet.handshake import NotAdmitted
from relay.effects import Fetch, FetchFailure
from relay.manifest import MAX_CHUNK_BYTES
from relay.messages import OP_CHUNK, RESPONSE, STATUS_OK, ChunkRequest, ChunkResponse

if TYPE_CHECKING:
    from relay.role import RelayRole

log = logging.getLogger(__name__)

OP_URGENT = 0x80  # or-ed into the op byte: the requester forwards this chunk


class Upstream:
    """Our connection to one source: pipelined chunk requests, responses in any order."""

    def __init__(self, role: RelayRole, peer: str) -> None:
        self.role = role
        self.peer = peer
        self.closed = False
        # request id -> (fetch, its clock's start, `_taking_s` then: `_read`)
        self._pending: dict[int, tuple[Fetch, float, float]] = {}
        self._next_id = 0
        # Requests for this source not yet written (`_write` takes each as soon as the connection
        # takes its frame). No finite size can be proven: the core keeps a window per (source,
        # stripe) and `max_in_flight` in all, but `asked_for` asks past both (one request per chunk
        # of a version in progress), and a request the core settled without its answer (asked
        # again elsewhere, `found`, its version forgotten) stays here until written. Writing waits
        # on the connection: while it opens (up to `request_timeout_s` for the source's address,
        # then the connect), and on TCP once the source holds `MAX_REQUESTS_PER_CONNECTION` of
        # ours. Nor may the producer, `_dispatch` (`submit`), wait on one source: the `DropSource`
        # that closes this one, and every other source's requests, would queue behind it.
        self._send, self._receive = trio.open_memory_channel[tuple[Fetch, float]](math.inf)  # (fetch, submitted at)
        self._connected_at = 0.0  # when `open_stream` returned (`_write` starts after)
        self._taking_s = 0.0  # seconds the connection spent taking answers in, from header to last byte
        self._scope = trio.CancelScope()
        self._buffers = role.buffers
        self._failure = FetchFailure.UNREACHABLE  # how requests still outstanding fail when the connection ends
        self._abandoned = False  # `close`d: the core dropped this source, and its requests with it

    @property
    def outstanding(self) -> int:
        return len(self._pending)

    def submit(self, fetch: Fetch) -> None:
        self._send.send_nowait((fetch, trio.current_time()))

    def close(self) -> None:
        """Abandon this source: the core gave up on it (`DropSource`: stalled, slow, or banned)
        and, as it did, took back every request it had out here and asked for those chunks again
        (`relay.failures`: `_release_peer`). So none is reported, written or not: a report would
        tell the core nothing it does not know, and would pass the core's verdict off as ours
        (`unreachable`: a slow source is alive, a stalled one gets no substitutes)."""
        self.closed = True
        self._abandoned = True
        self._pending.clear()
        self._scope.cancel()

    async def run(self) -> None:
        fault: BaseException | None = None  # our own, caught before the stream's close can hide it
        with self._scope:
            try:
                stream = await self.role.open_stream(self.peer)
                self._connected_at = trio.current_time()
            except PeerUnavailable as exc:
                log.info("source %s: %s", self.peer, exc)
                if isinstance(exc, NotAdmitted):
                    self._failure = FetchFailure.NOT_ADMITTED
            else:
                async with stream:
                    try:
                        await self._exchange(stream)
                    except BaseException as exc:
                        fault = _not_cancelled(exc)
                        raise
        self.closed = True
        if fault is not None:  # it came out of a scope `close` cancelled: the stream's close raised
            raise fault  # Cancelled over it, which the scope took as its own
        async with trio.open_nursery() as nursery:
            if self._failure is FetchFailure.NOT_ADMITTED:  # only on a refusal: it may dial the source
                nursery.start_soon(self.role.node.introduce, self.peer)  # our heartbeat, before the retry
            await self._fail_all()

    async def _exchange(self, stream: trio.SocketStream) -> None:
        """Write our requests and read the answers until the connection ends."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write, stream, nursery.cancel_scope)
            try:
                await self._read(stream, nursery)
            except (PeerUnavailable, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                log.info("source %s: %s", self.peer, exc)
            except (_CorruptSource, MessageRejected, ValueError) as exc:  # (MessageRejected: an oversized frame)
                log.warning("source %s broke the chunk protocol: %s", self.peer, exc)
            finally:
                nursery.cancel_scope.cancel()

    async def _write(self, stream: trio.SocketStream, connection: trio.CancelScope) -> None:
        try:
            async for fetch, submitted_at in self._receive:
                self._next_id += 1
                # our clock for it starts once it is ours to send: not while our dispatcher held it
                # (`RelayRole._sending_held`: our disk) nor while we dialled (`open_stream`: the
                # address, the connect, the handshake); from there on, a write that waits (a full
                # TCP window: the source reads no more of our requests) is the source's wait
                self._pending[self._next_id] = (fetch, max(submitted_at, self._connected_at), self._taking_s)
                op = OP_CHUNK | (OP_URGENT if fetch.urgent else 0)
                request = ChunkRequest(op, self._next_id, fetch.version, fetch.index, fetch.digest)
                await send_frame(stream, request.pack())
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("requests to %s ended: %s", self.peer, exc)
            connection.cancel()

    async def _read(self, stream: trio.SocketStream, nursery: trio.Nursery) -> None:
        reader = FrameReader(stream, max_frame_bytes=RESPONSE.size)
        while True:
            header = ChunkResponse.unpack(await read_frame(reader))
            answered_at = trio.current_time()
            entry = self._pending.get(header.request_id)
            if entry is None:
                if self._abandoned:  # `close` emptied `_pending` since this read began: no fault of the source's
                    return
                raise _CorruptSource(f"answer to request {header.request_id}, which we never sent")
            fetch, clock_from, taking_then = entry
            # the answer may have waited behind others on this connection, its header after their
            # bytes (and our wait for a buffer for them): that time is theirs, not its source's wait
            unexplained_s = answered_at - clock_from - (self._taking_s - taking_then) - header.queued_s
            if header.status != STATUS_OK:
                del self._pending[header.request_id]
                await self.role.report_failed(self.peer, fetch, FetchFailure.UNAVAILABLE)
                continue
            if header.length != fetch.size or header.length > MAX_CHUNK_BYTES:
                del self._pending[header.request_id]
                await self.role.report_failed(self.peer, fetch, FetchFailure.CORRUPT)
                raise _CorruptSource(f"chunk of {header.length} bytes, want {fetch.size}")
            buffer = await self._buffers.take(header.length)  # waits while STORING_CHUNKS are being stored
            started = trio.current_time()  # the bytes are timed from here, not from the ask
            try:
                await reader.exactly_into(header.length, buffer)  # TruncatedStream if the source dies mid-chunk
            except BaseException:
                self._buffers.give(buffer)
                raise
            self._taking_s += trio.current_time() - answered_at
            # (not there if `close` ran while this task was woken and not yet run: nothing in between
            # checks for cancellation. The chunk is whole, and is kept like any received before the
            # drop; the buffer goes back with the report)
            self._pending.pop(header.request_id, None)
            # hash and store it while we read on
            # the source's queue counts (it told us how long we waited for its upload); its long
            # poll, waiting for the chunk itself, does not, unless longer than our other sources'
            # (`relay.sources`, `_unexcused_s`): the wait beyond its report until its answer began,
            # by our clock, not our buffer's wait or our storing
            nursery.start_soon(self._report, fetch, buffer, trio.current_time() - started + header.queued_s,
                               unexplained_s)

    async def _report(self, fetch: Fetch, buffer: bytearray, elapsed_s: float, unexplained_s: float) -> None:
        try:
            with trio.CancelScope(shield=True):  # a received chunk is always stored and told, even as we close
                await self.role.report_fetched(self.peer, fetch, memoryview(buffer)[:fetch.size], elapsed_s,
                                               unexplained_s)
        finally:
            self._buffers.give(buffer)

    async def _fail_all(self) -> None:
        """The connection ended by itself: every request still out, sent or not, fails as
        `_failure`, those the role hands us while we report included. Not once the core has
        dropped us (`close`, maybe while this reports). Then, with no checkpoint between the last
        look at our requests and it, we leave the role's upstreams: a later request goes to a new
        connection, whose requests none of our reports can take back."""
        pending, self._pending = list(self._pending.values()), {}
        try:
            with trio.CancelScope(shield=True):
                for fetch, *_ in pending:
                    if self._abandoned:
                        return
                    await self.role.report_failed(self.peer, fetch, self._failure)
                while not self._abandoned:  # requests not yet sent fail too
                    try:
                        fetch, _ = self._receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    await self.role.report_failed(self.peer, fetch, self._failure)
        finally:
            self.role.upstream_done(self)


class Buffers:
    """At most `count` chunk buffers lent at once, reused: `take` waits for one to come back."""

    def __init__(self, count: int) -> None:
        self._lendable = trio.Semaphore(count)
        self._free: list[bytearray] = []

    async def take(self, nbytes: int) -> bytearray:
        await self._lendable.acquire()
        while self._free:
            buffer = self._free.pop()
            if len(buffer) >= nbytes:
                return buffer
        return bytearray(nbytes)

    def give(self, buffer: bytearray) -> None:
        self._free.append(buffer)
        self._lendable.release()


def _not_cancelled(exc: BaseException) -> BaseException | None:
    """What of `exc` is not a cancellation: None when all of it is."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1]
    return None if isinstance(exc, trio.Cancelled) else exc


class _CorruptSource(Exception):
    """The source broke the data-plane protocol; internal to `Upstream`."""


async def read_frame(reader: FrameReader) -> bytes:
    frame = await reader.frame()
    if frame is None:
        raise PeerUnavailable("the connection ended")
    return frame
