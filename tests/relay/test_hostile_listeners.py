"""Hostile input to a real relay role's chunk server, on a real data-plane listener on loopback:
nothing a stranger (or an admitted peer) sends over a socket stops the server, leaks a task, an
upload slot or a connection count, or keeps a connection open past the server's own deadlines.

The role runs its real core, runner, dispatcher, upload slots and store, serving one published
version on a real `DataPlane`; only the node around it is a stand-in (`FakeNode`). Every batch of
hostile connections (seeded: a failing run names its seed) is followed by an honest client that
fetches a manifest and every chunk, checked byte for byte, and by checks that every counter went
back to rest. An exception out of the role's serving code would end `serve_listeners`, and with
it this test's nursery: that is what "stops the peer" looks like here.

Deadlines scale with the work (`SLACK_S` per connection); nothing is timed.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import trio

from p2pnet.dataplane import DataPlane, DataPlaneLimits, FrameReader, open_data_stream, send_frame
from p2pnet.handshake import HANDSHAKE_MAX_BYTES, DataHello, DataProof
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from relay.messages import OP_CHUNK, OP_MANIFEST, REQUEST, RESPONSE, STATUS_OK, STATUS_UNAVAILABLE, ChunkRequest, \
    ChunkResponse
from relay.role import CHANNEL, RelayRole, _parse_request
from tests.relay.test_role_store_faults import ME, PUBLISHER, FakeNode, publish, start_shell

CLIENT = Identity.from_seed_text("honest client")
STRANGER = Identity.from_seed_text("stranger")
SEED = 20261205
CHUNKS = 8
VERSION = 1
SLACK_S = 10.0  # per connection: every wait below is bounded by a deadline that scales with this
LIMITS = DataPlaneLimits(handshake_timeout_s=1.0, max_handshaking_per_ip=64)  # room for every batch at once
RELAY = {"trusted_publishers": [PUBLISHER.peer_id], "fsync": False, "idle_timeout_s": 1.0,
         "request_timeout_s": 0.5, "send_timeout_s": 2.0}


class Server:
    """A relay role serving VERSION on a real data plane, as a peer that knows CLIENT."""

    def __init__(self, tmp_path: Path) -> None:
        self.node = FakeNode(tmp_path / "relay")
        self.role = RelayRole(self.node, dict(RELAY))
        self.signed = publish(self.role.store, tmp_path, VERSION, CHUNKS)
        self.plane = DataPlane("127.0.0.1", 0, codec=Codec(ME), self_id=ME.peer_id, limits=LIMITS,
                               admit=lambda peer: None if peer == CLIENT.peer_id else "not in our peer table")
        self.plane.register(CHANNEL, self.role._serve)
        self.address = ""
        self.host, self.port = "", 0

    async def start(self, nursery: trio.Nursery) -> None:
        role = self.role
        await start_shell(role, self.node, nursery)
        nursery.start_soon(role._uploads.run)
        signed = self.signed
        await role._command(lambda now: role.core.add_version(now, signed=signed, held=list(range(CHUNKS))))
        self.address = await nursery.start(self.plane.serve)
        host, port = self.plane.bound.rsplit(":", 1)
        self.host, self.port = host.strip("[]"), int(port)

    async def connect(self) -> trio.SocketStream:
        return await trio.open_tcp_stream(self.host, self.port)

    async def authenticated(self) -> trio.SocketStream:
        return await open_data_stream(self.address, CHANNEL, codec=Codec(CLIENT), peer=ME.peer_id)

    def at_rest(self) -> bool:
        uploads = self.role._uploads
        return (self.plane.connections() == {} and self.plane._open == 0 and self.plane._handshaking == {}
                and self.role.serving_now == {} and uploads._events == {} and uploads._granted == {}
                and uploads.core.status()["serving"] == 0 and uploads.core.status()["queued"] == 0)

    async def settle(self, connections: int) -> None:
        """Every connection of a batch closed, every count back to rest (the server's own
        deadlines do it: idle and handshake timeouts, the requests' wait limit)."""
        with trio.fail_after(SLACK_S * max(1, connections)):
            while not self.at_rest():
                await trio.sleep(0.02)

    async def honest_fetch(self) -> None:
        """The manifest and every chunk, pipelined on one connection, byte for byte."""
        stream = await self.authenticated()
        async with stream:
            with trio.fail_after(SLACK_S * CHUNKS):
                await send_frame(stream, ChunkRequest(OP_MANIFEST, 100, VERSION, 0, bytes(32)).pack())
                digests = self.signed.manifest.chunk_digests
                for index in range(CHUNKS):
                    await send_frame(stream, ChunkRequest(OP_CHUNK, index, VERSION, index, digests[index]).pack())
                reader = FrameReader(stream, max_frame_bytes=RESPONSE.size)
                got: dict[int, bytes] = {}
                for _ in range(CHUNKS + 1):
                    header = ChunkResponse.unpack(await reader.frame() or b"")
                    assert header.status == STATUS_OK, header
                    got[header.request_id] = await reader.exactly(header.length)
        assert got.pop(100) == self.signed.frame
        assert got == {i: self.role.store.read_chunk(VERSION, i) for i in range(CHUNKS)}


async def drain_until_closed(stream: trio.abc.Stream, limit_s: float) -> bytes:
    """What the server sends until it closes the connection (it must, within `limit_s`)."""
    out = bytearray()
    with trio.fail_after(limit_s):
        while True:
            try:
                data = await stream.receive_some(1 << 16)
            except trio.BrokenResourceError:  # reset: closed with our bytes unread
                break
            if not data:
                break
            out += data
    return bytes(out)


async def send_and_expect_close(server: Server, payload: bytes, *, eof: bool) -> bytes:
    stream = await server.connect()
    async with stream:
        try:
            await stream.send_all(payload)
            if eof:
                await stream.send_eof()
        except trio.BrokenResourceError:
            return b""  # the server closed before it took it all
        return await drain_until_closed(stream, SLACK_S)


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def hello(identity: Identity = CLIENT, channel: str = CHANNEL) -> bytes:
    return Codec(identity).encode(DataHello(channel, bytes(16), ME.peer_id), time.time())


@pytest.fixture
async def server(tmp_path: Path, nursery: trio.Nursery) -> Server:
    s = Server(tmp_path)
    await s.start(nursery)
    await s.honest_fetch()
    return s


async def test_random_bytes_and_torn_handshakes_before_authentication(server: Server) -> None:
    rng = random.Random(SEED)
    payloads: list[bytes] = []
    for length in (0, 1, 3, 4, 5, 17, 64, 1023, 1028, 1029, 5000):  # (a) random bytes
        payloads.append(rng.randbytes(length))
    valid = frame(hello())
    for _ in range(24):  # (b) a valid hello cut anywhere, then garbage
        cut = rng.randrange(len(valid))
        payloads.append(valid[:cut] + rng.randbytes(rng.randrange(1, 64)))
    for length in (0, 1, HANDSHAKE_MAX_BYTES, HANDSHAKE_MAX_BYTES + 1, 2**31, 2**32 - 1):  # (c) length fields
        payloads.append(length.to_bytes(4, "big") + rng.randbytes(min(length, 2048)))
    for _ in range(24):  # (d) bit flips of a valid hello
        mutated = bytearray(valid)
        for _ in range(rng.randrange(1, 4)):
            mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        payloads.append(bytes(mutated))
    payloads.append(frame(hello(STRANGER)))  # a stranger, and a known peer on no channel we serve
    payloads.append(frame(hello(channel="no/such")))
    proof = Codec(CLIENT).encode(DataProof(bytes(16), ME.peer_id), time.time())
    payloads.append(frame(hello()) + frame(proof))  # a proof that answers no challenge
    limiter = trio.CapacityLimiter(32)  # at once: the silent ones wait for the handshake deadline together

    async def one(i: int, payload: bytes, eof: bool) -> None:
        async with limiter:
            answer = await send_and_expect_close(server, payload, eof=eof)
        assert len(answer) <= 4 + HANDSHAKE_MAX_BYTES, (SEED, i)  # a challenge at most

    async with trio.open_nursery() as nursery:
        for i, payload in enumerate(payloads):
            for eof in (True, False):
                nursery.start_soon(one, i, payload, eof)
    await server.settle(len(payloads))
    assert "handshake_failed" in server.plane.refused and "not_admitted" in server.plane.refused
    await server.honest_fetch()
    await server.settle(1)


async def test_a_connection_that_stalls_inside_the_handshake_is_closed_by_the_server(server: Server) -> None:
    valid = frame(hello())
    streams = []
    for cut in (1, 3, 4, 5, len(valid) // 2, len(valid) - 1):  # (e) half a frame, then nothing
        stream = await server.connect()
        await stream.send_all(valid[:cut])
        streams.append(stream)
    for stream in streams:
        async with stream:
            await drain_until_closed(stream, SLACK_S + LIMITS.handshake_timeout_s)
    await server.settle(len(streams))
    await server.honest_fetch()


def hostile_requests(rng: random.Random, server: Server) -> list[bytes]:
    """Request frames (payloads) an admitted peer may send: every field at its extremes, and
    bit flips of valid requests."""
    digests = server.signed.manifest.chunk_digests
    valid = [ChunkRequest(OP_CHUNK, i, VERSION, i, digests[i]).pack() for i in range(CHUNKS)]
    out: list[bytes] = []
    for op in (0, OP_CHUNK, OP_MANIFEST, 3, 0x7F, 0x80, 0x81, 0x82, 0xFF):
        for version in (0, VERSION, 2**63, 2**64 - 1):
            for index in (0, CHUNKS - 1, CHUNKS, 2**31, 2**32 - 1):
                out.append(REQUEST.pack(op, rng.randrange(2**32), version, index, digests[index % CHUNKS]))
    for _ in range(120):
        mutated = bytearray(rng.choice(valid))
        for _ in range(rng.randrange(1, 3)):
            mutated[rng.randrange(len(mutated))] ^= 1 << rng.randrange(8)
        out.append(bytes(mutated))
    rng.shuffle(out)
    return out


def expected(server: Server, request: ChunkRequest) -> bytes | None:
    """The one right answer to a well-formed request: the bytes asked for, or None (unavailable)."""
    if request.version != VERSION:
        return None
    if request.op == OP_MANIFEST:
        return server.signed.frame
    digests = server.signed.manifest.chunk_digests
    if request.index < CHUNKS and digests[request.index] == request.digest:
        return server.role.store.read_chunk(VERSION, request.index)
    return None


async def test_mutated_requests_from_an_admitted_peer_get_the_right_answer_or_a_closed_connection(
        server: Server) -> None:
    """Well-formed requests (fields at their extremes, bit flips) are each answered rightly:
    the chunk or manifest asked for, or unavailable; a malformed one (an unknown op) ends its
    connection, and the answers it still owed are dropped."""
    rng = random.Random(SEED + 1)
    well_formed, malformed = [], []
    for payload in hostile_requests(rng, server):
        try:
            well_formed.append((payload, _parse_request(payload)[0]))
        except ValueError:
            malformed.append(payload)
    assert well_formed and malformed
    batch = 16
    batches = [well_formed[i:i + batch] for i in range(0, len(well_formed), batch)]
    for n, requests in enumerate(batches):
        by_id: dict[int, ChunkRequest] = {}
        stream = await server.authenticated()
        async with stream:
            for k, (original, r) in enumerate(requests):  # the op byte as sent (urgent or not), a unique id
                by_id[k] = r
                await send_frame(stream, original[:1] + ChunkRequest(r.op, k, r.version, r.index, r.digest).pack()[1:])
            reader = FrameReader(stream, max_frame_bytes=RESPONSE.size)
            with trio.fail_after(SLACK_S * batch):
                for _ in requests:
                    header = ChunkResponse.unpack(await reader.frame() or b"")
                    r = by_id.pop(header.request_id)
                    want = expected(server, r)
                    if want is None:
                        assert header.status == STATUS_UNAVAILABLE, (SEED + 1, r)
                    else:
                        assert header.status == STATUS_OK, (SEED + 1, r)
                        assert await reader.exactly(header.length) == want, (SEED + 1, r)
            if n < len(malformed):  # then a malformed one: the server closes
                await send_frame(stream, malformed[n])
                assert await drain_until_closed(stream, SLACK_S) == b""
    for payload in malformed[len(batches):]:  # the rest, each after a well-formed one still waiting
        stream = await server.authenticated()
        async with stream:
            await send_frame(stream, ChunkRequest(OP_CHUNK, 1, VERSION + 1, 0, bytes(32)).pack())
            await send_frame(stream, payload)
            assert await drain_until_closed(stream, SLACK_S) == b""
    await server.settle(len(batches) + len(malformed))
    await server.honest_fetch()
    await server.settle(1)


async def test_frames_of_every_size_from_an_admitted_peer(server: Server) -> None:
    rng = random.Random(SEED + 2)
    sizes = (0, 1, REQUEST.size - 1, REQUEST.size + 1, 4096, 4097, 2**31, 2**32 - 1)
    for size in sizes:  # (c) each length field at its edges, content random
        stream = await server.authenticated()
        async with stream:
            try:
                await stream.send_all(size.to_bytes(4, "big") + rng.randbytes(min(size, 4096)))
            except trio.BrokenResourceError:
                pass
            answers = await drain_until_closed(stream, SLACK_S)
        assert answers == b"", size  # a frame no request can be: closed without an answer
    await server.settle(len(sizes))
    await server.honest_fetch()


async def test_an_admitted_peer_that_stalls_inside_a_request_is_closed_by_the_server(server: Server) -> None:
    request = frame(ChunkRequest(OP_CHUNK, 1, VERSION, 0, server.signed.manifest.chunk_digests[0]).pack())
    streams = []
    for cut in (1, 4, 5, len(request) - 1):  # (e) half a frame, then nothing
        stream = await server.authenticated()
        await stream.send_all(request[:cut])
        streams.append(stream)
    for stream in streams:
        async with stream:
            await drain_until_closed(stream, SLACK_S + RELAY["idle_timeout_s"])
    await server.settle(len(streams))
    await server.honest_fetch()


async def test_an_admitted_peer_that_sends_one_request_twice_does_not_stop_the_server(server: Server) -> None:
    """Equal frames: one waiting for a chunk not held, one for a held chunk. Each is answered or
    waits on its own (a requester that repeats itself confuses only itself), and the data plane
    keeps serving everyone else."""
    waiting = frame(ChunkRequest(OP_CHUNK, 7, VERSION + 1, 0, bytes(32)).pack())
    held = frame(ChunkRequest(OP_CHUNK, 8, VERSION, 0, server.signed.manifest.chunk_digests[0]).pack())
    stream = await server.authenticated()
    async with stream:
        await stream.send_all(waiting + waiting + held + held)
        await trio.sleep(SLACK_S)
    await server.settle(1)
    await server.honest_fetch()
