"""A DiLoCo round's outgoing connections (`trainer.diloco_links.open_links`) over the real data
plane (real TCP, real handshakes): what reaches the round's inbox as a failure and what does not.
A refused handshake to a newcomer is no failure; a connection the other end closes mid-round is
one, found without a send; a close after the round stopped watching, the other end's or ours, is
none; nor is one the receiving end closes idle, telling us first (those:
tests/trainer/test_diloco_links_idle.py)."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from types import SimpleNamespace
from typing import AsyncIterator

import pytest
import trio
import trio.testing

from p2pnet.dataplane import DataPlane, open_data_stream
from p2pnet.handshake import NotAdmitted
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from trainer.diloco_messages import CHANNEL, STAGE_CONTRIBUTION, Join, NoRoom, Part, StateWanted
from trainer.diloco_inbox import RoundInbox
from trainer.diloco_links import Links, PeerFailed, open_links

RECEIVER = Identity.from_seed_text("diloco receiver")
SENDER = Identity.from_seed_text("diloco sender")
JOIN = Join(1, b"w" * 16, ())


async def _cannot_introduce(peer: str) -> bool:
    return False  # as `Node.introduce` when it has nothing to send (no heartbeat of ours yet, a peer introduced just now)


def _role(address: str, inbox: RoundInbox, introduce=_cannot_introduce) -> SimpleNamespace:
    """What `Links` uses of the role: our codec and introductions, the round's inbox, and
    connections to `address`."""
    return SimpleNamespace(node=SimpleNamespace(codec=Codec(SENDER), introduce=introduce), inbox=inbox,
                           open_stream=lambda peer: open_data_stream(address, CHANNEL, codec=Codec(SENDER), peer=peer))


@contextlib.asynccontextmanager
async def _receiving(serve) -> AsyncIterator[tuple[SimpleNamespace, RoundInbox]]:
    """RECEIVER's data plane serving the diloco channel with `serve`, running for the block: what
    `Links` uses of our role (`_role`, connecting to it) and the round's inbox."""
    plane = DataPlane("127.0.0.1", 0, codec=Codec(RECEIVER), self_id=RECEIVER.peer_id, admit=lambda peer: None)
    plane.register(CHANNEL, serve)
    inbox = RoundInbox()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(plane.serve)
        yield _role(address, inbox), inbox
        nursery.cancel_scope.cancel()


async def test_a_join_a_newcomer_refuses_does_not_make_it_a_suspect_but_other_failures_do():
    """A trainer that sends its join to a newcomer that has not heard its heartbeat gets the
    connection closed after its hello: that is no failure to report (the newcomer would become a
    suspect and miss the round). A send that must arrive (a part), or a peer nobody answers for,
    is reported."""

    async def serve(stream, reader, peer):
        raise AssertionError("nothing may pass a refused handshake")

    plane = DataPlane("127.0.0.1", 0, codec=Codec(RECEIVER), self_id=RECEIVER.peer_id,
                      admit=lambda peer: "not in our peer table (no heartbeat heard)")
    plane.register(CHANNEL, serve)
    inbox = RoundInbox()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(plane.serve)
        role = _role(address, inbox)
        async with open_links(role, 10.0) as links:
            body = StateWanted(3, False)
            assert not await links.send(RECEIVER.peer_id, body, report_refusal=False)
            with pytest.raises(trio.WouldBlock):
                inbox.receive_nowait()
            assert not await links.send(RECEIVER.peer_id, body)
            assert inbox.receive_nowait() == PeerFailed(RECEIVER.peer_id)
            assert plane.refused == {"not_admitted": 2}
            role.open_stream = lambda peer: open_data_stream("127.0.0.1:1", CHANNEL, codec=Codec(SENDER), peer=peer)
            assert not await links.send(RECEIVER.peer_id, body, report_refusal=False)
            assert inbox.receive_nowait() == PeerFailed(RECEIVER.peer_id)
        nursery.cancel_scope.cancel()


