"""A manifest asked of a holder that cannot answer yet, through the relay role's real
`_fetch_manifest`, `open_stream` and address wait and a real serving peer over the in-memory
wire, virtual time (MockClock): we learn of version 1 only from `Holding`s, none comes after
the first of each holder (at scale a holder gossips one every few minutes), and the version
must still come (`relay.announce`, `manifest_failed` and `_asks_instead`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from p2pnet.handshake import NotAdmitted
from p2pnet.wire import Envelope
from relay.effects import FetchManifest
from relay.failures import NO_ADDRESS_GRACE_S
from relay.messages import HeldVersion, Holding
from tests.relay.test_role_address_wait import ADDRESS, Table
from tests.relay.test_role_idle_connections import SourcePeer, start
from tests.relay.test_role_store_faults import (  # noqa: F401 (fixture)
    CHUNKS, PUBLISHER, Harness, inline_threads, publish)

GHOST = "12D3KooWghost"  # sends `Holding` and never a heartbeat: no member, no address
WAIT_S = 10.0  # the role's wait for a manifest (`request_timeout_s`), its address wait included


@pytest.fixture
def clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def _version_from_holdings(tmp_path: Path, monkeypatch, holdings: list[tuple[float, str]],
                                 refusals: int = 0) -> tuple[Harness, list[tuple[float, str]], list[str]]:
    """Version 1 is held by its publisher (a member, whose address we know) and named to us only
    by `holdings` ((seconds in, sender): the publisher or GHOST, one `Holding` each); the
    publisher's data plane refuses our first `refusals` connections as not admitted (it has not
    heard our heartbeat). Run until the version is complete (a 600 s limit): the harness, the
    manifest asks ((seconds in, of whom)) and the peers sent our heartbeat (`Node.introduce`)."""
    h = Harness(tmp_path, max_concurrent_downloads=8, request_timeout_s=WAIT_S)
    table = Table(h.node.peertable)
    h.node.peertable = table
    table.learn(PUBLISHER.peer_id, ADDRESS)  # the publisher's heartbeat came; the ghost's never does
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
        del h.role.open_stream  # the role's own: waits for the address in the peer table
        fetch_manifest = h.role._fetch_manifest
        started = trio.current_time()

        async def counted(ask: FetchManifest) -> None:
            asked.append((trio.current_time() - started, ask.peer))
            await fetch_manifest(ask)

        h.role._fetch_manifest = counted

        async def open_data_stream(address: str, channel: str, *, codec, peer: str) -> trio.abc.Stream:
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
