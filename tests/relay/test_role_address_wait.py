"""A source we heard of (a Holding, a manifest) before its heartbeat reached our peer table: the
relay role waits for its data address, up to `request_timeout_s`, instead of failing at once
(which would exclude a good source for `exclude_s`, a minute), woken by the node's peer table
news (`Node.wait_for_peers`): a join, or a known peer's changed entry. Virtual time (MockClock).

Heartbeats may come further apart than that wait (30 s past 150 peers, up to 50 s while busy):
a source whose address has not come when it ends is failed as `no_address`, nobody's fault, and
asked again soon, not excluded as unreachable for `exclude_s` (the origin, at worst)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from p2pnet.errors import PeerUnavailable
from p2pnet.peertable import LeftBecause, PeerChanged, PeerJoined, PeerLeft
from p2pnet.wire import Envelope
from relay.effects import DropReason, FetchFailure, FetchManifest
from relay.errors import AddressUnknown
from relay.messages import HeldVersion, Holding
from relay.role import RelayRole
from tests.relay.test_role_idle_connections import SourcePeer, start
from tests.relay.test_role_source_blame import drops
from tests.relay.test_role_store_faults import (  # noqa: F401 (fixture)
    CHUNKS, PUBLISHER, FakeNode, Harness, inline_threads, publish)

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
        self.entries[peer] = SimpleNamespace(data_addr=address, roles=("relay",))


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


async def test_an_address_not_known_in_time_fails_as_nobodys_fault_and_a_banned_peer_as_unavailable(
        tmp_path: Path, clock) -> None:
    role, table = make_role(tmp_path, request_timeout_s=4.0)
    with pytest.raises(AddressUnknown):  # (a PeerUnavailable: whoever catches those still does)
        await role.open_stream(SOURCE)
    table.banned.add(SOURCE)
    with pytest.raises(PeerUnavailable) as raised:
        await role.open_stream(SOURCE)
    assert not isinstance(raised.value, AddressUnknown)


HEARD_AT_S = 23.0  # when the origin's heartbeat reaches us: past the wait (10 s), within a heartbeat at scale
WAIT_S = 10.0  # the role's wait for a manifest (`request_timeout_s`, its default), its address wait included


async def test_an_origin_whose_heartbeat_comes_after_the_wait_is_fetched_from_and_not_excluded_as_unreachable(
        tmp_path: Path, clock, monkeypatch) -> None:
    """A relay hears of a version before the heartbeat of its publisher (a relay that just
    started, in a network where heartbeats are 30 s apart): every chunk is to come from the
    origin, whose data address comes only `HEARD_AT_S` in. The role's real upstream and
    `open_stream` wait for it (`request_timeout_s`), fail the requests as `no_address` when the
    wait ends, and the core asks the origin again soon: once its heartbeat has come the version
    is fetched from it. Before, the requests failed as `unreachable` and the origin was excluded
    for `exclude_s` (60 s here)."""
    h = Harness(tmp_path, max_concurrent_downloads=8)
    table = Table(h.node.peertable)
    h.node.peertable = table  # knows nobody: the publisher's heartbeat has not come
    h.node.codec = None  # (the wire below authenticates nobody)
    source = SourcePeer(h, idle_timeout_s=120.0)
    async with trio.open_nursery() as nursery:
        failures = await start(h, source, nursery, monkeypatch)
        del h.role.open_stream  # the role's own: waits for the address in the peer table

        async def open_data_stream(address: str, channel: str, *, codec, peer: str) -> trio.abc.Stream:
            assert (address, peer) == (ADDRESS, PUBLISHER.peer_id)
            return await source.connect(nursery)

        monkeypatch.setattr("relay.role.open_data_stream", open_data_stream)
        started = trio.current_time()
        await h.announce(1)
        await trio.sleep_until(started + HEARD_AT_S)
        assert not h.complete(1) and source.wires == []
        assert h.role.core._usable(trio.current_time(), PUBLISHER.peer_id)  # not excluded for `exclude_s`
        table.learn(PUBLISHER.peer_id, ADDRESS)
        tell(h.role, PeerJoined(PUBLISHER.peer_id))
        await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()

    assert failures and {reason for _, _, reason in failures} == {FetchFailure.NO_ADDRESS}
    assert set(drops(h, PUBLISHER.peer_id)) == {DropReason.NO_ADDRESS}  # never `unreachable`
    assert h.role.fetched_from.get(PUBLISHER.peer_id) == CHUNKS  # every chunk, from the origin


async def _manifest_from_a_late_holder(tmp_path: Path, monkeypatch, heard_at_s: float,
                                       first_dial_s: float = 0.0) -> tuple[Harness, float, list[float], list[float]]:
    """We learn of version 1 only from a `Holding` of its publisher, whose heartbeat (its data
    address) reaches us `heard_at_s` after it, and no `Holding` comes after it; the first dial of
    it takes `first_dial_s` (virtual). Run through the role's real `open_stream` (its wait for
    the address, `WAIT_S`) and `_fetch_manifest` until the version is complete (a 600 s limit):
    the harness, when the `Holding` came, and when the manifest was asked for and the holder dialed."""
    h = Harness(tmp_path, max_concurrent_downloads=8, request_timeout_s=WAIT_S)
    table = Table(h.node.peertable)
    h.node.peertable = table  # knows nobody: the holder's heartbeat has not come
    h.node.codec = None  # (the wire below authenticates nobody)
    source = SourcePeer(h, idle_timeout_s=120.0)
    asked: list[float] = []
    dials: list[float] = []
    async with trio.open_nursery() as nursery:
        await start(h, source, nursery, monkeypatch)
        del h.role.open_stream  # the role's own: waits for the address in the peer table
        fetch_manifest = h.role._fetch_manifest

        async def counted(ask: FetchManifest) -> None:
            asked.append(trio.current_time())
            await fetch_manifest(ask)

        h.role._fetch_manifest = counted

        async def open_data_stream(address: str, channel: str, *, codec, peer: str) -> trio.abc.Stream:
            assert (address, peer) == (ADDRESS, PUBLISHER.peer_id)
            dials.append(trio.current_time())
            if len(dials) == 1:
                await trio.sleep(first_dial_s)
            return await source.connect(nursery)

        monkeypatch.setattr("relay.role.open_data_stream", open_data_stream)
        signed = publish(h.origin, h.root, 1)  # the holder's (the publisher's) store holds it; no announce
        holding = Holding((HeldVersion(1, signed.manifest_id),))
        started = trio.current_time()
        await h.role._command(lambda now: h.role.core.on_message(
            now, Envelope(Holding.KIND, PUBLISHER.peer_id, b"", 0, holding, 0)))  # type: ignore[attr-defined]
        await trio.sleep_until(started + heard_at_s)
        assert not h.role.core.knows(1) and asked and source.wires == []
        table.learn(PUBLISHER.peer_id, ADDRESS)
        tell(h.role, PeerJoined(PUBLISHER.peer_id))
        await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()
    return h, started, asked, dials


async def test_a_manifest_asked_of_a_holder_whose_heartbeat_comes_after_the_wait_is_asked_again(
        tmp_path: Path, clock, monkeypatch) -> None:
    """We learn of a version only from a `Holding` (the manifest's announce missed us: we joined
    after it) whose sender's heartbeat has not reached us, and reaches us only `HEARD_AT_S` in,
    and no `Holding` comes after it (at scale a holder gossips one every few minutes). The role's
    real `open_stream` waits for its address (`request_timeout_s`), the manifest ask fails as
    `no_address`, and the core asks again soon: once its heartbeat has come the manifest, then
    the version, is fetched from it. Before, the failed ask was only logged, and the version
    waited for the next `Holding` of it."""
    h, started, asked, _ = await _manifest_from_a_late_holder(tmp_path, monkeypatch, HEARD_AT_S)
    assert asked[0] == pytest.approx(started) and len(asked) >= 2  # asked again, not only at the next `Holding`
    assert h.role.fetched_from.get(PUBLISHER.peer_id) == CHUNKS  # then every chunk, from it


async def test_a_manifest_ask_whose_deadline_ends_just_after_the_holders_address_came_is_asked_again(
        tmp_path: Path, clock, monkeypatch) -> None:
    """As above, but the holder's heartbeat comes half a second before our deadline for the ask
    ends (`request_timeout_s`, which the wait for its address shares), and dialing it takes a
    second: the ask ends in our deadline (`TooSlowError`) with its address known by then. It is
    still no verdict on the holder (the wait took the time), so it is asked again, and the
    version is fetched from it. Before, only an ask whose deadline ended with the address still
    unknown was made again: this one waited for the next `Holding` (none here)."""
    h, started, asked, dials = await _manifest_from_a_late_holder(tmp_path, monkeypatch, WAIT_S - 0.5,
                                                                  first_dial_s=1.0)
    assert asked[0] == pytest.approx(started) and len(asked) >= 2  # asked again, not only at the next `Holding`
    assert dials[0] < started + WAIT_S < dials[0] + 1.0  # (the first ask's deadline ended in its dial)
    assert h.role.fetched_from.get(PUBLISHER.peer_id) == CHUNKS  # then every chunk, from it
