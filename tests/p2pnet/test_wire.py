"""The codec: round trips, every rejection reason, and a fuzzer that sees only MessageRejected."""

from dataclasses import dataclass

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pnet.errors import MessageRejected
from p2pnet.identity import Identity
from p2pnet.messages import Capacity, Heartbeat
from p2pnet.wire import DOMAIN, SIGNATURE_BYTES, WIRE_VERSION, Codec, message

NOW = 1_800_000_000.0
ALICE = Identity.from_seed_text("alice")
MALLORY = Identity.from_seed_text("mallory")


@message("test/sample", max_bytes=600)
@dataclass(frozen=True)
class Sample:
    number: int
    ratio: float
    name: str
    blob: bytes
    flags: tuple[bool, ...]
    maybe: int | None
    pair: tuple[str, int]


def beat(seq: int = 1) -> Heartbeat:
    return Heartbeat(seq, 5, ("/ip4/127.0.0.1/tcp/1/p2p/x",), "127.0.0.1:2", ("relay",), Capacity(10, 20, 30))


def test_round_trip_keeps_every_field_and_names_the_sender():
    codec = Codec(ALICE)
    body = Sample(-7, 0.25, "név", b"\x00\xff", (True, False), None, ("a", 3))
    envelope = Codec(None).decode(codec.encode(body, NOW), NOW)
    assert envelope.body == body
    assert envelope.sender == ALICE.peer_id
    assert envelope.kind == "test/sample"
    assert envelope.ts_ms == int(NOW * 1000)


def test_encoding_is_deterministic():
    codec = Codec(ALICE)
    assert codec.encode(beat(), NOW) == codec.encode(beat(), NOW)


def test_encode_refuses_an_oversized_body():
    with pytest.raises(ValueError, match="exceeds"):
        Codec(ALICE).encode(Sample(1, 1.0, "x" * 1000, b"", (), None, ("", 0)), NOW)


def reason_of(frame: bytes, now: float = NOW) -> str:
    with pytest.raises(MessageRejected) as info:
        Codec(None).decode(frame, now)
    return info.value.reason


def resign(identity: Identity, payload_items: list) -> bytes:
    payload = cbor2.dumps(payload_items, canonical=True)
    return payload + identity.sign(DOMAIN + payload)


def test_each_kind_of_bad_frame_has_its_reason():
    good = Codec(ALICE).encode(beat(), NOW)
    assert reason_of(b"") == "unsigned"
    assert reason_of(b"\xff" * 100) == "garbage"
    assert reason_of(b"x" * (5 * 1024 * 1024)) == "oversized"
    tampered = bytearray(good)
    tampered[good.index(b"127.0.0.1:2") + 1] ^= 1  # a character of the data address: still well-formed CBOR
    assert reason_of(bytes(tampered)) == "bad_signature"
    assert reason_of(good[:-SIGNATURE_BYTES] + MALLORY.sign(DOMAIN + good[:-SIGNATURE_BYTES])) == "bad_signature"
    assert reason_of(good, now=NOW + 3600) == "stale"
    assert reason_of(good, now=NOW - 3600) == "stale"
    pid = ALICE.peer_id_bytes
    assert reason_of(resign(ALICE, [WIRE_VERSION, "no/such/kind", pid, int(NOW * 1000), []])) == "unknown_type"
    assert reason_of(resign(ALICE, [99, "heartbeat", pid, int(NOW * 1000), []])) == "bad_version"
    assert reason_of(resign(ALICE, [WIRE_VERSION, "heartbeat", pid, int(NOW * 1000), [1, 2]])) == "invalid_field"
    assert reason_of(resign(ALICE, [WIRE_VERSION, "heartbeat", b"short", int(NOW * 1000), []])) == "bad_sender"
    big = resign(ALICE, [WIRE_VERSION, "heartbeat", pid, int(NOW * 1000), ["x" * 5000]])
    assert reason_of(big) == "oversized"


def test_body_invariants_are_checked_on_decode():
    pid = ALICE.peer_id_bytes
    fields = [-1, 5, [], "127.0.0.1:2", [], [1, 2, 3]]  # seq must be >= 0
    assert reason_of(resign(ALICE, [WIRE_VERSION, "heartbeat", pid, int(NOW * 1000), fields])) == "invalid_field"
    fields = [1, 5, [], "a", [], [-1, 2, 3]]  # capacity must be >= 0
    assert reason_of(resign(ALICE, [WIRE_VERSION, "heartbeat", pid, int(NOW * 1000), fields])) == "invalid_field"


VALID = [Codec(ALICE).encode(beat(seq), NOW) for seq in range(1, 4)] + [
    Codec(ALICE).encode(Sample(1, 2.5, "s", b"b", (True,), 3, ("p", 1)), NOW)
]


@st.composite
def hostile_frames(draw):
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return draw(st.binary(max_size=2048))
    base = bytearray(draw(st.sampled_from(VALID)))
    if choice == 1:  # flip bytes
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(base) - 1))
            base[i] = draw(st.integers(0, 255))
        return bytes(base)
    if choice == 2:  # cut or extend
        cut = draw(st.integers(0, len(base)))
        return bytes(base[:cut]) + draw(st.binary(max_size=64))
    # valid CBOR of the wrong shape, signed correctly: must fail on structure, not crash
    items = draw(st.lists(st.one_of(st.integers(), st.text(max_size=8), st.binary(max_size=8),
                                     st.floats(), st.none(), st.lists(st.integers(), max_size=4)), max_size=6))
    shape = [WIRE_VERSION, draw(st.sampled_from(["heartbeat", "test/sample", "zzz"])),
             ALICE.peer_id_bytes, int(NOW * 1000), items]
    return resign(ALICE, shape)


@settings(max_examples=10_000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(hostile_frames())
def test_decoder_raises_only_message_rejected_on_hostile_input(frame):
    codec = Codec(None)
    try:
        codec.decode(frame, NOW)
    except MessageRejected:
        pass
