"""Idle data connections between a relay and its source, in virtual time (MockClock): an honest
source that closes one as we ask again is not excluded, we close our idle ones before the source
does, a source that is really gone is still found unreachable, a hostile one that answers and
closes each connection on our next requests gets two connections per exclusion, and an honest one
behind for longer than an exclusion is not excluded by an idle close at its end.

The requester is the role of `Harness` (its real core, runner, dispatcher, store) fetching over
its own upstreams (`relay.upstream.Upstream`, one per peer). The source is a second real role
(`SourcePeer`) serving the publisher's store with its own `_serve` (`relay.serving_shell`), idle
close included, as its data plane runs it. Between them is a `Wire`: an in-memory connection whose
bytes and end of stream arrive `LATENCY_S` after they are sent, in order, so that a source's close
and our next request can cross on it, as they do on a network. A source killed (`kill`) has its
connections closed at once (its kernel's FIN goes out on the wire) and refuses new ones.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import AsyncIterator

import pytest
import trio
import trio.testing

from p2pnet.dataplane import HELLO_MAX_BYTES, FrameReader, send_frame
from p2pnet.errors import MessageRejected, PeerUnavailable
from relay.effects import DropReason
from relay.messages import STATUS_UNAVAILABLE, ChunkResponse
from relay.role import RelayRole, _parse_request
from tests.relay.test_role_source_blame import drops
from tests.relay.test_role_store_faults import (  # noqa: F401 (fixtures)
    ME, PUBLISHER, FakeNode, Harness, clock, inline_threads)

CHUNKS = 16
LATENCY_S = 0.2  # virtual, each way
SHORT_IDLE_S = 20.0  # a source's idle bound shorter than half of ours (ours: the default, 120 s)


class _Direction(trio.abc.SendStream):
    """One direction of a `Wire`: what is sent arrives at `far` `LATENCY_S` later, in order, and
    so does the end of the stream. Bytes that arrive at an end already closed are lost."""

    def __init__(self) -> None:
        self.far = trio.testing.MemoryReceiveStream()
        self._send, self._in_flight = trio.open_memory_channel[tuple[float, bytes | None]](math.inf)
        self.closed_at: float | None = None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed_at is not None:
            raise trio.ClosedResourceError("closed")
        await trio.lowlevel.checkpoint()
        self._send.send_nowait((trio.current_time() + LATENCY_S, bytes(data)))

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        if self.closed_at is None:
            self.closed_at = trio.current_time()
            self._send.send_nowait((self.closed_at + LATENCY_S, None))
        await trio.lowlevel.checkpoint()

    async def carry(self) -> None:
        async for at, data in self._in_flight:
            await trio.sleep_until(at)
            try:
                if data is None:
                    self.far.put_eof()
                    return
                self.far.put_data(data)
            except trio.ClosedResourceError:
                pass  # the far end has closed: lost


class Wire:
    """One connection: the requester's end (`ours`) and the source's (`theirs`)."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.up, self.down = _Direction(), _Direction()  # to the source, to us
        self.ours = trio.StapledStream(self.up, self.down.far)
        self.theirs = trio.StapledStream(self.down, self.up.far)
        nursery.start_soon(self.up.carry)
        nursery.start_soon(self.down.carry)

    def closed_first_by(self) -> str | None:
        """Which end closed the connection first: "requester", "source" or None (still open)."""
        closes = [(at, who) for at, who in ((self.up.closed_at, "requester"), (self.down.closed_at, "source"))
                  if at is not None]
        return min(closes)[1] if closes else None


