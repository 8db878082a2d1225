"""p2pnet's hosts leave py-libp2p's signed peer record off their gossip RPCs, so no receiver
spends an Ed25519 check and a peerstore update on each one; gossip still arrives. With
`send_peer_record=True` (py-libp2p's own behaviour) the receiver does check records, which
shows the count below measures the real thing. Real hosts over real TCP."""

import libp2p.pubsub.utils as pubsub_utils
import trio

from p2pnet.host import open_host
from p2pnet.identity import Identity

TOPIC = "p2pnet/test/record"


async def records_checked_for_one_message(monkeypatch, send_peer_record: bool, tag: str) -> int:
    checked = []
    real = pubsub_utils.consume_envelope
    monkeypatch.setattr(pubsub_utils, "consume_envelope", lambda *a, **k: checked.append(1) or real(*a, **k))
    arrived = trio.Event()

    async def on_frame(frame: bytes, source: str) -> None:
        if frame == b"hello":
            arrived.set()

    async with open_host(Identity.from_seed_text(f"{tag}-a"), "/ip4/127.0.0.1/tcp/0",
                         send_peer_record=send_peer_record) as a, \
            open_host(Identity.from_seed_text(f"{tag}-b"), "/ip4/127.0.0.1/tcp/0",
                      send_peer_record=send_peer_record) as b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.subscribe, TOPIC, on_frame)
            nursery.start_soon(a.subscribe, TOPIC, on_frame)
            await a.connect(b.addrs()[0])
            with trio.fail_after(60):  # until a knows b subscribed, then until the message arrives
                while not a._pubsub.peer_topics.get(TOPIC):
                    await trio.sleep(0.02)
                await a.publish(TOPIC, b"hello")
                await arrived.wait()
            nursery.cancel_scope.cancel()
    return len(checked)


async def test_gossip_carries_no_signed_peer_record_by_default(monkeypatch):
    assert await records_checked_for_one_message(monkeypatch, False, "rec-off") == 0
    assert await records_checked_for_one_message(monkeypatch, True, "rec-on") > 0
