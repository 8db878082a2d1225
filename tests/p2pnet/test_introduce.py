"""A peer whose data plane refused us as unknown is sent our heartbeat directly (`Node.introduce`)
and admits us at the next try, long before our next scheduled heartbeat would have reached it.

Real peers over loopback (libp2p, the data plane's handshake). The server never takes the
client's gossiped heartbeats (a gossip gate drops them, as a restart or a lost heartbeat would
leave it), and the client's heartbeats are 600 s apart: only the introduction can make the
server admit it. Every wait is on a condition, under a deadline."""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import trio
from libp2p.peer.id import ID

from p2pnet.core import Connect
from p2pnet.dataplane import FrameReader, open_data_stream, send_frame
from p2pnet.errors import PeerUnavailable
from p2pnet.handshake import NotAdmitted
from p2pnet.identity import Identity
from p2pnet.messages import Heartbeat
from p2pnet.node import Node, PeerConfig, run_node
from p2pnet.peertable import PeerTableConfig

CHANNEL = "test/introduce"
SERVER = Identity.from_seed_text("introduce-server")
CLIENT = Identity.from_seed_text("introduce-client")
MIDDLE = Identity.from_seed_text("introduce-middle")
SLOW = PeerTableConfig(heartbeat_interval_s=600.0, expiry_s=3000.0, max_interval_s=600.0)
DEADLINE_S = 60.0  # each wait; a loaded 2-core machine needs a few seconds, never this many


async def start_server(nursery: trio.Nursery, tmp_path: Path, **config) -> Node:
    """A peer serving `CHANNEL` to the peers in its table (the data plane's default) that never
    takes the client's gossiped heartbeats."""
    server: Node = await nursery.start(partial(run_node, PeerConfig(data_dir=tmp_path / "server", **config),
                                               identity=SERVER))

    async def greet(stream: trio.SocketStream, reader: FrameReader, peer: str) -> None:
        await send_frame(stream, b"served " + peer.encode())

    server.dataplane.register(CHANNEL, greet)

    def lose_the_clients(frame: bytes) -> str | None:
        return "lost" if server.codec.precheck(frame)[1] == CLIENT.peer_id else None

    server.add_gossip_gate(Heartbeat.KIND, lose_the_clients)  # type: ignore[attr-defined]
    return server


async def served(client: Node, server: Node) -> bytes | None:
    """What the server says on a data connection of ours."""
    stream = await open_data_stream(server.dataplane.address, CHANNEL, codec=client.codec, peer=server.peer_id)
    async with stream:
        return await FrameReader(stream, max_frame_bytes=1024).frame()


async def refused_then_introduced(client: Node, server: Node) -> None:
    """The client is refused, introduces itself, and is served at the next try."""
    with trio.fail_after(DEADLINE_S):
        assert await client.wait_for_peers(lambda: client.peertable.get(server.peer_id) is not None)
    assert server.peertable.get(client.peer_id) is None
    with trio.fail_after(DEADLINE_S), pytest.raises(NotAdmitted):
        await served(client, server)
    with trio.fail_after(DEADLINE_S):
        assert await client.introduce(server.peer_id)
        assert await server.wait_for_peers(lambda: server.peertable.get(client.peer_id) is not None)
        assert await served(client, server) == b"served " + client.peer_id.encode()
    assert server.peertable.get(client.peer_id).seq == 1  # the client's first heartbeat, sent directly
    assert not await client.introduce(server.peer_id)  # once per heartbeat interval (600 s here)


async def test_a_connected_peer_that_refused_us_admits_us_once_introduced(tmp_path: Path) -> None:
    async with trio.open_nursery() as peers:
        server = await start_server(peers, tmp_path)
        client: Node = await peers.start(partial(
            run_node, PeerConfig(data_dir=tmp_path / "client", bootstrap=(server.host.addrs()[0],)),
            peertable_config=SLOW, identity=CLIENT))
        await refused_then_introduced(client, server)
        peers.cancel_scope.cancel()


