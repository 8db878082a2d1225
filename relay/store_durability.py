"""The checkpoint store's durability: flushes, and what a failed fsync costs.

Mixed into `relay.store.ChunkStore` (`Durability`): `flush` fsyncs each version's files, then
records the chunks in its bitmap (`_save_bitmap`: temp name, fsync, rename); `_flush_for` is the
flush a put waits for; `_lose_unsynced` takes a failed fsync's loss; `unsynced_chunks` and
`flush_due` say how big the batch has grown. When a flush is due and who makes it (the
`put_chunk` that fills or completes a batch, or an owner flushing in the background) is the
store's part (`relay.store`).

A failed fsync loses the batch. On Linux an fsync that fails may have dropped the dirty pages
it was to write, and a later fsync then succeeds without them; so when a flush's fsync of a
version's files fails (or one made while closing a file to stay under the open-file limit), every
chunk of that version written since its last flush is taken as lost: no longer held or counted,
never recorded in the bitmap, told to the owner (`ChunksLost`) and written again by the next
put of it. The flush still makes the other versions' batches durable, then raises the error; a
put whose flush failed raises it only if its own chunk was lost with the batch. A put whose write
overlapped a failed fsync writes its chunk again before it counts it as held; a flush that
overlapped one another thread made (closing a file) records nothing of that version and takes
the loss itself (its batch may be gone, and a chunk of it stored again since may have missed its
fsync).

These methods read and change the store's versions (`_versions`: each `_Version`'s `have`,
`unverified`, `unsynced` and `failures_seen`), its `_used_bytes` and `durable_flushes`, under its
`_lock` (`flush` under `_flush_lock` as well, taken first, never inside `_lock`); they read its
`_fsync` and `_batch`, and call its `_save_bitmap` and `_tell`. Their log lines go to the store's
logger ("relay.store"). No network I/O.
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import TYPE_CHECKING

from relay.manifest import chunk_size
from relay.store_records import ChunksLost

if TYPE_CHECKING:
    from relay.store_records import StoreEvent, _Version

log = logging.getLogger("relay.store")  # the store's logger: its log lines keep their name


class Durability:
    """Flushes and lost batches for `relay.store.ChunkStore` (see the module docstring)."""

    # the store's state these methods use (`ChunkStore.__init__` sets it)
    _fsync: bool
    _batch: int
    _lock: threading.RLock
    _flush_lock: threading.Lock
    _versions: dict[int, _Version]
    _used_bytes: int
    durable_flushes: int

    if TYPE_CHECKING:  # what these call on the store (`relay.store.ChunkStore` or another of its mixins)
        def _save_bitmap(self, held: _Version, durable: set[int]) -> None: ...
        def _tell(self, event: StoreEvent) -> None: ...

    def _flush_for(self, held: _Version, index: int) -> None:
        """`flush` for a put of chunk `index` of `held`: the put fails only if that chunk was lost
        with its batch, in this flush or one another thread made meanwhile (another version's loss
        is told to the listener, not to this put)."""
        try:
            self.flush()
        except OSError:
            if index not in held.have or index in held.unsynced:
                raise  # lost, or its bitmap could not be written: not durable
            return  # durable: another version's batch failed
        if index not in held.have:
            raise OSError(errno.EIO, f"chunk {index} of version {held.signed.version} was lost with a batch whose "
                                     "fsync failed")

    def flush(self) -> int:
        """Make every chunk written so far durable: fsync the files, then record the chunks in
        their version's bitmap. Returns how many chunks it made durable. A failed fsync loses the
        version's batch (see the module docstring); a bitmap that cannot be written leaves its
        batch for the next flush; either way the other versions are flushed, then the first
        error is raised."""
        with self._flush_lock:
            with self._lock:
                batches = {v: (h, set(h.unsynced), h.files.sync_failures)
                           for v, h in self._versions.items() if h.unsynced}
            done, failed = 0, None
            for version, (held, batch, failures) in batches.items():
                if self._fsync:
                    try:
                        held.files.sync()
                    except OSError as exc:
                        self._lose_unsynced(held, exc)
                        failed = failed or exc
                        continue  # the other versions' batches are still made durable
                with self._lock:
                    if self._versions.get(version) is not held:
                        continue  # collected meanwhile
                    # another thread's fsync (closing a file) failed before the loss was taken, or
                    # while we fsynced: the batch may be gone, and a chunk of it stored again since
                    # may have missed our fsync
                    overlapped = failures != held.failures_seen or held.files.sync_failures != failures
                    if not overlapped:
                        held.unsynced -= batch
                        durable = held.have - held.unsynced
                if overlapped:
                    self._lose_unsynced(held, OSError(errno.EIO, "another fsync of its files failed while a flush ran"))
                    continue
                try:
                    self._save_bitmap(held, durable)
                except OSError as exc:  # fsynced but not recorded: the next flush records them
                    with self._lock:
                        held.unsynced |= batch & held.have
                    failed = failed or exc
                    continue
                done += len(batch)
            if done:
                self.durable_flushes += 1
            if failed is not None:
                raise failed
            return done

    def _lose_unsynced(self, held: _Version, exc: OSError) -> None:
        """An fsync of `held`'s files failed: every chunk written since its last flush may be gone
        from the disk (see the module docstring). Drop them all, and tell the listener."""
        with self._lock:
            if self._versions.get(held.signed.version) is not held:
                return  # collected meanwhile
            held.failures_seen = held.files.sync_failures
            lost = sorted(held.unsynced)
            held.have -= held.unsynced
            held.unverified -= held.unsynced
            held.unsynced.clear()
            self._used_bytes -= sum(chunk_size(held.signed.manifest, i) for i in lost)
        if lost:  # (the bitmap never named them: nothing to rewrite)
            log.error("version %d: an fsync of its files in %s failed (%s): the %d chunk(s) written since its last "
                      "flush may not be on disk; they are dropped and fetched again", held.signed.version,
                      held.files.folder, exc, len(lost))
            self._tell(ChunksLost(held.signed.version, tuple(lost)))

    @property
    def unsynced_chunks(self) -> int:
        # over a copy: the trio thread asks (`flush_due`) while worker threads add and drop versions
        return sum(len(h.unsynced) for h in list(self._versions.values()))

    @property
    def flush_due(self) -> bool:
        """A batch of chunks waits for `flush` (with `background_flush`, the owner runs it off
        the path chunks arrive by)."""
        return self._fsync and self.unsynced_chunks >= self._batch
