"""No two peers wait on each other for one chunk: a request for a chunk we do not hold is held
(long poll) until the chunk arrives, except one from the very peer our own request for that chunk
is outstanding with, which is answered "unavailable" at once (`relay.serving.ServingCore.ask`,
`relay.transfer.TransferCore.asking`). Plans made before and after a membership change can put a
chunk in different stripes, each of two relays a leaf of the other; in the lab each then held the
other's request until the request timeout (30 s lost to one chunk).
"""

from __future__ import annotations

import trio
import trio.testing

from relay.messages import OP_CHUNK, ChunkRequest
from relay.serving import Refuse, Serve, ServingConfig, ServingCore
from tests.relay.test_role_store_faults import PUBLISHER, Harness, clock, inline_threads  # noqa: F401 (fixtures)


def test_a_request_from_the_peer_we_asked_for_that_chunk_is_refused_at_once_and_others_wait() -> None:
    core = ServingCore(ServingConfig(slots=4, wait_limit_s=10.0))
    assert core.ask(0.0, "from-r0", "r0", 1, 12, False, held=False, asked_of="r0") == [Refuse("from-r0")]
    assert core.ask(0.0, "from-r2", "r2", 1, 12, False, held=False, asked_of="r0") == []  # waits for it
    assert core.ask(0.0, "from-r3", "r3", 1, 13, True, held=False, asked_of=None) == []
    assert core.status()["waiting"] == 2
    assert core.arrived(1.0, 1, 12) == [Serve("from-r2", 0.0)]
    # held: served to anyone, the peer we asked included (its answer to us is on its way)
    assert core.ask(1.0, "held", "r0", 1, 12, False, held=True, asked_of="r0") == [Serve("held", 0.0)]
    assert core.expire(10.0) == [Refuse("from-r3")]  # the others still wait up to the limit


async def test_a_relay_asked_for_a_chunk_by_the_peer_it_waits_on_for_that_chunk_answers_at_once(tmp_path, clock):
    """The role has asked its source P for chunk c, which P does not hold yet (P holds our
    request); now P asks us for c. Holding P's request would make each wait on the other until a
    wait limit (`request_timeout_s`, 10 s): P is answered "unavailable" at once instead, so it asks
    elsewhere, while another peer's request for c waits for c and is served once it arrives."""
    h = Harness(tmp_path, request_timeout_s=10.0)
    answers: dict[int, tuple[float, bool]] = {}  # request id -> (virtual time answered, chunk sent)

    async def respond(stream, send_lock, request_id, payload, length=0, queued_s=0.0, reserved=None) -> None:
        answers[request_id] = (trio.current_time(), payload is not None)

    h.role._respond = respond  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await h.start(nursery)
        assert h.source is not None
        h.source.gate = trio.Event()  # P has nothing yet: our requests wait there
        signed = await h.announce(1)
        core = h.role.core
        await h.until(lambda: any(core.asking(1, i) is not None for i in range(16)), 5)
        index = next(i for i in range(16) if core.asking(1, i) is not None)
        source = core.asking(1, index)
        assert source == PUBLISHER.peer_id  # (the harness's one member)

        def ask(request_id: int, client: str, chunk: int = index) -> None:
            request = (ChunkRequest(OP_CHUNK, request_id, 1, chunk, signed.manifest.chunk_digests[chunk]), False)
            pending, borrower = trio.CapacityLimiter(1), object()
            pending.acquire_on_behalf_of_nowait(borrower)  # as the connection's reader does
            nursery.start_soon(h.role._answer, None, trio.Lock(), client, request, pending, trio.CancelScope(),
                               borrower)

        start = trio.current_time()
        ask(1, "another relay")
        ask(2, source)
        await h.until(lambda: 2 in answers, 5)  # well before the 10 s wait limit
        assert answers[2] == (start, False)  # "unavailable", at once
        assert 1 not in answers  # the other relay's request waits for the chunk
        # P asks for a chunk of the same stripe that we have not asked anyone for (our other requests
        # are with P): no cycle, so it waits like any other; only that very chunk's request counts
        other = next(i for i in range(16) if core.asking(1, i) is None and not core.has(1, i))
        ask(3, source, other)
        await trio.testing.wait_all_tasks_blocked()
        assert 3 not in answers
        h.source.gate.set()
        await h.until(lambda: 1 in answers, 5)
        assert answers[1][1]  # served once it arrived
        nursery.cancel_scope.cancel()
