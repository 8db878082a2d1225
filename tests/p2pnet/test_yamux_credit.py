"""p2pnet's hosts batch yamux receive credit (`PY_YAMUX_RELEASE_ON_READ=0`, set by `open_host`
unless the environment says otherwise) and read gossip streams through a read-ahead buffer
(`p2pnet.host._ReadAheadStream`): gossip still arrives, the receiver reads the yamux stream
about once per small RPC instead of once per length-prefix byte plus once for the body (py-libp2p's
own reader: 60 reads and, with the variable at "1", py-libp2p's default, 60 WINDOW_UPDATE frames
for 20 RPCs), and sends fewer WINDOW_UPDATE frames than two per RPC. Reading ahead one byte at a
time reads every byte alone, which shows the counts measure the real thing. Real hosts, real TCP."""

import trio
from libp2p.stream_muxer.yamux.yamux import YamuxStream

from p2pnet.host import YAMUX_RELEASE_ON_READ, _ReadAheadStream, open_host
from p2pnet.identity import Identity

TOPIC = "p2pnet/test/credit"
MESSAGES = 20


async def window_updates_for_messages(monkeypatch, tag: str) -> tuple[int, int]:
    """(WINDOW_UPDATE frames, yamux stream reads) while MESSAGES small gossip RPCs arrive."""
    updates, reads = [], []
    real_update, real_read = YamuxStream.send_window_update, YamuxStream.read

    async def counting_update(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        updates.append(1)
        return await real_update(self, *args, **kwargs)

    async def counting_read(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        data = await real_read(self, *args, **kwargs)
        reads.append(1)
        return data

    monkeypatch.setattr(YamuxStream, "send_window_update", counting_update)
    monkeypatch.setattr(YamuxStream, "read", counting_read)
    got = []
    all_arrived = trio.Event()

    async def on_frame(frame: bytes, source: str) -> None:
        got.append(frame)
        if len(got) == MESSAGES:
            all_arrived.set()

    async with open_host(Identity.from_seed_text(f"{tag}-a"), "/ip4/127.0.0.1/tcp/0") as a, \
            open_host(Identity.from_seed_text(f"{tag}-b"), "/ip4/127.0.0.1/tcp/0") as b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b.subscribe, TOPIC, on_frame)
            nursery.start_soon(a.subscribe, TOPIC, lambda frame, source: trio.lowlevel.checkpoint())
            await a.connect(b.addrs()[0])
            with trio.fail_after(60):  # until a knows b subscribed, then until every message arrived
                while not a._pubsub.peer_topics.get(TOPIC):
                    await trio.sleep(0.02)
                before = len(updates), len(reads)
                for i in range(MESSAGES):
                    await a.publish(TOPIC, f"message {i}".encode())
                await all_arrived.wait()
            nursery.cancel_scope.cancel()
    return len(updates) - before[0], len(reads) - before[1]


async def test_gossip_reads_are_not_each_answered_with_a_window_update(monkeypatch):
    monkeypatch.delenv(YAMUX_RELEASE_ON_READ, raising=False)
    batched, reads = await window_updates_for_messages(monkeypatch, "credit-batched")
    # read ahead: py-libp2p's own reader needs at least 2 reads per RPC (prefix byte, body);
    # gossip's control RPCs may add a few on a loaded machine
    assert reads < 2 * MESSAGES
    assert batched < 2 * MESSAGES
    # the counts see the real reads: reading ahead 1 byte at a time reads every byte alone
    monkeypatch.setattr(_ReadAheadStream, "READ_AHEAD", 1)
    _, reads_bytewise = await window_updates_for_messages(monkeypatch, "credit-bytewise")
    assert reads_bytewise >= 2 * MESSAGES
