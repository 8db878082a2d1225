"""Hostile bytes on a real peer's libp2p protocols (direct frames on `MSG_PROTOCOL`, dial-back
asks on `DIALBACK_PROTOCOL`) from a real attacking peer: each stream ends, at worst, reset; the
victim keeps hearing an honest peer's heartbeats and keeps answering dial-back asks.

Seeded (a failing run names its seed). The streams' own deadlines (10 s, 15 s) are not waited
for here: every hostile stream is written whole, or cut short by the attacker (a reset or a
close), so each ends at once; nothing is timed.
"""

from __future__ import annotations

import random
import time

import trio

import p2pnet.reachability
from p2pnet.host import MSG_PROTOCOL
from p2pnet.identity import Identity
from p2pnet.messages import DialBackAnswer, DialBackAsk
from p2pnet.node import PeerConfig, run_node
from p2pnet.peertable import PeerTableConfig
from p2pnet.reachability import DIALBACK_PROTOCOL
from p2pnet.wire import Codec

SEED = 20261205
FAST = PeerTableConfig(heartbeat_interval_s=0.2, expiry_s=5.0)
SLACK_S = 20.0


async def start(nursery: trio.Nursery, tmp_path, name: str, bootstrap=()):
    return await nursery.start(lambda task_status: run_node(
        PeerConfig(data_dir=tmp_path / name, bootstrap=tuple(bootstrap)), peertable_config=FAST,
        identity=Identity.from_seed_text(name), task_status=task_status))


async def write_and_end(attacker, victim, protocol: str, payload: bytes, end: str) -> bytes:
    """One stream: `payload`, then `end` it ("close" or "reset" at once, or "read" what the
    victim writes back until it closes or resets the stream: returned)."""
    from libp2p.peer.id import ID

    with trio.fail_after(SLACK_S):
        stream = await attacker.host._host.new_stream(ID.from_base58(victim.peer_id), [protocol])
        out = b""
        try:
            if payload:
                await stream.write(payload)
            if end == "reset":
                await stream.reset()
            elif end == "close":
                await stream.close()
            else:
                while data := await stream.read(1 << 16):
                    out += data
        except Exception:  # noqa: BLE001 - the end of the stream (py-libp2p raises StreamEOF), or the victim's reset
            pass
        return out


def hostile_payloads(rng: random.Random, valid: bytes, max_frame_bytes: int) -> list[bytes]:
    framed = len(valid).to_bytes(4, "big") + valid
    out = [rng.randbytes(n) for n in (0, 1, 3, 4, 5, 17, 200, 1000)]  # (a)
    out += [framed[:rng.randrange(len(framed))] + rng.randbytes(rng.randrange(1, 32)) for _ in range(8)]  # (b)
    for length in (0, 1, max_frame_bytes, max_frame_bytes + 1, 2**32 - 1):  # (c)
        out.append(length.to_bytes(4, "big") + rng.randbytes(min(length, 512)))
    for _ in range(12):  # (d)
        mutated = bytearray(framed)
        for _ in range(rng.randrange(1, 3)):
            mutated[rng.randrange(4, len(mutated))] ^= 1 << rng.randrange(8)
        out.append(bytes(mutated))
    return out


async def test_hostile_direct_frames_and_dial_back_asks_stop_nothing(tmp_path, nursery, monkeypatch):
    monkeypatch.setattr(p2pnet.reachability, "ASK_SPACING_S", 0.0)  # every ask of the attacker's is dialled
    victim = await start(nursery, tmp_path, "victim")
    attacker = await start(nursery, tmp_path, "attacker", [victim.host.addrs()[0]])
    honest = await start(nursery, tmp_path, "honest", [victim.host.addrs()[0]])
    with trio.fail_after(SLACK_S):
        while victim.peertable.get(honest.peer_id) is None or victim.peertable.get(attacker.peer_id) is None:
            await trio.sleep(0.05)
    rng = random.Random(SEED)
    codec = Codec(attacker.identity)
    ask = DialBackAsk(b"n" * 16, "127.0.0.1:1", ("/ip4/127.0.0.1/tcp/1",))
    cases: list[tuple[str, bytes]] = []
    for protocol in (MSG_PROTOCOL, DIALBACK_PROTOCOL):
        valid = codec.encode(ask, time.time())
        cases += [(protocol, p) for p in hostile_payloads(rng, valid, victim.host.max_frame_bytes)]
    for i, (protocol, payload) in enumerate(cases):
        for end in ("close", "reset"):
            await write_and_end(attacker, victim, protocol, payload, end)
    # an ask whose addresses are text the attacker chose: answered (refused), never a reset
    for data_addr, addrs in (("127.0.0.1:\u00b2", ("/ip4/127.0.0.1/tcp/\u00b2",)),
                             ("a" * 64 + ".example:80", ("/ip4/127.0.0.1/tcp/99999",)),
                             ("\u0663:1", ("/ip4/127.0.0.1/tcp/\u0663",))):
        frame = codec.encode(DialBackAsk(rng.randbytes(16), data_addr, addrs), time.time())
        answer = await write_and_end(attacker, victim, DIALBACK_PROTOCOL, len(frame).to_bytes(4, "big") + frame,
                                     "read")
        assert answer, (SEED, data_addr)
        envelope = codec.decode(answer[4:], time.time())
        assert isinstance(envelope.body, DialBackAnswer) and envelope.sender == victim.peer_id
    # still alive: an honest heartbeat arrives after the attack
    seen = victim.peertable.get(honest.peer_id).last_heard
    with trio.fail_after(SLACK_S):
        while victim.peertable.get(honest.peer_id).last_heard == seen:
            await trio.sleep(0.05)
    assert victim.stats["rejected"] > 0
    nursery.cancel_scope.cancel()
