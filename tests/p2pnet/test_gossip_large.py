"""Gossip messages larger than one yamux frame (64 KiB) arrive whole when two tasks write to the
same peer's gossip stream at once.

py-libp2p writes such a message as several frames, taking the stream's lock per frame, and it
writes to a peer's gossip stream from two places (its outbound queue, and the flush of messages
it held until the peer's subscriptions arrived). The two interleaved, the receiver dropped the
stream as "not a pubsub RPC", and a SmolLM2 devnet's relay lost the trainer's gossip for good
(its manifest is 87 KiB). Real hosts over real TCP; the writes go through pubsub's own
`write_msg`, as both of its writers do."""

import os

import trio
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import PUBSUB_SIGNING_PREFIX

from p2pnet.host import open_host
from p2pnet.identity import Identity

TOPIC = "p2pnet/test/large"


def signed_rpc(pubsub, data: bytes) -> rpc_pb2.RPC:
    """One publish RPC signed by `pubsub`'s host, as its `publish` builds it."""
    msg = rpc_pb2.Message(data=data, topicIDs=[TOPIC], from_id=pubsub.my_id.to_bytes(), seqno=pubsub._next_seqno())
    msg.signature = pubsub.sign_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
    msg.key = pubsub.host.get_public_key().serialize()
    return rpc_pb2.RPC(publish=[msg])


def _subscriber(pubsub, peer: str):
    """`peer`'s id once `pubsub` has its gossip stream and knows it subscribed to TOPIC."""
    for known in pubsub.peer_topics.get(TOPIC, set()):
        if known.to_base58() == peer and known in pubsub.peers:
            return known
    return None


async def test_two_writers_of_large_gossip_messages_do_not_interleave():
    bodies = [bytes([i]) * 8 + os.urandom(150_000 + 7_919 * i) for i in range(6)]
    got: list[bytes] = []
    all_arrived = trio.Event()

    async def on_frame(frame: bytes, source: str) -> None:
        got.append(frame)
        if len(got) == len(bodies):
            all_arrived.set()

    async with open_host(Identity.from_seed_text("large-a"), "/ip4/127.0.0.1/tcp/0") as a, \
            open_host(Identity.from_seed_text("large-b"), "/ip4/127.0.0.1/tcp/0") as b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.subscribe, TOPIC, on_frame)
            await a.connect(b.addrs()[0])
            with trio.fail_after(60):  # until b's subscription reached a
                while not (b_id := _subscriber(a._pubsub, b.peer_id)):
                    await trio.sleep(0.02)
            stream = a._pubsub.peers[b_id]
            async with trio.open_nursery() as writers:
                for body in bodies:
                    writers.start_soon(a._pubsub.write_msg, stream, signed_rpc(a._pubsub, body))
            with trio.fail_after(120):
                await all_arrived.wait()
            assert a._pubsub.peers.get(b_id) is stream  # the stream was never dropped
            nursery.cancel_scope.cancel()
    assert sorted(got) == sorted(bodies)
