"""Fetching chunks from one source peer: one authenticated data connection, many pipelined
requests, answers in any order, each chunk received into one of a few reused buffers.

`Upstream` is the relay role's connection to one source (`relay.role` creates one per peer it
fetches from and closes it when the core drops the source). A request is a `ChunkRequest`
frame (the urgent bit set when we forward that chunk's stripe); an answer is a `ChunkResponse`
frame followed by exactly `length` raw bytes. An answer is handed to the role only with the
expected length, received whole into a `Buffers` buffer (shared by every upstream, so a slow
disk slows the reading instead of filling memory); the role hashes and stores it while the
connection reads on. A connection that ends inside a chunk (a killed peer) fails every request
still outstanding as `unreachable`, never as a short chunk (one that ends between answers may be
an idle close instead: see below); a source that closes the connection after our hello (it has
not heard our heartbeat yet) fails them as `not_admitted`, and is sent our
latest heartbeat directly (`Node.introduce`, while the failures are reported), so that it admits
us when the core asks again after `not_admitted_s` instead of after our next heartbeat reaches it
(up to the peer table's `max_interval_s`); a source whose heartbeat, and with it its data
address, has not reached us (`AddressUnknown`, after the role's wait) fails them as
`no_address`; a source that answers with the wrong length broke the
protocol and is reported `corrupt`; one that answers a request we never sent, or sends a frame
longer than a response header, broke it too: the connection ends and its requests fail as
`unreachable` (raised, a source's garbage would stop the role). A connection that ended stays
its peer's upstream (`RelayRole._upstream`) until it has reported every request it carried,
those the role handed it meanwhile included (or carried them over to a new connection of its
own, below), and then leaves the role's upstreams itself
(`upstream_done`): the core takes its failure for the peer's (an exclusion takes back every
request out there), so a newer connection to the peer must not carry requests yet. A source the
core dropped (`close`) reports no failure: the core took its requests back as it dropped it (a chunk
received whole by then is still stored and told, and its buffer given back), nor does a report
already on its way as the core dropped it (`dropped`: `RelayRole.report_failed`). A bug of
ours (any other exception) is raised from `run()`, dropped source or not, into the role's
dispatcher, and stops the role and the peer with it, loudly, as every bug does
(`p2pnet.errors`). After `close` it comes out of a cancelled scope, where the connection's close
raises Cancelled over it and the scope would take that as its own and return quietly: `run`
keeps the bug aside before the close and raises it past the scope.

Idle connections. A source closes a connection with nothing asked or owed for its
`idle_timeout_s` (`relay.serving_shell`); a request we write as it closes meets a closed
connection (the keep-alive race of HTTP clients: the source's close and our request cross on
the wire), and failed as `unreachable` it excluded an honest, alive source (the origin, at
worst) for `exclude_s` at a version boundary minutes after the last. Two rules, in the shell
alone:
- We close first. A connection on which we have written nothing for `idle_timeout_s / 2` and
  are owed nothing (`_quiet_s`: the source's bound is ours by default, and its clock starts
  when it reads our last request, after we wrote it) is closed by us: `_write`, finding it so,
  leaves the role's upstreams (`upstream_done`) with no checkpoint since it last looked at the
  queue, so no request can be handed to it meanwhile; nothing is reported, and the next request
  for the peer opens a new connection (`RelayRole._upstream`).
- A quiet end is no evidence. A source with a shorter bound than ours, or a close that lands
  on our timer's edge, still meets a request. A connection that ended (a clean end of stream, a
  reset, or a write refused) between answers, by no protocol break, while every request still
  outstanding was written after the last bytes the source sent us (`_heard_id`: it may not have
  read one of them, and an honest source closes only when it owes nothing) carries those
  requests over, ahead of the queue, to a new connection of the same upstream (`_carry_over`),
  their clocks still counting what they waited on the old one (a source that closes on a request
  it holds back does not wipe that wait from its delivery: `relay.judging`, `_unexcused_s`),
  reported to nobody: the upstream stays the peer's throughout, so the ending protocol above
  holds as it is. A source that is really gone fails the new connection's open (a killed
  process: refused; its host gone: the connect's timeout), and its requests fail as
  `unreachable`, as before, one dial later. Only once: a new connection that ends so again
  before the source sent a chunk on it fails its requests (a source that accepts and closes
  each connection is unreachable). An `unavailable` answer does not count as one: a source that
  answers something on every connection and closes it on our next requests (each close looks
  idle) was given a new connection per answer, one per core tick for as long as we wanted the
  version, never excluded (its requests settle at each answer, so no stall either); now its
  second such connection in a row fails as `unreachable`, two connections per `exclude_s`. An
  honest source that is behind answers `unavailable` and keeps the connection; only two idle
  closes crossing our requests in a row, with no chunk between, fail so, and "in a row" lasts
  an exclusion at most: a carried-over connection that lived the core's `exclude_s` (behind for
  that long, answering `unavailable`) carries over again, which a hostile source gets no more
  from than the exclusion it would otherwise earn (still two connections per `exclude_s`). A reset counts
  because an honest source that closes with our request unread in its socket resets the
  connection (Linux sends RST, not FIN, when data is left unread); a killed source at an answer
  boundary looks the same on the wire either way, which is why the evidence is a new
  connection, not the way this one ended.
The simulator needs neither: it has no connections (a request is a message, a crash fails
them at once), so it never modelled the race.

This module must not touch the store or the transfer core directly: it reports to the role.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import TYPE_CHECKING

import trio

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.errors import MessageRejected, PeerUnavailable
from p2pnet.handshake import NotAdmitted
from relay.effects import Fetch, FetchFailure
from relay.errors import AddressUnknown
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
        # the core dropped this source, as its `DropSource` was emitted: before `close`, which
        # carries it out later (the role sets it: `RelayRole.report_failed`)
        self.dropped = False
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
        # Idle connections (see the top): written first on the next connection, (fetch, the seconds
        # it waited on the one that ended: still the source's, the dial between is not)
        self._again: deque[tuple[Fetch, float]] = deque()
        self._quiet_s = role.config.idle_timeout_s / 2  # we close a connection this quiet (the source: at its bound)
        self._quiet = trio.CancelScope()  # `_write`'s wait for a request, cancelled once the connection is quiet
        self._written_at = 0.0  # when `_write` last wrote a request, or the connection opened
        self._heard_id = 0  # requests up to this id were written before the source's last bytes came
        self._carried = False  # requests were carried over to this connection, and no chunk came on it since
        # (cleared when it lived `exclude_s` all the same: `_carry_over`)
        self._reader: FrameReader | None = None  # this connection's

    @property
    def outstanding(self) -> int:
        return len(self._pending) + len(self._again)

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
        self._again.clear()
        self._scope.cancel()

    async def run(self) -> None:
        fault: BaseException | None = None  # our own, caught before the stream's close can hide it
        with self._scope:
            while True:
                try:
                    stream = await self.role.open_stream(self.peer)
                except PeerUnavailable as exc:
                    log.info("source %s: %s", self.peer, exc)
                    if isinstance(exc, NotAdmitted):
                        self._failure = FetchFailure.NOT_ADMITTED
                    elif isinstance(exc, AddressUnknown):  # its heartbeat has not reached us yet
                        self._failure = FetchFailure.NO_ADDRESS
                    break
                self._opened()
                async with stream:
                    try:
                        await self._exchange(stream)
                    except BaseException as exc:
                        fault = _not_cancelled(exc)
                        raise
                if not self._carry_over():
                    break
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

    def _opened(self) -> None:
        """A new connection is open: what we know of the last one's state no longer holds."""
        self._connected_at = self._written_at = trio.current_time()
        self._heard_id = self._next_id  # (its handshake: the source has none of our requests yet)
        self._reader = None

    def _carry_over(self) -> bool:
        """Whether the connection that just ended (not `close`d) ended as an honest source ends
        an idle one (see the top): with requests to carry, and no byte from the source since the
        first of those outstanding was written (not a frame's start: a protocol break, or a
        chunk cut short, comes after bytes). If so, those written go back ahead of the queue
        (`_again`) for a new connection; only once: not if this one carried some over and has
        had no chunk since (an `unavailable` answer does not count: see the top), unless it lived
        the core's `exclude_s` (see the top)."""
        queued = self._receive.statistics().current_buffer_used
        if self._carried and trio.current_time() - self._connected_at >= self.role.core.config.exclude_s:
            self._carried = False  # it lived an exclusion's length: as many connections as excluding it allows
        if self._abandoned or self._carried or not (self._pending or queued):
            return False
        if any(rid <= self._heard_id for rid in self._pending) or (self._reader is not None and self._reader.buffered):
            return False
        log.info("our connection to %s ended between answers with %d requests out, none answered since written: "
                 "asking again on a new connection (an idle close crossed them, or it is gone)", self.peer,
                 len(self._pending) + queued)
        ended = trio.current_time()
        self._again.extend((fetch, ended - clock_from) for fetch, clock_from, _ in self._pending.values())  # (id order)
        self._pending.clear()
        self._carried = True
        return True

    async def _next_request(self) -> tuple[Fetch, float] | None:
        """The next request to write (one carried over from a quiet end first) and its clock's
        start (see `_write`), or None once the connection is quiet (nothing written for `_quiet_s`, nothing owed, nothing queued): then
        this upstream has left the role's upstreams, with no checkpoint since it found nothing
        queued, and the next request for the peer goes to a new one."""
        if self._again:  # its clock goes on from what it waited on the connection that ended
            fetch, waited_s = self._again.popleft()
            return fetch, self._connected_at - waited_s
        with trio.CancelScope(deadline=self._quiet_at()) as self._quiet:  # `_read` moves it when owed nothing
            fetch, submitted_at = await self._receive.receive()
            return fetch, max(submitted_at, self._connected_at)
        try:  # one queued as the timer fired: the deadline is past, so `receive` would only raise again
            fetch, submitted_at = self._receive.receive_nowait()
            return fetch, max(submitted_at, self._connected_at)
        except trio.WouldBlock:
            pass
        # (owed nothing: the deadline was finite, and only we add to `_pending`)
        log.info("closing our idle data connection to %s", self.peer)
        self.closed = True
        self.role.upstream_done(self)
        return None

    def _quiet_at(self) -> float:
        """When the connection is quiet unless we write or are owed something meanwhile."""
        return math.inf if self._pending else self._written_at + self._quiet_s

    def _settled(self, request_id: int) -> None:
        """`_read` is done with request `request_id`: its answer is told (or being stored)."""
        self._pending.pop(request_id, None)  # (not there if `close` ran meanwhile)
        if not self._pending:
            self._quiet.deadline = self._quiet_at()

    async def _write(self, stream: trio.SocketStream, connection: trio.CancelScope) -> None:
        try:
            while (request := await self._next_request()) is not None:
                fetch, clock_from = request
                self._next_id += 1
                # our clock for it (`_next_request`) starts once it is ours to send: not while our
                # dispatcher held it (`RelayRole._sending_held`: our disk) nor while we dialled
                # (`open_stream`: the address, the connect, the handshake; for one carried over, the
                # redial, but what it waited on the connection that ended counts); from there on, a
                # write that waits (a full TCP window: the source reads no more of our requests) is
                # the source's wait
                self._pending[self._next_id] = (fetch, clock_from, self._taking_s)
                op = OP_CHUNK | (OP_URGENT if fetch.urgent else 0)
                frame = ChunkRequest(op, self._next_id, fetch.version, fetch.index, fetch.digest).pack()
                await send_frame(stream, frame)
                self._written_at = trio.current_time()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.info("requests to %s ended: %s", self.peer, exc)
        connection.cancel()

    async def _read(self, stream: trio.SocketStream, nursery: trio.Nursery) -> None:
        reader = self._reader = FrameReader(stream, max_frame_bytes=RESPONSE.size)
        while True:
            header = ChunkResponse.unpack(await read_frame(reader))
            answered_at = trio.current_time()
            self._heard_id = self._next_id  # (`_carried` stays: only a chunk is an answer for the once-only rule)
            entry = self._pending.get(header.request_id)
            if entry is None:
                if self._abandoned:  # `close` emptied `_pending` since this read began: no fault of the source's
                    return
                raise _CorruptSource(f"answer to request {header.request_id}, which we never sent")
            fetch, clock_from, taking_then = entry
            # the answer may have waited behind others on this connection, its header after their
            # bytes (and our wait for a buffer for them): that time is theirs, not its source's wait
            unexplained_s = answered_at - clock_from - (self._taking_s - taking_then) - header.queued_s
            if header.status != STATUS_OK:  # (owed until told: the connection is not quiet while we tell it)
                with trio.CancelScope(shield=True):  # told whole, or a connection's end would fail it again
                    await self.role.report_failed(self.peer, fetch, FetchFailure.UNAVAILABLE, self)
                self._settled(header.request_id)
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
            self._heard_id, self._carried = self._next_id, False
            self._taking_s += trio.current_time() - answered_at
            # (not there if `close` ran while this task was woken and not yet run: nothing in between
            # checks for cancellation. The chunk is whole, and is kept like any received before the
            # drop; the buffer goes back with the report)
            self._settled(header.request_id)
            # hash and store it while we read on
            # the source's queue counts (it told us how long we waited for its upload); its long
            # poll, waiting for the chunk itself, does not, unless longer than our other sources'
            # (`relay.judging`, `_unexcused_s`): the wait beyond its report until its answer began,
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
        pending = [fetch for fetch, *_ in self._pending.values()] + [fetch for fetch, _ in self._again]
        self._pending, self._again = {}, deque()
        try:
            with trio.CancelScope(shield=True):
                for fetch in pending:
                    if self._abandoned:
                        return
                    await self.role.report_failed(self.peer, fetch, self._failure, self)
                while not self._abandoned:  # requests not yet sent fail too
                    try:
                        fetch, _ = self._receive.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    await self.role.report_failed(self.peer, fetch, self._failure, self)
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
