"""A manifest asked of a holder that cannot answer yet, through the relay role's real
`_fetch_manifest`, `open_stream` and address wait and a real serving peer over the in-memory
wire, virtual time (MockClock): we learn of version 1 only from `Holding`s, none comes after
the first of each holder (at scale a holder gossips one every few minutes), and the version
must still come (`relay.manifest_asks`, `manifest_failed` and `_asks_instead`)."""

from __future__ import annotations

from pathlib import Path
from typing import Awaitable, Callable

import pytest
import trio
import trio.testing

from p2pnet.dataplane import FrameReader, send_frame
from p2pnet.handshake import NotAdmitted
from p2pnet.wire import Envelope
from relay.effects import FetchManifest
from relay.failures import NO_ADDRESS_GRACE_S
from relay.messages import REQUEST, ChunkRequest, ChunkResponse, HeldVersion, Holding
from relay.upstream import read_frame
from tests.relay.test_role_address_wait import ADDRESS, Table
from tests.relay.test_role_idle_connections import SourcePeer, start
from relay.store import ChunkStore
from tests.relay.test_role_store_faults import (  # noqa: F401 (fixture)
    CHUNKS, PUBLISHER, Harness, inline_threads, publish)

GHOST = "12D3KooWghost"  # sends `Holding` and never a heartbeat: no member, no address
HOLDER = "12D3KooWholder"  # a member, whose address we know: it names the version, and cannot give it
HOLDER_ADDRESS = "/ip4/127.0.0.2/tcp/4001"
Dial = Callable[[Harness, trio.Nursery], Awaitable[trio.abc.Stream]]  # how dialling HOLDER goes
NEWER_STATUS = 255  # a status a newer peer may send: none this peer knows
WAIT_S = 10.0  # the role's wait for a manifest (`request_timeout_s`), its address wait included


@pytest.fixture
def clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def _version_from_holdings(tmp_path: Path, monkeypatch, holdings: list[tuple[float, str]],
                                 refusals: int = 0, holder: Dial | None = None,
                                 ) -> tuple[Harness, list[tuple[float, str]], list[str]]:
    """Version 1 is held by its publisher (a member, whose address we know) and named to us only
    by `holdings` ((seconds in, sender): the publisher, GHOST or HOLDER, one `Holding` each); the
    publisher's data plane refuses our first `refusals` connections as not admitted (it has not
    heard our heartbeat). HOLDER, a member whose address we know too, is dialled by `holder`.
    Run until the version is complete (a 600 s limit): the harness, the manifest asks ((seconds
    in, of whom)) and the peers sent our heartbeat (`Node.introduce`)."""
    h = Harness(tmp_path, max_concurrent_downloads=8, request_timeout_s=WAIT_S)
    table = Table(h.node.peertable)
    h.node.peertable = table
    table.learn(PUBLISHER.peer_id, ADDRESS)  # the publisher's heartbeat came; the ghost's never does
    table.learn(HOLDER, HOLDER_ADDRESS)
    h.node.codec = None  # (the wire below authenticates nobody)
    introduced: list[str] = []

    async def introduce(peer: str) -> bool:
        introduced.append(peer)
        return True

    h.node.introduce = introduce  # type: ignore[attr-defined]
    source = SourcePeer(h, idle_timeout_s=120.0)
    asked: list[tuple[float, str]] = []
    dials: list[float] = []
    async with trio.open_nursery() as nursery:
        await start(h, source, nursery, monkeypatch)
        if holder is not None:  # (a member that serves nobody: planned as a leaf, asked for no chunk)
            await h.role._command(lambda now: h.role.core.set_members(now, {PUBLISHER.peer_id: 1e9, HOLDER: 0.0}))
        del h.role.open_stream  # the role's own: waits for the address in the peer table
        fetch_manifest = h.role._fetch_manifest
        started = trio.current_time()

        async def counted(ask: FetchManifest) -> None:
            asked.append((trio.current_time() - started, ask.peer))
            await fetch_manifest(ask)

        h.role._fetch_manifest = counted

        async def open_data_stream(address: str, channel: str, *, codec, peer: str) -> trio.abc.Stream:
            if holder is not None and (address, peer) == (HOLDER_ADDRESS, HOLDER):
                return await holder(h, nursery)
            assert (address, peer) == (ADDRESS, PUBLISHER.peer_id)
            dials.append(trio.current_time())
            if len(dials) <= refusals:
                raise NotAdmitted(f"{peer} closed the connection after our hello")
            return await source.connect(nursery)

        monkeypatch.setattr("relay.role.open_data_stream", open_data_stream)
        signed = publish(h.origin, h.root, 1)  # the publisher's store holds it; no announce
        holding = Holding((HeldVersion(1, signed.manifest_id),))
        for at, sender in holdings:
            await trio.sleep_until(started + at)
            await h.role._command(lambda now: h.role.core.on_message(
                now, Envelope(Holding.KIND, sender, b"", 0, holding, 0)))  # type: ignore[attr-defined]
        await h.until(lambda: h.complete(1), 600)
        nursery.cancel_scope.cancel()
    return h, asked, introduced


