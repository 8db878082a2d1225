"""A DiLoCo round's outgoing connections (`Links`, made by `open_links`): opened on first use,
one sender at a time per peer, every send bounded by the round's deadline, and each connection
watched so that a peer that closes it (it died) is reported to the round's inbox as
`PeerFailed(peer)`, as a failed send is. The inbox's other event, `Received(peer, body)`, is
put there by the role's server (a Join, Members, Part or NoRoom: `RoundFrame`).

The receiving end writes one thing on these, ever: `Idle`, when it closes a connection that
carried no frame for a long while (`_serve` in `trainer.diloco_serving`: an admitted peer could
otherwise hold its connections for ever). Every frame we send says that we read it
(`hears_idle`); our watcher then forgets the link without reporting anything, once a send under
way on it has ended (the receiver reads on until we close), and the next send opens a new
connection.

A peer whose data plane refuses us as unknown (`NotAdmitted`: its table has not heard our
heartbeat, as after we restarted) is sent our latest heartbeat directly, once per connection
(`Node.introduce`, as the relay's fetches and `trainer.diloco_join.ask_publisher` do), and asked
again until it admits us, the send's deadline comes (the introduction included, never past
it) or the round is over (`stop_watching`: the round's end waits for its sends, not for a peer
that refuses us); a refusal to the end is still a refusal (`send`'s `report_refusal`).

The watchers belong to the task `open_links` starts, never to the tasks that send. This module
must not decide who is in a round or what is sent (trainer.diloco_role, trainer.allreduce).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.errors import MessageRejected, PeerUnavailable
from p2pnet.handshake import NotAdmitted
from trainer.diloco_messages import Idle, RoundFrame

if TYPE_CHECKING:
    from trainer.diloco_role import DilocoRole

log = logging.getLogger(__name__)

WATCH_QUEUE = 16  # connections opened and not yet taken by the watching task (it takes each at once)
FIRST_RETRY_S = 0.05  # after our introduction, the first ask again: the heartbeat is one direct frame
RETRY_CAP_S = 1.0  # the longest wait between two asks of a peer that refuses us as unknown
NOTICE_MAX_BYTES = 4096  # the most the receiving end may write on a link: one Idle frame


@dataclass(frozen=True)
class PeerFailed:
    """A round's inbox event: `peer` failed us (a send failed, or it closed our connection)."""

    peer: str


@dataclass(frozen=True)
class Received:
    """A round's inbox event: `peer` sent us `body` on the diloco channel."""

    peer: str
    body: RoundFrame


InboxEvent = PeerFailed | Received  # what a round's inbox carries


