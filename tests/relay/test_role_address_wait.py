"""A source we heard of (a Holding, a manifest) before its heartbeat reached our peer table: the
relay role waits for its data address, up to `request_timeout_s`, instead of failing at once
(which would exclude a good source for `exclude_s`, a minute), woken by the node's peer table
news (`Node.wait_for_peers`): a join, or a known peer's changed entry. Virtual time (MockClock)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from p2pnet.peertable import LeftBecause, PeerChanged, PeerJoined, PeerLeft
from relay.role import RelayRole
from tests.relay.test_role_store_faults import FakeNode

SOURCE = "12D3KooWsource"
ADDRESS = "/ip4/10.0.0.7/tcp/4001"


class Table:
    """The peer table as the role reads it: `get` knows the source once `learn` was called."""

    def __init__(self, base) -> None:
        self.entries: dict[str, SimpleNamespace] = {}
        self.banned: set[str] = set()
        self.penalise = base.penalise
        self.local = base.local

    def get(self, peer: str):
        return self.entries.get(peer)

    def is_banned(self, peer: str, now: float) -> bool:
        return peer in self.banned

    def learn(self, peer: str, address: str) -> None:
        self.entries[peer] = SimpleNamespace(data_addr=address)


def make_role(tmp_path: Path, **relay) -> tuple[RelayRole, Table]:
    node = FakeNode(tmp_path / "relay")
    table = Table(node.peertable)
    node.peertable = table
    return RelayRole(node, {"fsync": False, **relay}), table


def tell(role: RelayRole, event) -> None:
    """What the node does with the peer table's events (`Node.carry_out`)."""
    role.node.peer_news.on_event("peertable", event)


async def ask(role: RelayRole, got: list) -> None:
    """Wait for SOURCE's data address; note (address or None, when the wait ended)."""
    got.append((await role._data_addr_soon(SOURCE), trio.current_time()))


@pytest.fixture
def clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_the_address_that_arrives_with_a_later_heartbeat_is_used(tmp_path: Path, clock) -> None:
    role, table = make_role(tmp_path, request_timeout_s=10.0)
    got: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, role, got)
        await trio.sleep(3.0)
        assert got == []  # still waiting: nothing known yet
        table.learn(SOURCE, ADDRESS)
        tell(role, PeerJoined(SOURCE))
    assert got == [(ADDRESS, pytest.approx(3.0))]  # woken by the join at once (virtual time: nothing else moves it)


async def test_an_address_learnt_without_a_join_wakes_the_wait_too(tmp_path: Path, clock) -> None:
    role, table = make_role(tmp_path, request_timeout_s=10.0)
    got: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, role, got)
        await trio.sleep(2.2)
        tell(role, PeerJoined("12D3KooWsomeoneelse"))  # news, but not the address we wait for
        await trio.sleep(1.0)
        assert got == []
        table.learn(SOURCE, ADDRESS)  # e.g. a peer we knew changed its data address
        tell(role, PeerChanged(SOURCE))
    assert got == [(ADDRESS, pytest.approx(3.2))]


async def test_a_source_never_heard_from_fails_after_the_request_timeout(tmp_path: Path, clock) -> None:
    role, _ = make_role(tmp_path, request_timeout_s=4.0)
    started = trio.current_time()
    assert await role._data_addr_soon(SOURCE) is None
    assert trio.current_time() - started == pytest.approx(4.0)  # the timeout, no recheck on the way


async def test_a_known_address_is_returned_without_waiting(tmp_path: Path, clock) -> None:
    role, table = make_role(tmp_path)
    table.learn(SOURCE, ADDRESS)
    started = trio.current_time()
    assert await role._data_addr_soon(SOURCE) == ADDRESS
    assert trio.current_time() == started


async def test_a_banned_source_is_not_waited_for(tmp_path: Path, clock) -> None:
    role, table = make_role(tmp_path, request_timeout_s=10.0)
    table.banned.add(SOURCE)
    started = trio.current_time()
    assert await role._data_addr_soon(SOURCE) is None
    assert trio.current_time() == started


async def test_a_source_banned_while_we_wait_ends_the_wait_at_its_ban(tmp_path: Path, clock) -> None:
    role, table = make_role(tmp_path, request_timeout_s=10.0)
    got: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask, role, got)
        await trio.sleep(1.7)
        table.banned.add(SOURCE)  # a table that knows it bans it and emits PeerLeft "banned" (one that
        # does not know it yet emits nothing, and the wait runs to its timeout)
        tell(role, PeerLeft(SOURCE, LeftBecause.BANNED))
    assert got == [(None, pytest.approx(1.7))]  # not waited for until the timeout
