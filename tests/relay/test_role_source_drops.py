"""The relay role fetching over real upstreams from sources it drops at random moments, in
virtual time (MockClock): no drop crashes the role, and every chunk arrives.

Every source is a real `relay.upstream.Upstream` (the role's own, one per peer, closed by
`DropSource`) over an in-memory connection to a `FlakyServer`: it answers each request after a
random wait from the publisher's store, the chunk's bytes sometimes in two pieces with a pause
between, and now and then it dies (closes the connection) in the middle of a chunk. Meanwhile the
test drops a source that has requests out, at random moments, as the core does when a source
stalls (`_exclude` and `DropSource`, in the core's runner), so the close lands wherever the
upstream happens to be: reading a header or a chunk's bytes, waiting for a buffer, writing a
request, or storing a received chunk. A bug raised after a drop (`Upstream.run` raises it, and
the role stops) fails the test; so does a chunk never fetched, or a request the core still counts
in flight once every answer has come. Trio's scheduler shuffles its batches: each run of a seed
differs a little, and each finds more.

A connection that ends by itself is failed to the core for the peer as a whole (an exclusion
takes back every request out there). A core that hears of it late, after asking the same peer
again, must not have that failure take back requests a newer connection to the peer carries;
nor may one made for requests a drop still waiting in the dispatcher's queue took back.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial

import pytest
import trio
import trio.testing

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.errors import PeerUnavailable
from relay.effects import DropReason, DropSource
from relay.messages import STATUS_OK, ChunkResponse
from relay.role import RelayRole, _parse_request
from relay.upstream import Upstream
from tests.relay.test_role_source_blame import MEMBERS, drops
from tests.relay.test_role_store_faults import (  # noqa: F401 (fixtures)
    PUBLISHER, Harness, clock, inline_threads)

CHUNKS = 96
TICK_S = 0.05  # virtual: every wait is a whole number of these, so that a drop often comes at the moment of an answer
DROPS = 40  # then the drops stop, and the exclusions run out: the version must complete


class FlakyServer:
    """Every source's end of its data connections, answering from the publisher's store. Now and
    then, just before or after one of its sends, it has the source dropped (`drop(peer)`): the
    close then meets the upstream as those bytes arrive."""

    def __init__(self, store, rng: random.Random, drop: Callable[[str], None]) -> None:
        self.store, self.rng, self.drop = store, rng, drop
        self.deaths = 0  # connections closed in the middle of a chunk

    async def serve(self, peer: str, stream: trio.abc.Stream) -> None:
        sending = trio.Lock()
        with trio.CancelScope() as connection:
            try:
                async with trio.open_nursery() as nursery:
                    reader = FrameReader(stream, max_frame_bytes=4096)
                    while (frame := await reader.frame()) is not None:
                        request, _ = _parse_request(frame)
                        nursery.start_soon(self._answer, peer, stream, sending, request, connection)
            except (PeerUnavailable, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # our upstream closed the connection (the core dropped this source)
        await stream.aclose()

    async def _answer(self, peer: str, stream, sending: trio.Lock, request, connection: trio.CancelScope) -> None:
        rng = self.rng
        await trio.sleep(TICK_S * rng.choice((0, rng.randrange(6), rng.randrange(60))))
        data = self.store.read_chunk(request.version, request.index)
        cut = rng.randrange(len(data))
        try:
            async with sending:
                await self._send(peer, stream, ChunkResponse(request.request_id, STATUS_OK, len(data)).pack(), True)
                await self._send(peer, stream, data[:cut])
                if rng.random() < 0.3:
                    await trio.sleep(TICK_S * rng.randrange(20))
                if rng.random() < 0.03:
                    self.deaths += 1
                    connection.cancel()  # it dies inside the chunk: the connection ends there
                    return
                await self._send(peer, stream, data[cut:])
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            connection.cancel()  # our upstream closed the connection (the core dropped this source)

    async def _send(self, peer: str, stream, data: bytes, frame: bool = False) -> None:
        when = self.rng.random()
        if when < 0.03:  # the drop on its way to the upstream as these bytes go
            self.drop(peer)
        await (send_frame(stream, data) if frame else stream.send_all(data))
        if when > 0.97:
            self.drop(peer)


def drop_as_stalled(core, peer: str):
    """The core's input that drops `peer` as its stall check does (`_check_stalls`)."""

    def drop(now: float) -> list:
        effects: list = []
        core._exclude(now, peer, DropReason.STALLED, effects)
        effects.append(DropSource(peer))
        for v in list(core._versions.values()):
            if not v.complete:
                core._pump(now, v, effects)
        return core._arm(now, effects)

    return drop


