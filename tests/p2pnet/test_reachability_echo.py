"""A data-plane dial-back answered OK counts only if our data plane echoed that ask's nonce: the
answering peer learns the nonce from the ask itself, so without the check one peer answering OK
without dialling made a peer behind NAT, whose every honest answer was FAILED, say reachable (and
relays would plan a peer nobody can dial as a parent). And an answer comes within the ask's
deadline, whatever the asker's addresses do."""

from __future__ import annotations

import time

import trio

from p2pnet.identity import Identity
from p2pnet.messages import DialBackAnswer, DialResult
from p2pnet.reachability import Reachability
from p2pnet.wire import Codec

US = Identity.from_seed_text("behind a NAT, perhaps")
HONEST, LIAR, DIALLER = (Identity.from_seed_text(n) for n in ("honest", "liar", "dialler"))


class Host:
    def __init__(self, answer) -> None:
        self.answer = answer

    def set_request_handler(self, *args, **kwargs) -> None:
        pass

    def addrs(self):
        return [f"/ip4/10.0.0.9/tcp/4001/p2p/{US.peer_id}"]

    async def request(self, peer, protocol, frame, timeout_s):
        ask = Codec(US).decode(frame, time.time()).body
        identity, data, libp2p = await self.answer(peer, ask.nonce)
        return Codec(identity).encode(DialBackAnswer(ask.nonce, int(data), int(libp2p)), time.time())


class DataPlane:
    address = "10.0.0.9:4002"

    def register(self, channel, handler, known_only=True) -> None:
        self.handler = handler


class Stream:
    def __init__(self) -> None:
        self.sent = b""

    async def send_all(self, data: bytes) -> None:
        self.sent += data


class Reader:
    def __init__(self, frame: bytes) -> None:
        self._frame = frame

    async def frame(self) -> bytes:
        return self._frame


def reachability(answer) -> Reachability:
    node = type("Node", (), {"host": Host(answer), "dataplane": DataPlane(), "codec": Codec(US)})()
    return Reachability(node, interval_s=60.0)


async def test_an_ok_that_never_reached_our_data_plane_is_not_believed():
    async def answer(peer, nonce):
        if peer == HONEST.peer_id:
            return HONEST, DialResult.FAILED, DialResult.FAILED  # it dialled and could not reach us
        return LIAR, DialResult.OK, DialResult.OK  # it dialled nothing

    r = reachability(answer)
    await r._probe(HONEST.peer_id)
    await r._probe(LIAR.peer_id)
    assert (r.state.data, r.state.reachable) == (False, False)


async def test_an_ok_after_our_data_plane_echoed_the_nonce_is_believed():
    echoed = []

    async def answer(peer, nonce):  # it dials our data plane and sends the nonce, which we echo
        stream = Stream()
        await r.node.dataplane.handler(stream, Reader(nonce), DIALLER.peer_id)
        echoed.append(stream.sent.endswith(nonce))
        return DIALLER, DialResult.OK, DialResult.OK

    r = reachability(answer)
    await r._probe(DIALLER.peer_id)
    assert echoed == [True] and (r.state.data, r.state.libp2p, r.state.reachable) == (True, True, True)


def test_an_asker_whose_dials_all_hang_is_answered_within_the_asks_deadline(monkeypatch):
    """An asker behind a firewall that drops SYNs, with its data plane and four libp2p addresses at
    its IP: dialled one after another (5 s each) the answer took 30 s, the ask gave up at 15 and the
    asker stayed unknown. Side by side, it is answered FAILED, within the deadline."""
    import trio.testing

    from p2pnet import reachability
    from p2pnet.messages import DialBackAsk

    async def never_answers(host, port, **kwargs):
        await trio.sleep_forever()

    monkeypatch.setattr(trio, "open_tcp_stream", never_answers)  # (the data plane's dial goes through it too)
    asker = Identity.from_seed_text("asker")
    server = type("Node", (), {"host": Host(None), "dataplane": DataPlane(), "codec": Codec(HONEST)})()

    async def main():
        r = Reachability(server, interval_s=60.0)
        addrs = tuple(f"/ip4/198.51.100.7/tcp/{4001 + i}/p2p/{asker.peer_id}" for i in range(4))
        ask = Codec(asker).encode(DialBackAsk(b"n" * 16, "198.51.100.7:4000", addrs), time.time())
        with trio.fail_after(reachability.ASK_TIMEOUT_S):  # as the request handler's deadline
            frame = await r._answer(ask, asker.peer_id, "198.51.100.7")
        answer = Codec(HONEST).decode(frame, time.time()).body
        assert (DialResult(answer.data), DialResult(answer.libp2p)) == (DialResult.FAILED, DialResult.FAILED)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
