"""A DiLoCo round's links and the receiving end's idle close (`Idle`), over the real data plane:
a link the receiver closes idle, telling us first, is forgotten without a failure and the next
frame opens another; a frame sent before the notice was read still arrives; a receiver that
writes anything but its own notice is reported at once, and one that writes part of one holds
only its watcher. Moved out of test_diloco_links.py, unchanged."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from p2pnet.dataplane import FrameReader, open_data_stream, send_frame
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from tests.trainer.test_diloco_hostile import ME, PEER, SLACK_S, Listener
from tests.trainer.test_diloco_links import JOIN, RECEIVER, _cannot_introduce, _receiving
from trainer.diloco_messages import CHANNEL, Idle, Join
from trainer.diloco_inbox import RoundInbox
from trainer.diloco_links import PeerFailed, open_links
from trainer.diloco_role import IDLE_WINDOWS, STALL_WINDOWS


async def test_a_link_the_receiver_closes_idle_is_forgotten_without_a_failure_and_the_next_frame_opens_another():
    """A round's link is quiet between the round's stages; the receiving end (the role's real
    server, `DilocoRole._serve`, on a real data plane) closes one idle past its bound, and tells
    us first, since our frames say we read that (`hears_idle`). Our watcher forgets the link:
    no `PeerFailed` (the peer would become a suspect, as if dead), and the next send goes
    through on a new connection."""
    listener = Listener()  # admits PEER: here the sender
    listener.role.config.deadline_s = 0.2
    idle_s = (IDLE_WINDOWS + 1) * STALL_WINDOWS * listener.role.config.deadline_s  # told, then closed
    opened: list[trio.SocketStream] = []

    async def open_stream(peer: str) -> trio.SocketStream:
        opened.append(await open_data_stream(listener.address, CHANNEL, codec=Codec(PEER), peer=peer))
        return opened[-1]

    inbox = RoundInbox()
    role = SimpleNamespace(node=SimpleNamespace(codec=Codec(PEER), introduce=_cannot_introduce),
                           inbox=inbox, open_stream=open_stream)
    async with trio.open_nursery() as nursery:
        listener.address = await nursery.start(listener.plane.serve)
        with trio.fail_after(SLACK_S + idle_s):
            async with open_links(role, 10.0) as links:
                assert await links.send(ME.peer_id, JOIN)
                arrived = (await listener.inbox.receive()).body
                assert arrived == JOIN and arrived.hears_idle  # our frames say we read the notice
                while ME.peer_id in links.streams:  # the receiver closes it idle; our watcher forgets it
                    await trio.sleep(idle_s / 16)
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(trio.WouldBlock):
                    inbox.receive_nowait()  # no failure reported
                later = Join(2, b"w" * 16, ())
                assert await links.send(ME.peer_id, later)
                assert (await listener.inbox.receive()).body == later
                assert len(opened) == 2 and links.streams[ME.peer_id] is opened[1]
                with pytest.raises(trio.ClosedResourceError):
                    await opened[0].receive_some(1)  # the idle one: closed by us on the notice
                while listener.plane.connections() != {PEER.peer_id: 1}:  # the server ended the first: its slot is free
                    await trio.sleep(idle_s / 16)
            with pytest.raises(trio.WouldBlock):
                inbox.receive_nowait()
        nursery.cancel_scope.cancel()


async def test_a_frame_sent_before_the_idle_notice_was_read_still_arrives():
    """The notice and the sender's next frame can cross: the sender wrote it before it read the
    notice (its watcher then waits for that send to end before it closes the link). The
    receiving end reads on after its notice, until the sender closes, so that frame is not
    lost; then the connection ends. Here the sender is a bare connection whose frames say they
    read the notice, and it writes after the notice came, as one that had not read it yet."""
    listener = Listener()
    listener.role.config.deadline_s = 0.2
    idle_s = (IDLE_WINDOWS + 1) * STALL_WINDOWS * listener.role.config.deadline_s
    codec = Codec(PEER)
    async with trio.open_nursery() as nursery:
        listener.address = await nursery.start(listener.plane.serve)
        with trio.fail_after(SLACK_S + idle_s):
            stream = await listener.connect()
            async with stream:
                await send_frame(stream, codec.encode(Join(1, b"w" * 16, (), hears_idle=True), time.time()))
                assert (await listener.inbox.receive()).body == Join(1, b"w" * 16, ())
                notice = await FrameReader(stream, max_frame_bytes=4096).frame()  # the receiver's Idle
                assert codec.decode(notice or b"", time.time()).kind == "diloco/idle"
                crossed = Join(2, b"w" * 16, (), hears_idle=True)
                await send_frame(stream, codec.encode(crossed, time.time()))
                assert (await listener.inbox.receive()).body == crossed
        await listener.settle(1)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("writes", ["garbage", "huge_length", "idle_signed_by_another", "not_an_idle"])
async def test_a_receiver_that_writes_anything_but_its_own_idle_notice_is_reported_at_once(writes: str):
    """The watcher reads one frame, of at most `NOTICE_MAX_BYTES`: a receiving end that writes
    anything else (bytes that are no frame, a length no notice has, an `Idle` another peer
    signed, a frame that is no notice) is reported as failed at once, while it still holds the
    connection open (no wait for its close, nor for 4 GiB it announced), and the next frame to it
    goes on a new connection. Before, any byte it wrote ended the watching, unreported, and its
    connection stayed in use."""
    notice = {
        "garbage": (100).to_bytes(4, "big") + bytes(range(100)),
        "huge_length": (2**32 - 1).to_bytes(4, "big"),
        "idle_signed_by_another": Codec(Identity.from_seed_text("someone else")).encode(Idle(1.0), time.time()),
        "not_an_idle": Codec(RECEIVER).encode(JOIN, time.time()),
    }[writes]
    if writes in ("idle_signed_by_another", "not_an_idle"):
        notice = len(notice).to_bytes(4, "big") + notice
    got: list[object] = []
    hang_up = trio.Event()

    async def serve(stream, reader, peer):  # one frame, then it writes, and holds the connection open
        got.append(Codec(RECEIVER).decode(await reader.frame(), time.time()).body)
        if len(got) == 1:
            await stream.send_all(notice)
        await hang_up.wait()

    async with _receiving(serve) as (role, inbox):
        with trio.fail_after(60):  # generous; nothing here is timed
            async with open_links(role, 10.0) as links:
                assert await links.send(RECEIVER.peer_id, JOIN)
                first = links.streams[RECEIVER.peer_id]
                assert await inbox.receive() == PeerFailed(RECEIVER.peer_id)
                assert RECEIVER.peer_id not in links.streams
                with pytest.raises(trio.ClosedResourceError):
                    await first.receive_some(1)  # closed by us: never written to again
                assert await links.send(RECEIVER.peer_id, JOIN)  # on a new connection
                while len(got) < 2:
                    await trio.testing.wait_all_tasks_blocked()
            hang_up.set()
        assert got == [JOIN, JOIN]
        with pytest.raises(trio.WouldBlock):
            inbox.receive_nowait()  # reported once


async def test_a_receiver_that_writes_part_of_a_notice_holds_only_its_watcher_until_the_round_ends():
    """A receiving end that writes the start of a frame and stops: the watcher waits for the
    rest (nothing to report yet: no notice, no close), sends on the connection go through, and
    the round's end stops the watcher and closes the connection, reporting nothing."""
    got: list[object] = []
    hang_up = trio.Event()

    async def serve(stream, reader, peer):
        while (frame := await reader.frame()) is not None:
            got.append(Codec(RECEIVER).decode(frame, time.time()).body)
            if len(got) == 1:
                await stream.send_all((200).to_bytes(4, "big") + b"\0" * 10)

    async with _receiving(serve) as (role, inbox):
        with trio.fail_after(60):  # generous; nothing here is timed
            async with open_links(role, 10.0) as links:
                assert await links.send(RECEIVER.peer_id, JOIN)
                first = links.streams[RECEIVER.peer_id]
                while len(got) < 1:
                    await trio.testing.wait_all_tasks_blocked()
                await trio.testing.wait_all_tasks_blocked()
                assert await links.send(RECEIVER.peer_id, JOIN)
                assert links.streams[RECEIVER.peer_id] is first  # the same connection
                while len(got) < 2:
                    await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.ClosedResourceError):
                await first.receive_some(1)
            hang_up.set()
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.WouldBlock):
            inbox.receive_nowait()
