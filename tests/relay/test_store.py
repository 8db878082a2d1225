"""The store: a version is a folder of its files, written at chunk offsets, a crash-safe bitmap of
durable chunks, restart and lazy re-verification, publish and export without copies, garbage
collection and the budget."""

import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from p2pnet.errors import ConfigError
from p2pnet.identity import Identity
from relay.errors import ChunkCorrupt, ChunkMissing, ManifestRejected, StoreFull, VersionIncomplete, VersionUnknown
from relay.manifest import build_manifest, sign_manifest
from relay.store import TMP_PREFIX, ChunkRotten, ChunkStore, pack_bitmap, unpack_bitmap
from relay.versionfiles import VersionFiles
from tests.relay.disk import rot_chunk

NOW = 1_800_000_000.0
TRAINER = Identity.from_seed_text("trainer")
TRUSTED = [TRAINER.peer_id]
CHUNK = 1024


def checkpoint(directory: Path, version: int, shared_seed: int = 0) -> list[Path]:
    """Three files: the first identical across versions (shared chunks), the second not, the third
    not safetensors at all (it travels as bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    frozen = directory / "frozen.safetensors"
    moving = directory / "moving.safetensors"
    tokenizer = directory / "tokenizer.json"
    save_file({"frozen": np.random.default_rng(shared_seed).standard_normal(1024).astype(np.float32)}, str(frozen))
    save_file({"moving": np.full(700, version, dtype=np.float32)}, str(moving))
    tokenizer.write_text('{"vocab": {"a": 0, "b": 1}}' * 20)
    return [frozen, moving, tokenizer]


def open_store(root: Path, **kwargs) -> ChunkStore:
    kwargs.setdefault("budget_bytes", 10**9)
    kwargs.setdefault("fsync", False)
    return ChunkStore(root, trusted_publishers=TRUSTED, **kwargs)


def publish(store: ChunkStore, tmp_path: Path, version: int, **kwargs):
    paths = checkpoint(tmp_path / f"src{version}", version)
    return store.publish_files(TRAINER, paths, model="tiny", version=version, previous_version=version - 1,
                               chunk_bytes=CHUNK, now_s=NOW, **kwargs)


def fill(sink: ChunkStore, source: ChunkStore, version: int, indices) -> None:
    for i in indices:
        sink.put_chunk(version, i, source.read_chunk(version, i))


def test_a_published_version_is_its_files_and_export_hard_links_them(tmp_path):
    store = open_store(tmp_path / "store")
    signed = publish(store, tmp_path, 1)
    assert store.is_complete(signed) and store.complete_versions() == [1] and store.missing(signed) == []
    assert [f.name for f in signed.manifest.files] == ["frozen.safetensors", "moving.safetensors", "tokenizer.json"]
    assert signed.manifest.files[2].tensors == ()  # carried as bytes, not indexed
    folder = store.version_dir(1)
    sources = checkpoint(tmp_path / "again", 1)
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in sources)
    out = store.export_version(1, tmp_path / "out")
    for src, stored, exported in zip(sources, store.version_files(1), out):
        assert src.read_bytes() == stored.read_bytes() == exported.read_bytes()
        assert os.stat(stored).st_ino == os.stat(exported).st_ino  # a link, not a copy
        assert stored.stat().st_mode & 0o777 == 0o444
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(TMP_PREFIX)]


@pytest.mark.parametrize("place", ["link", "move", "copy"])
def test_publish_brings_the_files_in_as_asked(tmp_path, place):
    store = open_store(tmp_path / "store")
    paths = checkpoint(tmp_path / "src", 1)
    before = [(p.read_bytes(), os.stat(p).st_ino) for p in paths]
    store.publish_files(TRAINER, paths, model="m", version=1, chunk_bytes=CHUNK, now_s=NOW, place=place)
    for (data, inode), src, stored in zip(before, paths, store.version_files(1)):
        assert stored.read_bytes() == data
        if place == "move":
            assert not src.exists() and os.stat(stored).st_ino == inode
        elif place == "link":
            assert os.stat(stored).st_ino == inode and src.stat().st_mode & 0o777 == 0o444
        else:
            assert os.stat(stored).st_ino != inode and src.stat().st_mode & 0o777 != 0o444


def test_a_failed_publish_leaves_nothing_and_gives_moved_files_back(tmp_path):
    store = open_store(tmp_path / "store")
    paths = checkpoint(tmp_path / "src", 1)
    paths[1].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")  # a .safetensors file that is not one
    with pytest.raises(ConfigError, match="not a safetensors file"):
        store.publish_files(TRAINER, paths, model="m", version=1, chunk_bytes=CHUNK, now_s=NOW, place="move")
    assert all(p.exists() for p in paths)
    assert store.versions() == [] and list((tmp_path / "store" / "versions").iterdir()) == []
    with pytest.raises(ConfigError, match="no such file"):
        store.publish_files(TRAINER, [tmp_path / "nope.safetensors"], model="m", version=1, now_s=NOW)


def test_chunks_are_written_at_their_offsets_and_checked_first(tmp_path):
    source = open_store(tmp_path / "src")
    signed = publish(source, tmp_path, 1)
    sink = open_store(tmp_path / "sink")
    assert sink.add_manifest(signed) is True
    assert [p.stat().st_size for p in sink.version_files(1)] == [f.size for f in signed.manifest.files]
    good = source.read_chunk(1, 3)
    with pytest.raises(ChunkCorrupt) as info:
        sink.put_chunk(1, 3, b"x" + good[1:], sender="12D3peer")
    assert info.value.sender == "12D3peer" and info.value.reason == "chunk_corrupt"
    with pytest.raises(ChunkCorrupt):
        sink.put_chunk(1, 3, good[:-1])
    with pytest.raises(VersionUnknown):
        sink.put_chunk(2, 0, good)
    assert not sink.holds(1, 3) and sink.used_bytes == 0
    assert sink.put_chunk(1, 3, good) is True and sink.put_chunk(1, 3, memoryview(good)) is False
    assert sink.read_chunk(1, 3) == good and sink.used_bytes == len(good)
    fill(sink, source, 1, sink.missing(signed))
    assert sink.is_complete(signed)
    for mine, theirs in zip(sink.version_files(1), source.version_files(1)):
        assert mine.read_bytes() == theirs.read_bytes()


def test_segments_say_where_a_chunk_lies_even_across_two_files(tmp_path):
    store = open_store(tmp_path)
    signed = publish(store, tmp_path, 1)
    first_size = signed.manifest.files[0].size
    straddling = first_size // CHUNK  # starts in the first file, ends in the second
    assert first_size % CHUNK
    pieces = store.segments(1, straddling)
    assert [p[0].name for p in pieces] == ["frozen.safetensors", "moving.safetensors"]
    joined = b"".join(path.read_bytes()[offset:offset + length] for path, offset, length in pieces)
    assert joined == store.read_chunk(1, straddling)
    with pytest.raises(ChunkMissing):
        store.segments(2, 0)


def test_a_partial_download_resumes_after_restart_unverified_until_used(tmp_path):
    source = open_store(tmp_path / "src")
    signed = publish(source, tmp_path, 1)
    sink = open_store(tmp_path / "sink")
    sink.add_manifest(signed)
    count = len(signed.manifest.chunk_digests)
    fill(sink, source, 1, range(0, count, 2))
    (tmp_path / "sink" / "manifests" / (TMP_PREFIX + "x")).write_bytes(b"half")
    (tmp_path / "sink" / "versions" / "000000000009-orphan").mkdir()
    resumed = open_store(tmp_path / "sink")
    assert resumed.missing(signed) == list(range(1, count, 2))
    assert unpack_bitmap(resumed.have_bitmap(signed), count) == [i % 2 == 0 for i in range(count)]
    assert resumed.progress(signed)["chunks_have"] == (count + 1) // 2
    assert not resumed.is_verified(1, 0) and resumed.ensure_verified(1, 0) and resumed.is_verified(1, 0)
    assert sorted(p.name for p in (tmp_path / "sink" / "versions").iterdir()) == sorted(
        [resumed.version_dir(1).name, resumed.version_dir(1).name + ".have"])  # leftovers swept
    assert not list((tmp_path / "sink" / "manifests").glob(TMP_PREFIX + "*"))
    with pytest.raises(VersionIncomplete):
        resumed.export_version(1, tmp_path / "out")


def test_a_rotten_chunk_is_dropped_when_read_and_found_after_a_restart(tmp_path):
    store = open_store(tmp_path)
    told = []
    store.listener = told.append
    signed = publish(store, tmp_path, 1)
    rot_chunk(store, 1, 0)
    rot_chunk(store, 1, 1)
    with pytest.raises(ChunkMissing):
        store.read_chunk(1, 0)
    assert not store.holds(1, 0) and told == [ChunkRotten(1, 0)] and not store.is_complete(signed)
    again = open_store(tmp_path)
    assert again.missing(signed) == [0]  # the bitmap was rewritten without it
    assert not again.ensure_verified(1, 1) and again.missing(signed) == [0, 1]
    assert open_store(tmp_path).verify_all() == []


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_verify_hashes_side_by_side_and_drops_exactly_the_rotten_chunks(tmp_path, monkeypatch, threads):
    """However many threads hash, `verify` returns the rotten chunks in order, drops each once
    and tells each once; the good ones stay held and verified."""
    import relay.manifest as manifest_module

    monkeypatch.setattr(manifest_module, "HASH_THREADS", threads)
    store = open_store(tmp_path)
    told = []
    store.listener = told.append
    signed = publish(store, tmp_path, 1)
    count = len(signed.manifest.chunk_digests)
    bad = [1, 2, count - 1]
    for index in bad:
        rot_chunk(store, 1, index)
    assert count > 4 and store.verify(1, everything=True) == bad
    assert sorted(told, key=lambda e: e.index) == [ChunkRotten(1, i) for i in bad]
    assert store.missing(signed) == bad and all(store.is_verified(1, i) for i in range(count) if i not in bad)
    assert store.verify(1, everything=True) == []


def test_a_file_another_thread_closes_meanwhile_fails_no_read_nor_write(tmp_path, monkeypatch):
    """With at most one file open per version, a thread opening another file closes the one we are
    reading or writing with: each read and write uses a descriptor of its own, so neither fails
    (before, the read failed EBADF and a good chunk was dropped as rotten)."""
    import relay.versionfiles as versionfiles_module

    monkeypatch.setattr(versionfiles_module, "MAX_OPEN_FILES", 1)
    store = open_store(tmp_path)
    signed = publish(store, tmp_path, 1)
    files = store._versions[1].files
    last = len(signed.manifest.chunk_digests) - 1  # in the last file; chunk 0 is in the first
    expected = files.read_chunk(0)
    real_pread, real_pwrite = os.pread, os.pwrite

    def other_thread_opens_the_last_file() -> None:
        os.close(files._own_fd(files.segments(last)[-1].file))

    def pread(fd, n, offset):
        other_thread_opens_the_last_file()
        return real_pread(fd, n, offset)

    def pwrite(fd, data, offset):
        other_thread_opens_the_last_file()
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pread", pread)
    assert store.read_chunk(1, 0) == expected and store.holds(1, 0)
    monkeypatch.setattr(os, "pwrite", pwrite)
    files.write_chunk(0, expected)
    monkeypatch.setattr(os, "pread", real_pread)
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    assert store.verify(1, everything=True) == []


def test_export_re_verifies_the_whole_version(tmp_path):
    store = open_store(tmp_path)
    publish(store, tmp_path, 1)
    rot_chunk(store, 1, 2)
    with pytest.raises(ChunkMissing, match="corrupt on disk"):
        store.export_version(1, tmp_path / "out")
    assert not store.holds(1, 2)


def test_untrusted_stored_manifest_is_skipped_not_deleted(tmp_path):
    store = open_store(tmp_path)
    publish(store, tmp_path, 1)
    other = ChunkStore(tmp_path, budget_bytes=10**9, trusted_publishers=[Identity.from_seed_text("x").peer_id])
    assert other.manifests() == [] and len(list((tmp_path / "manifests").iterdir())) == 1
    assert len(list((tmp_path / "versions").iterdir())) == 2  # its files and bitmap stay too
    assert len(other.load(TRUSTED)) == 1 and other.complete_versions() == [1]


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


def test_shared_chunks_are_copied_from_a_held_version_not_fetched(tmp_path):
    source = open_store(tmp_path / "src")
    one, two = publish(source, tmp_path, 1), publish(source, tmp_path, 2)
    sink = open_store(tmp_path / "sink")
    sink.add_manifest(one)
    fill(sink, source, 1, range(len(one.manifest.chunk_digests)))
    sink.add_manifest(two)
    adopted = sink.adopt_shared(2)
    shared = [i for i, d in enumerate(two.manifest.chunk_digests) if d in set(one.manifest.chunk_digests)]
    assert adopted == shared and len(shared) >= 3  # the frozen file
    assert sink.missing(two) == [i for i in range(len(two.manifest.chunk_digests)) if i not in shared]


def test_gc_keeps_the_last_k_versions_and_removes_the_others_files(tmp_path):
    store = open_store(tmp_path, keep_versions=2)
    for v in (1, 2, 3, 4):
        publish(store, tmp_path, v)
    exported = store.export_version(1, tmp_path / "o1")
    old_folder = store.version_dir(1)
    summary = store.collect()
    assert summary["dropped_versions"] == [1, 2] and store.versions() == [3, 4]
    assert not old_folder.exists() and len(list((tmp_path / "versions").iterdir())) == 4
    assert exported[1].read_bytes() == checkpoint(tmp_path / "c1", 1)[1].read_bytes()  # a link outlives it
    assert store.used_bytes == sum(store.manifest(v).manifest.total_bytes for v in (3, 4))
    assert open_store(tmp_path, keep_versions=2).versions() == [3, 4]
    assert not store.should_fetch(2) and store.should_fetch(5)


def test_gc_keeps_an_incomplete_newer_version(tmp_path):
    store = open_store(tmp_path, keep_versions=1)
    publish(store, tmp_path, 1)
    source = open_store(tmp_path / "src")
    newer = publish(source, tmp_path, 2)
    store.add_manifest(newer)
    fill(store, source, 2, [len(newer.manifest.chunk_digests) - 1])
    store.collect()
    assert store.versions() == [1, 2] and store.complete_versions() == [1]


def test_over_budget_publish_is_refused_and_older_versions_make_room(tmp_path):
    store = open_store(tmp_path / "small", budget_bytes=3000)
    with pytest.raises(StoreFull):
        publish(store, tmp_path, 1)
    assert store.versions() == [] and list((tmp_path / "small" / "versions").iterdir()) == []
    probe = open_store(tmp_path / "probe")
    publish(probe, tmp_path, 1)
    store = open_store(tmp_path / "s", keep_versions=3, budget_bytes=int(probe.used_bytes * 1.8))
    for v in (1, 2, 3):
        publish(store, tmp_path, v)
    assert store.versions() == [3]  # each version is stored whole: two never fit
    assert store.used_bytes <= store.budget_bytes


def test_a_full_disk_is_store_full_and_nothing_is_held(tmp_path, monkeypatch):
    source = open_store(tmp_path / "src")
    signed = publish(source, tmp_path, 1)
    sink = open_store(tmp_path / "sink")
    sink.add_manifest(signed)

    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(StoreFull):
        fill(sink, source, 1, [0])
    monkeypatch.undo()
    assert not sink.holds(1, 0) and sink.used_bytes == 0
    assert open_store(tmp_path / "sink").missing(signed)[0] == 0


def test_concurrent_puts_from_threads(tmp_path):
    source = open_store(tmp_path / "src")
    signed = publish(source, tmp_path, 1)
    sink = open_store(tmp_path / "sink")
    sink.add_manifest(signed)
    count = len(signed.manifest.chunk_digests)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: sink.put_chunk(1, i, source.read_chunk(1, i)), list(range(count)) * 2))
    assert sink.is_complete(signed) and sink.used_bytes == signed.manifest.total_bytes
    assert [p.read_bytes() for p in sink.version_files(1)] == [p.read_bytes() for p in source.version_files(1)]


def test_batched_fsync_a_crash_loses_only_unflushed_chunks_and_completion_is_durable(tmp_path):
    source = open_store(tmp_path / "src")
    signed = publish(source, tmp_path, 1)
    count = len(signed.manifest.chunk_digests)
    root = tmp_path / "sink"
    sink = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, fsync_batch_chunks=4,
                      background_flush=True)
    sink.add_manifest(signed)
    fill(sink, source, 1, range(3))
    assert not sink.flush_due
    fill(sink, source, 1, range(3, 4))
    assert sink.flush_due and sink.unsynced_chunks == 4  # the owner flushes it (the relay: in the background)
    assert sink.flush() == 4 and not sink.flush_due
    fill(sink, source, 1, range(4, 6))
    assert all(sink.holds(1, i) for i in range(6)) and sink.unsynced_chunks == 2
    # a crash now: the bitmap names only the flushed batch; the rest is fetched again, never believed
    crashed = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, fsync_batch_chunks=4)
    assert crashed.missing(signed) == list(range(4, count))
    assert sink.flush() == 2 and sink.unsynced_chunks == 0
    fill(sink, source, 1, range(6, count))  # the put that completes the version flushes it
    after = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, fsync_batch_chunks=4)
    assert after.is_complete(signed) and after.verify(1) == []


def test_without_a_background_flusher_the_put_that_fills_a_batch_flushes_it(tmp_path):
    source = open_store(tmp_path / "src")
    signed = publish(source, tmp_path, 1)
    root = tmp_path / "sink"
    sink = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, fsync_batch_chunks=4)
    sink.add_manifest(signed)
    fill(sink, source, 1, range(6))
    assert sink.unsynced_chunks == 2
    crashed = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True)
    assert crashed.missing(signed)[0] == 4


def test_with_a_background_flusher_behind_a_put_flushes_by_itself_at_twice_the_batch(tmp_path):
    source = open_store(tmp_path / "src")
    signed = publish(source, tmp_path, 1)
    assert len(signed.manifest.chunk_digests) > 6
    root = tmp_path / "sink"
    sink = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, fsync_batch_chunks=3,
                      background_flush=True)
    sink.add_manifest(signed)
    fill(sink, source, 1, range(5))
    assert sink.flush_due and sink.unsynced_chunks == 5  # due since the 3rd, and the owner has not flushed
    fill(sink, source, 1, range(5, 6))
    assert sink.unsynced_chunks == 0 and not sink.flush_due  # the 6th put flushed all 6 itself
    crashed = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, fsync_batch_chunks=3)
    assert crashed.missing(signed)[0] == 6


def test_flush_due_can_be_asked_while_another_thread_keeps_a_new_version(tmp_path):
    """The relay asks `flush_due` on its trio thread while worker threads add manifests and
    collect versions; a thread switch inside the count must not break it."""
    source = open_store(tmp_path / "src")
    first, second = publish(source, tmp_path, 1), publish(source, tmp_path, 2)
    sink = ChunkStore(tmp_path / "sink", budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True,
                      fsync_batch_chunks=3, background_flush=True)
    sink.add_manifest(first)
    fill(sink, source, 1, range(3))

    class SwitchingSet(set):
        """Where the count reads this version's chunks, another thread keeps version 2."""

        def __len__(self) -> int:
            if 2 not in sink.versions():
                sink.add_manifest(second)
            return super().__len__()

    held = sink._held(1)
    held.unsynced = SwitchingSet(held.unsynced)
    assert sink.flush_due and sink.versions() == [1, 2]


