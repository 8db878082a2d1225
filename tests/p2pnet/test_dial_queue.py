"""Dials never hold up our heartbeat: any new identity's heartbeat makes the peer table ask for a
`Connect`, at no cost to it, and eight made-up peers listing 16 addresses that never answer held
every sender task for 160 s while our heartbeat waited (peers forget us after 10). Connects go
to their own queue and dialers, and one gives up after `CONNECT_BUDGET_S` in all.

The real peer table and the node's own `carry_out`, `_sender` and `_perform`; a host whose dials
never answer, as `Host.connect` fails against a silent address (`test_connect_deadline.py`);
virtual time."""

from __future__ import annotations

import time
from types import SimpleNamespace

import trio
import trio.testing

import p2pnet.node as N
from p2pnet.core import Connect, Publish
from p2pnet.errors import PeerUnavailable
from p2pnet.host import CONNECT_TIMEOUT_S
from p2pnet.identity import Identity
from p2pnet.messages import Capacity, Heartbeat
from p2pnet.peertable import TIMER_HEARTBEAT, LocalInfo, PeerTable, PeerTableConfig
from p2pnet.wire import Codec

US = Identity.from_seed_text("us")


class SilentHost:
    def __init__(self) -> None:
        self.published: list[float] = []
        self.dials: list[tuple[str, float]] = []  # (address, when it gave up)

    def connected_peers(self):
        return []

    async def connect(self, addr, peer=None, *, timeout_s=CONNECT_TIMEOUT_S):
        await trio.sleep(timeout_s)
        self.dials.append((addr, trio.current_time()))
        raise PeerUnavailable(f"{addr}: no connection within {timeout_s:g} s")

    async def publish(self, topic, frame):
        self.published.append(trio.current_time())


class Sink:
    """The node's effect carrying, with nothing else of a node."""
    carry_out, _sender, _perform = N.Node.carry_out, N.Node._sender, N.Node._perform

    def __init__(self, host, codec, outbox, dials) -> None:
        self.host, self.codec, self._outbox, self._dials = host, codec, outbox, dials
        self.config = SimpleNamespace(send_timeout_s=10.0)
        self.stats = {"sent": 0, "send_failed": 0}
        self.peer_news, self._listeners = SimpleNamespace(on_event=lambda origin, event: None), []


def test_connects_to_addresses_that_never_answer_do_not_delay_our_heartbeat():
    async def main():
        codec = Codec(US)
        table = PeerTable(PeerTableConfig(), US.peer_id, LocalInfo((), "127.0.0.1:1", (), Capacity(1, 1, 1)), 0)
        host = SilentHost()
        outbox_send, outbox = trio.open_memory_channel(N.OUTBOX_SIZE)
        dials_send, dials = trio.open_memory_channel(N.DIAL_QUEUE)
        node = Sink(host, codec, outbox_send, dials_send)
        start = trio.current_time()
        for i in range(2 * N.SENDER_TASKS):  # strangers: 16 silent addresses each
            stranger = Identity.from_seed_text(f"stranger{i}")
            addrs = tuple(f"/ip4/192.0.2.{j + 1}/tcp/9/p2p/{stranger.peer_id}" for j in range(16))
            beat = Heartbeat(1, 1, addrs, "192.0.2.1:9", (), Capacity(1, 1, 1))
            for effect in table.on_message(start, codec.decode(Codec(stranger).encode(beat, time.time()), time.time())):
                node.carry_out("peertable", effect)
        connects = dials.statistics().current_buffer_used
        assert connects >= N.SENDER_TASKS  # (the table asked to dial at least as many as we have senders)
        for effect in table.on_timer(start, TIMER_HEARTBEAT):
            if isinstance(effect, Publish):
                node.carry_out("peertable", effect)
        async with trio.open_nursery() as nursery:
            for _ in range(N.SENDER_TASKS):
                nursery.start_soon(node._sender, outbox.clone())
            for _ in range(N.DIALER_TASKS):
                nursery.start_soon(node._sender, dials.clone())
            while node.stats["send_failed"] < connects:  # every connect tried and given up
                await trio.sleep(1)
            nursery.cancel_scope.cancel()
        assert host.published == [start]  # our heartbeat went at once
        per_connect = {}
        for addr, _ in host.dials:
            per_connect.setdefault(addr.rsplit("/", 1)[1], []).append(addr)
        assert len(per_connect) == connects
        assert all(len(tried) == N.CONNECT_BUDGET_S // CONNECT_TIMEOUT_S for tried in per_connect.values())
        rounds = -(-connects // N.DIALER_TASKS)
        assert max(at for _, at in host.dials) - start <= rounds * N.CONNECT_BUDGET_S

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
