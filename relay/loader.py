"""Loading a complete checkpoint version into torch, and watching for new complete versions.

A complete version is a folder of its files (`relay.store`), so loading memory-maps them with
safetensors: no file is joined in memory, and `load_into` copies tensor by tensor straight into
a model's parameters, so the extra memory is about one tensor. Every chunk is hashed again just
before loading (`ChunkStore.verify`, chunks side by side from the page cache, one chunk held
per thread: blake3 hashes about 5 GB/s on one core here, a small part of a load), so no byte
is used that does not match the signed manifest, even if the disk rotted it since it arrived.
Before any tensor is copied, every file's header is checked against the manifest's tensor index and the
model (names, shapes, and dtypes of the parameter's kind: float into float, int into int; `DTYPE_KINDS`),
so a version that does not fit leaves the model as it was. The version is pinned in the store while it
loads (`ChunkStore.pinned`: garbage collection leaves its files alone), and a file that cannot be
opened here is our trouble (`LocalStateError`), not the publisher's. Only files
named `*.safetensors` are loaded; others (tokenizer, config) travel with the version unread.

This is the only relay module that imports torch, and it does so lazily inside the functions,
so a relay peer never loads torch. A version that does not load raises one of `LOAD_FAILURES`:
`VersionUnloadable` (the publisher's: safetensors refuses the files, or the tensors do not fit
the model) or a `LocalStateError` (ours: a chunk found rotten, which the store drops and the
relay fetches again).

`RejectedVersions` (pure) is how a worker or validator remembers versions that did not load, so
it keeps running on the one it has and tries a rejected version again only once the store's
`version_stamp` for it changed (its chunks were fetched again).

`VersionWatcher` tells interested code (a worker's weight reloader, `checkpoint wait`) when a
version becomes complete. It is a plain object: the relay role calls `mark_complete` (or
`update_from(store)`) from the trio thread; consumers register callbacks or iterate
`async for version in watcher.subscribe()`.

This module must not do network I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping

import trio

from p2pnet.errors import LocalStateError
from relay.errors import VersionUnloadable
from relay.manifest import is_safetensors
from relay.store import ChunkStore

LOAD_FAILURES = (VersionUnloadable, LocalStateError)  # what "this version does not load here" raises


class _Shape:
    """A tensor known only by its shape (from a safetensors header), for `_misfit`."""

    def __init__(self, shape: Iterable[int]) -> None:
        self.shape = tuple(shape)


def _open_version(store: ChunkStore, version: int, stack: ExitStack) -> dict[str, Any]:
    """Verify what needs it, open every safetensors file of the version (memory maps) and check
    their headers against the manifest: tensor name -> the open file holding it."""
    from safetensors import SafetensorError, safe_open

    stack.enter_context(store.pinned(version))  # garbage collection leaves its files alone until loaded
    signed = store.manifest(version)
    store.verify_complete(version, everything=True)
    where: dict[str, Any] = {}
    for entry, path in zip(signed.manifest.files, store.version_files(version)):
        if not is_safetensors(entry.name):
            continue
        try:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
        except SafetensorError as exc:
            raise VersionUnloadable(version, f"{entry.name}: {exc}", signed.publisher) from exc
        except OSError as exc:  # our disk or our process (files, descriptors), not the publisher
            raise LocalStateError(f"checkpoint version {version}: {path} cannot be opened here: {exc}") from exc
        names = set(handle.keys())
        expected = {t.name for t in entry.tensors}
        if names != expected:  # cannot happen for hashed bytes unless the parsers disagree
            raise VersionUnloadable(version, f"{entry.name}: tensors {sorted(names ^ expected)[:5]} "
                                    "disagree with the manifest", signed.publisher)
        where.update((name, handle) for name in names)
    return where


def load_state_dict(store: ChunkStore, version: int, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The tensors of a complete version, by name: `dict[str, torch.Tensor]` on the CPU.

    With `like` (a model's `state_dict()`), the tensors must match its names and shapes (a name
    that shares storage with a loaded one may be absent: tied weights), checked before anything
    is read. Raises VersionUnknown / VersionIncomplete, ChunkMissing if a chunk rotted on disk,
    and VersionUnloadable if the files do not load or do not fit `like`. To fill a model, use
    `load_into`: it never holds a second copy of the weights.
    """
    import torch

    torch.set_num_threads(1)
    with ExitStack() as stack:
        where = _open_version(store, version, stack)
        if like is not None:
            _check_fit(store, version, where, like)
        return {name: handle.get_tensor(name) for name, handle in where.items()}