def test_a_chunk_stored_twice_at_once_returns_only_once_its_version_is_durable(tmp_path, monkeypatch):
    """Two sources can deliver the same chunk (a request retried elsewhere) and the relay's core
    takes whichever it hears of first as the version's last chunk: the put that finds the chunk
    already held must not return while the put that stored it is still making the version durable."""
    source = open_store(tmp_path / "src")
    signed = publish(source, tmp_path, 1)
    count = len(signed.manifest.chunk_digests)
    root = tmp_path / "sink"
    sink = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, fsync_batch_chunks=count,
                      background_flush=True)
    sink.add_manifest(signed)
    fill(sink, source, 1, range(count - 1))
    last = source.read_chunk(1, count - 1)
    in_sync, release, settled = threading.Event(), threading.Event(), threading.Event()
    real_sync = VersionFiles.sync

    def slow_sync(files: VersionFiles) -> None:  # the disk takes the completing put's batch a while
        in_sync.set()
        release.wait()
        real_sync(files)

    class WatchedLock:
        """The store's flush lock; says when the second put waits for it."""

        def __init__(self, lock) -> None:
            self.lock = lock

        def __enter__(self) -> None:
            if threading.current_thread().name == "again":
                settled.set()
            self.lock.acquire()

        def __exit__(self, *exc) -> None:
            self.lock.release()

    monkeypatch.setattr(VersionFiles, "sync", slow_sync)
    sink._flush_lock = WatchedLock(sink._flush_lock)
    outcome: dict[str, bool] = {}

    def again() -> None:
        outcome["stored"] = sink.put_chunk(1, count - 1, last)
        after = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED)  # a crash now
        outcome["durable"] = after.is_complete(signed)
        after.close()
        settled.set()

    first = threading.Thread(target=sink.put_chunk, args=(1, count - 1, last))
    first.start()
    assert in_sync.wait(60)
    second = threading.Thread(target=again, name="again")
    second.start()
    assert settled.wait(60)  # the second put returned, or waits for the flush
    release.set()
    first.join(60)
    second.join(60)
    assert outcome == {"stored": False, "durable": True}


