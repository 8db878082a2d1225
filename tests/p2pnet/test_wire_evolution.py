"""Two versions of the peer talk: the codec's evolution rule (p2pnet.wire's docstring).

Frames are built by hand the way a peer one version apart would have built them (canonical CBOR,
signed over DOMAIN || payload), then decoded by today's codec; the last test sends one between
two real peers over loopback and waits for the receiver's peer table to admit the sender."""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import cbor2
import pytest
import trio

from p2pnet.errors import MessageRejected
from p2pnet.identity import Identity
from p2pnet.messages import Capacity, Heartbeat
from p2pnet.node import Node, PeerConfig, run_node
from p2pnet.peertable import PeerTableConfig
from p2pnet.wire import DOMAIN, WIRE_VERSION, Codec, message, signed_payload

NOW = 1_800_000_000.0
ALICE = Identity.from_seed_text("evolution-alice")
ADDR = "/ip4/127.0.0.1/tcp/1/p2p/x"


@dataclass(frozen=True)
class Part:
    size: int
    label: str = "none"  # a field a later version added


@dataclass(frozen=True)
class KeywordInner:
    a: int = field(default=0, kw_only=True)


@message("test/evolving", max_bytes=1024)
@dataclass(frozen=True)
class Evolving:
    part: Part
    parts: tuple[Part, ...]
    maybe: Part | None
    pair: tuple[str, int]
    tags: tuple[str, ...] = field(default_factory=tuple)


def signed(identity: Identity, kind: str, fields: Any, ts_s: float = NOW) -> tuple[bytes, bytes]:
    """(frame, payload) of `fields` as any version of the codec would sign them."""
    payload = cbor2.dumps([WIRE_VERSION, kind, identity.peer_id_bytes, int(ts_s * 1000), fields], canonical=True)
    return payload + identity.sign(DOMAIN + payload), payload


def decode(identity: Identity, kind: str, fields: Any) -> Any:
    frame, _ = signed(identity, kind, fields)
    return Codec(None).decode(frame, NOW).body


def rejection(identity: Identity, kind: str, fields: Any) -> str:
    with pytest.raises(MessageRejected) as info:
        decode(identity, kind, fields)
    return info.value.reason


# seq, started_ms, addrs, data_addr, roles, capacity, reachable, name: a heartbeat before interval_ms
OLD_BEAT = [3, 5, [ADDR], "127.0.0.1:2", ["relay"], [10, 20, 30], True, "old"]


def test_a_heartbeat_from_before_interval_ms_decodes_with_the_default():
    beat = decode(ALICE, "heartbeat", OLD_BEAT)
    assert beat == Heartbeat(3, 5, (ADDR,), "127.0.0.1:2", ("relay",), Capacity(10, 20, 30), True, "old")
    assert beat.interval_ms == 0
    older = decode(ALICE, "heartbeat", OLD_BEAT[:6])  # before reachable and name too
    assert (older.reachable, older.name, older.interval_ms) == (None, "", 0)


def test_fields_of_a_newer_version_are_ignored_without_their_types_being_checked():
    for extra in (7, "text", None, [1, [2, "x"]], {"a": b"b"}, -(2**70)):
        beat = decode(ALICE, "heartbeat", OLD_BEAT + [1500, extra])
        assert beat.interval_ms == 1500 and beat.name == "old"
    two_more = decode(ALICE, "heartbeat", OLD_BEAT + [1500, 1, 2])
    assert two_more == decode(ALICE, "heartbeat", OLD_BEAT + [1500])


def test_nested_structs_follow_the_same_rule_in_every_position():
    body = decode(ALICE, "test/evolving", [[1], [[2], [3, "three", "newer"]], [4, "four", 9.5], ["p", 1]])
    assert body == Evolving(Part(1), (Part(2), Part(3, "three")), Part(4, "four"), ("p", 1), ())
    assert body.part.label == "none"  # an older peer's struct: the default
    newest = decode(ALICE, "test/evolving", [[1, "a", 0], [], None, ["p", 1], ["t"], {"later": 1}])
    assert newest == Evolving(Part(1, "a"), (), None, ("p", 1), ("t",))


def test_nested_structs_evolve_alone_inside_a_message_of_our_own_version():
    """The message carries exactly its declared fields; only one struct inside it is a version
    apart, in each position in turn (so the old exact-count codec fails on that struct itself)."""
    exact: list[Any] = [[1, "a"], [], None, ["p", 1], []]
    cases = [("part", [1], Part(1)), ("part", [1, "a", 7], Part(1, "a")),
             ("parts", [[2], [3, "b", b"x"]], (Part(2), Part(3, "b"))),
             ("maybe", [4], Part(4)), ("maybe", [4, "d", None], Part(4, "d"))]
    for name, value, expected in cases:
        fields = list(exact)
        fields[["part", "parts", "maybe"].index(name)] = value
        assert getattr(decode(ALICE, "test/evolving", fields), name) == expected
    assert rejection(ALICE, "test/evolving", [[1, "a"], [], [], ["p", 1], []]) == "invalid_field"  # size has no default


