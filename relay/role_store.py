"""The relay role's side of its own store: storing fetched chunks, making them durable, the store's faults.

Mixed into `relay.role.RelayRole` (`StoreSide`). An upstream hands each chunk it receives whole
to `report_fetched`: hashed against the manifest and written at its offsets in a worker thread
while the connection reads on. Stored chunks reach the core in batches (`_tell_fetched`), one
round trip for all that finished meanwhile; at most `max_in_flight` wait for it, and an answer
past those (requests the core asked past its budget, or settled without their answer) waits with
its buffer, so a core that falls behind slows the reading instead of filling memory.

Durability. The store makes a version durable (files fsynced, then its bitmap) before the put
that completes it returns, so the core hears of the last chunk, reports the version complete,
announces it and hands it to workers only once a crash can no longer lose it. Batches of
chunks before that (`[relay] fsync_batch_chunks`) are made durable by `_flusher` in the
background, so the disk taking a batch does not hold the receive buffers.

Our own store's faults. The store tells us (`ChunkStore.listener`, from any thread) when a read
found a chunk rotten and when a failed fsync lost the chunks written since the version's last
flush (dropped either way: the core is told it `lost` them, so the version is incomplete, not
announced, and they are fetched again), and when garbage collection dropped a version (the
core and the watcher forget it). A stored chunk reaches the core only if the store still holds
it then (one lost meanwhile is a failed fetch, nobody's fault: `store_failed`), so the core never
counts a chunk the store dropped before the core heard of it. A store that is full (StoreFull,
ENOSPC from a put or from a background flush), or whose disk fails (any other OSError, such as
EIO), holds new requests (`StoreBackoff`: 1 s doubling to 60 s, one warning per hold; what
started the hold, full or failing, and the version a version's hold holds alone, are in the status
and the health check: `store_hold`), so a bad disk is not
fed chunks at network speed; while it backs off, a fetch is downloaded only if the store has room
by then (a disk that fails that question holds on as failing), and the first chunk stored ends
the backoff (when the error came from a put or an fsync, the first flush that succeeds: writes
into the page cache succeed on a full or failing disk). A hold that a put (or a copy, or the
probe before one) of one version started on a failing disk holds that version's requests alone
(`FailingVersion`; `TransferCore.hold_requests` per version): a partly failing disk (bad sectors
under one version's files) takes the others' writes, and they fetch on at full speed (held with
it, a healthy version of 16 chunks took 183 virtual s instead of 3). Such a hold is ended early
only by a chunk of that version stored since and made durable (`_ends_hold`), or by that
version's collection: another version's flushes prove nothing about its files (they ended the
hold at once, so the failing version was fed again and every hold started over at 1 s). Inside
it, any other failure (a full store, a flush, another version's write) makes it every version's
until it ends: room and fsyncs are the whole store's, and a second failing version would
otherwise be fed at network speed. A put that fails when another put of the same chunk has made
it durable since starts no hold: nothing might be left to store and end it.

These methods read the role's `store`, `core` and `watcher` (versions lost or collected are
forgotten), hold and end its `backoff` and keep `_full_on_flush` (the store's `durable_flushes`
when a put or an fsync found the disk full or failing) and `_failing` (`FailingVersion`), send
stored chunks into `_fetched_send` and take them from `_fetched`, set `_flush_wanted` (a batch
waits for `_flusher`), queue the store's events on `_queue_send` through `_token` (the trio
loop's, set by `run`), tell `_uploads` that a chunk arrived, and keep its counters
(`fetched_from`, `bytes_fetched_from`, `chunk_checks`, `timeline`, `_moved_at`); they call its
`_command(fn)` and `report_failed(peer, fetch, reason)`. `RelayRole._run` starts `_tell_fetched`
and `_flusher` and its `_dispatch` calls the rest; `_trouble_of` serves the role too
(`_copy_failed`). Their log lines go to the role's logger.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import trio

from relay.effects import Fetch, FetchFailure
from relay.errors import ChunkCorrupt, StoreFull, VersionUnknown
from relay.metrics import BytesByRole
from relay.store import NO_SPACE_ERRNOS, StoreTrouble

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from relay.loader import VersionWatcher
    from relay.store import ChunkStore, StoreBackoff, StoreEvent
    from relay.transfer import TransferCore
    from relay.uploads import Uploads
    from relay.upstream import Upstream

log = logging.getLogger("relay.role")  # the role's logger: its log lines keep their name


@dataclass
class FailingVersion:
    """The version whose files a failing disk would not write as a hold began (EIO and the like
    from its put, its copy or the probe before its put), which the hold holds alone, and its
    chunks stored since: only one of those made durable ends that hold before its time
    (`StoreSide._ends_hold`), or the version's collection."""

    version: int
    stored: set[int] = field(default_factory=set)