@pytest.mark.parametrize("seed", range(40))
async def test_sources_dropped_at_random_moments_crash_nothing_and_every_chunk_arrives(tmp_path, clock, monkeypatch,
                                                                                      seed):
    rng = random.Random(seed)
    h = Harness(tmp_path, max_concurrent_downloads=8)
    role, core = h.role, h.role.core
    closed_with_requests_out: list[int] = []
    real_close = Upstream.close

    def close(upstream: Upstream) -> None:
        closed_with_requests_out.append(upstream.outstanding + upstream._receive.statistics().current_buffer_used)
        real_close(upstream)

    monkeypatch.setattr(Upstream, "close", close)
    async with trio.open_nursery() as nursery:
        def drop(peer: str) -> None:
            if len(closed_with_requests_out) < DROPS and peer != PUBLISHER.peer_id:
                nursery.start_soon(role._command, drop_as_stalled(core, peer))

        server = FlakyServer(h.origin, rng, drop)

        async def open_stream(peer: str) -> trio.abc.Stream:
            ours, theirs = trio.testing.memory_stream_pair()
            nursery.start_soon(server.serve, peer, theirs)
            return ours

        role.open_stream = open_stream
        await h.start(nursery)
        role._upstream = RelayRole._upstream.__get__(role)  # the role's own upstreams, not the harness's source
        await role._command(lambda now: core.set_members(now, {PUBLISHER.peer_id: 1e8, **MEMBERS}))
        await h.announce(1, chunks=CHUNKS)
        while len(closed_with_requests_out) < DROPS and not h.complete(1):  # and at random moments of ours
            await trio.sleep(TICK_S * rng.choice((0, 1, rng.randrange(40))))
            busy = [p for p, u in role._upstreams.items() if not u.closed and u.outstanding]
            if busy:
                drop(rng.choice(sorted(busy)))
        await h.until(lambda: h.complete(1), 3600)
        # the requests still out when the last chunk came (asked twice) settle as their answers come
        await h.until(lambda: core.progress(trio.current_time(), 1)["in_flight"] == 0, 600)
        nursery.cancel_scope.cancel()

    assert all(role.store.holds(1, i) for i in range(CHUNKS))
    assert core._in_flight == 0
    assert sum(1 for n in closed_with_requests_out if n) >= 5  # (the drops found requests out)


