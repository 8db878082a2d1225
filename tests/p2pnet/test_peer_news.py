"""`Node.wait_for_peers`: a wait on the peer table that wakes at each change of it (a join, a
known peer's new data address or roles, a leave) and never polls; it times out. A real
`PeerTable` fed with heartbeats, its effects carried out by the real `Node.carry_out`, in virtual
time (MockClock): every time asserted is when a change was made, not a measurement."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from p2pnet.core import Emit
from p2pnet.identity import Identity
from p2pnet.messages import Capacity, Heartbeat
from p2pnet.node import Node, PeerNews
from p2pnet.peertable import (TIMER_EXPIRE, LeftBecause, LocalInfo, PeerChanged, PeerJoined, PeerLeft, PeerTable,
                              PeerTableConfig)
from p2pnet.wire import Envelope

ME = Identity.from_seed_text("me").peer_id
BOB = Identity.from_seed_text("bob").peer_id
LOCAL = LocalInfo(("/ip4/127.0.0.1/tcp/1/p2p/me",), "127.0.0.1:9", ("relay",), Capacity(1, 2, 3))
BEAT = Heartbeat(1, 7, ("/ip4/127.0.0.1/tcp/2/p2p/bob",), "127.0.0.1:8", ("worker",), Capacity(5, 6, 7))


class Peer:
    """A node as far as the peer table's effects go: the real `carry_out` and `wait_for_peers`."""

    carry_out = Node.carry_out
    wait_for_peers = Node.wait_for_peers
    peers_changed = Node.peers_changed

    def __init__(self) -> None:
        self.peertable = PeerTable(PeerTableConfig(heartbeat_interval_s=1.0, expiry_s=3.0), ME, LOCAL, 100)
        self.peer_news = PeerNews()
        self._listeners: list = []
        self.outbox: list = []
        self._outbox = SimpleNamespace(send_nowait=self.outbox.append)  # Publish, Connect: kept, not sent
        self._dials = None  # (connects into the outbox too)

    def hear(self, seq: int, **changes) -> None:
        body = replace(BEAT, seq=seq, **changes)
        for effect in self.peertable.on_message(trio.current_time(), Envelope("heartbeat", BOB, b"", 0, body, 100)):
            self.carry_out("peertable", effect)

    def tick(self) -> None:
        for effect in self.peertable.on_timer(trio.current_time(), TIMER_EXPIRE):
            self.carry_out("peertable", effect)

    def bob(self) -> str | None:
        entry = self.peertable.get(BOB)
        return entry.data_addr if entry is not None else None


@pytest.fixture
def clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def _when(peer: Peer, predicate, timeout_s: float, got: list) -> None:
    got.append((await peer.wait_for_peers(predicate, timeout_s), trio.current_time()))


async def test_it_wakes_on_a_join_on_a_changed_data_address_and_on_a_leave(clock) -> None:
    peer = Peer()
    got: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_when, peer, lambda: peer.bob() is not None, 60.0, got)
        nursery.start_soon(_when, peer, lambda: peer.bob() == "127.0.0.1:99", 60.0, got)
        await trio.sleep(1.0)
        peer.hear(1)  # joins: the first waiter's predicate holds
        await trio.sleep(1.0)
        peer.hear(2, capacity=Capacity(5, 6, 8))  # the same entry but its capacity: no news, nobody else wakes
        await trio.sleep(0.5)
        assert got == [(True, 1.0)]
        peer.hear(3, data_addr="127.0.0.1:99")  # no join, a new data address
    assert got == [(True, 1.0), (True, 2.5)]

    got.clear()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_when, peer, lambda: peer.bob() is None, 60.0, got)
        await trio.sleep(10.0)  # BOB falls silent; the table expires it at its next expiry timer
        peer.tick()
    assert got == [(True, pytest.approx(12.5))]
    assert peer.peer_news.changes == 3  # the join, the address, the leave


async def test_roles_changed_wake_it_and_a_predicate_that_never_holds_times_out(clock) -> None:
    peer = Peer()
    peer.hear(1)
    started = trio.current_time()
    got: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_when, peer, lambda: "diloco" in peer.peertable.get(BOB).roles, 5.0, got)
        nursery.start_soon(_when, peer, lambda: peer.bob() == "nowhere", 5.0, got)
        await trio.sleep(2.0)
        peer.hear(2, roles=("worker", "diloco"))
    assert got == [(True, started + 2.0), (False, started + 5.0)]


async def test_the_table_says_what_changed_and_peers_changed_returns_at_the_next_change(clock) -> None:
    peer = Peer()
    peer.hear(1)
    assert peer.peertable.on_message(1.0, Envelope("heartbeat", BOB, b"", 0, replace(BEAT, seq=2, reachable=True),
                                                   100)) == [Emit(PeerChanged(BOB))]
    woke: list = []
    before = peer.peer_news.changes

    async def wait() -> None:
        await peer.peers_changed()
        woke.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.sleep(4.0)
        peer.peer_news.on_event("relay", PeerJoined(BOB))  # another core's events are not the table's
        await trio.sleep(1.37)
        peer.peer_news.on_event("peertable", PeerLeft(BOB, LeftBecause.BANNED))
    assert woke == [pytest.approx(5.37)] and peer.peer_news.changes == before + 1