async def test_a_peer_that_has_not_heard_us_is_introduced_to_once_and_the_send_goes_through():
    """A restarted trainer's link to a peer whose table forgot it: the peer's data plane refuses it
    as unknown; we introduce ourselves (our heartbeat, sent directly: here it reaches the peer's
    table only after one more refused try, as a frame on its way would) and ask again, and the
    send goes through, with nothing reported. Without an introduction it fails at once, as before."""
    heard: set[str] = set()
    arrived: list[object] = []
    got = trio.Event()
    introduced: list[str] = []
    refused_since_introduced = 0

    def admit(peer: str) -> str | None:
        nonlocal refused_since_introduced
        if peer in heard:
            return None
        if introduced:
            refused_since_introduced += 1
            if refused_since_introduced == 2:  # our heartbeat has reached its table now
                heard.add(peer)
        return "not in our peer table (no heartbeat heard)"

    async def serve(stream, reader, peer):  # as the role's server: reads on until the sender closes
        while (frame := await reader.frame()) is not None:
            arrived.append(Codec(RECEIVER).decode(frame, time.time()).body)
            got.set()

    async def introduce(peer: str) -> bool:
        introduced.append(peer)
        return True

    plane = DataPlane("127.0.0.1", 0, codec=Codec(RECEIVER), self_id=RECEIVER.peer_id, admit=admit)
    plane.register(CHANNEL, serve)
    inbox = RoundInbox()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(plane.serve)
        role = _role(address, inbox, introduce)
        async with open_links(role, 30.0) as links:
            assert await links.send(RECEIVER.peer_id, JOIN, report_refusal=False)
            with trio.fail_after(30):
                await got.wait()
        assert arrived == [JOIN] and introduced == [RECEIVER.peer_id]  # once, for three refusals
        assert plane.refused == {"not_admitted": 3}
        with pytest.raises(trio.WouldBlock):
            inbox.receive_nowait()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("report_refusal", [False, True])
async def test_a_peer_that_never_admits_us_fails_the_send_by_its_deadline_even_while_introducing(
        autojump_clock, report_refusal):
    """Introduced, a peer that still refuses us is asked again until the send's deadline, never
    past it, also when the introduction itself is slow (a dial, up to the node's send timeout):
    the send fails by then, as a refusal (reported only when refusals are)."""
    tries: list[float] = []

    async def refuse(peer: str):
        tries.append(trio.current_time())
        raise NotAdmitted(f"{peer} closed the connection after our hello")

    async def slow_introduce(peer: str) -> bool:
        await trio.sleep(8.0)
        return True

    inbox = RoundInbox()
    for introduce, timeout_s in ((slow_introduce, 5.0), (slow_introduce, 20.0)):
        role = SimpleNamespace(node=SimpleNamespace(codec=Codec(SENDER), introduce=introduce), inbox=inbox,
                               open_stream=refuse)
        tries.clear()
        start = trio.current_time()
        async with open_links(role, timeout_s) as links:
            assert not await links.send(RECEIVER.peer_id, JOIN, report_refusal=report_refusal)
        assert trio.current_time() - start <= timeout_s
        if timeout_s < 8.0:  # the deadline came while introducing
            assert len(tries) == 1
        else:  # asked again after the introduction, 0.05 s later doubling to 1 s, until the deadline
            gaps = [later - earlier for earlier, later in zip(tries, tries[1:])]
            assert gaps[0] >= 8.0 and len(gaps) > 6 and all(gap <= 1.0 + 1e-9 for gap in gaps[1:])
            assert tries[-1] - start > timeout_s - 1.0
        if report_refusal:
            assert inbox.receive_nowait() == PeerFailed(RECEIVER.peer_id)
        with pytest.raises(trio.WouldBlock):
            inbox.receive_nowait()


