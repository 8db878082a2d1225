"""A flush that runs while another thread's fsync (closing a file to stay under the open-file
limit) fails: the flush must not record as durable a batch that failure may have dropped, nor a
chunk written again after it and not fsynced since. The interleavings are forced with hooks, not
with timing: each test runs the other thread's step at the exact point it describes."""

import threading

import pytest

from relay.store import ChunksLost, ChunkStore
from relay.versionfiles import VersionFiles
from tests.relay.test_store_fsync_faults import (failing_fsyncs, fill, one_open_file, sink_store,  # noqa: F401
                                                 source)  # (a fixture)


def test_a_flush_between_a_failed_closing_fsync_and_its_loss_does_not_record_the_lost_batch(
        tmp_path, source, monkeypatch):  # noqa: F811
    signed, sink, heard, first_file, other = one_open_file(tmp_path, source, monkeypatch)
    real_lose, flushed, started = ChunkStore._lose_unsynced, [], []

    def lose_after_a_flush(store, held, exc):
        if not started:  # the flusher thread runs right after the fsync failed, before the loss
            started.append(True)
            thread = threading.Thread(target=lambda: flushed.append(store.flush()))
            thread.start()
            thread.join()
        real_lose(store, held, exc)

    monkeypatch.setattr(ChunkStore, "_lose_unsynced", lose_after_a_flush)
    failing_fsyncs(monkeypatch)
    with pytest.raises(OSError, match="injected"):
        fill(sink, source, 1, [other])  # opening the third file closes the first: its fsync fails
    assert flushed == [0]  # the flush recorded nothing
    assert not any(sink.holds(1, i) for i in first_file) and heard == [ChunksLost(1, tuple(first_file))]
    assert sink_store(tmp_path / "sink").missing(signed)[:len(first_file)] == first_file


def test_a_flush_does_not_record_a_chunk_written_again_after_its_fsync(tmp_path, source, monkeypatch):  # noqa: F811
    """The flush took its batch; then, before its fsync, a closing fsync failed (the batch is lost),
    and after its fsync a chunk of the batch was stored again: not durable yet."""
    signed, sink, heard, first_file, other = one_open_file(tmp_path, source, monkeypatch)
    real_sync, state = VersionFiles.sync, {}

    def sync_then_fail_and_store_again(files):
        first = not state
        if first:
            state["synced"] = failing_fsyncs(monkeypatch).synced
            with pytest.raises(OSError, match="injected"):
                fill(sink, source, 1, [other])  # another thread: its closing fsync fails
        real_sync(files)
        if first:
            assert fill(sink, source, 1, first_file[:1]) == [True]  # a third stores a lost chunk again
            state["synced_then"] = list(state["synced"])

    monkeypatch.setattr(VersionFiles, "sync", sync_then_fail_and_store_again)
    sink.flush()
    first_path = sink._held(1).files.paths[0]
    fsynced_since = first_path in state["synced"][len(state["synced_then"]):]
    claimed = sink_store(tmp_path / "sink").missing(signed)[:1] != first_file[:1]
    assert fsynced_since or not claimed  # never claimed durable without an fsync after its write
    assert heard[0] == ChunksLost(1, tuple(first_file))
    # (dropped as well: it was written after the failure, but the flush cannot tell which were)
    assert not sink.holds(1, first_file[0]) and heard[1:] == [ChunksLost(1, (first_file[0],))]
    assert fill(sink, source, 1, first_file) == [True] * len(first_file)
    monkeypatch.setattr(VersionFiles, "sync", real_sync)
    assert sink.flush() == len(first_file)
    assert not set(first_file) & set(sink_store(tmp_path / "sink").missing(signed))
