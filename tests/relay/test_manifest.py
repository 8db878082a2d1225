"""The checkpoint format: building, signing, opening, and a fuzzer that sees only named errors."""

import dataclasses
import json
import struct
from pathlib import Path

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from p2pnet.errors import ConfigError, MessageRejected
from p2pnet.identity import Identity
from relay.errors import ManifestRejected, NotSafetensors
from relay.manifest import (FileEntry, Manifest, TensorEntry, build_manifest, chunk_count, chunk_range,
                            chunks_of_file, open_manifest, sign_manifest)

NOW = 1_800_000_000.0
TRAINER = Identity.from_seed_text("trainer")
MALLORY = Identity.from_seed_text("mallory")
TRUSTED = {TRAINER.peer_id}


def write_checkpoint(directory: Path, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    first = directory / "model-00001-of-00002.safetensors"
    second = directory / "model-00002-of-00002.safetensors"
    save_file({"embed.weight": rng.standard_normal((37, 11)).astype(np.float32),
               "norm.bias": np.arange(5, dtype=np.int64)}, str(first), metadata={"format": "np"})
    save_file({"head.weight": rng.standard_normal((23, 7)).astype(np.float16)}, str(second))
    return [first, second]


def small_manifest(tmp_path: Path, chunk_bytes: int = 1000) -> Manifest:
    return build_manifest(write_checkpoint(tmp_path), model="tiny", version=3, previous_version=2,
                          chunk_bytes=chunk_bytes, now_ms=int(NOW * 1000))


def test_build_indexes_files_and_hashes_each_chunk_of_the_concatenation(tmp_path):
    paths = write_checkpoint(tmp_path)
    m = build_manifest(paths, model="tiny", version=3, previous_version=2, chunk_bytes=1000, now_ms=7)
    blob = b"".join(p.read_bytes() for p in paths)
    assert m.total_bytes == len(blob) and chunk_count(m) == -(-len(blob) // 1000)
    for i, digest in enumerate(m.chunk_digests):
        start, end = chunk_range(m, i)
        assert digest == blake3.blake3(blob[start:end]).digest()
    assert [f.name for f in m.files] == [p.name for p in paths]
    assert m.files[1].offset == m.files[0].size
    embed = next(t for t in m.files[0].tensors if t.name == "embed.weight")
    assert (embed.dtype, embed.shape, embed.end - embed.start) == ("F32", (37, 11), 37 * 11 * 4)
    raw = paths[0].read_bytes()[embed.start:embed.end]
    assert np.frombuffer(raw, np.float32).shape == (37 * 11,)
    assert list(chunks_of_file(m, m.files[1]))[-1] == chunk_count(m) - 1


def test_chunk_boundaries_do_not_depend_on_file_boundaries(tmp_path):
    paths = write_checkpoint(tmp_path)
    whole = build_manifest(paths, model="m", version=0, chunk_bytes=64, now_ms=0)
    assert len(whole.chunk_digests) == -(-whole.total_bytes // 64)
    with pytest.raises(IndexError):
        chunk_range(whole, len(whole.chunk_digests))


@pytest.mark.parametrize("threads, block", [(1, 1 << 20), (4, 1 << 20), (4, 7), (3, 1000)])
def test_chunks_hashed_side_by_side_are_the_chunks_of_the_concatenation(tmp_path, monkeypatch, threads, block):
    """Any number of hashing threads and any read block give every chunk's digest of the
    concatenation: chunks inside one file, across files, across an empty file, the short last one."""
    import relay.manifest as manifest_module

    monkeypatch.setattr(manifest_module, "HASH_THREADS", threads)
    monkeypatch.setattr(manifest_module, "READ_BLOCK_BYTES", block)
    paths = write_checkpoint(tmp_path)
    rng = np.random.default_rng(5)
    for name, size in (("empty.bin", 0), ("config.json", 17), ("shard.bin", 5000)):
        (tmp_path / name).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        paths.insert(1, tmp_path / name)
    blob = b"".join(p.read_bytes() for p in paths)
    m = build_manifest(paths, model="m", version=0, chunk_bytes=999, now_ms=0)
    assert m.total_bytes == len(blob)
    assert list(m.chunk_digests) == [blake3.blake3(blob[i:i + 999]).digest() for i in range(0, len(blob), 999)]


def test_a_file_cut_short_while_it_is_hashed_is_refused_by_name(tmp_path, monkeypatch):
    """A file that is shorter when hashed than when indexed (its writer truncated it) is named in a
    ConfigError, not published with digests of other bytes."""
    import relay.manifest as manifest_module

    paths = write_checkpoint(tmp_path)
    (tmp_path / "shard.bin").write_bytes(bytes(range(256)) * 10)
    paths.insert(1, tmp_path / "shard.bin")
    sizes = {p.name: p.stat().st_size + (100 if p.name == "shard.bin" else 0) for p in paths}
    monkeypatch.setattr(manifest_module, "_file_size", lambda fh: sizes[Path(fh.name).name])
    with pytest.raises(ConfigError, match="shard.bin: changed while it was being published: 2560 bytes read"):
        build_manifest(paths, model="m", version=0, chunk_bytes=64, now_ms=0)


@pytest.mark.parametrize("content, problem", [
    (b"", "shorter"),
    (b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "header length"),
    (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
    (struct.pack("<Q", 3) + b"{x}", "not JSON"),
    (struct.pack("<Q", 2) + b"\xff\xfe", "not JSON"),
])
def test_non_safetensors_input_is_refused_clearly(tmp_path, content, problem):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(NotSafetensors, match=problem) as info:
        build_manifest([path], model="m", version=0, now_ms=0)
    assert isinstance(info.value, ConfigError)


def test_tensor_out_of_file_and_missing_file_are_refused(tmp_path):
    header = json.dumps({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 8)
    with pytest.raises(NotSafetensors, match="beyond"):
        build_manifest([path], model="m", version=0, now_ms=0)
    with pytest.raises(ConfigError, match="no such file"):
        build_manifest([tmp_path / "nope.safetensors"], model="m", version=0, now_ms=0)


def test_sign_and_open_round_trip(tmp_path):
    m = small_manifest(tmp_path)
    signed = sign_manifest(TRAINER, m, NOW)
    opened = open_manifest(signed.frame, trusted_publishers=TRUSTED, now_s=NOW + 5 * 365 * 86400)
    assert opened == signed and opened.manifest == m and opened.publisher == TRAINER.peer_id
    assert opened.manifest_id == blake3.blake3(signed.frame).digest() and opened.version == 3


def test_unknown_signer_is_rejected(tmp_path):
    signed = sign_manifest(MALLORY, small_manifest(tmp_path), NOW)
    with pytest.raises(ManifestRejected) as info:
        open_manifest(signed.frame, trusted_publishers=TRUSTED, now_s=NOW)
    assert info.value.reason == "untrusted_publisher" and info.value.sender == MALLORY.peer_id


def test_tampered_manifest_is_rejected(tmp_path):
    frame = bytearray(sign_manifest(TRAINER, small_manifest(tmp_path), NOW).frame)
    frame[len(frame) // 2] ^= 0x01
    with pytest.raises(ManifestRejected) as info:
        open_manifest(bytes(frame), trusted_publishers=TRUSTED, now_s=NOW)
    assert isinstance(info.value, MessageRejected)


def test_manifest_from_the_future_is_rejected(tmp_path):
    frame = sign_manifest(TRAINER, small_manifest(tmp_path), NOW + 3600).frame
    with pytest.raises(ManifestRejected) as info:
        open_manifest(frame, trusted_publishers=TRUSTED, now_s=NOW)
    assert info.value.reason == "stale"


def test_other_message_kinds_are_not_manifests():
    from p2pnet.messages import Capacity, Heartbeat
    from p2pnet.wire import Codec

    frame = Codec(TRAINER).encode(Heartbeat(1, 1, (), "x:1", (), Capacity(1, 1, 1)), NOW)
    with pytest.raises(ManifestRejected, match="wrong_kind"):
        open_manifest(frame, trusted_publishers=TRUSTED, now_s=NOW)


def entry(name="a.safetensors", size=10, offset=0, tensors=()):
    return FileEntry(name, size, offset, tensors)


@pytest.mark.parametrize("change", [
    lambda: dict(files=(entry(name="../evil"),)),
    lambda: dict(files=(entry(name="/etc/passwd"),)),
    lambda: dict(files=(entry(name=".."),)),
    lambda: dict(files=(entry(name=".hidden"),)),
    lambda: dict(files=(entry(), entry(offset=10))),  # duplicate names
    lambda: dict(files=(entry(offset=1),)),
    lambda: dict(total_bytes=11),
    lambda: dict(chunk_digests=(b"\x00" * 32,)),
    lambda: dict(chunk_digests=(b"\x00" * 31, b"\x00" * 32)),
    lambda: dict(chunk_bytes=0),
    lambda: dict(version=2, previous_version=2),
    lambda: dict(previous_version=-2),
    lambda: dict(model=""),
    lambda: dict(files=()),
    lambda: dict(files=(entry(tensors=(TensorEntry("t", "F32", (1,), 4, 12),)),)),
    lambda: dict(files=(entry(size=5, tensors=(TensorEntry("t", "F32", (1,), 0, 4),)),
                        entry(name="b", size=5, offset=5, tensors=(TensorEntry("t", "F32", (1,), 0, 4),)))),
])
def test_manifest_invariants(change):
    base = dict(model="m", version=3, previous_version=2, files=(entry(),), chunk_bytes=4, total_bytes=10,
                chunk_digests=(b"\x00" * 32,) * 3, created_ms=0)
    Manifest(**base)
    with pytest.raises(ValueError):
        Manifest(**{**base, **change()})


def test_invalid_manifest_signed_by_trusted_key_is_rejected(tmp_path):
    """A trusted publisher's frame that breaks an invariant is still refused on decode."""
    from p2pnet.wire import spec_of

    m = small_manifest(tmp_path)
    codec_frame = sign_manifest(TRAINER, m, NOW).frame
    fields = spec_of(m).to_wire(m)
    fields[5] += 1  # total_bytes
    import cbor2
    from p2pnet.wire import DOMAIN, SIGNATURE_BYTES, WIRE_VERSION

    payload = cbor2.dumps([WIRE_VERSION, "relay/manifest", TRAINER.peer_id_bytes, int(NOW * 1000), fields],
                          canonical=True)
    frame = payload + TRAINER.sign(DOMAIN + payload)
    assert len(frame) == len(codec_frame) and len(frame[-SIGNATURE_BYTES:]) == SIGNATURE_BYTES
    with pytest.raises(ManifestRejected) as info:
        open_manifest(frame, trusted_publishers=TRUSTED, now_s=NOW)
    assert info.value.reason == "invalid_field"


@pytest.fixture(scope="module")
def good_frame(tmp_path_factory):
    return sign_manifest(TRAINER, small_manifest(tmp_path_factory.mktemp("ckpt"), chunk_bytes=256), NOW).frame


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_frames_raise_only_manifest_rejected(good_frame, data):
    mode = data.draw(st.sampled_from(["flip", "truncate", "splice", "random"]))
    frame = bytearray(good_frame)
    if mode == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            frame[data.draw(st.integers(0, len(frame) - 1))] ^= data.draw(st.integers(1, 255))
    elif mode == "truncate":
        frame = frame[:data.draw(st.integers(0, len(frame) - 1))]
    elif mode == "splice":
        at = data.draw(st.integers(0, len(frame)))
        frame[at:at] = data.draw(st.binary(max_size=64))
    else:
        frame = bytearray(data.draw(st.binary(max_size=512)))
    try:
        open_manifest(bytes(frame), trusted_publishers=TRUSTED, now_s=NOW)
    except ManifestRejected:
        pass


def test_fuzzed_headers_raise_only_not_safetensors(tmp_path):
    """build_manifest on hostile safetensors headers: NotSafetensors or a valid manifest."""
    rng = np.random.default_rng(1)
    path = tmp_path / "x.safetensors"
    good = write_checkpoint(tmp_path)[0].read_bytes()
    for _ in range(300):
        blob = bytearray(good)
        for _ in range(rng.integers(1, 6)):
            blob[rng.integers(0, min(len(blob), 200))] = rng.integers(0, 256)
        path.write_bytes(bytes(blob[: rng.integers(0, len(blob) + 1)]))
        try:
            build_manifest([path], model="m", version=0, now_ms=0)
        except NotSafetensors:
            pass


def test_manifest_is_frozen(tmp_path):
    with pytest.raises(dataclasses.FrozenInstanceError):
        small_manifest(tmp_path).version = 9  # type: ignore[misc]
