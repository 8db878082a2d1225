"""Loading a version where it meets the rest of the store: dtypes of another kind than the
model's, a chunk dropped between the completeness check and the hashing, garbage collection while
the files are opened. Each interleaving is forced, not timed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors.torch import save_file

from p2pnet.errors import LocalStateError
from p2pnet.identity import Identity
from relay.errors import VersionIncomplete, VersionUnloadable
from relay.loader import load_into
from relay.store import ChunkStore
from tests.relay.disk import rot_chunk

TRAINER = Identity.from_seed_text("trainer")


def store_with(tmp_path: Path, files: dict[str, dict[str, torch.Tensor]], **kwargs) -> ChunkStore:
    store = ChunkStore(tmp_path / "store", budget_bytes=10**8, trusted_publishers=[TRAINER.peer_id], fsync=False,
                       **kwargs)
    paths = []
    for name, tensors in files.items():
        save_file(tensors, str(tmp_path / name))
        paths.append(tmp_path / name)
    store.publish_files(TRAINER, paths, model="m", version=1, chunk_bytes=64, now_s=time.time(), place="copy")
    return store


class Net(torch.nn.Module):
    def __init__(self, names: str, dtype: torch.dtype = torch.float32, size: int = 2) -> None:
        super().__init__()
        for name in names:
            setattr(self, name, torch.nn.Parameter(torch.zeros(size, dtype=dtype)))


def test_a_dtype_of_another_kind_than_the_parameter_is_refused_before_any_copy(tmp_path):
    torch.set_num_threads(1)
    store = store_with(tmp_path, {"m.safetensors": {
        "a": torch.tensor([1 + 5j, 2 + 6j], dtype=torch.complex64), "b": torch.tensor([True, False]),
        "c": torch.tensor([2**40, 3], dtype=torch.int64)}})
    net = Net("abc", torch.float16)
    with pytest.raises(VersionUnloadable, match="dtypes that do not load") as refused:
        load_into(net, store, 1)
    assert "a C64 into float16" in str(refused.value) and "b BOOL into float16" in str(refused.value)
    assert all(not p.any() for p in net.parameters())  # untouched


def test_a_float_version_loads_into_a_float_model_of_another_width(tmp_path):
    torch.set_num_threads(1)
    store = store_with(tmp_path, {"m.safetensors": {"a": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}})
    net = Net("a", torch.float32)
    load_into(net, store, 1)
    assert net.a.tolist() == [1.5, -2.0]


def test_a_chunk_dropped_before_the_hashing_looked_refuses_the_load(tmp_path):
    """After a restart every chunk is only claimed; serving finds the last one rotten and drops it
    between the load's completeness check and its hashing, which then no longer sees it."""
    torch.set_num_threads(1)
    good = torch.arange(64, dtype=torch.float32)
    store = store_with(tmp_path, {"m.safetensors": {"w": good}})
    store.close()
    store = ChunkStore(tmp_path / "store", budget_bytes=10**8, trusted_publishers=[TRAINER.peer_id], fsync=False)
    last = len(store.manifest(1).manifest.chunk_digests) - 1
    real_verify = store.verify

    def serving_first(version, *, everything=False):
        rot_chunk(store, 1, last, b"\xff" * 64)
        assert store.ensure_verified(1, last) is False  # the serving thread's check drops it
        return real_verify(version, everything=everything)

    store.verify = serving_first  # type: ignore[method-assign]
    net = Net("w", size=64)
    with pytest.raises(VersionIncomplete, match="lacks 1 of"):
        load_into(net, store, 1)
    assert not net.w.any()


def test_garbage_collection_leaves_a_version_alone_while_it_loads(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    store = store_with(tmp_path, {"a.safetensors": {"a": torch.ones(16)}, "b.safetensors": {"b": torch.ones(16)}},
                       keep_versions=1)
    save_file({"a": torch.ones(16), "b": torch.ones(16)}, str(tmp_path / "v2.safetensors"))
    real_open, dropped = safetensors.safe_open, []

    def newer_version_meanwhile(path, **kwargs):
        handle = real_open(path, **kwargs)
        if not dropped:  # the trio thread: version 2 arrives, and collection runs
            store.publish_files(TRAINER, [tmp_path / "v2.safetensors"], model="m", version=2, chunk_bytes=64,
                                now_s=time.time(), place="copy")
            dropped.append(store.collect()["dropped_versions"])
        return handle

    monkeypatch.setattr(safetensors, "safe_open", newer_version_meanwhile)
    net = Net("ab", size=16)
    load_into(net, store, 1)
    assert dropped == [[]] and net.a.tolist() == [1.0] * 16 and net.b.tolist() == [1.0] * 16
    assert store.collect()["dropped_versions"] == [1]  # once loaded, it goes


def test_a_file_that_cannot_be_opened_here_is_ours_not_the_publishers(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    store = store_with(tmp_path, {"a.safetensors": {"a": torch.ones(16)}})

    def out_of_descriptors(path, **kwargs):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(safetensors, "safe_open", out_of_descriptors)
    with pytest.raises(LocalStateError, match="cannot be opened here") as refused:
        load_into(Net("a", size=16), store, 1)
    assert not isinstance(refused.value, VersionUnloadable)
