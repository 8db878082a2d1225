"""The checkpoint store's records: the names of its files on disk, what it holds of one version,
and the events it tells its owner.

`TMP_PREFIX`, `MANIFEST_SUFFIX`, `BITMAP_SUFFIX` and `_name` make the names of the layout under
the store's root (see `relay.store`). `_Version` is what `relay.store.ChunkStore` holds of one
version: its signed manifest, its open files (`relay.versionfiles.VersionFiles`), which chunks
are held, which of them are unverified (claimed by the bitmap at startup) and which unsynced
(written since the last flush), its stamp and the fsync failures already taken as a loss.
`ChunkRotten`, `ChunksLost` and `VersionCollected` are what the store tells its `listener`.

Plain records, no decisions and no I/O. Used by the store and the mixins it is built from
(`relay.store_durability`, `relay.store_budget`, `relay.store_whole`); it imports none of them,
so they import it without importing the store. `relay.store` exports the public names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relay.manifest import SignedManifest
from relay.versionfiles import VersionFiles

TMP_PREFIX = ".tmp-"
MANIFEST_SUFFIX = ".manifest"
BITMAP_SUFFIX = ".have"


@dataclass(frozen=True)
class ChunkRotten:
    """A held chunk no longer matched its digest on disk; it is no longer held."""

    version: int
    index: int


@dataclass(frozen=True)
class ChunksLost:
    """An fsync of the version's files failed: these chunks, written since its last flush, may
    not be on disk; they are no longer held (a new put writes them again)."""

    version: int
    indices: tuple[int, ...]


@dataclass(frozen=True)
class VersionCollected:
    """Garbage collection dropped this version (manifest, files and bitmap)."""

    version: int


StoreEvent = ChunkRotten | ChunksLost | VersionCollected


@dataclass
class _Version:
    signed: SignedManifest
    files: VersionFiles
    have: set[int] = field(default_factory=set)  # held: verified on arrival, or claimed by the bitmap
    unverified: set[int] = field(default_factory=set)  # claimed by the bitmap at startup, not hashed since
    unsynced: set[int] = field(default_factory=set)  # written since the last flush: not in the bitmap yet
    stamp: int = 0  # the store's put counter when a chunk of this version was last stored
    failures_seen: int = 0  # `files.sync_failures` when the last loss was taken (`_lose_unsynced`)
    pins: int = 0  # exports under way: garbage collection leaves the version alone meanwhile

    @property
    def count(self) -> int:
        return len(self.signed.manifest.chunk_digests)

    @property
    def complete(self) -> bool:
        return len(self.have) == self.count

    @property
    def durably_complete(self) -> bool:
        """Complete and all of it fsynced and in the bitmap (the put that completed it has flushed)."""
        return self.complete and not self.unsynced



def _name(signed: SignedManifest) -> str:
    return f"{signed.version:012d}-{signed.manifest_id.hex()}"