async def test_a_peer_we_are_not_connected_to_is_dialled_then_sent_our_heartbeat(tmp_path: Path) -> None:
    """The client heard of the server only through a third peer and is not connected to it (its
    table asks for one connection only), and libp2p knows no address of it: the introduction
    dials the addresses of the server's heartbeat first, then sends (a Send alone fails here: a
    libp2p stream to a peer not connected dials only addresses libp2p knows)."""
    async with trio.open_nursery() as peers:
        middle: Node = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "middle"), identity=MIDDLE))
        client: Node = await peers.start(partial(
            run_node, PeerConfig(data_dir=tmp_path / "client", bootstrap=(middle.host.addrs()[0],)),
            peertable_config=replace(SLOW, target_connections=1), identity=CLIENT))
        with trio.fail_after(DEADLINE_S):  # its one connection asked for: the table dials nobody else
            assert await client.wait_for_peers(lambda: client.peertable.get(middle.peer_id) is not None)
        server = await start_server(peers, tmp_path, bootstrap=(middle.host.addrs()[0],))
        with trio.fail_after(DEADLINE_S):
            assert await client.wait_for_peers(lambda: client.peertable.get(server.peer_id) is not None)
        assert server.peer_id not in client.host.connected_peers()
        # py-libp2p may have kept addresses of the server it saw in gossip; nothing promises that
        # (a restarted source's are gone), so only the heartbeat's addresses are left to dial
        client.host._host.get_peerstore().clear_addrs(ID.from_base58(server.peer_id))
        await refused_then_introduced(client, server)
        assert server.peer_id in client.host.connected_peers()
        peers.cancel_scope.cancel()


@pytest.mark.parametrize("own_address_after", [False, True])
async def test_an_address_of_the_refusing_peer_where_another_peer_listens_is_not_taken_for_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, own_address_after: bool) -> None:
    """The server's heartbeat lists addresses where the middle peer listens: one naming the middle
    peer, one naming the server (as a stale address would after a NAT rebinding or a restart).
    Neither counts as reaching the server: with no other address the introduction fails, counted
    and logged as such; with the server's own address after them it goes through."""
    caplog.set_level(logging.INFO, logger="p2pnet.node")
    async with trio.open_nursery() as peers:
        middle: Node = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "middle"), identity=MIDDLE))
        client: Node = await peers.start(partial(
            run_node, PeerConfig(data_dir=tmp_path / "client", bootstrap=(middle.host.addrs()[0],)),
            peertable_config=replace(SLOW, target_connections=1), identity=CLIENT))
        with trio.fail_after(DEADLINE_S):
            assert await client.wait_for_peers(lambda: client.peertable.get(middle.peer_id) is not None)
        server = await start_server(peers, tmp_path, bootstrap=(middle.host.addrs()[0],))
        middles = middle.host.addrs()[0]
        stale = middles.split("/p2p/")[0] + "/p2p/" + server.peer_id
        listed = (middles, stale) + (tuple(server.host.addrs()) if own_address_after else ())
        server.peertable.set_local(replace(server.peertable.local, addrs=listed))  # from its next heartbeat on
        with trio.fail_after(DEADLINE_S):
            assert await client.wait_for_peers(
                lambda: (entry := client.peertable.get(server.peer_id)) is not None and entry.addrs == listed)
        assert server.peer_id not in client.host.connected_peers()
        client.host._host.get_peerstore().clear_addrs(ID.from_base58(server.peer_id))
        failed = client.stats["send_failed"]
        with trio.fail_after(DEADLINE_S):
            introduced = await client.introduce(server.peer_id)
        wrong = [r.getMessage() for r in caplog.records if "no longer belongs to" in r.getMessage()]
        assert len(wrong) == 1 and f"{middles}: the address no longer belongs to {server.peer_id}" in wrong[0]
        assert f"{stale}: the address no longer belongs to {server.peer_id}" in wrong[0]
        if own_address_after:
            assert introduced and client.stats["send_failed"] == failed
            with trio.fail_after(DEADLINE_S):
                assert await server.wait_for_peers(lambda: server.peertable.get(client.peer_id) is not None)
                assert await served(client, server) == b"served " + client.peer_id.encode()
        else:
            assert not introduced and client.stats["send_failed"] == failed + 1
            assert server.peer_id not in client.host.connected_peers()
            assert server.peertable.get(client.peer_id) is None
            # the Connect itself fails (the middle peer, connected already, is not the server): it is
            # never counted as reaching the server, as the Send after it alone would show
            with trio.fail_after(DEADLINE_S), pytest.raises(PeerUnavailable, match="no longer belongs to"):
                await client._perform(Connect(server.peer_id, listed))
        peers.cancel_scope.cancel()