def test_a_missing_field_without_a_default_and_a_wrong_known_field_stay_invalid():
    assert rejection(ALICE, "heartbeat", OLD_BEAT[:5]) == "invalid_field"  # capacity has no default
    assert rejection(ALICE, "heartbeat", OLD_BEAT[:5] + [[10, 20]]) == "invalid_field"  # nor its download_bps
    assert rejection(ALICE, "heartbeat", OLD_BEAT + ["1500"]) == "invalid_field"  # interval_ms is known: typed
    assert rejection(ALICE, "heartbeat", OLD_BEAT + [10**10]) == "invalid_field"  # and its invariant holds
    assert rejection(ALICE, "test/evolving", [[], [], None, ["p", 1]]) == "invalid_field"  # Part needs size
    assert rejection(ALICE, "test/evolving", [[1], [], None, ["p", 1, 2]]) == "invalid_field"  # a fixed tuple is exact
    assert rejection(ALICE, "test/evolving", [[1], [], None]) == "invalid_field"  # pair has no default
    assert rejection(ALICE, "heartbeat", {"seq": 1}) == "invalid_field"  # fields are an array


def test_the_envelope_keeps_the_payload_as_signed_not_a_re_encoding():
    frame, payload = signed(ALICE, "heartbeat", OLD_BEAT + [1500, "from the future"])
    envelope = Codec(None).decode(frame, NOW)
    assert envelope.payload == payload and signed_payload(envelope) == payload
    reencoded = Codec(ALICE).encode(envelope.body, NOW)[:-64]
    assert reencoded != payload  # which is why nothing may hash or check a re-encoding


def test_registration_refuses_fields_that_have_no_position():
    with pytest.raises(TypeError, match="keyword-only"):
        @message("test/keyword-only", max_bytes=256)
        @dataclass(frozen=True)
        class KeywordOnly:
            a: int
            _: KW_ONLY
            b: int

    with pytest.raises(TypeError, match="keyword-only"):
        @message("test/keyword-only-inner", max_bytes=256)
        @dataclass(frozen=True)
        class Outer:
            inner: KeywordInner



def test_registration_refuses_a_default_no_sender_could_send():
    with pytest.raises(TypeError, match="wire can carry"):
        @message("test/default-nan", max_bytes=256)
        @dataclass(frozen=True)
        class NanDefault:
            a: int
            b: tuple[int, ...] = ()
            c: float = float("nan")  # encodes, but decoding refuses a non-finite float

    with pytest.raises(TypeError, match="decodes as"):
        @message("test/default-list", max_bytes=256)
        @dataclass(frozen=True)
        class ListDefault:
            a: int
            b: tuple[int, ...] = field(default_factory=list)  # type: ignore[arg-type]  # comes back a tuple

    with pytest.raises(TypeError, match="wire can carry"):
        @message("test/default-wrong-type", max_bytes=256)
        @dataclass(frozen=True)
        class WrongType:
            a: int
            b: str = 3  # type: ignore[assignment]

    @message("test/default-fine", max_bytes=256)
    @dataclass(frozen=True)
    class Fine:
        a: int
        b: tuple[str, ...] = ()
        c: float | None = None
        d: bytes = b""

    assert Fine.KIND == "test/default-fine"  # type: ignore[attr-defined]

# -- end to end: an old peer's heartbeat admits it to a new peer's table --------------------------

OLD_PEER = Identity.from_seed_text("evolution-old-peer")
NEW_PEER = Identity.from_seed_text("evolution-new-peer")
DEADLINE_S = 60.0  # a loaded 2-core machine needs a few seconds, never this many


async def test_a_new_peer_admits_an_old_peer_from_its_old_format_heartbeat(tmp_path: Path) -> None:
    """The old peer's only way into the new peer's table is one hand-built heartbeat without
    `interval_ms`, sent as a direct frame: its own (current-format) heartbeats are dropped by a
    gossip gate on the receiver and come 600 s apart."""
    slow = PeerTableConfig(heartbeat_interval_s=600.0, expiry_s=3000.0, max_interval_s=600.0)
    async with trio.open_nursery() as peers:
        new: Node = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "new"), identity=NEW_PEER))
        new.add_gossip_gate(Heartbeat.KIND,  # type: ignore[attr-defined]
                            lambda frame: "lost" if new.codec.precheck(frame)[1] == OLD_PEER.peer_id else None)
        old: Node = await peers.start(partial(run_node, PeerConfig(data_dir=tmp_path / "old"),
                                              peertable_config=slow, identity=OLD_PEER))
        await old.host.connect(new.host.addrs()[0])
        fields = [41, 5, [str(a) for a in old.host.addrs()], "127.0.0.1:2", ["worker"], [1, 2, 3], None, "old"]
        frame, _ = signed(OLD_PEER, "heartbeat", fields, time.time())
        with trio.fail_after(DEADLINE_S):
            await old.host.send_frame(new.peer_id, frame, timeout_s=DEADLINE_S)
            assert await new.wait_for_peers(lambda: new.peertable.get(OLD_PEER.peer_id) is not None)
        entry = new.peertable.get(OLD_PEER.peer_id)
        assert entry is not None
        assert (entry.seq, entry.name, entry.roles, entry.interval_s) == (41, "old", ("worker",), 0.0)
        assert "invalid_field" not in new.rejections
        peers.cancel_scope.cancel()