def load_into(model: Any, store: ChunkStore, version: int) -> None:
    """Copy a complete version's tensors into `model`'s parameters and buffers, one at a time
    (peak extra memory: about one tensor). Everything is checked first (`load_state_dict`'s
    errors); the model is changed only once the version is known to fit it."""
    import torch

    torch.set_num_threads(1)
    target = model.state_dict(keep_vars=True)
    with ExitStack() as stack, torch.no_grad():
        where = _open_version(store, version, stack)
        _check_fit(store, version, where, target)
        for name, handle in where.items():
            target[name].copy_(handle.get_tensor(name))


# safetensors dtypes by the kind of parameter they load into (`copy_` converts within a kind: a
# bf16 version into an fp32 model). Packed and scale-only ones (F4, F6_*, F8_E8M0) are not values
# of the header's shape, and a kind into another (complex, int or bool into float) loses meaning
DTYPE_KINDS = {"float": {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"},
               "int": {"I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"},
               "bool": {"BOOL"}, "complex": {"C64"}}


def _check_fit(store: ChunkStore, version: int, where: Mapping[str, Any], like: Mapping[str, Any]) -> None:
    slices = {name: handle.get_slice(name) for name, handle in where.items()}
    problem = _misfit({name: _Shape(s.get_shape()) for name, s in slices.items()}, like) or \
        _dtype_misfit({name: s.get_dtype() for name, s in slices.items()}, like)
    if problem:
        raise VersionUnloadable(version, problem, store.manifest(version).publisher)


def _dtype_misfit(dtypes: Mapping[str, str], like: Mapping[str, Any]) -> str:
    """Tensors whose safetensors dtype does not load into the kind of their parameter ("" if none)."""
    wrong = []
    for name, dtype in sorted(dtypes.items()):
        target = like[name]
        kind = ("complex" if target.is_complex() else "float" if target.is_floating_point()
                else "bool" if str(target.dtype) == "torch.bool" else "int")
        if dtype not in DTYPE_KINDS[kind]:
            wrong.append(f"{name} {dtype} into {str(target.dtype).removeprefix('torch.')}")
    return f"dtypes that do not load: {wrong[:3]}" if wrong else ""


def _misfit(state: Mapping[str, Any], like: Mapping[str, Any]) -> str:
    """What keeps `state` from loading into a model whose state dict is `like` ("" if nothing)."""
    unexpected = sorted(k for k in state if k not in like)
    if unexpected:
        return f"unexpected tensors {unexpected[:5]}"
    shapes = sorted(f"{k} {tuple(state[k].shape)} != {tuple(like[k].shape)}"
                    for k in state if tuple(state[k].shape) != tuple(like[k].shape))
    if shapes:
        return f"wrong shapes: {shapes[:3]}"
    loaded = {like[k].untyped_storage().data_ptr() for k in state}
    missing = sorted(k for k in like if k not in state and like[k].untyped_storage().data_ptr() not in loaded)
    return f"missing tensors {missing[:5]}" if missing else ""


@dataclass(frozen=True)
class Rejection:
    version: int
    stamp: Hashable  # the store's `version_stamp` when it failed
    reason: str
    at_s: float


class RejectedVersions:
    """Versions that did not load, each with the stamp of the files that failed (pure).

    A version is `blocked` while its stamp is the one that failed: it is not tried again in a
    loop, only once its files change. At most `keep` rejections are remembered (oldest go)."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._by_version: OrderedDict[int, Rejection] = OrderedDict()

    def reject(self, version: int, stamp: Hashable, reason: str, at_s: float) -> None:
        self._by_version.pop(version, None)
        self._by_version[version] = Rejection(version, stamp, reason, at_s)
        while len(self._by_version) > self.keep:
            self._by_version.popitem(last=False)

    def blocked(self, version: int, stamp: Hashable) -> Rejection | None:
        """The rejection that still holds for these exact files, if any."""
        rejection = self._by_version.get(version)
        return rejection if rejection is not None and rejection.stamp == stamp else None

    def loaded(self, version: int) -> None:
        """The version loaded after all (its files changed): no longer rejected."""
        self._by_version.pop(version, None)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"version": r.version, "reason": r.reason, "at_s": round(r.at_s, 3)} for r in self._by_version.values()]


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

    def complete_versions(self) -> list[int]:
        return sorted(self._complete)

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
        """A version was garbage-collected or lost a chunk; it is no longer complete here (until
        it is marked complete again)."""
        self._complete.discard(version)

    async def wait_change(self) -> None:
        """Wait until a version is next marked complete: a new one, or one complete again."""
        await self._changed.wait()

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
