"""A DiLoCo round's outgoing connections (`trainer.diloco_role._open_links`) over the real data
plane (real TCP, real handshakes): what reaches the round's inbox as a failure and what does not.
A refused handshake to a newcomer is no failure."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio

from p2pnet.dataplane import DataPlane, open_data_stream
from p2pnet.identity import Identity
from p2pnet.wire import Codec
from trainer.diloco_messages import CHANNEL, StateWanted
from trainer.diloco_role import _open_links

RECEIVER = Identity.from_seed_text("diloco receiver")
SENDER = Identity.from_seed_text("diloco sender")


def _role(address: str, inbox_send: trio.MemorySendChannel[Any]) -> SimpleNamespace:
    """What `_Links` uses of the role: our codec, the round's inbox, and connections to `address`."""
    return SimpleNamespace(node=SimpleNamespace(codec=Codec(SENDER)), inbox_send=inbox_send,
                           open_stream=lambda peer: open_data_stream(address, CHANNEL, codec=Codec(SENDER), peer=peer))


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
    inbox_send, inbox = trio.open_memory_channel[Any](8)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(plane.serve)
        role = _role(address, inbox_send)
        async with _open_links(role, 10.0) as links:
            body = StateWanted(3, False)
            assert not await links.send(RECEIVER.peer_id, body, report_refusal=False)
            with pytest.raises(trio.WouldBlock):
                inbox.receive_nowait()
            assert not await links.send(RECEIVER.peer_id, body)
            assert inbox.receive_nowait() == ("failed", RECEIVER.peer_id, None)
            assert plane.refused == {"not_admitted": 2}
            role.open_stream = lambda peer: open_data_stream("127.0.0.1:1", CHANNEL, codec=Codec(SENDER), peer=peer)
            assert not await links.send(RECEIVER.peer_id, body, report_refusal=False)
            assert inbox.receive_nowait() == ("failed", RECEIVER.peer_id, None)
        nursery.cancel_scope.cancel()

