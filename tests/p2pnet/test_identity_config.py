"""Identity files and typed configuration."""

import stat

import pytest

from p2pnet.config import from_mapping, load_toml
from p2pnet.errors import ConfigError, LocalStateError
from p2pnet.identity import Identity, load_or_create_identity, peer_id_from_str
from p2pnet.node import PeerConfig
from p2pnet.peertable import PeerTableConfig


def test_peer_id_is_derived_exactly_as_libp2p_derives_it():
    from libp2p.peer.id import ID

    identity = Identity.from_seed_text("x")
    assert ID.from_pubkey(identity.libp2p_key_pair().public_key).to_base58() == identity.peer_id
    assert peer_id_from_str(identity.peer_id) == identity.peer_id_bytes


def test_key_is_created_once_with_mode_0600_and_reused(tmp_path):
    first = load_or_create_identity(tmp_path / "d")
    mode = stat.S_IMODE((tmp_path / "d" / "identity.key").stat().st_mode)
    assert mode == 0o600
    assert load_or_create_identity(tmp_path / "d").peer_id == first.peer_id


def test_corrupt_key_file_is_a_clear_local_error(tmp_path):
    (tmp_path / "identity.key").write_bytes(b"short")
    with pytest.raises(LocalStateError, match="identity.key"):
        load_or_create_identity(tmp_path)


@pytest.mark.parametrize("values, field", [
    ({"heartbeat_interval_s": 0}, "peertable.heartbeat_interval_s"),
    ({"heartbeat_interval_s": "fast"}, "peertable.heartbeat_interval_s"),
    ({"expiry_s": 1.0}, "peertable.expiry_s"),
    ({"busy_heartbeat_factor": 0.5}, "peertable.busy_heartbeat_factor"),
    ({"no_such": 1}, "peertable.no_such"),
])
def test_bad_peertable_values_name_the_field(values, field):
    with pytest.raises(ConfigError) as info:
        from_mapping(PeerTableConfig, values, "peertable")
    assert info.value.field == field


def test_bad_peer_values_name_the_field(tmp_path):
    with pytest.raises(ConfigError) as info:
        from_mapping(PeerConfig, {"bootstrap": ["/ip4/1.2.3.4/tcp/1"]}, "peer", data_dir=tmp_path)
    assert info.value.field == "peer.bootstrap"
    with pytest.raises(ConfigError) as info:
        from_mapping(PeerConfig, {"roles": ["wizard"]}, "peer", data_dir=tmp_path)
    assert info.value.field == "peer.roles"


def test_toml_file_fills_config_and_flags_override(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('[peer]\nlisten = "/ip4/127.0.0.1/tcp/4001"\nupload_bps = 5\n[peertable]\nexpiry_s = 30\n')
    sections = load_toml(path)
    config = from_mapping(PeerConfig, sections["peer"], "peer", data_dir=tmp_path, upload_bps=7)
    assert config.listen == "/ip4/127.0.0.1/tcp/4001" and config.upload_bps == 7
    assert from_mapping(PeerTableConfig, sections["peertable"], "peertable").expiry_s == 30.0


def test_invalid_toml_is_a_config_error(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[peer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(path)


def test_signature_checker_passes_a_repeat_without_verifying_again_and_nothing_else(monkeypatch):
    from p2pnet.errors import MessageRejected
    from p2pnet.identity import SignatureChecker

    alice, mallory = Identity.generate(), Identity.generate()
    payload = b"heartbeat 1"
    signature = alice.sign(payload)
    checker = SignatureChecker(max_recent=2)
    checker.verify(alice.peer_id_bytes, payload, signature)
    calls = []
    real_check = checker._check
    monkeypatch.setattr(checker, "_check", lambda *a: (calls.append(a), real_check(*a)))
    checker.verify(alice.peer_id_bytes, payload, signature)  # the same bytes: remembered
    assert calls == []
    for sender, body, sig in [(mallory.peer_id_bytes, payload, signature),  # another sender
                              (alice.peer_id_bytes, b"heartbeat 2", signature)]:  # another payload
        with pytest.raises(MessageRejected):
            checker.verify(sender, body, sig)
    assert len(calls) == 2
    for i in range(2):  # two other passed checks push the first out of a memory of 2
        checker.verify(alice.peer_id_bytes, b"x%d" % i, alice.sign(b"x%d" % i))
    checker.verify(alice.peer_id_bytes, payload, signature)
    assert len(calls) == 5


def test_peer_id_text_is_base58_for_any_bytes_like_and_stays_right_past_its_memory():
    import base58

    from p2pnet.host import _peer_text
    from p2pnet.identity import PEER_TEXT_CACHED, peer_id_to_str

    ids = [Identity.from_seed_text(f"p{i}").peer_id_bytes for i in range(3)]
    for raw in ids:
        want = base58.b58encode(raw).decode("ascii")
        assert peer_id_to_str(raw) == peer_id_to_str(bytearray(raw)) == peer_id_to_str(memoryview(raw)) == want
        assert _peer_text(raw) == want
    # more ids than it remembers, then the first ones again: each text still its own id's
    many = [bytes([0, 36, 8, 1, 18, 32]) + i.to_bytes(32, "big") for i in range(PEER_TEXT_CACHED + 10)]
    texts = [peer_id_to_str(raw) for raw in many]
    assert len(set(texts)) == len(many)
    assert [peer_id_to_str(raw) for raw in many[:20]] == texts[:20]
    assert all(peer_id_from_str(text) == raw for text, raw in zip(texts[::997], many[::997]))


def test_an_identity_derives_its_peer_id_once_and_it_matches_the_key():
    identity = Identity.from_seed_text("once")
    assert identity.peer_id is identity.peer_id  # the same object: derived when the identity was made
    assert identity.peer_id_bytes == bytes([0, 36, 8, 1, 18, 32]) + identity.public_key
    assert Identity(identity.seed).peer_id == identity.peer_id
    assert Identity.from_seed_text("other").peer_id != identity.peer_id