def test_unknown_version_and_bitmaps(tmp_path):
    store = open_store(tmp_path)
    with pytest.raises(VersionUnknown):
        store.manifest(7)
    with pytest.raises(VersionUnknown):
        store.export_version(7, tmp_path / "o")
    assert pack_bitmap([True, False] * 5) == bytes([0b10101010, 0b10000000])
    assert unpack_bitmap(b"\xff", 10) == [True] * 8 + [False, False]


def test_a_version_of_more_files_than_stay_open_is_written_and_made_durable(tmp_path):
    from relay.versionfiles import MAX_OPEN_FILES

    files = []
    for i in range(MAX_OPEN_FILES + 6):
        path = tmp_path / "src" / f"shard-{i:03d}.bin"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(700 + i))
        files.append(path)
    source = open_store(tmp_path / "source")
    signed = source.publish_files(TRAINER, files, model="m", version=1, chunk_bytes=CHUNK, now_s=NOW, place="copy")
    root = tmp_path / "sink"
    sink = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, fsync_batch_chunks=4)
    sink.add_manifest(signed)
    count = len(signed.manifest.chunk_digests)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: sink.put_chunk(1, i, source.read_chunk(1, i)), range(count)))
    again = ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True)
    assert again.is_complete(signed) and again.verify(1, everything=True) == []
    assert [p.read_bytes() for p in again.version_files(1)] == [p.read_bytes() for p in files]
