"""The data plane's handshake and its bounds: who we serve, who serves us, and what strangers get."""

import pytest
import trio
import trio.testing

from p2pnet.dataplane import DataPlane, DataPlaneLimits, open_data_stream, send_frame
from p2pnet.errors import MessageRejected, PeerUnavailable
from p2pnet.handshake import WrongPeer, client_handshake, server_handshake
from p2pnet.identity import Identity
from p2pnet.wire import Codec

SERVER = Identity.from_seed_text("server")
CLIENT = Identity.from_seed_text("client")
STRANGER = Identity.from_seed_text("stranger")


def admit_only(*peers):
    return lambda peer, channel: None if peer in peers else "unknown peer"


async def run_pair(client_side, server_side):
    a, b = trio.testing.memory_stream_pair()
    results = {}

    async def side(name, fn, stream):
        try:
            results[name] = await fn(stream)
        except Exception as exc:  # the test inspects what each side raised
            results[name] = exc
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(side, "client", client_side, a)
        nursery.start_soon(side, "server", server_side, b)
    return results


async def test_both_ends_learn_who_the_other_is():
    results = await run_pair(
        lambda s: client_handshake(s, Codec(CLIENT), "relay/chunks", SERVER.peer_id),
        lambda s: server_handshake(s, Codec(SERVER), SERVER.peer_id, admit_only(CLIENT.peer_id)))
    assert results == {"client": None, "server": (CLIENT.peer_id, "relay/chunks")}


async def test_an_address_that_is_another_peers_is_told_apart():
    results = await run_pair(
        lambda s: client_handshake(s, Codec(CLIENT), "relay/chunks", STRANGER.peer_id),
        lambda s: server_handshake(s, Codec(SERVER), SERVER.peer_id, admit_only(CLIENT.peer_id)))
    assert isinstance(results["client"], WrongPeer) and SERVER.peer_id in str(results["client"])
    assert isinstance(results["server"], MessageRejected) and results["server"].reason == "wrong_peer"


async def test_strangers_get_no_challenge():
    results = await run_pair(
        lambda s: client_handshake(s, Codec(STRANGER), "relay/chunks", SERVER.peer_id),
        lambda s: server_handshake(s, Codec(SERVER), SERVER.peer_id, admit_only(CLIENT.peer_id)))
    assert isinstance(results["server"], MessageRejected) and results["server"].reason == "not_admitted"
    assert isinstance(results["client"], PeerUnavailable)


async def test_a_recorded_handshake_cannot_be_replayed():
    """An eavesdropper replays a real client's hello and proof: the server's nonce is new, so
    the old proof does not answer it."""
    recorded = []

    class Recorder(trio.abc.Stream):
        def __init__(self, inner):
            self.inner = inner

        async def send_all(self, data):
            recorded.append(bytes(data))
            await self.inner.send_all(data)

        async def receive_some(self, max_bytes=None):
            return await self.inner.receive_some(max_bytes)

        async def wait_send_all_might_not_block(self):
            await self.inner.wait_send_all_might_not_block()

        async def send_eof(self):
            pass

        async def aclose(self):
            await self.inner.aclose()

    first = await run_pair(
        lambda s: client_handshake(Recorder(s), Codec(CLIENT), "relay/chunks", SERVER.peer_id),
        lambda s: server_handshake(s, Codec(SERVER), SERVER.peer_id, admit_only(CLIENT.peer_id)))
    assert first["server"] == (CLIENT.peer_id, "relay/chunks") and len(recorded) == 2

    async def replay(stream):
        await stream.send_all(recorded[0])  # the old hello
        await stream.receive_some(4096)  # a new challenge
        await stream.send_all(recorded[1])  # the old proof
        while await stream.receive_some(4096):
            pass

    again = await run_pair(replay, lambda s: server_handshake(s, Codec(SERVER), SERVER.peer_id,
                                                               admit_only(CLIENT.peer_id)))
    assert isinstance(again["server"], MessageRejected)


async def serve(nursery, limits=DataPlaneLimits(), known=(CLIENT.peer_id,)):
    plane = DataPlane("127.0.0.1", 0, codec=Codec(SERVER), self_id=SERVER.peer_id,
                      admit=lambda peer: None if peer in known else "not in our peer table", limits=limits)
    served = []

    async def echo(stream, reader, peer):
        served.append(peer)
        frame = await reader.frame()
        await send_frame(stream, frame)
        await trio.sleep_forever()

    plane.register("echo", echo)
    address = await nursery.start(plane.serve)
    return plane, address, served


