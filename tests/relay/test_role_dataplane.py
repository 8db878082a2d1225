"""The relay shell's data plane against scripted servers on loopback: what a fetcher believes."""

from types import SimpleNamespace

import pytest
import trio
import trio.testing

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.errors import MessageRejected
from p2pnet.handshake import server_handshake
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from relay.messages import STATUS_OK, STATUS_UNAVAILABLE, ChunkRequest, ChunkResponse
from relay.role import RelayRole, _parse_request
from relay.upstream import Buffers, Upstream
from relay.serving import ByteBudget, UploadMeter, UploadSlots
from relay.effects import Fetch

DIGEST = bytes(32)
ME = Identity.from_seed_text("fetcher")
SOURCE = Identity.from_seed_text("source")


class FakeRole:
    """Just what `Upstream` uses of the role; records what it is told."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.node = SimpleNamespace(peer_id=ME.peer_id, codec=Codec(ME))
        self.told: list[tuple] = []
        self.buffers = Buffers(2)

    def data_addr(self, peer: str) -> str:
        return self.address

    open_stream = RelayRole.open_stream  # the real one: authenticates, and penalises a wrong address

    def penalise(self, peer, amount, reason) -> None:
        self.told.append(("penalised", peer))

    async def report_fetched(self, peer, fetch, data, elapsed_s) -> None:
        self.told.append(("fetched", fetch.index, len(data)))

    async def report_failed(self, peer, fetch, reason) -> None:
        self.told.append((reason, fetch.index))


async def scripted_server(nursery: trio.Nursery, script) -> str:
    """A data-plane listener whose one connection runs `script(stream, requests)`."""

    async def handle(stream: trio.SocketStream) -> None:
        try:
            peer, channel = await server_handshake(stream, Codec(SOURCE), SOURCE.peer_id, lambda p, c: None)
        except MessageRejected:
            return  # a hello meant for another peer (the impostor test); the real data plane logs it
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


async def fetch_two(script) -> list[tuple]:
    async with trio.open_nursery() as nursery:
        address = await scripted_server(nursery, script)
        role = FakeRole(address)
        upstream = Upstream(role, SOURCE.peer_id)
        upstream.submit(Fetch(SOURCE.peer_id, 1, 0, DIGEST, 1000, urgent=True))
        upstream.submit(Fetch(SOURCE.peer_id, 1, 1, DIGEST, 1000))
        with trio.fail_after(5):
            await upstream.run()
        nursery.cancel_scope.cancel()
    return role.told


async def test_a_source_that_dies_inside_a_chunk_is_unreachable_never_a_short_chunk():
    async def script(stream, requests):
        (first, urgent), _ = requests
        assert urgent and first.index == 0
        await send_frame(stream, ChunkResponse(first.request_id, STATUS_OK, 1000).pack())
        await stream.send_all(b"x" * 500)  # then the process is killed

    told = await fetch_two(script)
    assert sorted(told) == [("unreachable", 0), ("unreachable", 1)]


async def test_answers_in_any_order_and_refusals_and_wrong_lengths_are_told_apart():
    async def script(stream, requests):
        (a, _), (b, _) = requests
        await send_frame(stream, ChunkResponse(b.request_id, STATUS_UNAVAILABLE, 0).pack())
        await send_frame(stream, ChunkResponse(a.request_id, STATUS_OK, 1000).pack())
        await stream.send_all(b"y" * 1000)

    assert await fetch_two(script) == [("unavailable", 1), ("fetched", 0, 1000)]

    async def liar(stream, requests):
        (a, _), _ = requests
        await send_frame(stream, ChunkResponse(a.request_id, STATUS_OK, 999_999).pack())

    told = await fetch_two(liar)
    assert ("corrupt", 0) in told and ("unreachable", 1) in told


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
    assert role.told == [("penalised", claimed), ("unreachable", 0)]


async def test_upload_slots_go_to_urgent_waiters_first():
    slots = UploadSlots(1)
    order = []
    await slots.acquire(urgent=False)

    async def waiter(name, urgent):
        await slots.acquire(urgent)
        order.append(name)
        slots.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, "normal", False)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, "urgent", True)
        await trio.testing.wait_all_tasks_blocked()
        slots.release()
    assert order == ["urgent", "normal"]
    assert slots.free == 1


async def test_one_peer_cannot_hold_every_upload_slot_and_waiters_take_turns():
    slots = UploadSlots(4)  # at most 2 per peer
    for _ in range(2):
        await slots.acquire(False, "greedy")
    served = []

    async def waiter(peer):
        await slots.acquire(False, peer)
        served.append(peer)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, "greedy")  # over its share: waits although 2 slots are free
        await trio.testing.wait_all_tasks_blocked()
        assert served == [] and slots.free == 2
        nursery.start_soon(waiter, "other")
        nursery.start_soon(waiter, "other")
        await trio.testing.wait_all_tasks_blocked()
        assert served == ["other", "other"] and slots.free == 0
        slots.release("greedy")  # greedy is back under its share and first in line
        await trio.testing.wait_all_tasks_blocked()
    assert served == ["other", "other", "greedy"]


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


async def test_the_slots_say_when_they_are_all_taken_and_when_one_is_free_again():
    told = []
    slots = UploadSlots(2, per_peer=2, on_full=told.append)
    await slots.acquire(False, "a")
    await slots.acquire(False, "b")
    assert told == [True]

    async def waiter():
        await slots.acquire(False, "c")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        slots.release("a")  # straight to the waiter: still full, nothing to say
        await trio.testing.wait_all_tasks_blocked()
    assert told == [True]
    slots.release("b")
    assert told == [True, False]


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
