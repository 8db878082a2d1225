"""Loading a complete checkpoint version into torch, and watching for new complete versions.

`load_state_dict(store, version)` rebuilds each safetensors file from the store's chunks (each
chunk re-hashed on read, so no byte is believed that does not match the signed manifest) and
parses it with safetensors. This is the only relay module that imports torch, and it does so
lazily inside the function, so a relay peer never loads torch.

`VersionWatcher` tells interested code (a worker's weight reloader, `checkpoint fetch`) when a
version becomes complete. It is a plain object: the relay role calls `mark_complete` (or
`update_from(store)`) from the trio thread; consumers register callbacks or iterate
`async for version in watcher.subscribe()`.

This module must not do network I/O.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import trio

from relay.errors import VersionIncomplete
from relay.store import ChunkStore


def load_state_dict(store: ChunkStore, version: int) -> dict[str, Any]:
    """The tensors of a complete version, by name: `dict[str, torch.Tensor]` on the CPU.

    Raises VersionUnknown / VersionIncomplete, and ChunkMissing if a chunk rotted on disk.
    """
    import torch
    from safetensors.torch import load

    torch.set_num_threads(1)
    signed = store.manifest(version)
    if not store.is_complete(signed):
        raise VersionIncomplete(f"checkpoint version {version} is not complete in {store.root}")
    state: dict[str, Any] = {}
    for entry in signed.manifest.files:
        tensors = load(b"".join(store.iter_file(signed, entry.name)))
        expected = {t.name for t in entry.tensors}
        if set(tensors) != expected:  # cannot happen for hashed bytes unless the parsers disagree
            raise VersionIncomplete(f"{entry.name}: tensors {sorted(set(tensors) ^ expected)[:5]} "
                                    "disagree with the manifest")
        state.update(tensors)
    return state


class VersionWatcher:
    """The set of complete versions, and who wants to hear about a new one."""

    def __init__(self, complete: Iterable[int] = ()) -> None:
        self._complete: set[int] = set(complete)
        self._callbacks: list[Callable[[int], None]] = []
        self._changed = trio.Event()

    @property
    def latest(self) -> int:
        """The newest complete version, -1 when none."""
        return max(self._complete, default=-1)

    def is_complete(self, version: int) -> bool:
        return version in self._complete

    def on_complete(self, callback: Callable[[int], None]) -> None:
        """Call `callback(version)` for every version marked complete from now on."""
        self._callbacks.append(callback)

    def mark_complete(self, version: int) -> bool:
        """Record a newly complete version (call from the trio thread); False if already known."""
        if version in self._complete:
            return False
        self._complete.add(version)
        for callback in list(self._callbacks):
            callback(version)
        self._changed.set()
        self._changed = trio.Event()
        return True

    def forget(self, version: int) -> None:
        """A version was garbage-collected; it is no longer complete here."""
        self._complete.discard(version)

    def update_from(self, store: ChunkStore) -> list[int]:
        """Mark every version the store holds in full; returns the newly complete ones."""
        return [v for v in store.complete_versions() if self.mark_complete(v)]

    async def wait_newer(self, than: int, *, at_least: int | None = None) -> int:
        """Wait until a complete version newer than `than` (and >= `at_least`) exists; return it."""
        floor = max(than + 1, at_least if at_least is not None else -math.inf)
        while True:
            newer = [v for v in self._complete if v >= floor]
            if newer:
                return min(newer)
            await self._changed.wait()

    def subscribe(self, *, after: int | None = None) -> _Subscription:
        """An async iterator of versions that complete after `after` (default: the latest now).

        It yields each newer version once, in increasing order; a version that completes
        after a newer one was already yielded is skipped (consumers want the freshest weights).
        """
        return _Subscription(self, self.latest if after is None else after)


class _Subscription:
    def __init__(self, watcher: VersionWatcher, after: int) -> None:
        self._watcher = watcher
        self._cursor = after

    def __aiter__(self) -> _Subscription:
        return self

    async def __anext__(self) -> int:
        self._cursor = await self._watcher.wait_newer(self._cursor)
        return self._cursor