async def test_the_data_plane_serves_known_peers_only_and_bounds_connections_per_peer():
    async with trio.open_nursery() as nursery:
        plane, address, served = await serve(nursery, DataPlaneLimits(max_connections_per_peer=2))
        streams = [await open_data_stream(address, "echo", codec=Codec(CLIENT), peer=SERVER.peer_id)
                   for _ in range(2)]
        for stream in streams:
            await send_frame(stream, b"hi")
        with trio.fail_after(10):
            while len(served) < 2:
                await trio.sleep(0.01)
        with pytest.raises(PeerUnavailable):  # a third from the same peer
            await open_data_stream(address, "echo", codec=Codec(CLIENT), peer=SERVER.peer_id)
        with pytest.raises(PeerUnavailable):
            await open_data_stream(address, "echo", codec=Codec(STRANGER), peer=SERVER.peer_id)
        assert served == [CLIENT.peer_id, CLIENT.peer_id]
        assert plane.connections() == {CLIENT.peer_id: 2}
        assert plane.refused == {"not_admitted": 2}
        nursery.cancel_scope.cancel()


async def test_handshakes_side_by_side_cannot_pass_the_bound_of_connections_per_peer():
    """The hello is checked against the count before the proof; hellos sent side by side all passed
    it before any connection was counted. Twelve at once under a bound of two: two served."""
    async with trio.open_nursery() as nursery:
        plane, address, served = await serve(nursery, DataPlaneLimits(max_connections_per_peer=2))
        opened, refused = [], []

        async def one() -> None:
            try:
                stream = await open_data_stream(address, "echo", codec=Codec(CLIENT), peer=SERVER.peer_id)
            except PeerUnavailable:
                refused.append(1)
                return
            opened.append(stream)
            try:
                await send_frame(stream, b"hi")
                await stream.receive_some(10)  # an echo, or b"" once the server closed it
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async with trio.open_nursery() as clients:
            for _ in range(12):
                clients.start_soon(one)
            with trio.fail_after(30):
                while len(opened) + len(refused) < 12 or sum(plane.refused.values()) + len(served) < 12:
                    await trio.sleep(0.01)
            clients.cancel_scope.cancel()
        assert len(served) == 2 and plane.connections() == {CLIENT.peer_id: 2}
        assert sum(plane.refused.values()) == 10
        nursery.cancel_scope.cancel()


async def test_a_connection_that_never_finishes_the_handshake_is_dropped():
    async with trio.open_nursery() as nursery:
        plane, address, _ = await serve(nursery, DataPlaneLimits(handshake_timeout_s=0.2, max_connections=1))
        host, port = address.rsplit(":", 1)
        idle = await trio.open_tcp_stream(host, int(port))  # says nothing
        with trio.fail_after(10):
            assert await idle.receive_some(10) == b""  # closed by the server at the deadline
        assert plane.refused == {"handshake_failed": 1}
        stream = await open_data_stream(address, "echo", codec=Codec(CLIENT), peer=SERVER.peer_id)
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_connections_that_stay_silent_cannot_crowd_out_more_than_their_ips_share():
    async with trio.open_nursery() as nursery:
        plane, address, _ = await serve(nursery, DataPlaneLimits(max_handshaking_per_ip=2, handshake_timeout_s=30))
        host, port = address.rsplit(":", 1)
        silent = [await trio.open_tcp_stream(host, int(port)) for _ in range(2)]
        extra = await trio.open_tcp_stream(host, int(port))
        with trio.fail_after(10):
            assert await extra.receive_some(10) == b""  # closed at once, not after 30 s
        assert plane.refused == {"too_many_handshakes": 1}
        for stream in silent:
            await stream.aclose()
        with trio.fail_after(10):  # their handshakes end; the IP's share is free again
            while True:
                try:
                    stream = await open_data_stream(address, "echo", codec=Codec(CLIENT), peer=SERVER.peer_id)
                    break
                except PeerUnavailable:
                    await trio.sleep(0.05)
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_an_address_that_answers_with_something_else_is_a_wrong_peer():
    async def not_a_data_plane(stream):
        await stream.receive_some(4096)
        await stream.send_all(b"\x00\x00\x00\x0bHTTP/1.1 200")  # a framed answer that is no handshake

    results = await run_pair(lambda s: client_handshake(s, Codec(CLIENT), "relay/chunks", SERVER.peer_id),
                             not_a_data_plane)
    assert isinstance(results["client"], WrongPeer) and "not a handshake" in str(results["client"])


