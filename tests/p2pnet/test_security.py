"""Only Noise-secured peers get in: a plaintext-only libp2p host cannot connect."""

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
