"""The checkpoint store on disk: each version held as a folder of its own files, the bitmap of
its durable chunks, and the signed manifests.

Layout under `root`:

    manifests/000000000042-<manifest id hex>.manifest   the signed manifest frame, as received
    versions/000000000042-<manifest id hex>/            the version's files, by their manifest names
    versions/000000000042-<manifest id hex>.have        which chunks are durable in them (bitmap)

Theory of operation. A version enters by its manifest (`add_manifest`: the manifest is written
first, then the files are created at full size, sparse; a manifest whose files cannot be made is
not kept) or whole (`publish_files`, in `relay.store_whole`: the trainer's files are linked or,
across filesystems, copied in, hashed once in one read to build the manifest, fsynced, made
read-only). A chunk enters only
through `put_chunk`, which checks its length and blake3 digest against the manifest before
writing it at its offsets (`relay.versionfiles`); from then on it is held: readable, servable,
counted. It becomes durable when a flush (`relay.store_durability`) fsyncs the files and then
rewrites the bitmap (temp name, fsync, rename), so the bitmap never claims a chunk whose bytes
were not on disk. A flush is due every
`fsync_batch_chunks` chunks (the relay peer's setting; 1: every chunk), made by the `put_chunk`
that fills the batch; or, for an owner that flushes in the background (`background_flush`: the
relay does, so chunks keep arriving while the disk takes a batch), by the owner when it sees
`flush_due`, a `put_chunk` flushing by itself only where twice that many wait (a flusher behind
the disk), which bounds what a crash can cost. Always, the
`put_chunk` that completes a version flushes before it returns: a version is complete (and can be
announced, reported, handed to a worker) only once all of it is durable. With `fsync=False`
nothing is fsynced and the bitmap is rewritten after every chunk (benchmarks, tests, simulations).

After a restart the bitmap's chunks are held but unverified: each is hashed before its first
use (`ensure_verified` before serving, `verify` before loading), and one that no longer matches
is dropped from the bitmap and reported; chunks not in the bitmap are fetched again, never
believed. Chunks received in this run were hashed on arrival and are served without hashing
again (`segments`, for `os.sendfile`). `export_version` (what `checkpoint fetch --out` hands
out, `relay.store_whole`) re-hashes the whole version first, makes its files read-only (mode
0444: a link handed out shares the store's file), then hard-links them (a reflink or a copy
across filesystems): a user gets verified bytes without a second copy on disk. Files are opened
for reading only until written (`relay.versionfiles`), so a user other than root reads the
read-only files of complete versions, and a rotten chunk of one is written again.

A failed fsync loses the batch: every chunk of that version written since its last flush is
taken as lost (no longer held or counted, never recorded in the bitmap), told to the owner
(`ChunksLost`) and written again by the next put of it; `relay.store_durability` says why, and
what a put or a flush that overlapped a failed fsync does.

What the owner hears. A chunk found rotten (`ChunkRotten`), chunks lost to a failed fsync
(`ChunksLost`) and a version dropped by garbage collection (`VersionCollected`) are told to
`listener`, from whichever thread found them, so the relay fetches the chunks again and stops
reporting the version complete (these records, `_Version` and the names of the layout are in
`relay.store_records`). `version_stamp(version)` changes whenever a chunk of the version is
stored again. `StoreBackoff` (pure, in `relay.store_backoff`) says when a full or failing store
may be tried again (`StoreTrouble`: which of the two started its hold).

Manifests are re-opened and re-verified against the trusted publishers when loaded; untrusted or
malformed ones are skipped with a warning (left on disk, with their files: trust lists change).
`collect()` (`relay.store_budget`) drops the complete versions older than the newest
`keep_versions`, and more of the older ones (never the newest complete one) while the kept ones
exceed `budget_bytes`; `put_chunk` runs it when a write would exceed the budget.
`adopt_shared` copies chunks a new version shares with a held one instead of fetching them.

The methods are synchronous and thread-safe (the relay role calls the slow ones through
`trio.to_thread`); one process owns a store at a time (the data directory's lock says which).
`ChunkStore` keeps its state, startup, the chunk puts and reads, verification and the manifests
here; it is built with the mixins `Durability` (`relay.store_durability`), `StoreBudget`
(`relay.store_budget`) and `WholeVersions` (`relay.store_whole`), whose docstrings say which of
its attributes they use. This module and those must not do network I/O and must not import torch.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterable

import blake3

from p2pnet.errors import ConfigError
from p2pnet.files import fsync_dir
from relay.errors import ChunkCorrupt, ChunkMissing, ManifestRejected, StoreFull, VersionUnknown
from relay.manifest import SignedManifest, TEN_YEARS_S, chunk_size, open_manifest
# what moved out stays importable from relay.store: StoreBackoff, StoreTrouble, the events and records
from relay.store_backoff import StoreBackoff, StoreTrouble
from relay.store_budget import StoreBudget
from relay.store_durability import Durability
from relay.store_records import (BITMAP_SUFFIX, MANIFEST_SUFFIX, TMP_PREFIX, ChunkRotten, ChunksLost, StoreEvent,
                                 VersionCollected, _name, _Version)
from relay.store_whole import WholeVersions
from relay.versionfiles import NO_SPACE_ERRNOS, VersionFiles, load_bitmap, remove_path, save_bitmap

log = logging.getLogger(__name__)

MAX_WRITES = 3  # a put writes its chunk again at most this often while fsyncs keep failing under it


def digest_of(data: bytes | bytearray | memoryview) -> bytes:
    return blake3.blake3(data, max_threads=1).digest()


class ChunkStore(Durability, StoreBudget, WholeVersions):
    def __init__(
        self,
        root: Path,
        *,
        budget_bytes: int,
        keep_versions: int = 3,
        trusted_publishers: Collection[str] | None = None,
        fsync: bool = True,
        fsync_batch_chunks: int = 1,
        background_flush: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Open (or create) the store at `root`, resuming what is there.

        With `trusted_publishers`, the stored manifests are loaded now; otherwise call `load`.
        """
        if budget_bytes <= 0 or keep_versions < 1 or fsync_batch_chunks < 1:
            raise ConfigError("relay", "budget_bytes must be > 0, keep_versions and fsync_batch_chunks >= 1")
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.keep_versions = keep_versions
        self._fsync = fsync
        self._batch = fsync_batch_chunks
        self._put_flushes_at = 2 * fsync_batch_chunks if background_flush else fsync_batch_chunks
        self._clock = clock
        self._lock = threading.RLock()
        self._flush_lock = threading.Lock()  # one flush at a time; taken before _lock, never inside it
        self._versions: dict[int, _Version] = {}
        self._puts = 0
        self.durable_flushes = 0  # flushes that recorded chunks as durable (proof the disk takes writes)
        self._used_bytes = 0
        self._reserved_bytes = 0
        self._trusted: frozenset[str] = frozenset()
        self.listener: Callable[[StoreEvent], None] | None = None  # called from any thread
        for sub in ("manifests", "versions"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._sweep()
        if trusted_publishers is not None:
            self.load(trusted_publishers)

    # -- startup ----------------------------------------------------------------------------

    def _sweep(self) -> None:
        """Delete what a crash left behind: temp files, and version folders or bitmaps that no
        stored manifest (trusted or not) names."""
        named = set()
        for path in (self.root / "manifests").iterdir():
            if path.name.startswith(TMP_PREFIX):
                path.unlink(missing_ok=True)
            elif path.name.endswith(MANIFEST_SUFFIX):
                named.add(path.name[:-len(MANIFEST_SUFFIX)])
        for path in (self.root / "versions").iterdir():
            base = path.name[:-len(BITMAP_SUFFIX)] if path.name.endswith(BITMAP_SUFFIX) else path.name
            if base in named:
                continue
            log.info("removing %s from the store: no manifest names it", path.name)
            remove_path(path)

    def load(self, trusted_publishers: Collection[str]) -> list[SignedManifest]:
        """(Re)load the stored manifests, believing only those signed by `trusted_publishers`;
        a version's chunks are what its bitmap claims (unverified until used)."""
        with self._lock:
            self._trusted = frozenset(trusted_publishers)
            for held in self._versions.values():
                held.files.close()
            self._versions = {}
            self._used_bytes = 0
            for path in sorted((self.root / "manifests").glob("*" + MANIFEST_SUFFIX)):
                try:
                    # its timestamp was checked on arrival; only signature and trust matter now
                    signed = open_manifest(path.read_bytes(), trusted_publishers=self._trusted,
                                           now_s=self._clock(), max_future_s=TEN_YEARS_S)
                except ManifestRejected as exc:
                    log.warning("skipping stored manifest %s: %s", path.name, exc)
                    continue
                if path.name != _name(signed) + MANIFEST_SUFFIX:
                    log.warning("skipping stored manifest %s: its name does not match its content", path.name)
                    continue
                try:
                    self._open_version(signed)
                except OSError as exc:  # one version's files, not the store: the others still load
                    log.error("skipping stored version %d (manifest %s): its files in %s cannot be opened: %s",
                              signed.version, path.name, self.version_dir_of(signed), exc)
            return self.manifests()

    def _open_version(self, signed: SignedManifest) -> _Version:
        files = VersionFiles(self.version_dir_of(signed), signed.manifest)
        intact = files.create()
        claimed = load_bitmap(self._bitmap_path(signed), signed.manifest_id, len(signed.manifest.chunk_digests))
        if not intact and claimed:
            log.warning("version %d: its files were missing or resized; fetching it again", signed.version)
            claimed = set()
        held = _Version(signed, files, have=set(claimed), unverified=set(claimed))
        self._versions[signed.version] = held
        self._used_bytes += sum(chunk_size(signed.manifest, i) for i in claimed)
        return held

    # -- chunks -----------------------------------------------------------------------------

    def holds(self, version: int, index: int) -> bool:
        held = self._versions.get(version)
        return held is not None and index in held.have

    @property
    def used_bytes(self) -> int:
        """Bytes of the chunks held (manifests and bitmaps not counted)."""
        return self._used_bytes

    def put_chunk(self, version: int, index: int, data: bytes | bytearray | memoryview, *,
                  sender: str | None = None) -> bool:
        """Store chunk `index` of `version` after checking it against the manifest; False if it
        was already held. The put that completes the version returns once all of it is durable.

        Raises VersionUnknown (no such manifest held: add it first), ChunkCorrupt (blaming
        `sender`) on a wrong length or digest, and StoreFull when the budget or the disk is
        exhausted even after `collect()`; in each case nothing is recorded as held. Raises
        OSError when our disk failed the chunk: a failed fsync lost it with its batch (not held;
        told to the listener), or the flush it was due could not make it durable.
        """
        held = self._held(version)
        manifest = held.signed.manifest
        if not 0 <= index < held.count:
            raise ChunkCorrupt(b"", f"version {version} has no chunk {index}", sender)
        digest = manifest.chunk_digests[index]
        if len(data) != chunk_size(manifest, index) or digest_of(data) != digest:
            raise ChunkCorrupt(digest, sender=sender)
        if index in held.have:
            return self._already_held(held, index)
        self._reserve(len(data))
        try:
            for _ in range(MAX_WRITES):
                failures = held.files.sync_failures
                try:
                    self._write(held, index, data, failures)
                except OSError:
                    if self._versions.get(version) is not held:
                        return False  # collected meanwhile: its files went as we wrote
                    raise
                with self._lock:
                    if self._versions.get(version) is not held:
                        return False  # collected meanwhile
                    if held.files.sync_failures != failures:
                        continue  # an fsync failed while we wrote: our pages may be gone with its batch
                    stored_meanwhile, flush_now = index in held.have, False  # stored by another thread
                    if not stored_meanwhile:
                        held.have.add(index)
                        held.unverified.discard(index)
                        held.unsynced.add(index)
                        self._used_bytes += len(data)
                        self._puts += 1
                        held.stamp = self._puts
                        # without fsync there is nothing to batch: the bitmap is rewritten at once (cheap)
                        flush_now = held.complete or not self._fsync or self.unsynced_chunks >= self._put_flushes_at
                    break
            else:
                raise OSError(errno.EIO, f"fsyncs of version {version}'s files in {held.files.folder} kept failing "
                                         f"while chunk {index} was written {MAX_WRITES} times")
        finally:
            with self._lock:
                self._reserved_bytes -= len(data)
        if stored_meanwhile:
            return self._already_held(held, index)
        if flush_now:
            self._flush_for(held, index)
        return True

    def _write(self, held: _Version, index: int, data: bytes | bytearray | memoryview, failures: int) -> None:
        """Write the chunk at its offsets; StoreFull for a full disk. An fsync that fails on the
        way (closing a file to stay under the open-file limit) loses the version's batch, and its
        error is raised as it is (ENOSPC from an fsync is not StoreFull: see the relay's backoff)."""
        try:
            held.files.write_chunk(index, data)
        except OSError as exc:
            if held.files.sync_failures != failures:
                self._lose_unsynced(held, exc)
                raise  # an fsync's error, ENOSPC too: only a flush that succeeds shows the disk has room
            if exc.errno in NO_SPACE_ERRNOS:
                raise StoreFull(f"no space left for the store at {self.root}: {exc}") from exc
            raise

    def _already_held(self, held: _Version, index: int) -> bool:
        """What a put of a chunk held already returns (False), once its version is durable if it
        is complete: the put that completed it may still be flushing, and the caller may report
        this copy as the version's last chunk (`TransferCore.fetched` takes it from whichever
        source delivers it first)."""
        if held.complete and self._fsync:
            self._flush_for(held, index)  # waits for a flush under way, then makes anything left durable
        return False

    def _save_bitmap(self, held: _Version, durable: set[int]) -> None:
        save_bitmap(self._bitmap_path(held.signed), held.signed.manifest_id, durable, held.count, fsync=self._fsync)

    def read_chunk(self, version: int, index: int) -> bytes:
        """The chunk's bytes, hashed; ChunkMissing if not held or found rotten (then dropped)."""
        held = self._versions.get(version)
        if held is None or index not in held.have:
            raise ChunkMissing(f"chunk {index} of version {version} is not in the store")
        failures = held.files.sync_failures
        try:
            data = held.files.read_chunk(index)
        except OSError as exc:
            if held.files.sync_failures != failures:  # closing a file to open this one failed its fsync
                self._lose_unsynced(held, exc)
            if self._versions.get(version) is held:  # (else collected meanwhile: no trouble of the disk)
                log.warning("reading chunk %d of version %d: %s", index, version, exc)
            data = b""
        if digest_of(data) != held.signed.manifest.chunk_digests[index]:
            if not self._rotten(held, index):
                raise ChunkMissing(f"chunk {index} of version {version} is not in the store (collected)")
            raise ChunkMissing(f"chunk {index} of version {version} was corrupt on disk and is dropped")
        with self._lock:
            held.unverified.discard(index)
        return data

    def _rotten(self, held: _Version, index: int) -> bool:
        """Drop a chunk whose bytes on disk no longer match; False if the version was collected
        meanwhile (its files gone with it: no rot, nothing to drop)."""
        with self._lock:
            if self._versions.get(held.signed.version) is not held:
                return False
            if index not in held.have:
                return True
            log.warning("chunk %d of version %d on disk no longer matches its digest; dropping it",
                        index, held.signed.version)
            held.have.discard(index)
            held.unverified.discard(index)
            held.unsynced.discard(index)
            self._used_bytes -= chunk_size(held.signed.manifest, index)
            durable = held.have - held.unsynced
        try:
            self._save_bitmap(held, durable)
        except OSError as exc:  # (a full or failing disk) the old bitmap still claims it: hashed again at a start
            log.error("version %d: dropping rotten chunk %d from its bitmap failed: %s", held.signed.version,
                      index, exc)
        finally:  # the owner hears of it either way: it is no longer held, and is fetched again
            self._tell(ChunkRotten(held.signed.version, index))
        return True

    def is_durable(self, version: int, index: int) -> bool:
        """Held, and fsynced and recorded in the bitmap (cheap: no I/O)."""
        held = self._versions.get(version)
        return held is not None and index in held.have and index not in held.unsynced

    def is_verified(self, version: int, index: int) -> bool:
        """Held and hashed since it was written or since startup (cheap: no I/O)."""
        held = self._versions.get(version)
        return held is not None and index in held.have and index not in held.unverified

    def ensure_verified(self, version: int, index: int) -> bool:
        """Whether the chunk is held and good, hashing it first if the bitmap only claims it."""
        held = self._versions.get(version)
        if held is None or index not in held.have:
            return False
        if index not in held.unverified:
            return True
        try:
            self.read_chunk(version, index)
        except ChunkMissing:
            return False
        return True

    def segments(self, version: int, index: int) -> list[tuple[Path, int, int]]:
        """Where a held chunk lies: (file, offset, length) pieces, for `os.sendfile`. ChunkMissing
        if it is not held. Call `ensure_verified` first after a restart."""
        held = self._versions.get(version)
        if held is None or index not in held.have:
            raise ChunkMissing(f"chunk {index} of version {version} is not in the store")
        return [(held.files.paths[s.file], s.offset, s.length) for s in held.files.segments(index)]

    def adopt_shared(self, version: int) -> list[int]:
        """Copy into `version` the chunks it shares (by digest) with versions held here, instead
        of fetching them; returns the indices now held."""
        target = self._held(version)
        with self._lock:
            found: dict[bytes, tuple[int, int]] = {}
            for other in self._versions.values():
                if other is not target:
                    for i in other.have:
                        found.setdefault(other.signed.manifest.chunk_digests[i], (other.signed.version, i))
            wanted = [(i, found[d]) for i, d in enumerate(target.signed.manifest.chunk_digests)
                      if i not in target.have and d in found]
        adopted = []
        for index, (held_version, held_index) in wanted:
            try:
                self.put_chunk(version, index, self.read_chunk(held_version, held_index))
            except (ChunkMissing, ChunkCorrupt, VersionUnknown):
                continue  # rotten or collected meanwhile: fetched instead
            adopted.append(index)
        return adopted

    # -- manifests and versions -------------------------------------------------------------

    def add_manifest(self, signed: SignedManifest) -> bool:
        """Keep a checked manifest (from `open_manifest`) and create its files; False if this
        exact one is held. Raises ManifestRejected('version_conflict') for a different manifest
        of a held version."""
        with self._lock:
            held = self._versions.get(signed.version)
            if held is not None:
                if held.signed.manifest_id == signed.manifest_id:
                    return False
                raise ManifestRejected("version_conflict", f"version {signed.version} is already held as "
                                       f"{held.signed.manifest_id.hex()[:16]}", signed.publisher)
            self._write_manifest(signed)
            try:
                self._open_version(signed)
            except BaseException:  # its files cannot be made: no manifest left for a restart to trip on
                (self.root / "manifests" / (_name(signed) + MANIFEST_SUFFIX)).unlink(missing_ok=True)
                raise
            return True

    def _write_manifest(self, signed: SignedManifest) -> None:
        path = self.root / "manifests" / (_name(signed) + MANIFEST_SUFFIX)
        tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
        with open(tmp, "wb") as fh:
            fh.write(signed.frame)
            if self._fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        if self._fsync:
            fsync_dir(path.parent)

    def manifests(self) -> list[SignedManifest]:
        """Every held manifest, oldest version first."""
        with self._lock:
            return [self._versions[v].signed for v in sorted(self._versions)]

    def manifest(self, version: int) -> SignedManifest:
        return self._held(version).signed

    def _held(self, version: int) -> _Version:
        try:
            return self._versions[version]
        except KeyError:
            raise VersionUnknown(f"checkpoint version {version} is not held "
                                 f"(held: {sorted(self._versions) or 'none'})") from None

    def versions(self) -> list[int]:
        return sorted(self._versions)

    def version_dir(self, version: int) -> Path:
        """The folder holding the version's files (complete or not)."""
        return self._held(version).files.folder

    def version_dir_of(self, signed: SignedManifest) -> Path:
        return self.root / "versions" / _name(signed)

    def version_files(self, version: int) -> list[Path]:
        return list(self._held(version).files.paths)

    def _bitmap_path(self, signed: SignedManifest) -> Path:
        return self.root / "versions" / (_name(signed) + BITMAP_SUFFIX)

    def missing(self, signed: SignedManifest) -> list[int]:
        """Indices of the manifest's chunks not held yet, in order."""
        held = self._versions.get(signed.version)
        have = held.have if held is not None and held.signed.manifest_id == signed.manifest_id else set()
        return [i for i in range(len(signed.manifest.chunk_digests)) if i not in have]

    def have_bitmap(self, signed: SignedManifest) -> bytes:
        """Bit i (most significant bit first) set when chunk i is held."""
        missing = set(self.missing(signed))
        return pack_bitmap(i not in missing for i in range(len(signed.manifest.chunk_digests)))

    def is_complete(self, signed: SignedManifest) -> bool:
        held = self._versions.get(signed.version)
        return held is not None and held.signed.manifest_id == signed.manifest_id and held.complete

    def complete_versions(self) -> list[int]:
        with self._lock:
            return sorted(v for v, h in self._versions.items() if h.complete)

    def version_stamp(self, version: int) -> tuple[bytes, int]:
        """Changes whenever one of the version's chunks is stored (again): a loader that refused
        the version tries it again only once its stamp changed. VersionUnknown if not held."""
        held = self._held(version)
        return held.signed.manifest_id, held.stamp

    def progress(self, signed: SignedManifest) -> dict[str, int]:
        """Chunks and bytes held of one version."""
        m = signed.manifest
        missing = set(self.missing(signed))  # once, not once per chunk
        held = [i for i in range(len(m.chunk_digests)) if i not in missing]
        return {"version": m.version, "chunks_have": len(held), "chunks_total": len(m.chunk_digests),
                "bytes_have": sum(chunk_size(m, i) for i in held), "total_bytes": m.total_bytes}

    def status(self) -> dict[str, Any]:
        """What `p2pnet checkpoint status` shows: budget, usage and progress per version."""
        versions = []
        for signed in self.manifests():
            row: dict[str, Any] = {**self.progress(signed)}
            row.update(model=signed.manifest.model, complete=row["chunks_have"] == row["chunks_total"],
                       publisher=signed.publisher, manifest_id=signed.manifest_id.hex(),
                       files=[f.name for f in signed.manifest.files], dir=str(self.version_dir_of(signed)))
            versions.append(row)
        return {"store": str(self.root), "used_bytes": self.used_bytes, "budget_bytes": self.budget_bytes,
                "keep_versions": self.keep_versions, "versions": versions}

    # -- telling the owner, closing ---------------------------------------------------------

    def _tell(self, event: StoreEvent) -> None:
        if self.listener is not None:
            self.listener(event)

    def close(self) -> None:
        """Flush and close every open file (the store may be opened again); a failed flush
        raises once the files are closed."""
        try:
            self.flush()
        finally:
            with self._lock:
                for held in self._versions.values():
                    held.files.close()


def pack_bitmap(bits: Iterable[bool]) -> bytes:
    out = bytearray()
    for i, bit in enumerate(bits):
        if i % 8 == 0:
            out.append(0)
        if bit:
            out[-1] |= 0x80 >> (i % 8)
    return bytes(out)


def unpack_bitmap(bitmap: bytes, count: int) -> list[bool]:
    """The first `count` bits of a bitmap made by `pack_bitmap` (missing bytes read as 0)."""
    return [i // 8 < len(bitmap) and bool(bitmap[i // 8] & (0x80 >> (i % 8))) for i in range(count)]
