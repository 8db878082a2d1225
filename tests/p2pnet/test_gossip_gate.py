"""Gossip is checked before it costs: signer and kind from the header, one signature check,
no body decode, before a frame is forwarded or decoded in full."""

import time
from types import SimpleNamespace

import cbor2
import pytest

from p2pnet.errors import MessageRejected
from p2pnet.identity import Identity
from p2pnet.messages import Capacity, Heartbeat
from p2pnet.node import Node
from p2pnet.wire import DOMAIN, WIRE_VERSION, Codec
from relay.errors import ManifestRejected
from relay.manifest import MANIFEST_KIND, open_manifest

ALICE = Identity.from_seed_text("alice")
MALLORY = Identity.from_seed_text("mallory")
NOW = time.time()


def beat() -> Heartbeat:
    return Heartbeat(1, 1, (), "127.0.0.1:1", ("relay",), Capacity(1, 1, 1))


def signed(identity: Identity, kind: str, fields: list) -> bytes:
    payload = cbor2.dumps([WIRE_VERSION, kind, identity.peer_id_bytes, int(NOW * 1000), fields], canonical=True)
    return payload + identity.sign(DOMAIN + payload)


def test_precheck_reads_kind_and_signer_without_the_body():
    frame = Codec(ALICE).encode(beat(), NOW)
    assert Codec(None).precheck(frame) == ("heartbeat", ALICE.peer_id)
    nonsense_body = signed(ALICE, "heartbeat", ["not", "a", "heartbeat"])  # precheck does not look inside
    assert Codec(None).precheck(nonsense_body) == ("heartbeat", ALICE.peer_id)
    tampered = bytearray(frame)
    tampered[-70] ^= 1
    for bad, reason in [(bytes(tampered), "bad_signature"), (b"\x85" + b"\x00" * 80, "garbage"),
                        (signed(ALICE, "no/such", []), "unknown_type"), (b"x" * 10, "unsigned")]:
        with pytest.raises(MessageRejected) as caught:
            Codec(None).precheck(bad)
        assert caught.value.reason == reason


def test_an_untrusted_manifest_is_refused_before_its_body_is_decoded():
    """A manifest-kind frame from an untrusted signer whose body is nonsense: refused as
    untrusted (the signer was checked first), not as an invalid field."""
    frame = signed(MALLORY, MANIFEST_KIND, [[0] * 5000])
    with pytest.raises(ManifestRejected) as caught:
        open_manifest(frame, trusted_publishers={ALICE.peer_id}, now_s=NOW)
    assert caught.value.reason == "untrusted_publisher"


def fake_node(gates=None, banned=()):
    return SimpleNamespace(codec=Codec(None), peer_id="me", _routes={"heartbeat": [object()]}, _gates=gates or {},
                           stats={}, peertable=SimpleNamespace(is_banned=lambda peer, now: peer in banned))


async def test_the_gossip_validator_forwards_only_signed_routed_unbanned_gated_frames():
    good = Codec(ALICE).encode(beat(), NOW)
    assert Node._gossip_ok(fake_node(), good, "fwd")
    assert not Node._gossip_ok(fake_node(banned={ALICE.peer_id}), good, "fwd")
    assert not Node._gossip_ok(fake_node(), good[:-1] + bytes([good[-1] ^ 1]), "fwd")  # bad signature
    assert not Node._gossip_ok(fake_node(), signed(ALICE, "notice", []), "fwd")  # a kind no core handles
    gated = fake_node(gates={"heartbeat": lambda frame: "not from a trusted publisher"})
    assert not Node._gossip_ok(gated, good, "fwd") and gated.stats == {"gated": 1}
