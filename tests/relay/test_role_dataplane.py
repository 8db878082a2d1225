"""The relay shell's data plane against scripted servers on loopback: what a fetcher believes."""

import contextlib
import random
import socket
import struct
from types import SimpleNamespace
from typing import AsyncIterator

import pytest
import trio
import trio.testing

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.errors import MessageRejected
from p2pnet.handshake import server_handshake
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from relay.config import RelayConfig
from relay.messages import RESPONSE, STATUS_OK, STATUS_UNAVAILABLE, ChunkRequest, ChunkResponse
from relay.role import RelayRole, _parse_request
from relay.upstream import Buffers, Upstream
from relay.serving import ByteBudget, Refuse, Serve, ServingConfig, ServingCore, UploadMeter
from relay.uploads import Uploads
from relay.effects import Fetch, FetchFailure, FetchManifest

DIGEST = bytes(32)
ME = Identity.from_seed_text("fetcher")
SOURCE = Identity.from_seed_text("source")


class FakeRole:
    """Just what `Upstream` uses of the role; records what it is told."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.config = RelayConfig()  # (its `idle_timeout_s`)
        # (its core's `exclude_s`, as the role sets it: how long the once-only re-send rule lasts)
        self.core = SimpleNamespace(config=SimpleNamespace(exclude_s=2 * self.config.stall_timeout_s))
        self.node = SimpleNamespace(peer_id=ME.peer_id, codec=Codec(ME), introduce=self._introduce)
        self.told: list[tuple] = []
        self.introduced: list[str] = []  # sources sent our heartbeat (`Node.introduce`)
        self.elapsed: dict[int, float] = {}  # chunk index -> the time its delivery took, as reported
        self.unexplained: dict[int, float] = {}  # chunk index -> its wait beyond the source's report, as reported
        self.buffers = Buffers(2)

    def data_addr(self, peer: str) -> str:
        return self.address

    open_stream = RelayRole.open_stream  # the real one: authenticates, and penalises a wrong address
    _data_addr_soon = RelayRole._data_addr_soon  # the real one (the address is known: no wait)

    def penalise(self, peer, amount, reason) -> None:
        self.told.append(("penalised", peer))

    async def _introduce(self, peer) -> bool:
        self.introduced.append(peer)
        return True

    async def report_fetched(self, peer, fetch, data, elapsed_s, unexplained_s=None) -> None:
        self.told.append(("fetched", fetch.index, len(data)))
        self.elapsed[fetch.index] = elapsed_s
        self.unexplained[fetch.index] = unexplained_s

    async def report_failed(self, peer, fetch, reason, upstream=None) -> None:
        assert type(reason) is FetchFailure, reason  # a member, never a bare string
        self.told.append((reason, fetch.index))

    def upstream_done(self, upstream) -> None:
        pass  # (one upstream, no upstreams to leave)


async def scripted_server(nursery: trio.Nursery, script, admit=lambda peer, channel: None) -> str:
    """A data-plane listener whose one connection runs `script(stream, requests)`."""

    async def handle(stream: trio.SocketStream) -> None:
        try:
            peer, channel = await server_handshake(stream, Codec(SOURCE), SOURCE.peer_id, admit)
        except MessageRejected:
            return  # not admitted, or a hello meant for another peer: closed without a word, as the real data plane does
        assert (peer, channel) == (ME.peer_id, "relay/chunks")
        reader = FrameReader(stream, max_frame_bytes=4096)
        requests = []
        for _ in range(2):
            frame = await reader.frame()
            requests.append(_parse_request(frame))
        await script(stream, requests)
        await stream.aclose()

    listeners = await nursery.start(trio.serve_tcp, handle, 0)
    host, port = listeners[0].socket.getsockname()[:2]
    return f"{host}:{port}"


async def fetch_two(script, **server) -> list[tuple]:
    return (await fetch_two_with(script, **server)).told


async def fetch_two_from(address: str) -> FakeRole:
    """Chunks 0 (urgent) and 1 from the source at `address`; the role, with what it was told."""
    role = FakeRole(address)
    upstream = Upstream(role, SOURCE.peer_id)
    upstream.submit(Fetch(SOURCE.peer_id, 1, 0, DIGEST, 1000, urgent=True))
    upstream.submit(Fetch(SOURCE.peer_id, 1, 1, DIGEST, 1000))
    with trio.fail_after(5):
        await upstream.run()
    return role


async def fetch_two_with(script, **server) -> FakeRole:
    """`fetch_two_from` a `scripted_server`."""
    async with trio.open_nursery() as nursery:
        role = await fetch_two_from(await scripted_server(nursery, script, **server))
        nursery.cancel_scope.cancel()
    return role


async def test_a_source_that_dies_inside_a_chunk_is_unreachable_never_a_short_chunk():
    async def script(stream, requests):
        (first, urgent), _ = requests
        assert urgent and first.index == 0
        await send_frame(stream, ChunkResponse(first.request_id, STATUS_OK, 1000).pack())
        await stream.send_all(b"x" * 500)  # then the process is killed

    role = await fetch_two_with(script)
    assert sorted(role.told) == [(FetchFailure.UNREACHABLE, 0), (FetchFailure.UNREACHABLE, 1)]
    assert role.introduced == []  # it admitted us: no introduction (only a refusal may dial)


async def source_connections(nursery: trio.Nursery, serve) -> tuple[str, list[int], trio.CancelScope]:
    """A data-plane listener that runs `serve(stream, n)` on its `n`th connection (from 1), once
    the handshake is done; the list counts the connections, and cancelling the scope kills the
    source (its listener and its connections close)."""
    accepted: list[int] = []
    process = trio.CancelScope()

    async def handle(stream: trio.SocketStream) -> None:
        accepted.append(len(accepted) + 1)
        async with stream:
            await server_handshake(stream, Codec(SOURCE), SOURCE.peer_id, lambda peer, channel: None)
            await serve(stream, accepted[-1])

    async def listen(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with process:
            await trio.serve_tcp(handle, 0, host="127.0.0.1", task_status=task_status)

    listeners = await nursery.start(listen)
    host, port = listeners[0].socket.getsockname()[:2]
    return f"{host}:{port}", accepted, process


async def answer_all(stream: trio.SocketStream) -> None:
    """Answer our two requests, then close: nothing owed (our upstream's connection ends quietly)."""
    reader = FrameReader(stream, max_frame_bytes=4096)
    for _ in range(2):
        request, _ = _parse_request(await reader.frame())
        await send_frame(stream, ChunkResponse(request.request_id, STATUS_OK, 1000).pack())
        await stream.send_all(b"r" * 1000)


async def test_a_source_that_closes_its_idle_connection_with_our_request_unread_is_asked_again_on_a_new_one():
    """An honest source closes a connection on which it owes nothing (its idle bound) just as our
    request arrives: it closes with the request unread, and its kernel resets the connection (RST,
    not FIN). That is no evidence that it is gone: the requests, all written after the last bytes
    it sent us (here: its handshake), are asked again on a new connection, and nothing fails."""
    async def serve(stream: trio.SocketStream, n: int) -> None:
        if n == 1:
            await trio.lowlevel.wait_readable(stream.socket)  # our request is here: closed unread
        else:
            await answer_all(stream)

    async with trio.open_nursery() as nursery:
        address, accepted, _ = await source_connections(nursery, serve)
        role = await fetch_two_from(address)
        nursery.cancel_scope.cancel()
    assert sorted(role.told) == [("fetched", 0, 1000), ("fetched", 1, 1000)]
    assert accepted == [1, 2]


async def test_a_source_that_closes_every_connection_unanswered_gets_one_more_then_is_unreachable():
    """Requests are asked again on a new connection once: a source that closes that one too
    before answering anything is unreachable (no loop of connections)."""
    async def serve(stream: trio.SocketStream, n: int) -> None:
        await trio.lowlevel.wait_readable(stream.socket)

    async with trio.open_nursery() as nursery:
        address, accepted, _ = await source_connections(nursery, serve)
        role = await fetch_two_from(address)
        nursery.cancel_scope.cancel()
    assert sorted(role.told) == [(FetchFailure.UNREACHABLE, 0), (FetchFailure.UNREACHABLE, 1)]
    assert accepted == [1, 2]


async def test_a_source_killed_between_answers_is_still_unreachable():
    """A source whose process is killed while it owes us answers (it read our requests) ends the
    connection between answers, as an idle close does (its kernel's FIN): asked again, its
    listener is gone (refused), and the requests fail as unreachable."""
    async def serve(stream: trio.SocketStream, n: int) -> None:
        reader = FrameReader(stream, max_frame_bytes=4096)
        for _ in range(2):
            await reader.frame()
        process.cancel()  # killed: its listener and connections close

    async with trio.open_nursery() as nursery:
        address, accepted, process = await source_connections(nursery, serve)
        role = await fetch_two_from(address)
        nursery.cancel_scope.cancel()
    assert sorted(role.told) == [(FetchFailure.UNREACHABLE, 0), (FetchFailure.UNREACHABLE, 1)]
    assert accepted == [1]


async def test_a_request_asked_again_on_a_new_connection_keeps_what_it_waited_on_the_old_one(mock_clock):
    """A source that reads our requests, holds them `HELD_S` (virtual) and closes the connection
    having sent nothing is asked again on a new connection (it may have closed an idle one), where
    it answers at once: that wait was its own, and is still counted in the time our clock gives
    the answers (`unexplained_s`), the redial left out; closing does not wipe it."""
    held, release = trio.Event(), trio.Event()
    held_s = 3.0  # (under `fetch_two_from`'s bound: virtual seconds pass only by our jump)

    async def serve(stream: trio.SocketStream, n: int) -> None:
        if n == 1:
            reader = FrameReader(stream, max_frame_bytes=4096)
            for _ in range(2):
                await reader.frame()
            held.set()
            await release.wait()  # then closed, both read: its FIN, as an idle close
        else:
            await answer_all(stream)

    async with trio.open_nursery() as nursery:
        address, accepted, _ = await source_connections(nursery, serve)

        async def hold() -> None:
            await held.wait()
            mock_clock.jump(held_s)
            release.set()

        nursery.start_soon(hold)
        role = await fetch_two_from(address)
        nursery.cancel_scope.cancel()
    assert sorted(role.told) == [("fetched", 0, 1000), ("fetched", 1, 1000)]
    assert accepted == [1, 2]
    assert min(role.unexplained.values()) >= held_s, role.unexplained


async def test_a_refusal_being_told_as_the_connection_breaks_is_not_told_again_as_unreachable():
    """The source answers our first request `unavailable` and resets the connection while that
    answer is being told (the runner is busy); our next request's write finds the reset and ends
    the connection. The refusal is told once, as it is: not again as `unreachable` with the
    requests still out."""
    closed, proceed = trio.Event(), trio.Event()

    async def serve(stream: trio.SocketStream, n: int) -> None:
        reader = FrameReader(stream, max_frame_bytes=4096)
        requests = [_parse_request(await reader.frame())[0] for _ in range(2)]
        await send_frame(stream, ChunkResponse(requests[0].request_id, STATUS_UNAVAILABLE, 0).pack())
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stream.socket.close()  # reset, not closed cleanly: the write below fails
        closed.set()

    async with trio.open_nursery() as nursery:
        address, accepted, _ = await source_connections(nursery, serve)
        role = FakeRole(address)
        report_failed = role.report_failed

        async def slow_report(peer, fetch, reason, upstream=None) -> None:
            await report_failed(peer, fetch, reason, upstream)
            if reason is FetchFailure.UNAVAILABLE:
                await proceed.wait()  # told, and the runner not yet done with it

        role.report_failed = slow_report
        upstream = Upstream(role, SOURCE.peer_id)
        upstream.submit(Fetch(SOURCE.peer_id, 1, 0, DIGEST, 1000))
        upstream.submit(Fetch(SOURCE.peer_id, 1, 1, DIGEST, 1000))
        with trio.fail_after(5):
            async with trio.open_nursery() as running:
                running.start_soon(upstream.run)
                await closed.wait()
                await trio.testing.wait_all_tasks_blocked()  # the refusal is being told
                upstream.submit(Fetch(SOURCE.peer_id, 1, 2, DIGEST, 1000))
                await trio.testing.wait_all_tasks_blocked()  # its write met the reset
                proceed.set()
        nursery.cancel_scope.cancel()
    assert sorted(role.told, key=lambda t: t[1]) == [
        (FetchFailure.UNAVAILABLE, 0), (FetchFailure.UNREACHABLE, 1), (FetchFailure.UNREACHABLE, 2)]
    assert accepted == [1]


def noting_the_first_fetch(role: FakeRole) -> trio.Event:
    """An event set once `role` has been told its first fetched chunk."""
    first = trio.Event()
    report_fetched = role.report_fetched

    async def fetched(*args) -> None:
        await report_fetched(*args)
        first.set()

    role.report_fetched = fetched
    return first


@contextlib.asynccontextmanager
async def past_the_first_fetch(serve, config: RelayConfig | None = None) -> AsyncIterator[
        tuple[FakeRole, Upstream, trio.Nursery, list[int]]]:
    """An upstream (its role's `config` when given) to a source that `serve` answers, once it has
    fetched chunk 0 and its `_write` waits for another request: the role, the upstream, the
    nursery running it (within 5 s in all) and the source's accepted connections. The source
    stops on leaving; the upstream's nursery is left to the test."""
    async with trio.open_nursery() as nursery:
        address, accepted, _ = await source_connections(nursery, serve)
        role = FakeRole(address)
        if config is not None:
            role.config = config
        first = noting_the_first_fetch(role)
        upstream = Upstream(role, SOURCE.peer_id)
        upstream.submit(Fetch(SOURCE.peer_id, 1, 0, DIGEST, 1000))
        with trio.fail_after(5):
            async with trio.open_nursery() as running:
                running.start_soon(upstream.run)
                await first.wait()
                await trio.testing.wait_all_tasks_blocked()  # `_write` waits for another request
                yield role, upstream, running, accepted
        nursery.cancel_scope.cancel()


async def test_a_request_queued_as_our_idle_timer_fires_is_written_not_spun_on():
    """Our quiet timer fires (its deadline is past) and a request for the source is queued before
    `_write` runs again, in the same scheduling batch: `_write` is owed nothing but has a request
    to write, so it writes it (on this connection) instead of waiting again on a deadline already
    past, which would raise at once, forever, with the request queued."""
    async def serve(stream: trio.SocketStream, n: int) -> None:
        await answer_all(stream)

    async with past_the_first_fetch(serve) as (role, upstream, _, accepted):
        # the timer fires as trio fires it, with its deadline past: no checkpoint before the submit
        upstream._quiet_s = 0.0
        upstream._quiet.cancel()
        upstream.submit(Fetch(SOURCE.peer_id, 1, 1, DIGEST, 1000))
    assert role.told == [("fetched", 0, 1000), ("fetched", 1, 1000)]
    assert accepted == [1]


async def test_an_idle_connection_leaves_the_role_before_a_request_can_be_handed_to_it(mock_clock):
    """Our idle connection closes itself: from finding nothing queued to leaving the role's
    upstreams it must not let another task run (a checkpoint there), or the dispatcher could hand
    it a request for its peer as it leaves: never written, failed as `unreachable` (its source
    excluded) or lost. Here a request is handed over at every point where `_write` lets other
    tasks run after its quiet timer fired and before it has left."""
    async def serve(stream: trio.SocketStream, n: int) -> None:
        reader = FrameReader(stream, max_frame_bytes=4096)
        request, _ = _parse_request(await reader.frame())
        await send_frame(stream, ChunkResponse(request.request_id, STATUS_OK, 1000).pack())
        await stream.send_all(b"r" * 1000)
        await reader.frame()  # (a request handed over as we left: read, never answered)

    left = trio.Event()
    handed: list[int] = []
    async with past_the_first_fetch(serve, RelayConfig(idle_timeout_s=2.0)) as (role, upstream, running, accepted):
        role.upstream_done = lambda upstream: left.set()

        class HandOver(trio.abc.Instrument):
            def after_task_step(self, task: trio.lowlevel.Task) -> None:
                if task.name.endswith("Upstream._write") and upstream._quiet.cancel_called and not left.is_set():
                    index = 1 + len(handed)  # as `_dispatch` would: it is still the peer's upstream
                    handed.append(index)
                    upstream.submit(Fetch(SOURCE.peer_id, 1, index, DIGEST, 1000))

        trio.lowlevel.add_instrument(HandOver())
        mock_clock.jump(1.5)  # past `idle_timeout_s / 2`: the quiet timer fires
        await left.wait()
        await trio.testing.wait_all_tasks_blocked()  # (it has closed: nothing more to run)
        running.cancel_scope.cancel()
    assert (left.is_set(), role.told, handed) == (True, [("fetched", 0, 1000)], [])
    assert accepted == [1]


async def test_answers_in_any_order_and_refusals_and_wrong_lengths_are_told_apart():
    async def script(stream, requests):
        (a, _), (b, _) = requests
        await send_frame(stream, ChunkResponse(b.request_id, STATUS_UNAVAILABLE, 0).pack())
        await send_frame(stream, ChunkResponse(a.request_id, STATUS_OK, 1000).pack())
        await stream.send_all(b"y" * 1000)

    assert await fetch_two(script) == [(FetchFailure.UNAVAILABLE, 1), ("fetched", 0, 1000)]

    async def liar(stream, requests):
        (a, _), _ = requests
        await send_frame(stream, ChunkResponse(a.request_id, STATUS_OK, 999_999).pack())

    told = await fetch_two(liar)
    assert (FetchFailure.CORRUPT, 0) in told and (FetchFailure.UNREACHABLE, 1) in told


async def test_a_source_that_sends_an_oversized_frame_broke_the_protocol_and_crashes_nothing():
    """A header frame longer than a response (the reader refuses it, `MessageRejected`) is the
    source's fault, like an answer to a request we never sent: its requests fail, and `run`
    returns (raised, it would stop the role and the peer)."""
    async def bloated(stream, requests):
        await stream.send_all((1 << 20).to_bytes(4, "big") + b"z" * 64)

    assert sorted(await fetch_two(bloated)) == [(FetchFailure.UNREACHABLE, 0), (FetchFailure.UNREACHABLE, 1)]


async def test_a_manifest_source_that_sends_an_oversized_frame_is_not_believed_and_crashes_nothing():
    """The same of a manifest fetch (`RelayRole._fetch_manifest`, run in the dispatcher's
    nursery): no frame is handed to the core, only that the ask failed on a broken answer (it
    asks another holder: `relay.manifest_asks`)."""
    role = InMemoryRole()
    role.config = SimpleNamespace(request_timeout_s=5.0)
    role.answers.put_data((1 << 20).to_bytes(4, "big") + b"z" * 64)
    told = _manifest_outcomes(role)
    with trio.fail_after(5):
        await RelayRole._fetch_manifest(role, FetchManifest(SOURCE.peer_id, 1, asked_at=7.0))
    assert role.introduced == [] and role.told == []
    assert told == [("failed", SOURCE.peer_id, 1, FetchFailure.CORRUPT, 7.0)]  # (the ask's time: which ask failed)


def _manifest_outcomes(role: "InMemoryRole") -> list[tuple]:
    """What `_fetch_manifest` tells the core, through the role's runner: ("failed", peer, version,
    reason, the ask's `asked_at`), ("declined", peer, version, `asked_at`: a status we do not know)
    or ("frame", peer, its length)."""
    told: list[tuple] = []
    role.core = SimpleNamespace(  # type: ignore[assignment]
        manifest_failed=lambda now, peer, version, reason, asked_at: told.append(
            ("failed", peer, version, reason, asked_at)),
        manifest_answer=lambda now, peer, version, frame, asked_at: told.append(("frame", peer, len(frame))),
        manifest_declined=lambda now, peer, version, asked_at: told.append(("declined", peer, version, asked_at)))

    async def command(fn) -> None:
        fn(0.0)

    role._command = command  # type: ignore[method-assign]
    return told


async def test_the_time_a_request_queued_at_the_source_counts_in_its_delivery_time():
    """The source's header says how long each request waited for its upload (its queue, not its
    long poll): a source with more requesters than its upload can feed is timed as slow as it
    is, although each chunk's bytes move fast once sent."""
    async def script(stream, requests):
        (a, _), (b, _) = requests
        await send_frame(stream, ChunkResponse(a.request_id, STATUS_OK, 1000, queued_us=0).pack())
        await stream.send_all(b"a" * 1000)
        await send_frame(stream, ChunkResponse(b.request_id, STATUS_OK, 1000, queued_us=2_500_000).pack())
        await stream.send_all(b"b" * 1000)

    elapsed = (await fetch_two_with(script)).elapsed
    assert sorted(elapsed) == [0, 1]
    assert elapsed[0] < 2.5 <= elapsed[1]  # 1,000 bytes on loopback take far less than the queue
    assert elapsed[1] - 2.5 < elapsed[0] + 1.0
    assert ChunkResponse.unpack(ChunkResponse(7, STATUS_OK, 3, 2**32 - 1).pack()).queued_s == pytest.approx(4294.967295)


async def test_a_source_that_has_not_heard_of_us_yet_fails_requests_as_not_admitted():
    """Its data plane closes after our hello (we are not in its table yet): that is no dead peer,
    and the transfer core excludes it only briefly (`not_admitted`, tested in test_transfer).
    It is sent our heartbeat directly, so that it knows us when the core asks again."""
    async def never(stream, requests):
        raise AssertionError("no request may pass a refused handshake")

    role = await fetch_two_with(never, admit=lambda peer, channel: "not in our table")
    assert sorted(role.told) == [(FetchFailure.NOT_ADMITTED, 0), (FetchFailure.NOT_ADMITTED, 1)]
    assert role.introduced == [SOURCE.peer_id]  # once for the refusal, not per request: it admits us at the retry


async def test_an_address_that_answers_as_another_peer_is_penalised_not_fetched_from():
    async def never(stream, requests):
        raise AssertionError("no request may reach an impostor")

    async with trio.open_nursery() as nursery:
        address = await scripted_server(nursery, never)
        role = FakeRole(address)
        claimed = Identity.from_seed_text("claimed").peer_id  # advertised SOURCE's address as its own
        upstream = Upstream(role, claimed)
        upstream.submit(Fetch(claimed, 1, 0, DIGEST, 1000))
        with trio.fail_after(5):
            await upstream.run()
        nursery.cancel_scope.cancel()
    assert role.told == [("penalised", claimed), (FetchFailure.UNREACHABLE, 0)]



class InMemoryRole(FakeRole):
    """A `FakeRole` whose data connection is in memory (the test reads our requests from
    `requests` and puts the source's answers into `answers`), with one chunk buffer."""

    def __init__(self) -> None:
        super().__init__("unused")
        self.buffers = Buffers(1)
        self.requests, self.answers = trio.testing.MemorySendStream(), trio.testing.MemoryReceiveStream()

    async def open_stream(self, peer: str) -> trio.abc.Stream:
        return trio.StapledStream(self.requests, self.answers)

    async def request(self) -> ChunkRequest:
        """The one request the upstream has written by now."""
        await trio.testing.wait_all_tasks_blocked()
        frame = self.requests.get_data_nowait()
        return _parse_request(frame[4:])[0]  # (after the frame's length)

    def requests_written(self) -> list[ChunkRequest]:
        """Every request the upstream has written by now (each frame after its length)."""
        data, requests = self.requests.get_data_nowait(), []
        while data:
            length = int.from_bytes(data[:4], "big")
            requests.append(_parse_request(data[4:4 + length])[0])
            data = data[4 + length:]
        return requests

    @staticmethod
    def answer(request: ChunkRequest, chunk: bytes) -> bytes:
        """A source's whole answer to `request`: the header frame, then the chunk."""
        header = ChunkResponse(request.request_id, STATUS_OK, len(chunk)).pack()
        return len(header).to_bytes(4, "big") + header + chunk


async def run_until_closed(upstream: Upstream, nursery: trio.Nursery) -> trio.Event:
    ended = trio.Event()

    async def run() -> None:
        await upstream.run()
        ended.set()

    nursery.start_soon(run)
    return ended


async def test_a_source_dropped_as_its_answer_comes_in_gives_its_buffer_back_and_keeps_the_chunk():
    """The core drops a source (`close`) while the upstream, its answer whole, is about to take it
    in (woken, not yet run: a buffer just came back). The upstream gives the buffer back (the
    buffers are shared by every upstream: one lost for each such drop, and after `STORING_CHUNKS`
    of them nothing is fetched any more) and fails with nothing of its own; the chunk, received
    whole, is stored and told, as one received before the drop is; nothing is reported failed."""
    role = InMemoryRole()
    lent = await role.buffers.take(1000)  # every buffer is storing a chunk: the upstream waits for one
    upstream = Upstream(role, SOURCE.peer_id)
    upstream.submit(Fetch(SOURCE.peer_id, 1, 0, DIGEST, 1000))
    async with trio.open_nursery() as nursery:
        ended = await run_until_closed(upstream, nursery)
        role.answers.put_data(role.answer(await role.request(), b"z" * 1000))  # read in one go
        await trio.testing.wait_all_tasks_blocked()
        assert upstream.outstanding == 1  # the header is in; the upstream waits for a buffer
        role.buffers.give(lent)  # a buffer comes back (the upstream is woken) ...
        upstream.close()  # ... and the core drops the source before the upstream runs again
        with trio.fail_after(5):
            await ended.wait()
            await role.buffers.take(1000)  # the buffer is lendable again
    assert role.told == [("fetched", 0, 1000)]


async def test_an_answer_behind_another_on_the_connection_did_not_wait_on_the_source(autojump_clock):
    """Answers to us share one connection: the second's header comes only after the first's bytes.
    Its wait beyond the source's report (`relay.judging`, `_unexcused_s`) leaves out the time the
    connection spent taking the first in (its bytes, our wait for a buffer): a parent serving us
    in several stripes had each answer timed behind all of ours before it, as if its queue. A
    source that holds them back does not gain by it: its wait since our ask still counts."""
    role = InMemoryRole()
    role.buffers = Buffers(2)
    upstream = Upstream(role, SOURCE.peer_id)
    for index in (0, 1):
        upstream.submit(Fetch(SOURCE.peer_id, 1, index, DIGEST, 1000))
    async with trio.open_nursery() as nursery:
        ended = await run_until_closed(upstream, nursery)
        await trio.testing.wait_all_tasks_blocked()
        first, second = role.requests_written()
        answer = role.answer(first, b"a" * 1000)
        role.answers.put_data(answer[:-500])  # half its bytes now ...
        await trio.sleep(1.0)
        role.answers.put_data(answer[-500:])  # ... and the rest a second later
        await trio.sleep(2.0)  # the second, held back by the source, reporting no queue
        role.answers.put_data(role.answer(second, b"b" * 1000))
        await trio.testing.wait_all_tasks_blocked()
        role.answers.put_eof()
        with trio.fail_after(5):
            await ended.wait()
    assert role.elapsed == {0: pytest.approx(1.0), 1: 0.0}
    assert role.unexplained == {0: 0.0, 1: pytest.approx(2.0)}  # not 3 s: 1 s of it was the first's bytes


async def test_a_source_dropped_as_an_answer_comes_in_is_not_said_to_break_the_protocol(caplog):
    """The core drops a source (`close`) while the upstream is woken by an answer's header and not
    yet run: the request is no longer ours, but we did send it; the source broke nothing."""
    role = InMemoryRole()
    upstream = Upstream(role, SOURCE.peer_id)
    upstream.submit(Fetch(SOURCE.peer_id, 1, 0, DIGEST, 1000))
    async with trio.open_nursery() as nursery:
        ended = await run_until_closed(upstream, nursery)
        role.answers.put_data(role.answer(await role.request(), b"z" * 1000))  # (the upstream is woken) ...
        upstream.close()  # ... and the core drops the source before it runs again
        with trio.fail_after(5):
            await ended.wait()
    assert not [r for r in caplog.records if "broke the chunk protocol" in r.getMessage()]
    assert role.told == []


class _FailingPending(dict):
    """An upstream's table of requests whose `pop` has a bug (as `del` had: a KeyError after `close`)."""

    def pop(self, *args):
        raise RuntimeError("injected: a bug of ours in the read path")


@pytest.mark.parametrize("where", ["read", "report"])
async def test_a_bug_of_ours_after_the_source_was_dropped_is_raised_not_hidden(where):
    """The core drops a source (`close`) while the upstream, its answer whole, is woken to take it
    in; then a bug of ours raises, in the read path itself or in the task that reports the chunk.
    The upstream's scope is cancelled by then, and the connection's close raises Cancelled over
    the bug: `run()` must still raise it, not return as if the source had just been dropped."""
    role = InMemoryRole()
    lent = await role.buffers.take(1000)  # every buffer is storing a chunk: the upstream waits for one
    upstream = Upstream(role, SOURCE.peer_id)
    if where == "read":
        upstream._pending = _FailingPending()
    else:
        async def report_fetched(peer, fetch, data, elapsed_s, unexplained_s=None) -> None:
            raise RuntimeError("injected: a bug of ours in storing a chunk")

        role.report_fetched = report_fetched
    upstream.submit(Fetch(SOURCE.peer_id, 1, 0, DIGEST, 1000))
    raised: list[BaseException] = []
    ended = trio.Event()

    async def run() -> None:
        try:
            await upstream.run()
        except Exception as exc:
            raised.append(exc)
        ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        role.answers.put_data(role.answer(await role.request(), b"z" * 1000))
        await trio.testing.wait_all_tasks_blocked()
        role.buffers.give(lent)  # a buffer comes back (the upstream is woken) ...
        upstream.close()  # ... and the core drops the source before the upstream runs again
        with trio.fail_after(5):
            await ended.wait()
    assert len(raised) == 1
    bug = raised[0]
    if isinstance(bug, BaseExceptionGroup):
        bug = bug.subgroup(RuntimeError)
        assert bug is not None and bug.subgroup(trio.Cancelled) is None
        (bug,) = _leaves(bug)
    assert isinstance(bug, RuntimeError) and "injected" in str(bug)
    assert role.told == []


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def test_upload_slots_go_to_urgent_requests_first():
    core = ServingCore(ServingConfig(slots=1))
    assert core.ask(0.0, "first", "a", 1, 0, False, held=True) == [Serve("first")]
    assert core.ask(0.0, "normal", "b", 1, 1, False, held=True) == []
    assert core.ask(0.0, "urgent", "c", 1, 2, True, held=True) == []
    assert core.done(1.0, "first") == [Serve("urgent", queued_s=1.0)]
    assert core.done(2.0, "urgent") == [Serve("normal", queued_s=2.0)]  # the queue time goes in the answer
    assert core.done(3.0, "normal") == [] and core.free == 1


def test_one_peer_cannot_hold_every_upload_slot_and_peers_take_turns():
    core = ServingCore(ServingConfig(slots=4))  # at most 2 per peer
    assert core.ask(0, "g1", "greedy", 1, 0, False, True) + core.ask(0, "g2", "greedy", 1, 1, False, True) == \
        [Serve("g1"), Serve("g2")]
    assert core.ask(0, "g3", "greedy", 1, 2, False, True) == []  # over its share: waits with 2 slots free
    assert core.ask(0, "o1", "other", 1, 0, False, True) == [Serve("o1")]
    assert core.ask(0, "o2", "other", 1, 1, False, True) == [Serve("o2")]
    assert core.ask(0, "o3", "other", 1, 2, False, True) == []
    assert core.done(1, "g1") == [Serve("g3", 1.0)]  # greedy is back under its share and first in line
    assert core.done(2, "g2") == []  # a free slot, but "other" holds its share already
    assert core.done(3, "o1") == [Serve("o3", 3.0)]


def test_a_peer_that_forwards_gets_one_urgent_chunk_at_a_time_but_others_still_get_several():
    core = ServingCore(ServingConfig(slots=8))  # 4 per peer, 1 of them urgent (the default)
    assert core.ask(0, "u1", "child", 1, 0, True, True) == [Serve("u1")]
    assert core.ask(0, "u2", "child", 1, 1, True, True) == []  # its next chunk waits for the first
    assert core.ask(0, "n1", "leaf", 1, 0, False, True) + core.ask(0, "n2", "leaf", 1, 1, False, True) == \
        [Serve("n1"), Serve("n2")]
    assert core.done(1, "u1") == [Serve("u2", 1.0)]  # at full rate, then the next one
    wide = ServingCore(ServingConfig(slots=8, urgent_per_peer=2))
    assert wide.ask(0, "u1", "child", 1, 0, True, True) + wide.ask(0, "u2", "child", 1, 1, True, True) == \
        [Serve("u1"), Serve("u2")]


def test_urgent_requests_leave_one_slot_to_waiting_leaves():
    # 4 children that forward (urgent) and 2 leaves on 4 slots: before, a forwarder with more
    # children that forward than slots served its leaves only when those children were done
    core = ServingCore(ServingConfig(slots=4, per_peer=1))
    assert sum((core.ask(0, f"c{i}u0", f"c{i}", 1, 0, True, True) for i in range(1, 5)), []) == \
        [Serve(f"c{i}u0") for i in range(1, 5)]
    for leaf in ("l1", "l2"):
        assert core.ask(0, f"{leaf}n0", leaf, 1, 0, False, True) == []
    for i in range(1, 5):
        assert core.ask(0, f"c{i}u1", f"c{i}", 1, 1, True, True) == []
    assert core.done(1, "c1u0") == [Serve("l1n0", 1.0)]  # 3 urgent served: the free slot is a leaf's
    assert core.done(2, "c2u0") == [Serve("c1u1", 2.0)]  # a leaf holds one: urgent first again
    assert core.done(3, "l1n0") == [Serve("l2n0", 3.0)]  # the leaves' slot goes to the other leaf


def test_slots_set_higher_serve_every_child_at_once_and_never_fewer_than_configured():
    core = ServingCore(ServingConfig(slots=2, per_peer=1))
    assert sum((core.ask(0, f"c{i}", f"child{i}", 1, 0, False, True) for i in range(4)), []) == \
        [Serve("c0"), Serve("c1")]  # two children wait a whole transfer for a slot
    assert core.set_slots(0.5, 4) == [Serve("c2", 0.5), Serve("c3", 0.5)] and core.full
    assert core.set_slots(0.6, 1) == [] and core.slots == 2  # back to the configured 2
    assert core.full  # 4 served on 2 slots: our upload is the bottleneck (`UploadMeter` counts it)
    assert core.ask(0.6, "c4", "child4", 1, 0, False, True) == []  # it waits
    assert core.done(1.0, "c0") == [] and core.full and core.done(1.0, "c1") == []
    assert core.done(1.0, "c2") == [Serve("c4", 0.4)]


def test_a_request_for_a_chunk_not_held_waits_for_it_then_is_refused_at_the_wait_limit():
    core = ServingCore(ServingConfig(slots=2, wait_limit_s=10.0))
    assert core.ask(0.0, "early", "a", 1, 5, False, held=False) == []
    assert core.ask(4.0, "later", "b", 1, 6, False, held=False) == []
    assert core.next_deadline() == 10.0 and core.expire(9.9) == []
    assert core.arrived(5.0, 1, 5) == [Serve("early", 0.0)]  # cut-through: served as soon as we hold it
    # (waiting for the chunk is not queueing: the requester is told 0 s)
    assert core.next_deadline() == 14.0
    assert core.expire(14.0) == [Refuse("later")]
    assert core.next_deadline() is None and core.arrived(20.0, 1, 6) == []


def test_a_departed_peer_is_forgotten_and_the_core_says_when_every_slot_is_taken():
    core = ServingCore(ServingConfig(slots=2, per_peer=2))
    core.ask(0, "a1", "a", 1, 0, False, True)
    assert not core.full
    core.ask(0, "a2", "a", 1, 1, False, True)
    assert core.full
    core.ask(0, "a3", "a", 1, 2, False, True)
    core.ask(0, "a4", "a", 1, 9, False, False)
    assert sorted(core.drop_peer("a")) == ["a3", "a4"]
    assert core.done(1, "a1") == [] and not core.full
    assert core.status() == {"slots": 2, "serving": 1, "lingering": 0, "queued": 0, "waiting": 0}


async def test_the_trio_shell_waits_for_its_turn_and_tells_when_the_slots_are_full(autojump_clock):
    told = []
    uploads = Uploads(ServingConfig(slots=1, wait_limit_s=5.0), on_full=told.append)
    order = []

    async def answer(name, index, held):
        async with uploads.turn(name, 1, index, False, held) as queued_s:
            order.append((name, queued_s, trio.current_time()))
            await trio.sleep(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(uploads.run)
        nursery.start_soon(answer, "held", 0, True)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(answer, "comes", 1, False)
        nursery.start_soon(answer, "never", 2, False)
        await trio.sleep(2)
        uploads.arrived(1, 1)
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    # "comes" arrives at 2 but the one slot is "held"'s until 1: served at 2, queued 0 s; "never" is refused
    assert [(name, queued_s) for name, queued_s, _ in order] == [("held", 0.0), ("comes", 0.0), ("never", None)]
    assert order[2][2] == pytest.approx(5.0)  # refused at the wait limit
    assert told == [True, False, True, False]


def test_request_headers_round_trip_with_the_urgent_bit():
    req = ChunkRequest(1, 7, 3, 9, DIGEST)
    assert _parse_request(req.pack()) == (req, False)
    urgent = bytearray(req.pack())
    urgent[0] |= 0x80
    assert _parse_request(bytes(urgent)) == (req, True)


def test_a_byte_budget_lets_a_burst_through_then_paces_a_peer_to_its_rate():
    budget = ByteBudget(1_000_000)  # 1 MB/s, one second of burst
    assert budget.reserve(0.0, 600_000) == 0.0
    assert budget.reserve(0.0, 400_000) == 0.0  # the burst is spent
    assert budget.reserve(0.0, 500_000) == pytest.approx(0.5)  # wait half a second before sending
    assert budget.reserve(0.5, 500_000) == pytest.approx(0.5)  # half a second later: still in debt
    assert budget.reserve(10.0, 1) == 0.0  # a quiet peer gets its burst back (never more than one second)
    assert budget.reserve(10.0, 1_000_000) == pytest.approx(1e-6)
    budget.refund(1_000_000)  # that serve was cancelled before its first byte
    assert budget.reserve(10.0, 500_000) == 0.0
    budget.refund(10**9)  # a refund never raises the burst beyond one second
    assert budget.reserve(10.0, 1_000_000) == 0.0 and budget.reserve(10.0, 1) > 0.0


def test_the_upload_meter_counts_only_time_when_every_slot_was_busy():
    meter = UploadMeter(window_s=30.0, min_full_s=2.0)
    assert meter.rate(0.0, 0) is None
    meter.full(10.0, 0)
    assert meter.rate(11.0, 5_000_000) is None  # one second is not enough to judge
    meter.not_full(13.0, 30_000_000)  # 30 MB in 3 s of saturation
    meter.full(20.0, 90_000_000)  # bytes sent while not saturated do not count
    meter.not_full(21.0, 100_000_000)
    assert meter.rate(21.0, 100_000_000) == pytest.approx(40_000_000 / 4)
    assert meter.rate(52.0, 100_000_000) is None  # the window moved past both stretches


@pytest.mark.parametrize("address", ["127.0.0.1:\u00b2", "a" * 64 + ".example:80"])
async def test_a_source_that_advertises_a_malformed_data_address_fails_its_requests_and_stops_nothing(address):
    """The address is what the source's signed heartbeat says (any text of up to 256 bytes): an
    address no connection can be opened to makes the source unreachable; `run` returns (an error
    out of it would stop the role and the peer)."""
    role = FakeRole(address)
    upstream = Upstream(role, SOURCE.peer_id)
    upstream.submit(Fetch(SOURCE.peer_id, 1, 0, DIGEST, 1000))
    with trio.fail_after(10):
        await upstream.run()
    assert role.told == [(FetchFailure.UNREACHABLE, 0)]


async def test_hostile_answers_end_the_connection_at_worst_and_every_request_is_told_once():
    """Seeded answers a source controls: random bytes, a valid answer cut anywhere then garbage,
    every header field at its edges, bit flips of a valid answer. Each run returns (an error out
    of it would stop the role), tells each request exactly once (fetched or failed), and gives
    every chunk buffer back."""
    rng = random.Random(20261205)
    good = frame_of(ChunkResponse(1, STATUS_OK, 1000).pack()) + b"c" * 1000
    answers: list[bytes] = [rng.randbytes(n) for n in (1, 3, 4, 5, 21, 22, 500, 2000)]
    answers += [good[:rng.randrange(1, len(good))] + rng.randbytes(rng.randrange(0, 64)) for _ in range(10)]
    for request_id in (0, 1, 2, 3, 2**32 - 1):
        for status in (STATUS_OK, STATUS_UNAVAILABLE, 2, 255):
            for length in (0, 999, 1000, 1001, 2**63, 2**64 - 1):
                answers.append(frame_of(ChunkResponse(request_id, status, length, rng.choice((0, 2**32 - 1))).pack())
                               + b"d" * min(length, 1001))
    for _ in range(30):
        mutated = bytearray(good + frame_of(ChunkResponse(2, STATUS_OK, 1000).pack()) + b"e" * 1000)
        for _ in range(rng.randrange(1, 3)):
            mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        answers.append(bytes(mutated))
    for i, answer in enumerate(answers):
        async def script(stream, requests, answer=answer):
            ids = {r.request_id for r, _ in requests}
            assert ids == {1, 2}  # as the answers above assume
            await stream.send_all(answer)

        role = await fetch_two_with(script)
        told = sorted(entry[1] for entry in role.told)
        assert told == [0, 1], (i, role.told)  # each request once, fetched or failed
        assert all(entry[0] != "fetched" or entry[2] == 1000 for entry in role.told), (i, role.told)
        assert role.buffers._lendable.value == 2, i  # every buffer given back


def frame_of(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


async def test_hostile_manifest_answers_crash_nothing_and_hand_the_core_only_whole_frames():
    """`RelayRole._fetch_manifest` against seeded answers (random bytes, header fields at their
    edges, torn answers, then the end of the stream): it returns, and tells the core once: either
    exactly the `length` bytes an OK header announced (the core opens and checks it), or that the
    ask failed (the core asks another holder: `relay.manifest_asks`)."""
    rng = random.Random(20261206)
    answers = [rng.randbytes(n) for n in (0, 1, 4, 21, 22, 300)]
    for status in (STATUS_OK, STATUS_UNAVAILABLE, 255):
        for length in (0, 1, 4096, 1 << 20, 2**64 - 1):
            body = rng.randbytes(min(length, 5000))
            answers.append(frame_of(ChunkResponse(0, status, length).pack()) + body)
            answers.append(frame_of(ChunkResponse(0, status, length).pack()) + body[:len(body) // 2])
    for answer in answers:
        role = InMemoryRole()
        role.config = SimpleNamespace(request_timeout_s=5.0)
        role.answers.put_data(answer)
        role.answers.put_eof()
        told = _manifest_outcomes(role)
        with trio.fail_after(5):
            await RelayRole._fetch_manifest(role, FetchManifest(SOURCE.peer_id, 1))
        assert len(told) == 1  # the frame, or that the ask failed (the core then asks another holder)
        if told[0][0] == "frame":  # only a whole OK answer
            header = ChunkResponse.unpack(answer[4:4 + RESPONSE.size])
            assert header.status == STATUS_OK and len(answer) == 4 + RESPONSE.size + header.length