class SourcePeer:
    """The publisher as a relay serves: a real role's `_serve` per connection over the publisher's
    store, with `idle_timeout_s`. `read_at`: when it read each request, by virtual time."""

    def __init__(self, h: Harness, idle_timeout_s: float) -> None:
        self.role = RelayRole(FakeNode(h.root / "source"), {
            "trusted_publishers": [PUBLISHER.peer_id], "fsync": False, "idle_timeout_s": idle_timeout_s})
        self.role.store.close()
        self.role.store = h.origin
        self.wires: list[Wire] = []
        self.read_at: list[float] = []
        self.alive = True
        self._connections: list[trio.CancelScope] = []

    async def connect(self, nursery: trio.Nursery) -> trio.abc.Stream:
        """`RelayRole.open_stream` to this source: a new `Wire`, served while the source lives."""
        if not self.alive:
            raise PeerUnavailable("data plane: ConnectionRefusedError")
        wire = Wire(nursery)
        self.wires.append(wire)
        nursery.start_soon(self._serve, wire.theirs)
        return wire.ours

    async def _serve(self, stream: trio.abc.Stream) -> None:
        source = self

        class Reader(FrameReader):
            async def frame(self) -> bytes | None:
                frame = await super().frame()
                if frame is not None:
                    source.read_at.append(trio.current_time())
                return frame

        with trio.CancelScope() as connection:
            self._connections.append(connection)
            async with stream:  # (as the data plane runs a channel's handler)
                try:
                    await self.role._serve(stream, Reader(stream, max_frame_bytes=HELLO_MAX_BYTES), ME.peer_id)
                except (trio.BrokenResourceError, trio.ClosedResourceError, PeerUnavailable, MessageRejected):
                    pass

    def kill(self) -> None:
        """Its process dies: its connections close (the kernel's FIN) and new ones are refused."""
        self.alive = False
        for connection in self._connections:
            connection.cancel()


async def start(h: Harness, source: SourcePeer, nursery: trio.Nursery, monkeypatch) -> list[tuple]:
    """Start the requester `h` fetching from `source` over its own upstreams; returns the list of
    the failures its core is told, (peer, index, reason), as they come."""

    async def send_file(stream, fd: int, offset: int, count: int, *, idle_s: float = math.inf) -> None:
        with trio.fail_after(idle_s):  # (one write: its whole time is the time between writes)
            await stream.send_all(os.pread(fd, count, offset))  # (a `Wire` has no socket for `os.sendfile`)

    monkeypatch.setattr("relay.serving_shell.send_file", send_file)
    failures: list[tuple] = []
    fetch_failed = h.role.core.fetch_failed

    def told(now, peer, version, index, reason):
        failures.append((peer, index, reason))
        return fetch_failed(now, peer, version, index, reason)

    monkeypatch.setattr(h.role.core, "fetch_failed", told)
    nursery.start_soon(source.role._uploads.run)

    async def open_stream(peer: str) -> trio.abc.Stream:
        assert peer == PUBLISHER.peer_id
        return await source.connect(nursery)

    h.role.open_stream = open_stream
    await h.start(nursery)
    h.role._upstream = RelayRole._upstream.__get__(h.role)  # the role's own upstreams, not the harness's source
    return failures


async def fetched_first(h: Harness) -> None:
    await h.announce(1, chunks=CHUNKS)
    await h.until(lambda: h.complete(1), 60)


@contextlib.asynccontextmanager
async def idle_after_version_1(tmp_path, monkeypatch) -> AsyncIterator[tuple[Harness, SourcePeer, list[tuple], float]]:
    """A requester that has fetched version 1 from a source keeping the default idle bound
    (120 s), as both sides do: the requester, the source, the failures its core is told (`start`)
    and when the source read our last request. Both stop on leaving."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    source = SourcePeer(h, idle_timeout_s=120.0)
    async with trio.open_nursery() as nursery:
        failures = await start(h, source, nursery, monkeypatch)
        await fetched_first(h)
        yield h, source, failures, source.read_at[-1]
        nursery.cancel_scope.cancel()


async def test_a_source_closing_an_idle_connection_as_we_ask_again_is_not_excluded_and_serves_the_version(
        tmp_path, clock, monkeypatch):
    """The source's idle bound is shorter than ours: it closes our connection `SHORT_IDLE_S`
    after the last request it read, and version 2's requests are written while its FIN is on the
    wire. They meet a closed connection; the source is alive and honest (it owed us nothing), so
    it is not excluded: they are asked again on a new connection, and version 2 comes from it."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    source = SourcePeer(h, idle_timeout_s=SHORT_IDLE_S)
    async with trio.open_nursery() as nursery:
        failures = await start(h, source, nursery, monkeypatch)
        await fetched_first(h)
        await trio.sleep_until(source.read_at[-1] + SHORT_IDLE_S + LATENCY_S / 2)  # its FIN is half way here
        assert source.wires[0].closed_first_by() == "source"
        await h.announce(2, chunks=CHUNKS)
        await h.until(lambda: h.complete(2), 600)
        nursery.cancel_scope.cancel()

    assert failures == [] and drops(h, PUBLISHER.peer_id) == []
    assert PUBLISHER.peer_id not in h.role.core._excluded
    assert len(source.wires) == 2  # version 2 came on a new connection


