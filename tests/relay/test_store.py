"""The chunk store: atomic verified puts, restart, garbage collection, budget, export."""

import errno
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from p2pnet.errors import ConfigError
from p2pnet.identity import Identity
from relay.errors import ChunkCorrupt, ChunkMissing, ManifestRejected, StoreFull, VersionIncomplete, VersionUnknown
from relay.manifest import build_manifest, sign_manifest
from relay.store import TMP_PREFIX, ChunkStore, digest_of, pack_bitmap, unpack_bitmap

NOW = 1_800_000_000.0
TRAINER = Identity.from_seed_text("trainer")
TRUSTED = [TRAINER.peer_id]
CHUNK = 1024


def checkpoint(directory: Path, version: int, shared_seed: int = 0) -> list[Path]:
    """Two files; the first is identical across versions (shared chunks), the second is not."""
    directory.mkdir(parents=True, exist_ok=True)
    frozen = directory / "frozen.safetensors"
    moving = directory / "moving.safetensors"
    save_file({"frozen": np.random.default_rng(shared_seed).standard_normal(1024).astype(np.float32)}, str(frozen))
    save_file({"moving": np.full(700, version, dtype=np.float32)}, str(moving))
    return [frozen, moving]


def open_store(root: Path, **kwargs) -> ChunkStore:
    kwargs.setdefault("budget_bytes", 10**9)
    return ChunkStore(root, trusted_publishers=TRUSTED, fsync=False, **kwargs)


def publish(store: ChunkStore, tmp_path: Path, version: int):
    paths = checkpoint(tmp_path / f"src{version}", version)
    return store.publish_files(TRAINER, paths, model="tiny", version=version, previous_version=version - 1,
                               chunk_bytes=CHUNK, now_s=NOW)


def chunk_files(root: Path) -> list[Path]:
    return [p for p in (root / "chunks").rglob("*") if p.is_file()]


def test_publish_then_export_is_byte_identical(tmp_path):
    store = open_store(tmp_path / "store")
    signed = publish(store, tmp_path, 1)
    assert store.is_complete(signed) and store.complete_versions() == [1] and store.missing(signed) == []
    out = store.export_version(1, tmp_path / "out")
    for src, dst in zip(checkpoint(tmp_path / "again", 1), out):
        assert src.name == dst.name and src.read_bytes() == dst.read_bytes()
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(TMP_PREFIX)]


