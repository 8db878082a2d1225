"""The checkpoint format: a signed manifest of files cut into blake3-named chunks.

Theory of operation. A checkpoint version is one or more files: safetensors weights and
whatever else travels with them (tokenizer, config, data shards). Concatenated in manifest order
they form one byte string of `total_bytes`, cut into chunks of `chunk_bytes` (the last one
shorter). The manifest lists each file (name, size, offset in the concatenation, and, for a
file named `*.safetensors`, its tensor index with byte ranges relative to the file; other files
have none) and the 32-byte blake3 digest of every chunk. The trainer signs the manifest with its peer key through the one wire
codec; a peer believes a manifest only when `open_manifest` finds it well formed and signed by
a trusted publisher, and believes a chunk only when its bytes hash to the manifest's digest.

Every invariant a receiver relies on is checked in `__post_init__`, so a decoded `Manifest` is
always internally consistent (sizes add up, digest count matches, names are safe file names).

This module must not do any I/O except reading the files given to `build_manifest`, and must
not import torch.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Collection, Sequence, TypeVar

import blake3

from p2pnet.errors import ConfigError, MessageRejected
from p2pnet.identity import Identity
from p2pnet.wire import Codec, message
from relay.errors import ManifestRejected, NotSafetensors
from relay.safetensors_check import HeaderTensor, read_safetensors_header

MANIFEST_KIND = "relay/manifest"
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
DIGEST_BYTES = 32
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024  # 1 GiB to 8 local peers: 4 MiB chunks cost 20% more CPU (BENCHMARKS.md)
MAX_CHUNK_BYTES = 64 * 1024 * 1024
MAX_FILES = 10_000
MAX_NAME_BYTES = 200  # UTF-8; the filesystem's limit is 255 bytes, and a store's temp names add up to ~30
MAX_TENSOR_NAME_CHARS = 1024
MAX_DIMS = 16
READ_BLOCK_BYTES = 1024 * 1024
HASH_THREADS = min(4, len(os.sched_getaffinity(0)))  # a publish hashes on this many cores
TEN_YEARS_S = 10 * 365 * 24 * 3600.0
_T = TypeVar("_T")
_R = TypeVar("_R")


def is_safe_name(name: str) -> bool:
    """A plain file name: no directories, no hidden or dot names, no control characters, and
    short enough in bytes for every filesystem with its temp names (`MAX_NAME_BYTES`)."""
    return (
        0 < len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
        and all(ord(c) >= 32 for c in name)
    )


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file; [start, end) are byte offsets relative to the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 < len(self.name) <= MAX_TENSOR_NAME_CHARS:
            raise ValueError("tensor name empty or too long")
        if not 0 < len(self.dtype) <= 16:
            raise ValueError("tensor dtype empty or too long")
        if len(self.shape) > MAX_DIMS or any(d < 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: bad shape")
        if not 0 <= self.start <= self.end:
            raise ValueError(f"tensor {self.name!r}: bad byte range")


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a checkpoint: `size` bytes at `offset` within the concatenation of all files."""

    name: str
    size: int
    offset: int
    tensors: tuple[TensorEntry, ...]

    def __post_init__(self) -> None:
        if not is_safe_name(self.name):
            raise ValueError(f"unsafe file name {self.name[:64]!r}: a file name of 1-{MAX_NAME_BYTES} UTF-8 bytes is "
                             "needed, without '/', '\\', a leading '.' or control characters")
        if self.size < 0 or self.offset < 0:
            raise ValueError(f"file {self.name!r}: negative size or offset")
        if any(t.end > self.size for t in self.tensors):
            raise ValueError(f"file {self.name!r}: a tensor lies beyond the end of the file")