async def test_we_close_an_idle_connection_before_the_source_does_and_ask_on_a_new_one(tmp_path, clock, monkeypatch):
    """Both sides keep the default idle bound (120 s). We close our connection once we have
    written nothing on it for half of it and are owed nothing, before the source's bound, and
    tell the core nothing: the upstream leaves the role's upstreams, and version 2, asked after
    the source's bound, goes on a new connection."""
    async with idle_after_version_1(tmp_path, monkeypatch) as (h, source, failures, last_read):
        await trio.sleep_until(last_read + 120.0 - LATENCY_S)  # the source's bound not reached yet
        assert source.wires[0].closed_first_by() == "requester"
        assert h.role._upstreams == {}
        await trio.sleep_until(last_read + 300.0)
        await h.announce(2, chunks=CHUNKS)
        await h.until(lambda: h.complete(2), 600)

    assert failures == [] and drops(h, PUBLISHER.peer_id) == []
    assert len(source.wires) == 2


@pytest.mark.parametrize("killed_at_s, asked_at_s", [
    (30.0, 40.0),  # killed while our connection is open and idle: its FIN ends it, the next ask is refused
    (30.0, 30.0 + LATENCY_S / 2),  # killed as we ask again: our requests cross its FIN
    (90.0, 100.0),  # killed after we closed our idle connection
])
async def test_a_source_killed_after_an_idle_period_is_still_excluded_as_unreachable(
        tmp_path, clock, monkeypatch, killed_at_s, asked_at_s):
    async with idle_after_version_1(tmp_path, monkeypatch) as (h, source, failures, last_read):
        await trio.sleep_until(last_read + killed_at_s)
        source.kill()
        await trio.sleep_until(last_read + asked_at_s)
        await h.announce(2, chunks=CHUNKS)
        await h.until(lambda: bool(drops(h, PUBLISHER.peer_id)), 60)

    assert drops(h, PUBLISHER.peer_id)[0] is DropReason.UNREACHABLE
    assert failures and {reason for _, _, reason in failures} == {"unreachable"}
    assert not h.complete(2)


class ChurningSource:
    """A hostile source: on each connection it answers every request it reads `unavailable` at
    once, and closes the connection as soon as it reads a request written after our upstream
    heard its last answer (read `2 * LATENCY_S` or more after that answer went out). Every request
    still out then was written after the source's last byte, as when an honest source's idle
    close crosses our requests; but it answered something on every connection."""

    def __init__(self) -> None:
        self.wires: list[Wire] = []
        self.answers = 0

    async def connect(self, nursery: trio.Nursery) -> trio.abc.Stream:
        wire = Wire(nursery)
        self.wires.append(wire)
        nursery.start_soon(self._serve, wire.theirs, len(self.wires))
        return wire.ours

    def _closes_on(self, answered_at: float | None, n: int) -> bool:
        """Whether it closes its `n`th connection on the request it just read instead of answering
        it: one written after our upstream heard its last answer (at `answered_at`)."""
        return answered_at is not None and trio.current_time() >= answered_at + 2 * LATENCY_S

    async def _serve(self, stream: trio.abc.Stream, n: int) -> None:
        answered_at: float | None = None
        async with stream:
            try:
                reader = FrameReader(stream, max_frame_bytes=HELLO_MAX_BYTES)
                while (frame := await reader.frame()) is not None:
                    request, _ = _parse_request(frame)
                    if self._closes_on(answered_at, n):
                        return
                    await send_frame(stream, ChunkResponse(request.request_id, STATUS_UNAVAILABLE, 0).pack())
                    answered_at = trio.current_time()
                    self.answers += 1
            except (trio.BrokenResourceError, trio.ClosedResourceError, PeerUnavailable):
                pass  # our upstream closed the connection