@pytest.mark.parametrize("report_refusal", [False, True])
async def test_a_send_asking_a_refusing_peer_again_gives_up_when_the_round_is_over(autojump_clock, report_refusal):
    """The round's end waits for its sends (bounded by the deadline, as `DilocoRole` does): one
    still asking a peer that refuses us, introduced, fails at once when the round is over
    (`stop_watching`), as a refusal, and a send behind it on the same peer's lock, refused
    in turn, fails at once too. Asking on to its deadline would hold every round that sent
    to such a peer (one that banned us) that much longer, where before it failed at once."""
    tries: list[float] = []

    async def refuse(peer: str):
        tries.append(trio.current_time())
        raise NotAdmitted(f"{peer} closed the connection after our hello")

    async def introduce(peer: str) -> bool:
        return True

    inbox = RoundInbox()
    role = SimpleNamespace(node=SimpleNamespace(codec=Codec(SENDER), introduce=introduce), inbox=inbox,
                           open_stream=refuse)
    timeout_s = 30.0
    results: list[bool] = []

    async def send() -> None:
        results.append(await links.send(RECEIVER.peer_id, JOIN, report_refusal=report_refusal))

    async with open_links(role, timeout_s) as links:
        async with trio.open_nursery() as sends:
            sends.start_soon(send)
            await trio.sleep(3.0)  # the round goes on: asked again meanwhile
            sends.start_soon(send)  # waits on the peer's lock
            await trio.sleep(2.0)
            asked = len(tries)
            links.stop_watching()  # the round is over
            over = trio.current_time()
            sends.cancel_scope.deadline = over + timeout_s  # finish sends, bounded
        assert trio.current_time() == over  # (virtual time) nothing held the round's end
    assert results == [False, False] and asked > 2 and len(tries) == asked + 1  # the second asked once
    if report_refusal:
        assert [inbox.receive_nowait(), inbox.receive_nowait()] == [PeerFailed(RECEIVER.peer_id)] * 2
    with pytest.raises(trio.WouldBlock):
        inbox.receive_nowait()


async def test_a_connection_the_other_end_closes_mid_round_is_reported_and_none_closed_after_the_round():
    """The receiving end never writes on a round's connections: one that it closes means it died
    (a peer killed mid-round), and is reported with no send of ours to find it out. Once the
    round stopped watching, a close is no failure: neither the other end's nor, leaving the
    block, ours (the watchers stop before the connections close)."""
    got: list[tuple[str, object]] = []
    accepted_send, accepted = trio.open_memory_channel[trio.Event](4)

    async def serve(stream, reader, peer):  # takes one frame, then holds the connection until hung up
        got.append((peer, Codec(RECEIVER).decode(await reader.frame(), time.time()).body))
        hang_up = trio.Event()
        await accepted_send.send(hang_up)
        await hang_up.wait()  # returning closes the connection

    async with _receiving(serve) as (role, inbox):
        with trio.fail_after(60):  # generous; nothing here is timed
            async with open_links(role, 10.0) as links:  # a round: the receiver dies in it
                assert await links.send(RECEIVER.peer_id, JOIN)
                (await accepted.receive()).set()
                assert await inbox.receive() == PeerFailed(RECEIVER.peer_id)

            async with open_links(role, 10.0) as links:  # a round that ends, then the other end closes
                assert await links.send(RECEIVER.peer_id, JOIN)
                hang_up = await accepted.receive()
                links.stop_watching()
                hang_up.set()
                # the end of stream reaches us (no watcher reads this connection any more: a
                # second reader would fail here), and nothing is reported of it
                assert await links.streams[RECEIVER.peer_id].receive_some(1) == b""
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(trio.WouldBlock):
                    inbox.receive_nowait()

            async with open_links(role, 10.0) as links:  # a round that ends with our closing
                assert await links.send(RECEIVER.peer_id, JOIN)
                hang_up = await accepted.receive()
                stream = links.streams[RECEIVER.peer_id]
            assert not links.streams
            with pytest.raises(trio.ClosedResourceError):
                await stream.receive_some(1)  # closed by us on the way out
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.WouldBlock):
                inbox.receive_nowait()
            hang_up.set()
        assert got == [(SENDER.peer_id, JOIN)] * 3


async def test_a_send_handing_its_connection_over_when_the_round_stops_watching_is_no_failure():
    """`send` hands each connection it opens to the watching task over a bounded channel. A send
    that waits there (the channel full) when the round stops watching, and the watching task
    closes its end, has done nothing wrong and neither has its peer: the frame is still sent,
    nothing is reported, and the connection is closed with the others. Here the test holds the
    watching task's end, as a busy scheduler can; `open_links` does the rest."""
    got: list[object] = []

    async def serve(stream, reader, peer):
        got.append(Codec(RECEIVER).decode(await reader.frame(), time.time()).body)

    opened_send, opened = trio.open_memory_channel[tuple[str, trio.SocketStream]](0)  # full: nobody takes
    async with _receiving(serve) as (role, inbox):
        links = Links(role, 10.0, opened_send)
        sent: list[bool] = []

        async def send() -> None:
            sent.append(await links.send(RECEIVER.peer_id, JOIN))

        with trio.fail_after(60):  # generous; nothing here is timed
            async with trio.open_nursery() as sends:
                sends.start_soon(send)
                while not opened.statistics().tasks_waiting_send:  # the connection is open, the handover waits
                    await trio.testing.wait_all_tasks_blocked()
                links.stop_watching()
                await opened.aclose()  # what the watching task does when the round stops watching
            assert sent == [True]
            stream = links.streams[RECEIVER.peer_id]
            while not got:
                await trio.testing.wait_all_tasks_blocked()
            await links.aclose()
        assert got == [JOIN]
        with pytest.raises(trio.ClosedResourceError):
            await stream.receive_some(1)  # closed with the others, not left open and unlisted
        with pytest.raises(trio.WouldBlock):
            inbox.receive_nowait()