@pytest.mark.parametrize("address", [
    "127.0.0.1:\u00b2",  # a digit to str.isdigit, not to int()
    "127.0.0.1:\u0663\u0660",  # decimal digits, but not ASCII: no port of ours
    "a" * 64 + ".example:80",  # a DNS label too long: the IDNA codec's UnicodeError
    "..:80",
    "\udcff:80",
    "127.0.0.1",
    ":80",
])
async def test_a_malformed_advertised_address_is_a_peer_unavailable_never_another_error(address):
    """A data address comes from the peer's signed heartbeat (only its length is checked): what
    it says may be anything, and dialling it must fail as that peer's unavailability, which every
    caller handles; any other error would stop the dialling role."""
    with pytest.raises(PeerUnavailable):
        await open_data_stream(address, "relay/chunks", codec=Codec(CLIENT), peer=SERVER.peer_id, timeout_s=10.0)


async def _stranger_connection(address: str, identity: Identity, channel: str, local_ip: str) -> trio.SocketStream:
    """A data connection from `local_ip` (any 127.x.y.z is this machine's), authenticated as
    `identity`: what any number of freshly made identities on a few addresses can open."""
    host, port = address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port), local_address=local_ip)
    await client_handshake(stream, Codec(identity), channel, SERVER.peer_id)
    return stream


async def test_strangers_on_a_channel_open_to_all_cannot_take_the_connections_of_known_peers(nursery):
    """A channel registered `known_only=False` (the dial-back echo) admits any identity, and
    identities cost nothing: connections to such channels are bounded per IP and in all, below
    `max_connections`, so strangers holding them open cannot refuse the known peers theirs."""
    limits = DataPlaneLimits(max_connections=8, max_open_channel_connections=4, max_open_channel_connections_per_ip=2)
    plane, address, served = await serve(nursery, limits)

    async def hold(stream, reader, peer):
        await trio.sleep_forever()

    plane.register("open", hold, known_only=False)
    held = []
    for i in range(12):  # 12 strangers from 3 addresses
        sybil = Identity.from_seed_text(f"sybil {i}")
        stream = await _stranger_connection(address, sybil, "open", f"127.0.0.{1 + i % 3}")
        held.append(stream)
    with trio.fail_after(10):
        while sum(plane.refused.values()) + plane._open < 12:  # each admitted or refused by now
            await trio.sleep(0.01)
    assert plane._open == 4 and plane.refused == {"too_many_open": 8}
    known = [await open_data_stream(address, "echo", codec=Codec(CLIENT), peer=SERVER.peer_id) for _ in range(4)]
    for stream in known:
        await send_frame(stream, b"hi")
    with trio.fail_after(10):
        while len(served) < 4:
            await trio.sleep(0.01)
    assert plane.connections()[CLIENT.peer_id] == 4
    for stream in held + known:
        await stream.aclose()
    nursery.cancel_scope.cancel()


async def test_strangers_from_one_address_take_at_most_its_share_of_a_channel_open_to_all(nursery):
    """Behind the bound in all, a bound per IP: strangers from one address (one host, or many
    behind one NAT) hold at most `max_open_channel_connections_per_ip` connections to channels
    open to all, and a stranger from another address is still served."""
    limits = DataPlaneLimits(max_connections=8, max_open_channel_connections=6, max_open_channel_connections_per_ip=2)
    plane, address, _ = await serve(nursery, limits)
    held_by = []

    async def hold(stream, reader, peer):
        held_by.append(peer)
        await trio.sleep_forever()

    plane.register("open", hold, known_only=False)
    streams = [await _stranger_connection(address, Identity.from_seed_text(f"sybil {i}"), "open", "127.0.0.1")
               for i in range(6)]
    with trio.fail_after(10):
        while sum(plane.refused.values()) + len(held_by) < 6:  # each admitted or refused by now
            await trio.sleep(0.01)
    assert len(held_by) == 2 and plane.refused == {"too_many_open": 4}
    other = Identity.from_seed_text("elsewhere")
    streams.append(await _stranger_connection(address, other, "open", "127.0.0.2"))
    with trio.fail_after(10):
        while other.peer_id not in held_by:
            await trio.sleep(0.01)
    assert len(held_by) == 3 and plane.refused == {"too_many_open": 4}
    for stream in streams:
        await stream.aclose()
    nursery.cancel_scope.cancel()
