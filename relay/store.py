"""The content-addressed chunk store on disk, and the manifests of the versions it holds.

Layout under `root`:

    chunks/ab/abcdef...   one file per chunk, named by the hex blake3 digest of its bytes
    manifests/000000000042-<manifest id hex>.manifest   the signed manifest frame, as received

Theory of operation. A chunk enters only through `put_chunk`, which hashes the bytes first and
writes them to a `.tmp-` name in the chunk's directory. Only once those bytes are fsynced is the
file renamed to its digest (and the directory fsynced), so a chunk name on disk always means a
complete, durable chunk that once hashed right. With `fsync_batch_chunks` > 1 (the relay
peer's setting) fsyncs are batched: a written chunk waits under its temp name (held, readable,
servable) until that many are waiting or `flush()` is called (the relay calls it when a version
completes and when it stops; `publish_files` before returning); then all of them are fsynced,
renamed, and their directories fsynced once. With the default of 1, `put_chunk` returns only
once its chunk is durable; with `fsync=False`
chunks are renamed at once, unsynced (benchmarks and simulations only). The in-memory index
(digest -> size) is rebuilt at startup from the names on disk after deleting leftover temp
files, so a chunk that was not yet durable when the process died is fetched again, never
believed; contents are re-verified lazily: every `read_chunk` hashes what it read, and a chunk
whose bytes no longer match its name is deleted and reported as `ChunkMissing`. `verify_all()`
does the same eagerly. Chunks are shared between versions (stored once).

What the owner hears. A chunk found rotten and deleted (`ChunkRotten`) and a version dropped by
garbage collection (`VersionCollected`) are told to `listener`, from whichever thread found
them, so the relay fetches the chunk again and stops reporting the version complete.
`version_stamp(version)` changes whenever a chunk of the version is stored again, so a loader
that refused a version can tell when its files changed. `StoreBackoff` (pure: no clock, no I/O)
says when a full store may be tried again.

Manifests are re-opened and re-verified against the trusted publishers when loaded; untrusted
or malformed ones are skipped with a warning (left on disk: trust lists change). `collect()`
keeps the newest `keep_versions` complete versions plus any newer incomplete one (a download
in progress), then drops older complete versions (never the newest complete one) while the full
size of what is kept, counting chunks still to come, exceeds `budget_bytes`; it then deletes
every chunk no kept manifest references. `put_chunk` runs it when a write would exceed the
budget. Add a manifest before putting its chunks, or they are garbage.

The methods are synchronous and thread-safe (the relay role calls the slow ones through
`trio.to_thread`); one process owns a store at a time (the data directory's lock says which).
This module must not do network I/O and must not import torch.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterable, Sequence

import blake3

from p2pnet.errors import ConfigError
from p2pnet.files import fsync_dir
from p2pnet.identity import Identity
from relay.errors import (ChunkCorrupt, ChunkMissing, ManifestRejected, NotSafetensors, StoreFull,
                          VersionIncomplete, VersionUnknown)
from relay.manifest import (DEFAULT_CHUNK_BYTES, DIGEST_BYTES, Manifest, SignedManifest, build_manifest,
                            TEN_YEARS_S, chunk_range, chunks_of_file, open_manifest, sign_manifest)

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"
MANIFEST_SUFFIX = ".manifest"
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # what a full disk raises (as OSError.errno)


def digest_of(data: bytes | bytearray | memoryview) -> bytes:
    return blake3.blake3(data, max_threads=1).digest()


@dataclass(frozen=True)
class ChunkRotten:
    """A held chunk no longer matched its digest on disk; it has been deleted."""

    digest: bytes


@dataclass(frozen=True)
class VersionCollected:
    """Garbage collection dropped this version's manifest (and its unshared chunks)."""

    version: int


StoreEvent = ChunkRotten | VersionCollected