async def test_a_connection_a_send_failed_on_is_closed_at_once_and_reported_once():
    """A send that cannot finish within the deadline (the peer takes nothing: its receive buffer
    and our send buffer are full) fails. The connection it failed on may hold part of a frame:
    it is closed then (the peer sees it end), not left open until the round ends, and the peer
    is reported once, not a second time by the connection's watcher seeing it closed."""
    drain = trio.Event()
    ended = trio.Event()

    async def serve(stream, reader, peer):  # takes nothing until told to, then reads to the end
        await drain.wait()
        while await stream.receive_some(1 << 20):
            pass
        ended.set()

    big = Part(1, b"m" * 16, STAGE_CONTRIBUTION, 0, 1 << 18, 0, 1 << 18, "fp32", 256, b"v" * (4 << 18), b"", ())
    async with _receiving(serve) as (role, inbox):
        async with open_links(role, 2.0) as links:
            with trio.fail_after(120):  # generous: the buffers fill within a few sends
                while await links.send(RECEIVER.peer_id, big):
                    pass
                assert await inbox.receive() == PeerFailed(RECEIVER.peer_id)
                assert RECEIVER.peer_id not in links.streams
                drain.set()
                await ended.wait()  # the connection was closed by the failed send, before the round ended
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(trio.WouldBlock):
                    inbox.receive_nowait()  # and reported once


async def test_a_notice_that_meets_the_close_of_a_connection_an_earlier_send_opened_reports_it():
    """A notice sent best effort (`report=False`: `NoRoom`) fails unreported when it is its own
    failure; but when it meets the peer's close of a connection our Join opened (the joiner died
    just then) before that connection's watcher does, the close is reported as the watcher would
    have (the failed send drops the connection, and its watcher then says nothing): else the
    joiner, which may lead, was found only at its leader timeout."""
    die, dead = trio.Event(), trio.Event()

    async def serve(stream, reader, peer):  # takes our Join, then dies: its end resets the connection
        await reader.frame()
        await die.wait()
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()
        dead.set()

    async with _receiving(serve) as (role, inbox):
        with trio.fail_after(60):  # generous; nothing here is timed
            async with open_links(role, 10.0) as links:
                assert await links.send(RECEIVER.peer_id, JOIN)  # opens the connection, watched
                links.watching.cancel()  # its watcher has not seen the close yet: the notice meets it first
                die.set()
                await dead.wait()
                assert not await links.send(RECEIVER.peer_id, NoRoom(1), report=False)
                assert inbox.receive_nowait() == PeerFailed(RECEIVER.peer_id)
                assert RECEIVER.peer_id not in links.streams


async def test_a_connection_the_other_end_closed_is_not_written_to_again():
    """A peer that closed its connection mid-round (it restarted, say) is reported, and the next
    send to it opens a new connection: a frame written into the closed one would be lost."""
    got: list[object] = []
    arrived = trio.Semaphore(0)

    async def serve(stream, reader, peer):  # takes one frame per connection, then closes it
        got.append(Codec(RECEIVER).decode(await reader.frame(), time.time()).body)
        arrived.release()

    async with _receiving(serve) as (role, inbox):
        with trio.fail_after(60):  # generous; nothing here is timed
            async with open_links(role, 10.0) as links:
                assert await links.send(RECEIVER.peer_id, JOIN)
                await arrived.acquire()
                assert await inbox.receive() == PeerFailed(RECEIVER.peer_id)  # the close, seen by the watcher
                assert await links.send(RECEIVER.peer_id, JOIN)
                await arrived.acquire()  # the second frame arrived, over a second connection
        assert got == [JOIN, JOIN]