async def test_a_source_that_answers_unavailable_and_closes_on_every_connection_gets_few_connections(
        tmp_path, clock, monkeypatch):
    """What a hostile source can make us do by answering `unavailable` on each connection and
    closing it with our next requests unread: each close looks like an honest idle close (every
    request out was written after its last byte), and each connection answered something. An
    `unavailable` answer is no answer for the once-only rule: the second such connection in a row
    fails its requests as `unreachable`, so the source gets two connections per exclusion
    (`exclude_s`, twice `stall_timeout_s`). When any answer counted, it got one per core tick
    (every 5 s here: 36 in these 180 s) and was never excluded: no stall either, for its
    requests settle at each answer."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    source = ChurningSource()
    exclude_s = 2 * h.role.config.stall_timeout_s
    async with trio.open_nursery() as nursery:
        async def open_stream(peer: str) -> trio.abc.Stream:
            assert peer == PUBLISHER.peer_id
            return await source.connect(nursery)

        h.role.open_stream = open_stream
        await h.start(nursery)
        h.role._upstream = RelayRole._upstream.__get__(h.role)  # the role's own upstreams
        await h.announce(1, chunks=CHUNKS)
        start_at = trio.current_time()
        await trio.sleep(3 * exclude_s)
        dropped = drops(h, PUBLISHER.peer_id)
        nursery.cancel_scope.cancel()

    elapsed_s = trio.current_time() - start_at
    # two connections per exclusion (the second one's end excludes it), and the one under way
    assert len(source.wires) <= 2 * (elapsed_s // exclude_s + 1), (len(source.wires), source.answers)
    assert dropped and set(dropped) == {DropReason.UNREACHABLE}
    assert not h.complete(1)


class BehindSource(ChurningSource):
    """An honest source that is behind for a long time: its first connection closes idle as our
    first requests cross it (they are carried over), its second answers every request
    `unavailable` until `behind_until` and then closes idle as our next request crosses it (as
    `ChurningSource` closes), and from its third on it serves the version (`SourcePeer`)."""

    def __init__(self, peer: SourcePeer, behind_until: float) -> None:
        super().__init__()
        self.wires = peer.wires  # one count of connections with the serving peer's own
        self.peer = peer
        self.behind_until = behind_until

    async def connect(self, nursery: trio.Nursery) -> trio.abc.Stream:
        if len(self.wires) >= 2:
            return await self.peer.connect(nursery)
        return await super().connect(nursery)

    def _closes_on(self, answered_at: float | None, n: int) -> bool:
        # the first: its idle close crossed our first requests; the second: caught up, idle, and
        # closing as our next request comes
        return n == 1 or (super()._closes_on(answered_at, n) and trio.current_time() >= self.behind_until)


async def test_a_source_behind_for_longer_than_an_exclusion_whose_idle_close_crosses_a_request_is_not_excluded(
        tmp_path, clock, monkeypatch):
    """Requests were carried over to a connection, on which the source, behind, answers only
    `unavailable` for longer than `exclude_s`; then its idle close crosses our next request. The
    once-only rule lasts an exclusion's length: the connection lived `exclude_s`, so the request
    is asked again on a new connection, which serves the version, and nobody is excluded."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    peer = SourcePeer(h, idle_timeout_s=120.0)
    exclude_s = h.role.core.config.exclude_s
    source = BehindSource(peer, behind_until=trio.current_time() + 1.5 * exclude_s)
    async with trio.open_nursery() as nursery:
        failures = await start(h, peer, nursery, monkeypatch)

        async def open_stream(name: str) -> trio.abc.Stream:
            assert name == PUBLISHER.peer_id
            return await source.connect(nursery)

        h.role.open_stream = open_stream
        await h.announce(1, chunks=CHUNKS)
        await h.until(lambda: h.complete(1), 3 * exclude_s)
        nursery.cancel_scope.cancel()

    assert source.answers > 0 and len(peer.wires) == 3  # version 1 came on the third connection
    assert peer.wires[1].closed_first_by() == "source"
    assert {reason for _, _, reason in failures} <= {"unavailable"} and drops(h, PUBLISHER.peer_id) == []