class ChunkStore:
    def __init__(
        self,
        root: Path,
        *,
        budget_bytes: int,
        keep_versions: int = 3,
        trusted_publishers: Collection[str] | None = None,
        fsync: bool = True,
        fsync_batch_chunks: int = 1,
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
        self._clock = clock
        self._lock = threading.RLock()
        self._flush_lock = threading.Lock()  # one flush at a time; taken before _lock, never inside it
        self._unsynced: dict[bytes, Path] = {}  # held chunks still under their temp name, not yet fsynced
        self._sizes: dict[bytes, int] = {}
        self._stamps: dict[bytes, int] = {}  # digest -> `_puts` when it was stored (0: found at startup)
        self._puts = 0
        self._used_bytes = 0
        self._reserved_bytes = 0
        self._manifests: dict[int, SignedManifest] = {}
        self._trusted: frozenset[str] = frozenset()
        self.listener: Callable[[StoreEvent], None] | None = None  # called from any thread
        (self.root / "chunks").mkdir(parents=True, exist_ok=True)
        (self.root / "manifests").mkdir(parents=True, exist_ok=True)
        self._scan_chunks()
        if trusted_publishers is not None:
            self.load(trusted_publishers)

    # -- startup ----------------------------------------------------------------------------

    def _scan_chunks(self) -> None:
        for sub in (self.root / "chunks").iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if path.name.startswith(TMP_PREFIX):
                    path.unlink(missing_ok=True)
                    continue
                digest = _parse_digest(path.name)
                if digest is None or path.name[:2] != sub.name:
                    log.warning("ignoring stray file %s in the chunk store", path)
                    continue
                self._sizes[digest] = path.stat().st_size
                self._used_bytes += self._sizes[digest]
        for path in (self.root / "manifests").glob(TMP_PREFIX + "*"):
            path.unlink(missing_ok=True)

    def load(self, trusted_publishers: Collection[str]) -> list[SignedManifest]:
        """(Re)load the stored manifests, believing only those signed by `trusted_publishers`."""
        with self._lock:
            self._trusted = frozenset(trusted_publishers)
            self._manifests = {}
            for path in sorted((self.root / "manifests").glob("*" + MANIFEST_SUFFIX)):
                try:
                    # its timestamp was checked on arrival; only signature and trust matter now
                    signed = open_manifest(path.read_bytes(), trusted_publishers=self._trusted,
                                           now_s=self._clock(), max_future_s=TEN_YEARS_S)
                except ManifestRejected as exc:
                    log.warning("skipping stored manifest %s: %s", path.name, exc)
                    continue
                if path.name != _manifest_name(signed):
                    log.warning("skipping stored manifest %s: its name does not match its content", path.name)
                    continue
                self._manifests[signed.version] = signed
            return self.manifests()

    def verify_all(self) -> list[bytes]:
        """Re-hash every chunk; delete and return the digests of those that no longer match."""
        rotten = []
        for digest in list(self._sizes):
            try:
                self.read_chunk(digest)
            except ChunkMissing:
                rotten.append(digest)
        return rotten

    # -- chunks -----------------------------------------------------------------------------

    def chunk_path(self, digest: bytes) -> Path:
        name = digest.hex()
        return self.root / "chunks" / name[:2] / name

    def has_chunk(self, digest: bytes) -> bool:
        return digest in self._sizes

    @property
    def used_bytes(self) -> int:
        """Bytes of the chunks held (manifests not counted)."""
        return self._used_bytes

    def put_chunk(self, digest: bytes, data: bytes | bytearray | memoryview, *, sender: str | None = None) -> bool:
        """Store a chunk after checking it hashes to `digest`; False if it was already held.

        Raises ChunkCorrupt (blaming `sender`) on a mismatch and StoreFull when the budget or
        the disk is exhausted even after `collect()`; in both cases nothing is left on disk.
        """
        if len(digest) != DIGEST_BYTES or digest_of(data) != digest:
            raise ChunkCorrupt(digest, sender=sender)
        if self.has_chunk(digest):
            return False
        self._reserve(len(data))
        staged = None
        try:
            if self._fsync and self._batch > 1:
                staged = self._write_temp(self.chunk_path(digest), data)
            else:
                self._write_atomically(self.chunk_path(digest), data)
        finally:
            with self._lock:
                self._reserved_bytes -= len(data)
        with self._lock:
            if digest not in self._sizes:
                self._sizes[digest] = len(data)
                self._used_bytes += len(data)
                self._puts += 1
                self._stamps[digest] = self._puts
                if staged is not None:
                    self._unsynced[digest] = staged
            elif staged is not None:
                staged.unlink(missing_ok=True)  # another thread stored it meanwhile
            flush_now = len(self._unsynced) >= self._batch
        if flush_now:
            self.flush()
        return True

    def flush(self) -> int:
        """Make every chunk written so far durable: fsync, rename to its digest, fsync its
        directory. Returns how many chunks it made durable."""
        with self._flush_lock:
            with self._lock:
                batch = dict(self._unsynced)
            for tmp in batch.values():
                try:
                    fd = os.open(tmp, os.O_RDONLY)
                except FileNotFoundError:
                    continue  # forgotten (garbage collected) meanwhile
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            dirs = set()
            with self._lock:
                for digest, tmp in batch.items():
                    if self._unsynced.get(digest) != tmp:
                        continue
                    os.replace(tmp, self.chunk_path(digest))
                    del self._unsynced[digest]
                    dirs.add(tmp.parent)
            for path in dirs:
                fsync_dir(path)
            return len(batch)

    @property
    def unsynced_chunks(self) -> int:
        return len(self._unsynced)

    def _reserve(self, nbytes: int) -> None:
        with self._lock:
            if self.used_bytes + self._reserved_bytes + nbytes > self.budget_bytes:
                self.collect()
            if self.used_bytes + self._reserved_bytes + nbytes > self.budget_bytes:
                raise StoreFull(f"chunk store {self.root} would exceed its budget of {self.budget_bytes} bytes "
                                f"({self.used_bytes} used); raise relay.budget_bytes or keep fewer versions")
            self._reserved_bytes += nbytes

    def has_room(self, nbytes: int) -> bool:
        """Whether a chunk of `nbytes` would fit now: within the budget (after `collect()` if
        needed) and on the disk. A cheap check before fetching while the store was full."""
        with self._lock:
            if self.used_bytes + self._reserved_bytes + nbytes > self.budget_bytes:
                self.collect()
            if self.used_bytes + self._reserved_bytes + nbytes > self.budget_bytes:
                return False
        return shutil.disk_usage(self.root).free >= nbytes

    def _write_temp(self, path: Path, data: bytes | bytearray | memoryview, sync: bool = False) -> Path:
        """`data` in a new temp file next to `path` (fsynced if `sync`); its name."""
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            with open(tmp, "wb", buffering=0) as fh:
                view = memoryview(data)
                while view:
                    view = view[fh.write(view):]
                if sync:
                    os.fsync(fh.fileno())
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in NO_SPACE_ERRNOS:
                raise StoreFull(f"no space left for the chunk store at {self.root}: {exc}") from exc
            raise
        return tmp

    def _write_atomically(self, path: Path, data: bytes | bytearray | memoryview) -> None:
        tmp = self._write_temp(path, data, sync=self._fsync)
        try:
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        if self._fsync:
            fsync_dir(path.parent)

    def read_chunk(self, digest: bytes) -> bytes:
        """The chunk's bytes, re-hashed; ChunkMissing if not held or found rotten (then deleted)."""
        if not self.has_chunk(digest):
            raise ChunkMissing(f"chunk {digest.hex()[:16]} is not in the store")
        data = b""
        for path in (self._unsynced.get(digest), self.chunk_path(digest)):  # a flush may rename it meanwhile
            if path is None:
                continue
            try:
                data = path.read_bytes()
                break
            except FileNotFoundError:
                continue
        if digest_of(data) != digest:
            log.warning("chunk %s on disk no longer matches its digest; deleting it", digest.hex()[:16])
            self._forget(digest)
            self._tell(ChunkRotten(digest))
            raise ChunkMissing(f"chunk {digest.hex()[:16]} was corrupt on disk and has been deleted")
        return data

    def _forget(self, digest: bytes) -> None:
        with self._lock:
            self._used_bytes -= self._sizes.pop(digest, 0)
            self._stamps.pop(digest, None)
            staged = self._unsynced.pop(digest, None)
            if staged is not None:
                staged.unlink(missing_ok=True)
            self.chunk_path(digest).unlink(missing_ok=True)

    # -- manifests and versions -------------------------------------------------------------

    def add_manifest(self, signed: SignedManifest) -> bool:
        """Keep a checked manifest (from `open_manifest`); False if this exact one is held.

        Raises ManifestRejected('version_conflict') for a different manifest of a held version.
        """
        with self._lock:
            held = self._manifests.get(signed.version)
            if held is not None:
                if held.manifest_id == signed.manifest_id:
                    return False
                raise ManifestRejected("version_conflict", f"version {signed.version} is already held as "
                                       f"{held.manifest_id.hex()[:16]}", signed.publisher)
            self._write_atomically(self.root / "manifests" / _manifest_name(signed), signed.frame)
            self._manifests[signed.version] = signed
            return True

    def manifests(self) -> list[SignedManifest]:
        """Every held manifest, oldest version first."""
        with self._lock:
            return [self._manifests[v] for v in sorted(self._manifests)]

    def manifest(self, version: int) -> SignedManifest:
        try:
            return self._manifests[version]
        except KeyError:
            raise VersionUnknown(f"checkpoint version {version} is not held "
                                 f"(held: {sorted(self._manifests) or 'none'})") from None

    def versions(self) -> list[int]:
        return sorted(self._manifests)

    def missing(self, signed: SignedManifest) -> list[int]:
        """Indices of the manifest's chunks not held yet, in order."""
        return [i for i, d in enumerate(signed.manifest.chunk_digests) if d not in self._sizes]

    def have_bitmap(self, signed: SignedManifest) -> bytes:
        """Bit i (most significant bit first) set when chunk i is held."""
        return pack_bitmap(d in self._sizes for d in signed.manifest.chunk_digests)

    def is_complete(self, signed: SignedManifest) -> bool:
        return all(d in self._sizes for d in signed.manifest.chunk_digests)

    def complete_versions(self) -> list[int]:
        return [s.version for s in self.manifests() if self.is_complete(s)]

    def version_stamp(self, version: int) -> tuple[bytes, int]:
        """Changes whenever one of the version's chunks is stored (again): a loader that refused
        the version tries it again only once its stamp changed. VersionUnknown if not held."""
        with self._lock:
            signed = self.manifest(version)
            stamps = self._stamps
            return signed.manifest_id, max((stamps.get(d, 0) for d in signed.manifest.chunk_digests), default=0)

    def progress(self, signed: SignedManifest) -> dict[str, int]:
        """Chunks and bytes held of one version."""
        m = signed.manifest
        held = [i for i, d in enumerate(m.chunk_digests) if d in self._sizes]
        held_bytes = sum(chunk_range(m, i)[1] - chunk_range(m, i)[0] for i in held)
        return {"version": m.version, "chunks_have": len(held), "chunks_total": len(m.chunk_digests),
                "bytes_have": held_bytes, "total_bytes": m.total_bytes}

    def status(self) -> dict[str, object]:
        """What `p2pnet checkpoint status` shows: budget, usage and progress per version."""
        versions = []
        for signed in self.manifests():
            row = self.progress(signed)
            row.update(model=signed.manifest.model, complete=row["chunks_have"] == row["chunks_total"],
                       publisher=signed.publisher, manifest_id=signed.manifest_id.hex(),
                       files=[f.name for f in signed.manifest.files])
            versions.append(row)
        return {"store": str(self.root), "used_bytes": self.used_bytes, "budget_bytes": self.budget_bytes,
                "keep_versions": self.keep_versions, "versions": versions}

    def should_fetch(self, version: int) -> bool:
        """False for versions garbage collection would drop anyway (older than the kept ones)."""
        complete = self.complete_versions()
        return len(complete) < self.keep_versions or version > complete[-self.keep_versions]

    # -- garbage collection -----------------------------------------------------------------

    def collect(self) -> dict[str, object]:
        """Drop old versions and unreferenced chunks (see the module docstring); a summary."""
        with self._lock:
            keep = self._versions_to_keep()
            dropped = sorted(v for v in self._manifests if v not in keep)
            for version in dropped:
                signed = self._manifests.pop(version)
                (self.root / "manifests" / _manifest_name(signed)).unlink(missing_ok=True)
            referenced = {d for s in self._manifests.values() for d in s.manifest.chunk_digests}
            garbage = [d for d in self._sizes if d not in referenced]
            freed = sum(self._sizes[d] for d in garbage)
            for digest in garbage:
                self._forget(digest)
            for version in dropped:
                self._tell(VersionCollected(version))
            return {"dropped_versions": dropped, "deleted_chunks": len(garbage), "freed_bytes": freed}

    def _tell(self, event: StoreEvent) -> None:
        if self.listener is not None:
            self.listener(event)

    def _versions_to_keep(self) -> set[int]:
        complete = self.complete_versions()
        newest_complete = complete[-1] if complete else -1
        keep_complete = complete[-self.keep_versions:]
        downloading = [v for v in self._manifests if v > newest_complete]
        while len(keep_complete) > 1 and self._footprint(keep_complete + downloading) > self.budget_bytes:
            keep_complete = keep_complete[1:]  # over budget: drop the oldest, never the newest
        return set(keep_complete) | set(downloading)

    def _footprint(self, versions: Iterable[int]) -> int:
        """Bytes these versions take once complete (shared chunks counted once)."""
        sizes: dict[bytes, int] = {}
        for v in versions:
            m = self._manifests[v].manifest
            for i, d in enumerate(m.chunk_digests):
                sizes[d] = min(m.chunk_bytes, m.total_bytes - i * m.chunk_bytes)
        return sum(sizes.values())

    # -- files in and out -------------------------------------------------------------------

    def export_version(self, version: int, out_dir: Path) -> list[Path]:
        """Write the version's files byte-identically into `out_dir` (each atomically)."""
        signed = self.manifest(version)
        missing = self.missing(signed)
        if missing:
            raise VersionIncomplete(f"checkpoint version {version} lacks {len(missing)} of "
                                    f"{len(signed.manifest.chunk_digests)} chunks")
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for entry in signed.manifest.files:
            path = out_dir / entry.name
            tmp = out_dir / f"{TMP_PREFIX}{entry.name}.{os.getpid()}"
            try:
                with open(tmp, "wb") as fh:
                    for block in self.iter_file(signed, entry.name):
                        fh.write(block)
                    fh.flush()
                    if self._fsync:
                        os.fsync(fh.fileno())
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            paths.append(path)
        if self._fsync:
            fsync_dir(out_dir)
        return paths

    def iter_file(self, signed: SignedManifest, name: str) -> Iterable[bytes]:
        """The bytes of one file of a complete version, chunk by chunk (each re-verified)."""
        m = signed.manifest
        entry = next((f for f in m.files if f.name == name), None)
        if entry is None:
            raise VersionUnknown(f"version {m.version} has no file {name!r}")
        file_start, file_end = entry.offset, entry.offset + entry.size
        for index in chunks_of_file(m, entry):
            start, end = chunk_range(m, index)
            data = self.read_chunk(m.chunk_digests[index])
            yield data[max(file_start, start) - start: min(file_end, end) - start]

    def publish_files(
        self,
        identity: Identity,
        paths: Sequence[Path],
        *,
        model: str,
        version: int,
        previous_version: int = -1,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        now_s: float,
    ) -> SignedManifest:
        """The trainer's side: build and sign a manifest, store every chunk, then the manifest."""
        if version in self._manifests:
            raise ConfigError("version", f"version {version} is already published in {self.root}")
        try:
            manifest = build_manifest(paths, model=model, version=version, previous_version=previous_version,
                                      chunk_bytes=chunk_bytes, now_ms=int(now_s * 1000))
        except NotSafetensors:
            raise
        except ValueError as exc:
            raise ConfigError("checkpoint", str(exc)) from exc
        signed = sign_manifest(identity, manifest, now_s)
        with self._lock:
            self._manifests[version] = signed  # so collect() during the puts keeps its chunks
        try:
            for index, digest in enumerate(manifest.chunk_digests):
                if not self.has_chunk(digest):
                    self.put_chunk(digest, _read_range(paths, manifest, index))
        except ChunkCorrupt as exc:
            with self._lock:
                del self._manifests[version]
            raise ConfigError("checkpoint", "a file changed while it was being published") from exc
        except BaseException:
            with self._lock:
                del self._manifests[version]
            raise
        with self._lock:
            del self._manifests[version]
        self.flush()
        self.add_manifest(signed)
        return signed


class StoreBackoff:
    """When to try a full store again: pure (times are passed in), for the relay's fetching.

    The first failure starts a hold of `first_s`; a failure after a hold ended (the probe found
    the store still full) starts the next one, twice as long, up to `max_s`; failures inside a
    hold (requests that were already out) change nothing. `failed` returns the end of a new hold,
    once per hold, so the caller says so once per interval, not once per chunk. A store that
    succeeds ends the backoff (`succeeded` is True when one was running).
    """

    def __init__(self, first_s: float = 1.0, max_s: float = 60.0) -> None:
        if not 0 < first_s <= max_s:
            raise ConfigError("relay", "store backoff needs 0 < first_s <= max_s")
        self.first_s = first_s
        self.max_s = max_s
        self.hold_s = 0.0  # the current (or last) hold's length; 0 when not backing off
        self.until = -float("inf")
        self.failures = 0

    @property
    def active(self) -> bool:
        """The store was full and nothing has been stored since."""
        return self.hold_s > 0

    def failed(self, now: float) -> float | None:
        """A store failed for lack of space: the end of a new hold, or None inside the current one."""
        self.failures += 1
        if now < self.until:
            return None
        self.hold_s = self.first_s if not self.active else min(2 * self.hold_s, self.max_s)
        self.until = now + self.hold_s
        return self.until

    def succeeded(self) -> bool:
        """A store succeeded: back to normal. True if that ended a backoff."""
        was = self.active
        self.hold_s, self.until = 0.0, -float("inf")
        return was

    def to_json(self, now: float) -> dict[str, object]:
        return {"backing_off": self.active, "hold_s": self.hold_s,
                "retry_in_s": round(max(self.until - now, 0.0), 3) if self.active else 0.0,
                "failed_stores": self.failures}


def _read_range(paths: Sequence[Path], manifest: Manifest, index: int) -> bytes:
    """Chunk `index` of the concatenated files, read back from the source files."""
    start, end = chunk_range(manifest, index)
    parts = []
    for path, entry in zip(paths, manifest.files):
        lo, hi = max(start, entry.offset), min(end, entry.offset + entry.size)
        if lo < hi:
            with open(path, "rb") as fh:
                fh.seek(lo - entry.offset)
                parts.append(fh.read(hi - lo))
    return b"".join(parts)


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


def _manifest_name(signed: SignedManifest) -> str:
    return f"{signed.version:012d}-{signed.manifest_id.hex()}{MANIFEST_SUFFIX}"


def _parse_digest(name: str) -> bytes | None:
    if len(name) != 2 * DIGEST_BYTES:
        return None
    try:
        return bytes.fromhex(name)
    except ValueError:
        return None