class StoreSide:
    """Our own store's side of `relay.role.RelayRole` (see the module docstring)."""

    # the role's state these methods use (`RelayRole.__init__` sets it)
    store: ChunkStore
    core: TransferCore
    watcher: VersionWatcher
    backoff: StoreBackoff
    _full_on_flush: int | None
    _failing: FailingVersion | None
    _fetched_send: trio.MemorySendChannel[tuple[str, Fetch, float, float | None]]
    _fetched: trio.MemoryReceiveChannel[tuple[str, Fetch, float, float | None]]
    _flush_wanted: trio.Event
    _queue_send: trio.MemorySendChannel[Any]
    _token: trio.lowlevel.TrioToken | None
    _uploads: Uploads
    fetched_from: dict[str, int]
    bytes_fetched_from: dict[str, int]
    bytes_by_role: BytesByRole
    chunk_checks: dict[str, int]
    timeline: dict[int, dict[str, float]]
    _moved_at: float

    if TYPE_CHECKING:  # what these call on the role (`relay.role.RelayRole`)
        async def _command(self, fn: Callable[[float], list[Any]]) -> None: ...
        def _sending_held(self) -> AbstractAsyncContextManager[None]: ...
        async def report_failed(self, peer: str, fetch: Fetch, reason: FetchFailure,
                                upstream: Upstream | None = None) -> None: ...

    async def report_fetched(self, peer: str, fetch: Fetch, data: bytes | bytearray | memoryview,
                             elapsed_s: float, unexplained_s: float | None = None) -> None:
        """Verify and store one chunk from `peer`; tell the core either way (a stored chunk in
        the next batch of completions). `data` is not used after this returns. `elapsed_s` and
        `unexplained_s`: as `TransferCore.fetched` takes them (`relay.upstream` times them)."""
        fetched_bytes = len(data)
        try:
            await trio.to_thread.run_sync(lambda: self.store.put_chunk(fetch.version, fetch.index, data, sender=peer))
        except VersionUnknown:
            log.info("chunk %d of version %d arrived after the version was dropped", fetch.index, fetch.version)
            return
        except ChunkCorrupt:
            self.chunk_checks["rejected"] += 1
            log.warning("chunk %d of version %d from %s does not match its digest", fetch.index, fetch.version, peer)
            await self.report_failed(peer, fetch, FetchFailure.CORRUPT)
            return
        except StoreFull as exc:
            await self._not_stored(peer, fetch, str(exc))
            return
        except OSError as exc:  # a batched fsync found the disk full (a write raises StoreFull), or our disk failed
            trouble = _trouble_of(exc)
            if self.store.is_durable(fetch.version, fetch.index):
                # another put of it (a second request for the chunk) stored it and a flush made it durable
                # after this put began: the disk takes writes, and a hold might have nothing left to end it
                log.error("cannot keep chunk %d of version %d: %s (another put of it is durable since: no hold)",
                          fetch.index, fetch.version, exc)
                await self.report_failed(peer, fetch, FetchFailure.STORE_FAILED)
                return
            if trouble is StoreTrouble.FAILING:
                log.error("cannot keep chunk %d of version %d: %s", fetch.index, fetch.version, exc)
            self._full_on_flush = self.store.durable_flushes  # (maybe the fsync: only a durable flush ends the hold)
            await self._not_stored(peer, fetch, str(exc), trouble, version=fetch.version)
            return
        if self._ends_hold(fetch):
            await self._room_again()
        else:  # a write into the page cache proves nothing: a flush of it will
            self._flush_wanted.set()
        self.fetched_from[peer] = self.fetched_from.get(peer, 0) + 1
        self.chunk_checks["verified"] += 1
        self.bytes_fetched_from[peer] = self.bytes_fetched_from.get(peer, 0) + fetched_bytes
        self.bytes_by_role.add(self.bytes_by_role.fetched, peer, fetched_bytes)
        self._uploads.arrived(fetch.version, fetch.index)
        self._moved_at = trio.current_time()
        try:
            try:
                self._fetched_send.send_nowait((peer, fetch, elapsed_s, unexplained_s))
            except trio.WouldBlock:  # more answers than requests out: wait for the core's next batch
                await self._fetched_send.send((peer, fetch, elapsed_s, unexplained_s))
        except trio.BrokenResourceError:  # `_tell_fetched` has ended: the relay stops
            log.info("chunk %d of version %d stored as the relay stops: the core is not told", fetch.index,
                     fetch.version)
            return
        if self.store.flush_due:
            self._flush_wanted.set()

    async def _tell_fetched(self) -> None:
        """Stored chunks reach the core in batches: one round trip for all that completed while
        the previous one ran. The channel closes when this ends (the relay stops), so a
        `report_fetched` waiting on a full one (shielded: see `relay.upstream`) is let go."""
        with self._fetched:
            while True:
                batch = [await self._fetched.receive()]
                while True:
                    try:
                        batch.append(self._fetched.receive_nowait())
                    except trio.WouldBlock:
                        break
                await self._command(partial(self._stored_all, batch=batch))

    def _stored_all(self, now: float, batch: list[tuple[str, Fetch, float, float | None]]) -> list[Any]:
        return [effect for peer, fetch, took, beyond in batch
                for effect in self._stored(now, peer, fetch, took, beyond)]

    def _stored(self, now: float, peer: str, fetch: Fetch, elapsed_s: float, unexplained_s: float | None) -> list[Any]:
        """Tell the core a chunk was stored, if the store still holds it: a failed fsync may have
        lost it since (`ChunksLost`, which the core may hear of first and find nothing to undo)."""
        if self.store.holds(fetch.version, fetch.index):
            return self.core.fetched(now, peer, fetch.version, fetch.index, elapsed_s, unexplained_s)
        return self.core.fetch_failed(now, peer, fetch.version, fetch.index, FetchFailure.STORE_FAILED)

    async def _flusher(self) -> None:
        """Batches of stored chunks made durable in the background: fsyncing a batch takes the
        disk for a while, and doing it on the path a chunk arrives by held every receive buffer
        (on loopback, 8 peers fsyncing at once left the machine idle for 0.6 s of a 5 s round)."""
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted = trio.Event()
            await self._flush_store()

    async def _flush_store(self, *, stopping: bool = False) -> None:
        """Make every chunk stored so far durable (the store batches its fsyncs). What a failed
        fsync lost the store tells us (`ChunksLost`); a full disk also holds new requests, as a
        full store does for a put (unless `stopping`: no more requests then)."""
        try:
            await trio.to_thread.run_sync(self.store.flush)
        except OSError as exc:
            trouble = _trouble_of(exc)
            if trouble is StoreTrouble.FAILING or stopping:
                log.error("flushing the chunk store failed: %s", exc)
            if not stopping:
                self._full_on_flush = self.store.durable_flushes
                await self._store_trouble(str(exc), trouble=trouble)
            return
        if not stopping and self._ends_hold(None):
            await self._room_again()

    # -- what the store tells us, and a full store --------------------------------------------

    def _from_store(self, event: StoreEvent) -> None:
        """The store's listener, called from whichever thread found it: queue it for `_dispatch`."""
        if self._token is None:  # before `run`: the startup path reads the store as it is then
            log.info("store event before the relay started: %s", event)
            return
        try:
            self._token.run_sync_soon(self._queue_send.send_nowait, event)
        except trio.RunFinishedError:
            log.info("store event after the relay stopped: %s", event)

    async def _chunks_lost(self, version: int, indices: tuple[int, ...], why: str) -> None:
        """Chunks the store held are dropped (`why`: rot found on read, a failed fsync): their
        version is incomplete (not reported, not announced) until they are fetched again."""
        if not self.core.knows(version):
            return  # a version we no longer follow
        lost = [i for i in indices if not self.store.holds(version, i)]  # (not stored again meanwhile)
        if not lost:
            return
        self.watcher.forget(version)
        log.warning("chunk(s) %s of version %d %s: dropped, the version is incomplete until they are fetched "
                    "again", _some(lost), version, why)
        await self._command(lambda now: [e for i in lost for e in self.core.lost(now, version, i)])

    async def _collect(self) -> None:
        """A version became complete: keep the newest `keep_versions` complete ones (the store
        tells us what it dropped, and the core forgets those)."""
        try:
            await trio.to_thread.run_sync(self.store.collect)
        except OSError as exc:  # our disk: the versions stay until the next collection
            log.error("garbage collection of the chunk store failed: %s", exc)

    async def _version_collected(self, version: int) -> None:
        self.watcher.forget(version)
        self.timeline.pop(version, None)
        await self._command(lambda now: self.core.collected(version))
        log.info("version %d was garbage-collected: no longer held or announced", version)
        if self._failing is not None and self._failing.version == version:
            # nothing of it will come to end its hold, and an incomplete version is collected only
            # once a newer one is complete here: the disk took other writes
            await self._room_again()

    def store_hold(self, now: float) -> dict[str, object]:
        """The store's hold for `status()` (`store_backoff`) and `/healthz`: the backoff's state
        (`StoreBackoff.to_json`) and the version it holds alone (`version`: a hold that version's
        failing write began, `_failing`), None while it holds every version, or none."""
        alone = self._failing.version if self.backoff.active and self._failing is not None else None
        return {**self.backoff.to_json(now), "version": alone}

    def _held_for(self, version: int) -> bool:
        """Whether the store's hold (`backoff`, between its holds too) holds `version`'s requests:
        every version's, unless it began as one failing version's (`_failing`)."""
        return self.backoff.active and (self._failing is None or self._failing.version == version)

    async def _room_to_fetch(self, fetch: Fetch) -> bool:
        """Whether `fetch` may be downloaded now: yes, unless the store's hold holds its version;
        then only if the store has room by now (asked with our sends held); if not, the fetch
        fails as ours and holds on (a probe for a failing version's write fails as its write)."""
        if not self._held_for(fetch.version):
            return True
        async with self._sending_held():
            trouble = await self._no_room_for(fetch.size)
        if trouble is None:
            return True
        why = "still no room" if trouble is StoreTrouble.FULL else "its disk still fails"
        await self._not_stored(fetch.peer, fetch, f"{why} after the hold", trouble,
                               version=fetch.version if trouble is StoreTrouble.FAILING else None)
        return False

    async def _no_room_for(self, nbytes: int) -> StoreTrouble | None:
        """Why the store cannot take a chunk now, or None if it can (asked before fetching while
        backing off): no room, or a disk that fails the question itself."""
        if trio.current_time() < self.backoff.until:  # a request issued just before the hold began
            return self.backoff.cause or StoreTrouble.FULL
        try:
            return None if await trio.to_thread.run_sync(self.store.has_room, nbytes) else StoreTrouble.FULL
        except OSError as exc:
            log.error("cannot check the chunk store's free space: %s", exc)
            return _trouble_of(exc)

    async def _not_stored(self, peer: str, fetch: Fetch, why: str,
                          trouble: StoreTrouble = StoreTrouble.FULL, *, version: int | None = None) -> None:
        """Our store had no room for a chunk (or its disk failed: `trouble`, writing `version`'s
        files if its put failed): fetch it again later, blaming nobody, and hold new requests
        (`_store_trouble`)."""
        reason = FetchFailure.STORE_FULL if trouble is StoreTrouble.FULL else FetchFailure.STORE_FAILED
        await self._store_trouble(why, lambda now: self.core.fetch_failed(now, peer, fetch.version, fetch.index,
                                                                          reason), trouble=trouble, version=version)

    def _ends_hold(self, stored: Fetch | None) -> bool:
        """Whether what just succeeded (a put of `stored`'s chunk; None: a flush) proves that the
        store takes writes again, ending a hold before its time. A hold that a failing version
        started (`_failing`, while the core follows it): one of that version's chunks stored since,
        now durable; another version's writes prove nothing about the failing files (a partly
        failing disk). Otherwise, once a put or an fsync failed (`_full_on_flush`), a durable flush
        since; else the chunk stored."""
        failing = self._failing
        if failing is not None and self.core.knows(failing.version):
            if stored is not None:
                if stored.version != failing.version:
                    return False
                failing.stored.add(stored.index)  # (at most its version's chunks, till the next hold or the end)
            return any(self.store.is_durable(failing.version, index) for index in failing.stored)
        if self._full_on_flush is None:
            return stored is not None
        return self.store.durable_flushes > self._full_on_flush

    async def _room_again(self) -> None:
        """A chunk was stored (or, when an fsync found the disk full, a flush succeeded): a
        backoff, if one was running, ends, and requests resume at once."""
        self._full_on_flush, self._failing = None, None
        cause = self.backoff.cause  # (what started the hold, not the last failure inside it)
        if self.backoff.succeeded():
            log.warning("the chunk store %s again: fetching resumes",
                        "takes writes" if cause is StoreTrouble.FAILING else "has room")
            await self._command(lambda now: self.core.hold_requests(now, now))

    async def _store_trouble(self, why: str, then: Callable[[float], list[Any]] = lambda now: [], *,
                             trouble: StoreTrouble = StoreTrouble.FULL, version: int | None = None) -> None:
        """Our store is full, or its disk fails (`StoreTrouble.FAILING`: EIO and the like; writing
        `version`'s files, when a put or a copy named them): hold new requests (1 s, doubling up to
        60 s while it stays so; a failing disk must not be fed chunks at network speed), of that
        version alone if it named one, say so once per hold, and tell the core `then`. A failure
        inside a hold leaves the hold, its cause and what ends it early (`_ends_hold`) as they are,
        unless the hold was one version's and the failure is not that version's write: then it
        holds every version till its end (see the top)."""
        until = self.backoff.failed(trio.current_time(), trouble)
        failing, hold = self._failing, until
        if until is not None:  # a new hold: on the failing version alone when its own write failed
            self._failing = FailingVersion(version) if trouble is StoreTrouble.FAILING and version is not None \
                else None
            log.warning("chunk store %s (%s): no new chunk requests%s for %.0fs (%d failed stores so far)",
                        trouble.value, why, f" for version {version}" if self._failing is not None else "",
                        until - trio.current_time(), self.backoff.failures)
        elif failing is not None and (trouble is StoreTrouble.FULL or version != failing.version):
            # inside one version's hold, a failure that is not that version's write (a full store, a
            # flush, another version's files): the store's trouble is not that version's alone
            self._failing, hold = None, self.backoff.until
            log.info("chunk store %s (%s) inside the hold on version %d: no new chunk requests for any version "
                     "for %.0fs", trouble.value, why, failing.version, hold - trio.current_time())
        scope = self._failing.version if self._failing is not None else None
        await self._command(lambda now: (self.core.hold_requests(now, hold, scope) if hold is not None else [])
                            + then(now))


def _trouble_of(exc: OSError) -> StoreTrouble:
    """A full disk (ENOSPC, EDQUOT; a write raises StoreFull, a batched fsync the OSError itself)
    or a failing one (any other error)."""
    return StoreTrouble.FULL if exc.errno in NO_SPACE_ERRNOS else StoreTrouble.FAILING


def _some(indices: list[int], shown: int = 8) -> str:
    """Chunk indices for a log line: the first few, and how many more."""
    text = ", ".join(map(str, indices[:shown]))
    return text + (f" and {len(indices) - shown} more" if len(indices) > shown else "")