@message(MANIFEST_KIND, max_bytes=MAX_MANIFEST_BYTES)
@dataclass(frozen=True, slots=True)
class Manifest:
    """Checkpoint `version` of `model`: its files, chunking and the blake3 digest of each chunk.

    Invariants: version >= 0; -1 <= previous_version < version; files are non-empty, uniquely
    and safely named, laid end to end from offset 0 with sizes summing to total_bytes; tensor
    names are unique across files; 1 <= chunk_bytes <= 64 MiB; exactly ceil(total_bytes /
    chunk_bytes) digests of 32 bytes each.
    """

    model: str
    version: int
    previous_version: int
    files: tuple[FileEntry, ...]
    chunk_bytes: int
    total_bytes: int
    chunk_digests: tuple[bytes, ...]
    created_ms: int

    def __post_init__(self) -> None:
        if not 0 < len(self.model) <= 256:
            raise ValueError("model name empty or too long")
        if self.version < 0 or not -1 <= self.previous_version < self.version:
            raise ValueError("version must be >= 0 and previous_version in [-1, version)")
        if not 1 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}]")
        if self.created_ms < 0:
            raise ValueError("created_ms must be >= 0")
        _check_files(self.files, self.total_bytes)
        if len(self.chunk_digests) != -(-self.total_bytes // self.chunk_bytes):
            raise ValueError("digest count does not match total_bytes / chunk_bytes")
        if any(len(d) != DIGEST_BYTES for d in self.chunk_digests):
            raise ValueError(f"every chunk digest must have {DIGEST_BYTES} bytes")


def _check_files(files: tuple[FileEntry, ...], total_bytes: int) -> None:
    if not 0 < len(files) <= MAX_FILES:
        raise ValueError(f"a manifest lists 1 to {MAX_FILES} files")
    if len({f.name for f in files}) != len(files):
        raise ValueError("file names must be unique")
    offset = 0
    for f in files:
        if f.offset != offset:
            raise ValueError(f"file {f.name!r} is not at offset {offset}")
        offset += f.size
    if offset != total_bytes:
        raise ValueError("file sizes do not add up to total_bytes")
    names = [t.name for f in files for t in f.tensors]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique across files")


def chunk_count(manifest: Manifest) -> int:
    return len(manifest.chunk_digests)


def chunk_range(manifest: Manifest, index: int) -> tuple[int, int]:
    """[start, end) of chunk `index` within the concatenation of the manifest's files."""
    if not 0 <= index < len(manifest.chunk_digests):
        raise IndexError(f"chunk {index} out of range (0..{len(manifest.chunk_digests) - 1})")
    start = index * manifest.chunk_bytes
    return start, min(start + manifest.chunk_bytes, manifest.total_bytes)


def chunk_size(manifest: Manifest, index: int) -> int:
    start, end = chunk_range(manifest, index)
    return end - start


def chunks_of_file(manifest: Manifest, entry: FileEntry) -> range:
    """Indices of the chunks that hold any byte of `entry`."""
    if entry.size == 0:
        return range(0)
    first = entry.offset // manifest.chunk_bytes
    last = (entry.offset + entry.size - 1) // manifest.chunk_bytes
    return range(first, last + 1)


# -- building -----------------------------------------------------------------------------


def build_manifest(
    paths: Sequence[Path],
    *,
    model: str,
    version: int,
    previous_version: int = -1,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    now_ms: int,
) -> Manifest:
    """Index and hash files (streamed, never whole in memory) into a Manifest; each file is
    read once. Files named `*.safetensors` are indexed (`is_safetensors`), others carried as bytes.

    Raises ConfigError for a missing file, NotSafetensors for a `*.safetensors` file that is
    not one, and ValueError for bad arguments (no files, a version or chunk size the Manifest
    invariants refuse).
    """
    if not paths:
        raise ValueError("publish at least one file")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
    entries: list[FileEntry] = []
    offset = 0
    for path in paths:
        path = Path(path)
        try:
            with open(path, "rb") as fh:
                size = _file_size(fh)
                tensors = read_safetensors_index(fh, size, path) if is_safetensors(path.name) else ()
        except FileNotFoundError as exc:
            raise ConfigError(str(path), "no such file to publish") from exc
        except IsADirectoryError as exc:
            raise ConfigError(str(path), "is a directory; publish the files in it") from exc
        entries.append(FileEntry(path.name, size, offset, tensors))
        offset += size
    digests = _hash_chunks([Path(p) for p in paths], entries, chunk_bytes, offset)
    return Manifest(model, version, previous_version, tuple(entries), chunk_bytes, offset, digests, now_ms)


def is_safetensors(name: str) -> bool:
    """Whether a checkpoint file is safetensors weights (indexed, loaded) by its name."""
    return name.endswith(".safetensors")


def _file_size(fh: BinaryIO) -> int:
    fh.seek(0, 2)
    size = fh.tell()
    fh.seek(0)
    return size


def side_by_side(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """`fn` of each of `items`, in order, run on up to `HASH_THREADS` threads (one when there is
    one item): for work that releases the GIL, as blake3's hashing and file reads do."""
    threads = min(HASH_THREADS, len(items))
    if threads <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(threads, thread_name_prefix="hash") as pool:
        return list(pool.map(fn, items))


def _hash_chunks(paths: Sequence[Path], entries: Sequence[FileEntry], chunk_bytes: int,
                 total: int) -> tuple[bytes, ...]:
    """The blake3 digest of every chunk of the files' concatenation, chunks hashed side by side
    (`side_by_side`): each reads its chunk's byte ranges with `os.preadv` into a block of its own,
    so a publish reads every byte once and costs the trainer about the time of one core's share of
    the hashing, not all of it."""
    return tuple(side_by_side(lambda start: _hash_chunk(paths, entries, start, min(chunk_bytes, total - start)),
                              range(0, total, chunk_bytes)))


def _hash_chunk(paths: Sequence[Path], entries: Sequence[FileEntry], start: int, length: int) -> bytes:
    """The digest of bytes [start, start + length) of the concatenation; ConfigError naming the
    file if one turns out shorter than its size when it was indexed (changed while published)."""
    hasher = blake3.blake3(max_threads=1)
    block = bytearray(min(READ_BLOCK_BYTES, length))
    view = memoryview(block)
    end = start + length
    for path, entry in zip(paths, entries):
        lo, hi = max(start, entry.offset), min(end, entry.offset + entry.size)
        if lo >= hi:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            at = lo - entry.offset
            while at < hi - entry.offset:
                want = min(len(block), hi - entry.offset - at)
                got = os.preadv(fd, [view[:want]], at)
                if got <= 0:
                    raise ConfigError(str(path), f"changed while it was being published: {at} bytes read "
                                                 f"of the {entry.size} it had")
                hasher.update(view[:got])
                at += got
        finally:
            os.close(fd)
    return hasher.digest()


def read_safetensors_index(fh: BinaryIO, size: int, path: object = "<bytes>") -> tuple[TensorEntry, ...]:
    """A safetensors file's tensor entries (byte ranges relative to the file), in data order.

    NotSafetensors unless `safetensors.torch.load` would load the file (relay.safetensors_check)
    and the manifest can hold its entries (names, dtypes and ranks within the manifest's limits).
    """
    tensors = read_safetensors_header(fh, size, path)
    data_start = size - (tensors[-1].end if tensors else 0)  # the tensors end exactly at the file's end
    return tuple(_tensor_entry(path, t, data_start) for t in tensors)


def _tensor_entry(path: object, t: HeaderTensor, data_start: int) -> TensorEntry:
    try:
        return TensorEntry(t.name, t.dtype, t.shape, data_start + t.begin, data_start + t.end)
    except ValueError as exc:
        raise NotSafetensors(path, f"tensor {t.name[:64]!r} does not fit a manifest: {exc}") from exc


# -- signing ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignedManifest:
    """A manifest with the exact signed frame it came in; `manifest_id` = blake3(frame)."""

    manifest: Manifest
    frame: bytes
    publisher: str
    manifest_id: bytes

    @property
    def version(self) -> int:
        return self.manifest.version


def sign_manifest(identity: Identity, manifest: Manifest, now_s: float) -> SignedManifest:
    frame = Codec(identity).encode(manifest, now_s)
    return SignedManifest(manifest, frame, identity.peer_id, blake3.blake3(frame).digest())


def open_manifest(
    frame: bytes,
    *,
    trusted_publishers: Collection[str],
    now_s: float,
    max_age_s: float = TEN_YEARS_S,
    max_future_s: float = 300.0,
) -> SignedManifest:
    """Check a signed manifest frame; raises only ManifestRejected.

    Old manifests are fine (a checkpoint may be fetched long after it was published); one
    stamped more than `max_future_s` ahead of `now_s` is not.
    """
    codec = Codec(None, max_age_s=max_age_s, max_future_s=max_future_s)
    try:
        kind, signer = codec.precheck(frame)  # the signer is checked before the body is decoded
        if kind == MANIFEST_KIND and signer not in trusted_publishers:
            raise ManifestRejected("untrusted_publisher", f"signed by {signer}", signer)
        envelope = codec.decode(frame, now_s)
    except MessageRejected as exc:
        raise ManifestRejected(exc.reason, exc.detail, exc.sender) from exc
    if envelope.kind != MANIFEST_KIND:
        raise ManifestRejected("wrong_kind", envelope.kind[:64], envelope.sender)
    if envelope.sender not in trusted_publishers:
        raise ManifestRejected("untrusted_publisher", f"signed by {envelope.sender}", envelope.sender)
    frame = bytes(frame)
    return SignedManifest(envelope.body, frame, envelope.sender, blake3.blake3(frame).digest())