def test_put_chunk_with_wrong_digest_is_rejected_and_nothing_is_written(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(ChunkCorrupt) as info:
        store.put_chunk(digest_of(b"right"), b"wrong", sender="12D3peer")
    assert info.value.sender == "12D3peer" and info.value.reason == "chunk_corrupt"
    assert chunk_files(tmp_path) == [] and not store.has_chunk(digest_of(b"right"))
    with pytest.raises(ChunkCorrupt):
        store.put_chunk(b"short", b"short")


def test_put_read_and_duplicates(tmp_path):
    store = open_store(tmp_path)
    digest = digest_of(b"hello")
    assert store.put_chunk(digest, b"hello") is True
    assert store.put_chunk(digest, memoryview(b"hello")) is False
    assert store.read_chunk(digest) == b"hello" and store.used_bytes == 5
    assert store.chunk_path(digest).read_bytes() == b"hello"
    with pytest.raises(ChunkMissing):
        store.read_chunk(digest_of(b"other"))


def test_restart_resumes_keeps_chunks_and_cleans_temp_files(tmp_path):
    store = open_store(tmp_path / "s")
    signed = publish(store, tmp_path, 1)
    held = chunk_files(tmp_path / "s")
    stray = held[0].with_name(TMP_PREFIX + held[0].name + ".123")
    stray.write_bytes(b"half a chunk")
    (tmp_path / "s" / "manifests" / (TMP_PREFIX + "x")).write_bytes(b"half")
    again = open_store(tmp_path / "s")
    assert not stray.exists() and sorted(chunk_files(tmp_path / "s")) == sorted(held)
    assert again.manifests() == [signed] and again.is_complete(signed)
    assert again.used_bytes == store.used_bytes


def test_partial_download_resumes_after_restart(tmp_path):
    source = open_store(tmp_path / "src")
    signed = publish(source, tmp_path, 1)
    sink = open_store(tmp_path / "sink")
    sink.add_manifest(signed)
    digests = signed.manifest.chunk_digests
    for i in range(0, len(digests), 2):
        sink.put_chunk(digests[i], source.read_chunk(digests[i]))
    resumed = open_store(tmp_path / "sink")
    assert resumed.missing(signed) == list(range(1, len(digests), 2))
    bits = unpack_bitmap(resumed.have_bitmap(signed), len(digests))
    assert bits == [i % 2 == 0 for i in range(len(digests))]
    assert resumed.progress(signed)["chunks_have"] == (len(digests) + 1) // 2
    with pytest.raises(VersionIncomplete):
        resumed.export_version(1, tmp_path / "out")


def test_rotten_chunk_is_deleted_on_read_and_by_verify_all(tmp_path):
    store = open_store(tmp_path)
    signed = publish(store, tmp_path, 1)
    first, second = signed.manifest.chunk_digests[:2]
    store.chunk_path(first).write_bytes(b"bit rot")
    store.chunk_path(second).write_bytes(b"more rot")
    with pytest.raises(ChunkMissing):
        store.read_chunk(first)
    assert not store.has_chunk(first) and not store.chunk_path(first).exists()
    assert open_store(tmp_path).verify_all() == [second]
    assert open_store(tmp_path).missing(signed) == [0, 1]


def test_untrusted_stored_manifest_is_skipped_not_deleted(tmp_path):
    store = open_store(tmp_path)
    publish(store, tmp_path, 1)
    other = ChunkStore(tmp_path, budget_bytes=10**9, trusted_publishers=[Identity.from_seed_text("x").peer_id])
    assert other.manifests() == [] and len(list((tmp_path / "manifests").iterdir())) == 1
    assert len(other.load(TRUSTED)) == 1


def test_conflicting_manifest_for_a_held_version_is_rejected(tmp_path):
    store = open_store(tmp_path)
    signed = publish(store, tmp_path, 1)
    assert store.add_manifest(signed) is False
    other = sign_manifest(TRAINER, build_manifest(checkpoint(tmp_path / "o", 9), model="tiny", version=1,
                                                  chunk_bytes=CHUNK, now_ms=0), NOW)
    with pytest.raises(ManifestRejected, match="version_conflict"):
        store.add_manifest(other)
    with pytest.raises(ConfigError):
        publish(store, tmp_path, 1)


def test_gc_keeps_last_k_versions_and_shared_chunks_once(tmp_path):
    store = open_store(tmp_path, keep_versions=2)
    versions = [publish(store, tmp_path, v) for v in (1, 2, 3, 4)]
    shared = set(versions[0].manifest.chunk_digests) & set(versions[3].manifest.chunk_digests)
    assert shared  # the frozen file's chunks are stored once
    assert len(chunk_files(tmp_path)) == len({d for s in versions for d in s.manifest.chunk_digests})
    summary = store.collect()
    assert summary["dropped_versions"] == [1, 2] and store.versions() == [3, 4]
    kept = {d for s in versions[2:] for d in s.manifest.chunk_digests}
    assert {bytes.fromhex(p.name) for p in chunk_files(tmp_path)} == kept
    assert all(store.has_chunk(d) for d in shared)
    assert store.export_version(3, tmp_path / "o3")[1].read_bytes() == checkpoint(tmp_path / "c3", 3)[1].read_bytes()
    assert open_store(tmp_path, keep_versions=2).versions() == [3, 4]
    assert not store.should_fetch(2) and store.should_fetch(5)


def test_gc_keeps_an_incomplete_newer_version(tmp_path):
    store = open_store(tmp_path, keep_versions=1)
    publish(store, tmp_path, 1)
    source = open_store(tmp_path / "src")
    newer = publish(source, tmp_path, 2)
    store.add_manifest(newer)
    store.put_chunk(newer.manifest.chunk_digests[-1], source.read_chunk(newer.manifest.chunk_digests[-1]))
    store.collect()
    assert store.versions() == [1, 2] and store.complete_versions() == [1]
    assert store.has_chunk(newer.manifest.chunk_digests[-1])


def test_store_full_on_budget_leaves_no_partial_file(tmp_path):
    store = open_store(tmp_path, budget_bytes=3000)
    with pytest.raises(StoreFull):
        publish(store, tmp_path, 1)
    assert not [p for p in chunk_files(tmp_path) if p.name.startswith(TMP_PREFIX)]
    assert store.versions() == [] and store.used_bytes <= 3000
    assert store.used_bytes == sum(p.stat().st_size for p in chunk_files(tmp_path))


def test_budget_drops_older_versions_but_never_the_newest(tmp_path):
    probe = open_store(tmp_path / "probe")
    one = publish(probe, tmp_path, 1)
    store = open_store(tmp_path / "s", keep_versions=3, budget_bytes=int(probe.used_bytes * 1.8))
    for v in (1, 2, 3):
        publish(store, tmp_path, v)
    assert store.versions() == [2, 3]
    assert store.used_bytes <= store.budget_bytes and one.manifest.total_bytes > 0


def test_enospc_becomes_store_full_with_no_partial_file(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    real_open = open

    class Full:
        def __init__(self, path, mode):
            self.fh = real_open(path, mode)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            self.fh.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("builtins.open", lambda path, mode="r", *a, **k: Full(path, mode) if "w" in mode
                        else real_open(path, mode, *a, **k))
    with pytest.raises(StoreFull):
        store.put_chunk(digest_of(b"x" * 100), b"x" * 100)
    monkeypatch.undo()
    assert chunk_files(tmp_path) == [] and store.used_bytes == 0


def test_unknown_version_and_bitmaps(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(VersionUnknown):
        store.manifest(7)
    with pytest.raises(VersionUnknown):
        store.export_version(7, tmp_path / "o")
    assert pack_bitmap([True, False] * 5) == bytes([0b10101010, 0b10000000])
    assert unpack_bitmap(b"\xff", 10) == [True] * 8 + [False, False]


def test_concurrent_puts_from_threads(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    store = open_store(tmp_path)
    blobs = [os.urandom(500) for _ in range(40)] * 2
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda b: store.put_chunk(digest_of(b), b), blobs))
    assert store.used_bytes == 40 * 500 and len(chunk_files(tmp_path)) == 40


def test_batched_fsync_serves_staged_chunks_and_a_restart_drops_unflushed_ones(tmp_path):
    root = tmp_path / "store"
    store = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, fsync_batch_chunks=4)
    chunks = [os.urandom(CHUNK) + bytes([i]) for i in range(6)]
    digests = [digest_of(c) for c in chunks]
    for digest, data in zip(digests, chunks):
        store.put_chunk(digest, data)
    # the first batch of 4 was flushed under final names; the last 2 wait under temp names
    assert all(store.has_chunk(d) for d in digests)
    assert store.read_chunk(digests[5]) == chunks[5]
    final = {p.name for p in (root / "chunks").rglob("*") if p.is_file() and not p.name.startswith(TMP_PREFIX)}
    assert {d.hex() for d in digests[:4]} <= final and digests[5].hex() not in final
    del store  # a crash before flush: staged chunks were never durable, so they must be fetched again
    again = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, fsync_batch_chunks=4)
    assert [again.has_chunk(d) for d in digests] == [True] * 4 + [False] * 2
    assert not [p for p in (root / "chunks").rglob(f"{TMP_PREFIX}*")]
    for digest, data in zip(digests[4:], chunks[4:]):
        again.put_chunk(digest, data)
    assert again.flush() == 2
    assert all(again.has_chunk(d) for d in digests)