class Links:
    """One round's outgoing connections: opened on first use, one sender at a time per peer,
    every send bounded by the deadline. A failed send, or a connection the other end closes
    (it died), is reported to the round's inbox (unless `reports` is off: a link no round reads
    for, as `_tell_ahead`'s in `trainer.diloco_serving`), and the connection is closed then and
    never written to again (the next send opens another). The watcher of a connection a failed send
    closed reports nothing more; a peer that closes while a send to it is under way can be
    reported twice, which the round takes as once. A connection the other end closes with an
    `Idle` notice first is forgotten the same way, and reported not at all.

    Made by `open_links`, whose own task (`_watch_all`) owns the watchers of the connections:
    `send`, called from many tasks, spawns nothing; it hands each connection it opens to that
    task over a bounded channel. `stop_watching` ends the watching (at the end of a round, before
    the last sends finish: a close after the round, ours or the other end's, is no failure)."""

    def __init__(self, role: DilocoRole, timeout_s: float,
                 opened: trio.MemorySendChannel[tuple[str, trio.SocketStream]], *, reports: bool = True) -> None:
        self.role = role
        self.timeout_s = timeout_s
        self.reports = reports  # failures go to the round's inbox (False: a link of no round's, logged only)
        self.opened = opened  # to `_watch_all`
        self.watching = trio.CancelScope()  # `_watch_all`'s, with every watcher under it
        self.streams: dict[str, trio.SocketStream] = {}
        self.locks: dict[str, trio.Lock] = {}
        self.bytes_sent = 0
        self.over = trio.Event()  # `stop_watching`: the round is over, a peer that refuses us is not asked again

    async def send(self, peer: str, body: object, *, report_refusal: bool = True, report: bool = True) -> bool:
        """Send `body` to `peer`; False when it failed. A failure is reported to the inbox (the
        peer becomes a suspect), except, unless `report_refusal`, a handshake the peer refused to
        the end (it is alive but has not heard our heartbeat yet, though introduced: see `_open`),
        and, unless `report`, any failure of the send's own: a notice of ours the peer need not read
        (`NoRoom`: a joiner that left, or reads slowly, owes us nothing and is no suspect of a later
        round for it). Not the peer's close of a connection an earlier send opened, which this send
        met before the connection's watcher did: the watcher would have reported it (a joiner that
        died just then, and may lead, would be found only at its leader timeout), and a failed
        send's connection is dropped, its watcher silent. Either way the connection a failed send
        used is dropped; one it opened is watched as any (its close, later, is the peer's)."""
        if isinstance(body, RoundFrame):  # our watcher reads the receiver's Idle notice
            body = dataclasses.replace(body, hears_idle=True)
        frame = self.role.node.codec.encode(body, time.time())
        lock = self.locks.setdefault(peer, trio.Lock())
        stream: trio.SocketStream | None = None  # the connection this send used
        opened = False  # by this send (else by an earlier one, and watched since)
        refusals: list[NotAdmitted] = []  # of the connection it opened (introduced after the first)
        deadline = trio.current_time() + self.timeout_s
        try:
            with trio.fail_at(deadline):
                async with lock:
                    stream = self.streams.get(peer)
                    if stream is None:
                        opened = True
                        stream = self.streams[peer] = await self._open(peer, deadline, refusals)
                        if not self.watching.cancel_called:  # (once stopped, nobody takes it off the channel)
                            try:
                                await self.opened.send((peer, stream))
                            except trio.BrokenResourceError:
                                pass  # the round stopped watching while we waited: no fault of the peer's
                    await send_frame(stream, frame)
                    self.bytes_sent += len(frame) + 4
                    return True
        except (PeerUnavailable, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError, OSError) as exc:
            log.info("diloco: sending to %s failed: %s", peer, exc)
            if stream is not None and self.streams.get(peer) is stream:  # a frame may be cut short in it:
                await self._drop(peer, stream)  # never written to again
            # refused to the end: the deadline may come while we introduce ourselves or wait to ask again
            refused = isinstance(exc, NotAdmitted) or (isinstance(exc, trio.TooSlowError) and stream is None
                                                       and bool(refusals))
            # the peer closed a watched connection (a reset, a broken pipe): what its watcher reports
            closed = stream is not None and not opened and isinstance(exc, trio.BrokenResourceError)
            if (report or closed) and (report_refusal or not refused):
                await self._report(peer)
            return False

    async def _open(self, peer: str, deadline: float, refusals: list[NotAdmitted]) -> trio.SocketStream:
        """A connection to `peer`. Refused as unknown (`NotAdmitted`: its table has not heard our
        heartbeat, as after we restarted), we introduce ourselves once (`Node.introduce`: our
        heartbeat sent directly) and ask again, `FIRST_RETRY_S` later and twice as long after each
        refusal, up to `RETRY_CAP_S`, while `deadline` leaves time for it and the round is not
        over (`stop_watching`: the round's end waits for its sends, and would wait for this one
        up to its deadline); the last refusal is raised, at once when no introduction could be
        sent. The caller bounds all of it by `deadline` (the introduction may dial `peer`, up to
        the node's `send_timeout_s`)."""
        while True:
            try:
                return await self.role.open_stream(peer)
            except NotAdmitted as exc:
                refusals.append(exc)
                if len(refusals) == 1:
                    if not await self.role.node.introduce(peer):
                        raise
                    log.info("diloco: %s did not admit us (%s); introduced us, asking again", peer, exc)
                wait_s = min(FIRST_RETRY_S * 2 ** (len(refusals) - 1), RETRY_CAP_S)
                if self.over.is_set() or trio.current_time() + wait_s >= deadline:
                    raise
            with trio.move_on_after(wait_s):
                await self.over.wait()
            if self.over.is_set():  # the round ends waiting for its sends: not for this one
                raise refusals[-1]

    def stop_watching(self) -> None:
        self.watching.cancel()
        self.over.set()

    async def _watch_all(self, opened: trio.MemoryReceiveChannel[tuple[str, trio.SocketStream]]) -> None:
        """Watch each connection `send` opens, until `stop_watching`: the watchers are this task's."""
        with self.watching:
            async with opened, trio.open_nursery() as watchers:
                async for peer, stream in opened:
                    watchers.start_soon(self._watch, peer, stream)

    async def _watch(self, peer: str, stream: trio.SocketStream) -> None:
        """Until `peer` closes the connection (it died: reported) or tells us it closes it idle
        (`Idle`: forgotten quietly). Anything else it writes is no notice: taken as a failure."""
        idle = False
        try:
            frame = await FrameReader(stream, max_frame_bytes=NOTICE_MAX_BYTES).frame()
            if frame is not None:
                envelope = self.role.node.codec.decode(frame, time.time())
                idle = isinstance(envelope.body, Idle) and envelope.sender == peer
                if not idle:
                    log.warning("diloco: %s wrote %s on our link, where only an idle notice may come", peer,
                                envelope.kind)
        except MessageRejected as exc:
            log.warning("diloco: %s wrote no idle notice on our link: %s", peer, exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError, PeerUnavailable, OSError):
            pass  # it closed (or we did: then it is no longer in `streams`)
        if self.streams.get(peer) is not stream:  # a failed send dropped it, and reported it there
            return
        if idle:
            async with self.locks.setdefault(peer, trio.Lock()):  # a send under way on it ends first: the
                if self.streams.get(peer) is stream:  # peer reads on until we close (a frame is never cut)
                    await self._drop(peer, stream)
            log.info("diloco: %s closed our idle link; the next frame to it opens another", peer)
            return
        log.info("diloco: %s closed its connection", peer)
        await self._drop(peer, stream)  # a frame written into it now would be lost
        await self._report(peer)

    async def _report(self, peer: str) -> None:
        """`peer` failed us: the round hears of it (`PeerFailed` in its inbox), unless no round
        reads for these links (`reports` off: logged where it happened, only)."""
        if self.reports:
            await self.role.inbox.report(PeerFailed(peer))

    async def _drop(self, peer: str, stream: trio.SocketStream) -> None:
        """Never use `peer`'s connection `stream` again (the next send opens another): close it."""
        del self.streams[peer]
        with trio.CancelScope(shield=True):
            await stream.aclose()

    async def aclose(self) -> None:
        """Close every connection (each close is immediate: all are closed, also when cancelled)."""
        streams, self.streams = list(self.streams.values()), {}
        with trio.CancelScope(shield=True):
            for stream in streams:
                await stream.aclose()


@asynccontextmanager
async def open_links(role: DilocoRole, timeout_s: float, *, reports: bool = True) -> AsyncIterator[Links]:
    """A round's `Links`, watched by a task of our own until the block ends (or `stop_watching`);
    then, the watchers stopped first so that a close we make is not reported, its connections closed.
    Not `reports`: failures are logged, not put into the round's inbox (links no round reads for)."""
    opened_send, opened = trio.open_memory_channel[tuple[str, trio.SocketStream]](WATCH_QUEUE)
    links = Links(role, timeout_s, opened_send, reports=reports)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(links._watch_all, opened)
            try:
                yield links
            finally:
                links.stop_watching()
    finally:
        await links.aclose()
