"""The store when an fsync fails: on Linux a failed fsync may drop the dirty pages it was to
write (and a later fsync then succeeds without them), so every chunk of the version written
since its last flush is taken as lost: not held, not counted, never in the bitmap, told to the
owner (`ChunksLost`), and written again by its next put."""

import errno
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from p2pnet.identity import Identity
from relay.errors import StoreFull
from relay.store import ChunksLost, ChunkStore
from relay.versionfiles import VersionFiles
from tests.relay.disk import failing_fsyncs
from tests.relay.test_store_events import listening

NOW = 1_800_000_000.0
TRAINER = Identity.from_seed_text("trainer")
TRUSTED = [TRAINER.peer_id]
CHUNK = 1024


def publish(store: ChunkStore, folder: Path, version: int):
    """Three files (so a version's chunks lie in several), about 11 chunks."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, count in (("a", 1100), ("b", 700), ("c", 900)):
        path = folder / f"{name}.safetensors"
        save_file({name: np.random.default_rng(version * 10 + count).standard_normal(count).astype(np.float32)},
                  str(path))
        paths.append(path)
    return store.publish_files(TRAINER, paths, model="m", version=version, previous_version=version - 1,
                               chunk_bytes=CHUNK, now_s=NOW)


def sink_store(root: Path, **kwargs) -> ChunkStore:
    kwargs.setdefault("fsync_batch_chunks", 1000)  # nothing flushes before the test says so
    return ChunkStore(root, budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=True, **kwargs)


def fill(sink: ChunkStore, source: ChunkStore, version: int, indices) -> list[bool]:
    return [sink.put_chunk(version, i, source.read_chunk(version, i)) for i in indices]


def all_but_the_last(tmp_path: Path, source: ChunkStore):
    """A store that holds every chunk of version 1 but the last, none fsynced yet (every file
    has some); its manifest, chunk count, and what its listener heard."""
    signed = source.manifest(1)
    count = len(signed.manifest.chunk_digests)
    sink = sink_store(tmp_path / "sink")
    sink.add_manifest(signed)
    heard = listening(sink)
    fill(sink, source, 1, range(count - 1))
    return signed, count, sink, heard


@pytest.fixture
def source(tmp_path):
    store = ChunkStore(tmp_path / "src", budget_bytes=10**9, trusted_publishers=TRUSTED, fsync=False)
    publish(store, tmp_path / "files1", 1)
    publish(store, tmp_path / "files2", 2)
    return store


def test_a_failed_fsync_loses_the_batch_and_its_chunks_are_written_again(tmp_path, source, monkeypatch):
    signed, count, sink, heard = all_but_the_last(tmp_path, source)
    files = sink._held(1).files
    written = {files.paths[seg.file] for i in range(count - 1) for seg in files.segments(i)}
    assert len(written) == 3 and sink.used_bytes > 0
    synced = failing_fsyncs(monkeypatch).synced
    with pytest.raises(OSError, match="injected"):
        sink.flush()
    # every chunk of the batch is gone: not held, not counted, told, not claimed after a restart
    assert heard == [ChunksLost(1, tuple(range(count - 1)))]
    assert sink.missing(signed) == list(range(count)) and sink.used_bytes == 0 and sink.unsynced_chunks == 0
    assert sink.flush() == 0  # a retry "succeeds" (as on Linux) and claims nothing
    assert sink_store(tmp_path / "sink").missing(signed) == list(range(count))
    # a new put of each writes it again (not "already held"), and the next flush fsyncs every file
    assert fill(sink, source, 1, range(count - 1)) == [True] * (count - 1)
    assert sink.flush() == count - 1 and written <= set(synced)
    assert sink_store(tmp_path / "sink").missing(signed) == [count - 1]
    fill(sink, source, 1, [count - 1])
    after = sink_store(tmp_path / "sink")
    assert after.is_complete(signed) and after.verify(1, everything=True) == []
    assert [p.read_bytes() for p in after.version_files(1)] == [p.read_bytes() for p in source.version_files(1)]


def test_the_put_that_completes_a_version_fails_if_its_fsync_fails_and_the_version_is_not_complete(
        tmp_path, source, monkeypatch):
    signed, count, sink, heard = all_but_the_last(tmp_path, source)
    failing_fsyncs(monkeypatch)
    with pytest.raises(OSError, match="injected"):
        fill(sink, source, 1, [count - 1])
    assert not sink.is_complete(signed) and sink.complete_versions() == []
    assert sink.missing(signed) == list(range(count)) and heard == [ChunksLost(1, tuple(range(count)))]
    assert not sink_store(tmp_path / "sink").is_complete(signed)
    assert fill(sink, source, 1, range(count)) == [True] * count
    assert sink_store(tmp_path / "sink").is_complete(signed)


def test_a_failed_fsync_of_one_version_costs_only_that_version(tmp_path, source, monkeypatch):
    """The flush still makes the other versions' batches durable; a put of another version whose
    flush met the failure is stored (the loss is told to the listener, not to that put)."""
    one, two = source.manifest(1), source.manifest(2)
    sink = sink_store(tmp_path / "sink", fsync_batch_chunks=6)  # no background flusher: the 6th put flushes
    sink.add_manifest(one)
    sink.add_manifest(two)
    heard = listening(sink)
    fill(sink, source, 1, range(3))
    fill(sink, source, 2, range(2))
    failing_fsyncs(monkeypatch, which=lambda path: sink.version_dir_of(one).name in str(path))
    assert fill(sink, source, 2, [2]) == [True]  # the batch's 6th chunk: this put flushes both versions
    assert heard == [ChunksLost(1, (0, 1, 2))]
    assert sink.missing(one)[:3] == [0, 1, 2] and all(sink.holds(2, i) for i in range(3))
    after = sink_store(tmp_path / "sink")
    assert after.missing(one)[:3] == [0, 1, 2] and after.missing(two)[:3] == [3, 4, 5]


def test_a_put_whose_write_overlapped_a_failed_fsync_writes_its_chunk_again(tmp_path, source, monkeypatch):
    """A chunk written while another thread's flush of its version failed may have lost its pages
    with that batch, yet it was not in it (not counted as held yet): its put writes it again."""
    signed = source.manifest(1)
    sink = sink_store(tmp_path / "sink")
    sink.add_manifest(signed)
    real_write, writes = VersionFiles.write_chunk, []

    def write_chunk(files: VersionFiles, index: int, data) -> None:
        real_write(files, index, data)
        writes.append(index)
        if len(writes) == 1:  # meanwhile, a flush of this version failed
            files.sync_failures += 1

    monkeypatch.setattr(VersionFiles, "write_chunk", write_chunk)
    assert fill(sink, source, 1, [4]) == [True]
    assert writes == [4, 4] and sink.holds(1, 4) and sink.unsynced_chunks == 1


def one_open_file(tmp_path: Path, source: ChunkStore, monkeypatch):
    """A store holding the chunks of version 1 that lie in its first file only (not fsynced),
    with one file of a version open at a time: its manifest, the store, what it heard, those
    chunks, and a chunk of the third file (storing it closes the first file)."""
    import relay.versionfiles

    monkeypatch.setattr(relay.versionfiles, "MAX_OPEN_FILES", 1)
    signed = source.manifest(1)
    sink = sink_store(tmp_path / "sink")
    sink.add_manifest(signed)
    heard = listening(sink)
    files = sink._held(1).files
    count = len(signed.manifest.chunk_digests)
    first_file = [i for i in range(count) if {s.file for s in files.segments(i)} == {0}]
    other = next(i for i in range(count) if files.segments(i)[0].file == 2)
    fill(sink, source, 1, first_file)
    return signed, sink, heard, first_file, other


def test_an_fsync_that_fails_while_closing_a_file_loses_the_batch(tmp_path, source, monkeypatch):
    """A version keeps at most MAX_OPEN_FILES open; closing one fsyncs what was written to it.
    When that fsync fails, the batch is lost as in a flush, and the put that opened a file fails."""
    signed, sink, heard, first_file, other = one_open_file(tmp_path, source, monkeypatch)
    failing_fsyncs(monkeypatch)
    with pytest.raises(OSError, match="injected"):
        fill(sink, source, 1, [other])  # opening the third file closes the first
    assert heard == [ChunksLost(1, tuple(first_file))] and not any(sink.holds(1, i) for i in first_file)
    assert sink.used_bytes == 0 and not sink.holds(1, other)
    assert fill(sink, source, 1, first_file + [other]) == [True] * (len(first_file) + 1)
    assert sink.flush() == len(first_file) + 1
    after = sink_store(tmp_path / "sink")
    assert all(after.holds(1, i) for i in first_file + [other]) and after.verify(1, everything=True) == []


def test_a_closing_fsync_that_finds_the_disk_full_raises_its_error_not_store_full(tmp_path, source, monkeypatch):
    """StoreFull says a write found no room (a put that succeeds later shows there is room again);
    an fsync's ENOSPC is told as it is (writes into the page cache succeed on a full disk)."""
    signed, sink, heard, first_file, other = one_open_file(tmp_path, source, monkeypatch)
    failing_fsyncs(monkeypatch, error=errno.ENOSPC)
    with pytest.raises(OSError) as raised:
        fill(sink, source, 1, [other])
    assert not isinstance(raised.value, StoreFull) and raised.value.errno == errno.ENOSPC
    assert heard == [ChunksLost(1, tuple(first_file))]


def test_a_bitmap_that_cannot_be_written_fails_the_completing_put_and_the_next_flush_records_it(
        tmp_path, source, monkeypatch):
    """The files were fsynced but the record of them was not written (a full disk): the put that
    completes the version fails (it is not durable), nothing is lost, and the next flush records it."""
    import relay.store

    signed, count, sink, heard = all_but_the_last(tmp_path, source)
    real_save, state = relay.store.save_bitmap, {"fail": True}

    def save_bitmap(*args, **kwargs) -> None:
        if state.pop("fail", False):
            raise OSError(errno.ENOSPC, "injected: no room for the bitmap")
        real_save(*args, **kwargs)

    monkeypatch.setattr(relay.store, "save_bitmap", save_bitmap)
    last = source.read_chunk(1, count - 1)
    with pytest.raises(OSError, match="no room for the bitmap"):
        sink.put_chunk(1, count - 1, last)
    assert heard == [] and sink.unsynced_chunks == count  # held, not durable
    assert sink_store(tmp_path / "sink").missing(signed) == list(range(count))
    assert sink.put_chunk(1, count - 1, last) is False  # (held already) returns once it is durable
    assert sink.unsynced_chunks == 0 and sink_store(tmp_path / "sink").is_complete(signed)
