"""Only Noise-secured peers get in: a plaintext-only libp2p host cannot connect; a failed
handshake is ours to report, not a shout of py-libp2p's."""

import contextlib
import logging
from functools import partial

import multiaddr
import pytest
import trio

from p2pnet.identity import Identity
from p2pnet.node import PeerConfig, run_node


async def test_plaintext_only_peer_cannot_connect_but_a_noise_peer_can(tmp_path, nursery):
    from libp2p import new_host
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux

    node = await nursery.start(lambda task_status: run_node(PeerConfig(data_dir=tmp_path / "n"), task_status=task_status))
    target = info_from_p2p_addr(multiaddr.Multiaddr(node.host.addrs()[0]))

    key_pair = Identity.from_seed_text("plain").libp2p_key_pair()
    plain = new_host(key_pair=key_pair, sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)},
                     muxer_opt={YAMUX_ID: Yamux})
    listen = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    async with plain.run(listen_addrs=[listen]):
        with pytest.raises(Exception):
            with trio.fail_after(15):
                await plain.connect(target)
        assert node.peer_id not in [p.to_base58() for p in plain.get_connected_peers()]
        await plain.close()

    other = await nursery.start(lambda task_status: run_node(PeerConfig(data_dir=tmp_path / "m"), task_status=task_status))
    with trio.fail_after(15):
        assert await other.host.connect(node.host.addrs()[0]) == node.peer_id
    nursery.cancel_scope.cancel()


async def test_garbage_on_the_gossip_protocol_does_not_take_a_peer_down(tmp_path, nursery):
    """A peer that writes a non-protobuf pubsub RPC loses its stream; the victim keeps gossiping."""
    from p2pnet.peertable import PeerTableConfig

    fast = PeerTableConfig(heartbeat_interval_s=0.2, expiry_s=2.0)

    async def start(name, bootstrap=()):
        return await nursery.start(lambda task_status: run_node(
            PeerConfig(data_dir=tmp_path / name, bootstrap=tuple(bootstrap)), peertable_config=fast,
            task_status=task_status))

    victim = await start("victim")
    attacker = await start("attacker", [victim.host.addrs()[0]])
    honest = await start("honest", [victim.host.addrs()[0]])
    from libp2p.peer.id import ID

    from p2pnet.host import GOSSIP_PROTOCOL

    for _ in range(3):
        with trio.fail_after(15):
            stream = await attacker.host._host.new_stream(ID.from_base58(victim.peer_id), [GOSSIP_PROTOCOL])
            await stream.write(bytes([40]) + b"\xff" * 40)  # varint length 40, then no valid protobuf
            await trio.sleep(0.2)
    with trio.fail_after(20):
        while honest.peertable.get(victim.peer_id) is None or victim.peertable.get(honest.peer_id) is None:
            await trio.sleep(0.1)
    seen = victim.peertable.get(honest.peer_id).last_heard
    with trio.fail_after(20):
        while victim.peertable.get(honest.peer_id).last_heard == seen:
            await trio.sleep(0.1)  # heartbeats still arrive after the attack
    nursery.cancel_scope.cancel()


async def test_a_failed_security_handshake_is_named_in_our_log_and_not_shouted_in_libp2ps(tmp_path, nursery, caplog):
    """py-libp2p logs a dial whose security handshake fails as ERROR lines (2 for each of its 4
    tries when what answers speaks no libp2p), though the dial's caller gets the error: they are
    DEBUG lines now, and our own record (the bootstrap dial's warning) names the cause. A stranger
    who sends garbage to our libp2p port gets no ERROR line either (py-libp2p's is a DEBUG one
    already), and an ERROR line of py-libp2p's about anything else stays one."""
    caplog.set_level(logging.DEBUG)
    warned = trio.Event()

    class Warned(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.name == "p2pnet.connectivity" and record.levelno == logging.WARNING:
                warned.set()

    async def speaks_no_libp2p(stream: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(b"SSH-2.0-OpenSSH_9.6\r\n")

    listeners = await nursery.start(partial(trio.serve_tcp, speaks_no_libp2p, 0, host="127.0.0.1"))
    stranger = f"/ip4/127.0.0.1/tcp/{listeners[0].socket.getsockname()[1]}/p2p/" \
               f"{Identity.from_seed_text('stranger').peer_id}"
    handler = Warned()
    logging.getLogger("p2pnet.connectivity").addHandler(handler)
    try:
        node = await nursery.start(lambda task_status: run_node(
            PeerConfig(data_dir=tmp_path / "n", bootstrap=(stranger,)), task_status=task_status))
        with trio.fail_after(30):
            await warned.wait()
    finally:
        logging.getLogger("p2pnet.connectivity").removeHandler(handler)
    ours = [r.getMessage() for r in caplog.records if r.name == "p2pnet.connectivity" and r.levelno == logging.WARNING]
    assert len(ours) == 1 and "the security handshake failed: failed to negotiate the secure protocol" in ours[0], ours
    theirs = [r for r in caplog.records if r.name == "libp2p.network.swarm"
              and r.getMessage().startswith("failed to upgrade security for peer")]
    assert theirs and {r.levelno for r in theirs} == {logging.DEBUG}, [(r.levelname, r.getMessage()) for r in theirs]

    port = int(multiaddr.Multiaddr(node.host.addrs()[0]).value_for_protocol("tcp"))
    with trio.socket.socket() as scanner:
        await scanner.connect(("127.0.0.1", port))
        await scanner.send(b"\x16\x03\x01\x00\x05hello" + bytes(range(256)))
        with trio.fail_after(30), contextlib.suppress(ConnectionResetError):
            while await scanner.recv(1 << 16):  # until our peer closes the connection, the failure logged
                pass
    assert [r.getMessage() for r in caplog.records if r.name.startswith("libp2p") and r.levelno >= logging.ERROR] \
        == []

    logging.getLogger("libp2p.network.swarm").error("Error in background prune: %s", "a bug of py-libp2p's")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("libp2p") and r.levelno >= logging.ERROR] \
        == ["Error in background prune: a bug of py-libp2p's"]
    nursery.cancel_scope.cancel()