class RestartingServer:
    """The publisher's end of its data connections, answering from its store: its first
    connection ends by itself after the first answer (the source restarted, or the connection
    was reset), our other requests on it unanswered; a later one answers each request once
    `ready` is set."""

    def __init__(self, store, ready: trio.Event) -> None:
        self.store, self.ready = store, ready
        self.connections = 0

    async def serve(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        first = self.connections == 1
        async with stream:
            try:
                reader = FrameReader(stream, max_frame_bytes=4096)
                while (frame := await reader.frame()) is not None:
                    request, _ = _parse_request(frame)
                    if not first:
                        await self.ready.wait()
                    data = self.store.read_chunk(request.version, request.index)
                    await send_frame(stream, ChunkResponse(request.request_id, STATUS_OK, len(data)).pack())
                    await stream.send_all(data)
                    if first:
                        return
            except (PeerUnavailable, trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # our upstream closed the connection


def answers_checked(core, monkeypatch) -> list[bool]:
    """Per chunk the core is told fetched, as it is told: whether it still had it out at its sender."""
    answered: list[bool] = []
    fetched = core.fetched

    def fetched_checked(now, peer, version, index, *args):
        entry = core._versions[version].in_flight.get(index)
        answered.append(entry is not None and entry[0] == peer)
        return fetched(now, peer, version, index, *args)

    monkeypatch.setattr(core, "fetched", fetched_checked)
    return answered


async def start_fetching(h: Harness, server: RestartingServer, nursery: trio.Nursery) -> None:
    """Start `h`'s role fetching version 1 from `server` over its own upstreams (each connection
    a new one of `server`'s)."""
    async def open_stream(peer: str) -> trio.abc.Stream:
        ours, theirs = trio.testing.memory_stream_pair()
        nursery.start_soon(server.serve, theirs)
        return ours

    h.role.open_stream = open_stream
    await h.start(nursery)
    h.role._upstream = RelayRole._upstream.__get__(h.role)  # the role's own upstreams, not the harness's source
    await h.announce(1, chunks=CHUNKS)


async def test_a_connection_that_fails_by_itself_cancels_no_request_a_newer_connection_carries(
        tmp_path, clock, monkeypatch):
    """The publisher, our only source, ends its first connection by itself with requests out,
    and our core lags: before it hears of that failure it hears of the chunk the connection
    delivered, and asks the publisher for another. The old connection's failure must speak only
    for the requests it carried: every chunk the publisher delivers, on any connection, answers a
    request the core still has out at it (a later connection answers once the core has heard of
    the failure), and the version completes."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    role, core = h.role, h.role.core
    failing = trio.Event()  # the first connection's failure is on its way to the core
    told = trio.Event()  # the core may hear it
    heard = trio.Event()  # it has
    server = RestartingServer(h.origin, heard)
    command, report_failed = role._command, role.report_failed

    async def lagging(fn) -> None:  # the core hears of stored chunks once that failure is on its way
        if isinstance(fn, partial) and fn.func == role._stored_all:
            await failing.wait()
        await command(fn)

    async def lagging_report(peer, fetch, reason, upstream=None) -> None:
        failing.set()
        await told.wait()
        await report_failed(peer, fetch, reason, upstream)
        heard.set()

    role._command, role.report_failed = lagging, lagging_report
    answered = answers_checked(core, monkeypatch)
    asked_while_failing = trio.Event()  # a request handed to an upstream after the connection failed
    submit = Upstream.submit

    def submit_noted(upstream: Upstream, fetch) -> None:
        if failing.is_set():
            asked_while_failing.set()
        submit(upstream, fetch)

    monkeypatch.setattr(Upstream, "submit", submit_noted)
    async with trio.open_nursery() as nursery:
        await start_fetching(h, server, nursery)
        with trio.fail_after(60):
            await asked_while_failing.wait()
        told.set()
        await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()

    assert server.connections >= 2
    assert len(answered) == CHUNKS and all(answered), answered


def drop_as_slow_and_ask_again(core, peer: str):
    """The core's input that drops `peer` as slow (`fetched` does, `_delivers_too_little`) and
    asks it again at once, as `_instead_of_origin` asks a member dropped only as slow (alive, it
    comes before the origin): here `peer` is the only source, so its exclusion is lifted."""

    def drop(now: float) -> list:
        effects: list = []
        core._exclude(now, peer, DropReason.SLOW, effects)
        effects.append(DropSource(peer))
        del core._excluded[peer]
        for v in list(core._versions.values()):
            if not v.complete:
                core._pump(now, v, effects)
        return core._arm(now, effects)

    return drop


async def test_a_late_report_of_a_dropped_sources_old_connection_takes_back_no_request_asked_of_it_since(
        tmp_path, clock, monkeypatch):
    """The publisher's first connection ends by itself with requests out, and the first of their
    failures is on its way to the core when the core drops the publisher as slow and asks it again
    on a new connection. That drop took every request of the old connection back: the late
    failure must not take the new requests back too, nor turn the drop into `unreachable`."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    role, core = h.role, h.role.core
    failing, told, landed, answer = trio.Event(), trio.Event(), trio.Event(), trio.Event()
    server = RestartingServer(h.origin, answer)
    report_failed = role.report_failed

    async def lagging_report(peer, fetch, reason, upstream=None) -> None:
        failing.set()
        await told.wait()
        await report_failed(peer, fetch, reason, upstream)
        landed.set()

    role.report_failed = lagging_report
    answered = answers_checked(core, monkeypatch)
    async with trio.open_nursery() as nursery:
        await start_fetching(h, server, nursery)
        with trio.fail_after(60):
            await failing.wait()
        await role._command(drop_as_slow_and_ask_again(core, PUBLISHER.peer_id))
        await h.until(lambda: server.connections == 2, 60)  # asked again, on a new connection
        told.set()
        await h.until(landed.is_set, 60)
        answer.set()
        await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()

    assert drops(h, PUBLISHER.peer_id) == [DropReason.SLOW]
    assert len(answered) == CHUNKS and all(answered), answered
    assert role._dropping == {}  # (an entry lives only while its drops wait to be carried out)


class HeldDrops:
    """`_dispatch`'s queue, handing over each `DropSource` only once `ready` is set: the drop
    waits in the queue, as it does behind our disk or behind a slow dispatcher."""

    def __init__(self, queue: trio.MemoryReceiveChannel, ready: trio.Event) -> None:
        self.queue, self.ready = queue, ready

    def __aiter__(self) -> HeldDrops:
        return self

    async def __anext__(self):
        item = await self.queue.__anext__()
        if isinstance(item, DropSource):
            await self.ready.wait()
        return item


async def serve_all(store, stream: trio.abc.Stream) -> None:
    """A source's end of one data connection: every request answered from `store`."""
    async with stream:
        try:
            reader = FrameReader(stream, max_frame_bytes=4096)
            while (frame := await reader.frame()) is not None:
                request, _ = _parse_request(frame)
                data = store.read_chunk(request.version, request.index)
                await send_frame(stream, ChunkResponse(request.request_id, STATUS_OK, len(data)).pack())
                await stream.send_all(data)
        except (PeerUnavailable, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # our upstream closed the connection


async def test_an_upstream_made_while_its_peers_drop_waits_in_the_queue_reports_nothing(
        tmp_path, clock, monkeypatch):
    """Our dispatcher waits on the disk (keeping version 1's manifest) with the publisher's first
    requests queued behind it, and the core drops the publisher as slow and asks it again: the
    `DropSource` waits in the queue behind those requests. No upstream exists for the publisher
    yet, so the dispatcher makes one for the old requests (the drop took them back); its
    connection is refused and it reports their failure before the drop is carried out. That
    upstream was made dropped (`RelayRole._upstream`: its peer's drop was pending), so its
    reports tell the core nothing: the publisher stays dropped as slow, not unreachable, and the
    requests asked of it since are not taken back."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    role, core = h.role, h.role.core
    disk, reported = trio.Event(), trio.Event()
    dialled: list[int] = []
    role._queue = HeldDrops(role._queue, reported)
    keep_manifest, report_failed = role._keep_manifest, role.report_failed

    async def slow_disk(signed) -> None:
        await disk.wait()
        await keep_manifest(signed)

    async def noted_report(peer, fetch, reason, upstream=None) -> None:
        await report_failed(peer, fetch, reason, upstream)
        if upstream is not None:
            reported.set()

    role._keep_manifest, role.report_failed = slow_disk, noted_report
    answered = answers_checked(core, monkeypatch)
    async with trio.open_nursery() as nursery:
        async def open_stream(peer: str) -> trio.abc.Stream:
            dialled.append(len(dialled))
            if len(dialled) == 1:
                raise PeerUnavailable("data plane: ConnectionRefusedError")  # the first dial fails
            ours, theirs = trio.testing.memory_stream_pair()
            nursery.start_soon(serve_all, h.origin, theirs)
            return ours

        role.open_stream = open_stream
        await h.start(nursery)
        role._upstream = RelayRole._upstream.__get__(role)  # the role's own upstreams, not the harness's source
        await h.announce(1, chunks=CHUNKS)
        await h.until(lambda: core.progress(trio.current_time(), 1)["in_flight"] > 0, 60)
        await role._command(drop_as_slow_and_ask_again(core, PUBLISHER.peer_id))
        assert role._upstreams == {} and role._dropping == {PUBLISHER.peer_id: 1}
        disk.set()
        await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()

    assert reported.is_set() and len(dialled) >= 2
    assert drops(h, PUBLISHER.peer_id) == [DropReason.SLOW]
    assert len(answered) == CHUNKS and all(answered), answered
    assert role._dropping == {}
