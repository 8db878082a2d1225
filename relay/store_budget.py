"""The checkpoint store's budget: room reserved for what is about to be written, and garbage
collection.

Mixed into `relay.store.ChunkStore` (`StoreBudget`): `_reserve` counts the bytes a put or a
publish is about to write against `budget_bytes` (collecting first where they would not fit, and
raising StoreFull where they still do not); `has_room` is the cheap check before fetching again
while the store was full; `collect` drops old versions (manifest, files and bitmap) and tells
the listener (`VersionCollected`); `should_fetch` says which versions it would drop anyway.

`collect()` keeps the newest `keep_versions` complete versions plus any newer incomplete one (a
download in progress), then drops older complete versions (never the newest complete one) while
their full size exceeds `budget_bytes`. `put_chunk` runs it when a write would exceed the budget.
A version counts as complete here only once it is durable (a failed flush of its last batch
would leave it incomplete, and its predecessor gone), and a version being exported (`pins`,
`export_version`) is kept until its files are handed out. What cannot be deleted is logged as our
disk's error and stays on disk, outside the budget's count (`relay.versionfiles.remove_path`).

These methods read and change the store's versions (`_versions`), `_used_bytes` and
`_reserved_bytes` under its `_lock`, read its `root`, `budget_bytes`, `keep_versions` and
`used_bytes`, and call its `complete_versions`, `_bitmap_path` and `_tell`. No network I/O.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from relay.errors import StoreFull
from relay.manifest import chunk_size
from relay.store_records import MANIFEST_SUFFIX, VersionCollected, _name
from relay.versionfiles import remove_path

if TYPE_CHECKING:
    from relay.manifest import SignedManifest
    from relay.store_records import StoreEvent, _Version


class StoreBudget:
    """The budget and garbage collection of `relay.store.ChunkStore` (see the module docstring)."""

    # the store's state these methods use (`ChunkStore.__init__` sets it)
    root: Path
    budget_bytes: int
    keep_versions: int
    _lock: threading.RLock
    _versions: dict[int, _Version]
    _used_bytes: int
    _reserved_bytes: int

    if TYPE_CHECKING:  # what these call on the store (`relay.store.ChunkStore` or another of its mixins)
        @property
        def used_bytes(self) -> int: ...
        def _bitmap_path(self, signed: SignedManifest) -> Path: ...
        def _tell(self, event: StoreEvent) -> None: ...
        def complete_versions(self) -> list[int]: ...

    def _reserve(self, nbytes: int, *, incoming: bool = False) -> None:
        """Count `nbytes` about to be written against the budget, collecting first if needed;
        `incoming`: they are a whole new complete version, which may replace every held one."""
        with self._lock:
            if self.used_bytes + self._reserved_bytes + nbytes > self.budget_bytes:
                self.collect(room_for=nbytes if incoming else 0)
            if self.used_bytes + self._reserved_bytes + nbytes > self.budget_bytes:
                raise StoreFull(f"store {self.root} would exceed its budget of {self.budget_bytes} bytes "
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

    def collect(self, room_for: int = 0) -> dict[str, object]:
        """Drop old versions: manifest, files and bitmap (see the module docstring); a summary.
        With `room_for`, a new complete version of that size is coming (a publish): it counts
        as the newest, so every held complete version may go to make room for it."""
        with self._lock:
            keep = self._versions_to_keep(room_for)
            dropped = sorted(v for v in self._versions if v not in keep)
            freed, left = 0, []
            for version in dropped:
                held = self._versions.pop(version)
                nbytes = sum(chunk_size(held.signed.manifest, i) for i in held.have)
                self._used_bytes -= nbytes
                held.files.close()
                # the manifest first: a folder left behind is swept at the next start (nothing names it)
                gone = remove_path(self.root / "manifests" / (_name(held.signed) + MANIFEST_SUFFIX))
                gone = remove_path(self._bitmap_path(held.signed)) and gone
                if remove_path(held.files.folder) and gone:
                    freed += nbytes
                else:
                    left.append(version)
        for version in dropped:
            self._tell(VersionCollected(version))
        # `left`: dropped, but some of their files could not be deleted (logged): still on disk
        return {"dropped_versions": dropped, "freed_bytes": freed, "left_on_disk": left}

    def _versions_to_keep(self, room_for: int = 0) -> set[int]:
        # complete here means durable too: the put that completed a version may still be flushing,
        # and if that flush fails the version is incomplete again, so the one before must still be here
        complete = sorted(v for v, h in self._versions.items() if h.durably_complete)
        newest_complete = complete[-1] if complete else -1
        keep_complete = complete[-self.keep_versions:]
        downloading = [v for v in self._versions if v > newest_complete]
        while len(keep_complete) > (0 if room_for else 1) and \
                self._footprint(keep_complete + downloading) + room_for > self.budget_bytes:
            keep_complete = keep_complete[1:]  # over budget: drop the oldest, never the newest
        exporting = {v for v, h in self._versions.items() if h.pins}  # kept until their export is done
        return set(keep_complete) | set(downloading) | exporting

    def _footprint(self, versions: list[int]) -> int:
        """Bytes these versions take once complete."""
        return sum(self._versions[v].signed.manifest.total_bytes for v in versions)

    def should_fetch(self, version: int) -> bool:
        """False for versions garbage collection would drop anyway (older than the kept ones)."""
        complete = self.complete_versions()
        return len(complete) < self.keep_versions or version > complete[-self.keep_versions]