async def test_a_manifest_ask_refused_as_not_admitted_is_made_again_soon(tmp_path: Path, clock, monkeypatch) -> None:
    """The holder's data plane refuses our first two manifest asks as not admitted (it has not
    heard our heartbeat: the role sends it ours, `Node.introduce`): the core asks again
    `not_admitted_s` (2 s) after each refusal, and the manifest, then the version, comes from it.
    Before, a refused ask was only logged, and the version waited for the next `Holding`."""
    h, asked, introduced = await _version_from_holdings(tmp_path, monkeypatch, [(0.0, PUBLISHER.peer_id)],
                                                        refusals=2)
    assert asked == [(0.0, PUBLISHER.peer_id), (pytest.approx(2.0), PUBLISHER.peer_id),
                     (pytest.approx(4.0), PUBLISHER.peer_id)]
    assert introduced == [PUBLISHER.peer_id] * 2
    assert h.role.fetched_from.get(PUBLISHER.peer_id) == CHUNKS  # then every chunk, from it


async def test_a_members_holding_is_asked_at_once_while_a_ghosts_ask_waits(tmp_path: Path, clock,
                                                                           monkeypatch) -> None:
    """A ghost (a `Holding`, never a heartbeat) names the version first, then its publisher, a
    member whose address we know, a second later: the publisher is asked at once, and the
    version comes from it while the ghost's ask still waits for an address. Before, the
    publisher's `Holding` asked nothing (the ghost had been asked less than `manifest_retry_s`
    before, and each of its asks again refreshed that), so the version waited for another
    `Holding` (none here), past the ghost's grace (`NO_ADDRESS_GRACE_S`)."""
    h, asked, _ = await _version_from_holdings(tmp_path, monkeypatch, [(0.0, GHOST), (1.0, PUBLISHER.peer_id)])
    assert asked[:2] == [(0.0, GHOST), (pytest.approx(1.0), PUBLISHER.peer_id)]
    assert all(at < NO_ADDRESS_GRACE_S for at, _ in asked)  # (the ghost's asks again end with the version)
    assert h.role.fetched_from.get(PUBLISHER.peer_id) == CHUNKS


async def _unreachable(h: Harness, nursery: trio.Nursery) -> trio.abc.Stream:
    """HOLDER's host is gone: the dial fails when the connection attempt times out."""
    await trio.sleep(3.0)
    raise OSError(110, "Connection timed out")


async def _without_it(h: Harness, nursery: trio.Nursery) -> trio.abc.Stream:
    """HOLDER serves, as a relay, from a store without the version (it dropped it): the real
    role's `_serve` answers that it does not hold the manifest."""
    without = SourcePeer(h, idle_timeout_s=120.0)
    without.role.store = ChunkStore(h.root / "without", budget_bytes=10**9, trusted_publishers=[PUBLISHER.peer_id],
                                    fsync=False)
    return await without.connect(nursery)


@pytest.mark.parametrize("dial", [_unreachable, _without_it])
async def test_a_failed_manifest_ask_goes_at_once_to_another_holder_that_named_the_version(
        tmp_path: Path, clock, monkeypatch, dial: Dial) -> None:
    """HOLDER, a member, names the version first and cannot give it (unreachable, or it answers
    that it does not hold it); the publisher, a member too, names it a second later, while that
    ask is in flight (unreachable: the connection attempt times out at 3 s) or has failed (not
    held): the publisher is asked as the failure comes, and the version comes from it. Before,
    the role told the core nothing of such a failure, and the version waited for another
    `Holding` (none here: the 600 s limit)."""
    h, asked, _ = await _version_from_holdings(tmp_path, monkeypatch, [(0.0, HOLDER), (1.0, PUBLISHER.peer_id)],
                                               holder=dial)
    at = 3.0 if dial is _unreachable else 1.0  # (not held: the answer comes at once, before the publisher's `Holding`)
    assert asked == [(0.0, HOLDER), (pytest.approx(at), PUBLISHER.peer_id)]
    assert h.role.fetched_from.get(PUBLISHER.peer_id) == CHUNKS


async def _newer_status(h: Harness, nursery: trio.Nursery) -> trio.abc.Stream:
    """HOLDER is a newer peer: it answers our manifest ask with a status this peer does not know."""
    ours, theirs = trio.testing.memory_stream_pair()

    async def serve() -> None:
        reader = FrameReader(theirs, max_frame_bytes=REQUEST.size)
        request = ChunkRequest.unpack(await read_frame(reader))
        await send_frame(theirs, ChunkResponse(request.request_id, NEWER_STATUS, 0, 0).pack())

    nursery.start_soon(serve)
    return ours


async def test_an_answer_with_a_status_we_do_not_know_asks_another_holder_and_holds_nothing_against_it(
        tmp_path: Path, clock, monkeypatch) -> None:
    """HOLDER, a member, names the version first and answers our ask with a status a newer peer
    may add (an old peer cannot tell what it means: `p2pnet.wire`'s evolution rule): the
    publisher, naming it a second later, is asked at once, and HOLDER is neither excluded nor
    banned. Before, any status but OK counted as "not held", which excluded HOLDER (`exclude_s`)."""
    h, asked, _ = await _version_from_holdings(tmp_path, monkeypatch, [(0.0, HOLDER), (1.0, PUBLISHER.peer_id)],
                                               holder=_newer_status)
    assert asked == [(0.0, HOLDER), (pytest.approx(1.0), PUBLISHER.peer_id)]
    assert h.role.fetched_from.get(PUBLISHER.peer_id) == CHUNKS
    core = h.role.core
    assert HOLDER not in core._banned and core._excluded.get(HOLDER, 0.0) <= 1.0
