"""p2pnet's hosts batch yamux receive credit (`PY_YAMUX_RELEASE_ON_READ=0`, set by `open_host`
unless the environment says otherwise): gossip still arrives, and the receiver sends one
WINDOW_UPDATE frame per small gossip RPC (measured: 20 for 20) instead of one per read
(py-libp2p reads an RPC's length prefix byte by byte: 60 for 20 with the variable at "1",
py-libp2p's default, which also shows the count measures the real thing). Real hosts, real TCP."""

import trio
from libp2p.stream_muxer.yamux.yamux import YamuxStream

from p2pnet.host import YAMUX_RELEASE_ON_READ, open_host
from p2pnet.identity import Identity

TOPIC = "p2pnet/test/credit"
MESSAGES = 20


async def window_updates_for_messages(monkeypatch, tag: str) -> int:
    updates = []
    real = YamuxStream.send_window_update

    async def counting(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        updates.append(1)
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(YamuxStream, "send_window_update", counting)
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
                before = len(updates)
                for i in range(MESSAGES):
                    await a.publish(TOPIC, f"message {i}".encode())
                await all_arrived.wait()
            nursery.cancel_scope.cancel()
    return len(updates) - before


async def test_gossip_reads_are_not_each_answered_with_a_window_update(monkeypatch):
    monkeypatch.delenv(YAMUX_RELEASE_ON_READ, raising=False)
    batched = await window_updates_for_messages(monkeypatch, "credit-batched")
    monkeypatch.setenv(YAMUX_RELEASE_ON_READ, "1")
    per_read = await window_updates_for_messages(monkeypatch, "credit-per-read")
    assert per_read >= 2 * MESSAGES  # py-libp2p's default: length prefix and body reads each credited
    # the first read after new data still credits it; gossip's own control RPCs may add a few
    # on a loaded machine, and crediting every read gives at least 3 per message
    assert batched < 2 * MESSAGES
