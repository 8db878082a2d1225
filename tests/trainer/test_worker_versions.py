"""A worker (and a validator) that meets a version that does not load keeps the one it has.

Real chunk store, real micro model; the relay is only its store and watcher. Versions: 0 good,
1 a file safetensors refuses (the relays accept it), 2 one tensor of the wrong shape,
3 good but with a chunk rotten on disk (then fetched again).
"""

from __future__ import annotations

import json
import logging
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from p2pnet.identity import Identity
from relay.loader import VersionWatcher
from relay.manifest import FileEntry, Manifest, TensorEntry, sign_manifest
from relay.store import ChunkStore, digest_of
from tests.relay.disk import rot_chunk
from trainer.model import build_model, save_model_dir, save_weights, snapshot_state

torch.set_num_threads(1)
PUBLISHER = Identity.from_seed_text("trainer")
IDS = [1, 5, 6, 7]


def publish(store: ChunkStore, root: Path, version: int, path: Path):
    return store.publish_files(PUBLISHER, [path], model="micro", version=version, previous_version=version - 1,
                               chunk_bytes=64 * 1024, now_s=time.time())


def weights(root: Path, name: str, seed: int, misshapen: str = "") -> Path:
    """A model's weights; with `misshapen`, that one tensor has the wrong shape (the rest fit)."""
    path = root / f"{name}-{seed}{misshapen}.safetensors"
    state = snapshot_state(build_model(name, seed=seed)[0])
    if misshapen:
        state[misshapen] = torch.zeros(3, 3)
    save_weights(state, path)
    return path


def publish_refused_by_safetensors(store: ChunkStore, version: int):
    """A version whose file safetensors refuses (4 floats in 8 bytes), signed by a trusted
    publisher that did not check it (our `publish_files` would refuse it): relays accept it."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    blob = struct.pack("<Q", len(header)) + header + bytes(8)
    chunk = 32
    parts = [blob[i:i + chunk] for i in range(0, len(blob), chunk)]
    entry = FileEntry("model.safetensors", len(blob), 0, (TensorEntry("w", "F32", (4,), len(blob) - 8, len(blob)),))
    manifest = Manifest("micro", version, version - 1, (entry,), chunk, len(blob), tuple(digest_of(p) for p in parts),
                        int(time.time() * 1000))
    signed = sign_manifest(PUBLISHER, manifest, time.time())
    store.add_manifest(signed)
    for index, part in enumerate(parts):
        store.put_chunk(version, index, part)
    return signed


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    base = save_model_dir(*build_model("micro", seed=0), root / "base")
    store = ChunkStore(root / "store", budget_bytes=10**9, trusted_publishers=[PUBLISHER.peer_id], fsync=False)
    signed = {
        0: publish(store, root, 0, weights(root, "micro", 1)),
        1: publish_refused_by_safetensors(store, 1),
        2: publish(store, root, 2, weights(root, "micro", 2, misshapen="lm_head.weight")),
        3: publish(store, root, 3, weights(root, "micro", 3)),
    }
    return SimpleNamespace(root=root, base=base, store=store, signed=signed)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits


def rot(store: ChunkStore, signed, index: int) -> bytes:
    data = store.read_chunk(signed.version, index)
    rot_chunk(store, signed.version, index, b"rot")
    return data


def warnings_about(caplog, version: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and f"version {version} does not load" in r.getMessage()]


async def test_a_worker_keeps_its_version_when_a_newer_one_does_not_load(world, caplog, monkeypatch):
    import trainer.roles
    from trainer.roles import WorkerRole

    loads: list[int] = []
    real_load = trainer.roles.load_version
    monkeypatch.setattr(trainer.roles, "load_version", lambda *a: loads.append(a[2]) or real_load(*a))
    watcher = VersionWatcher()
    relay = SimpleNamespace(store=world.store, watcher=watcher, config=SimpleNamespace(trusted_publishers=()))
    node = SimpleNamespace(roles={"relay": relay}, peer_id="w", config=SimpleNamespace(data_dir=world.root / "w"))
    worker = WorkerRole(node, {"model_dir": str(world.base), "model_name": "micro"})

    watcher.mark_complete(0)
    assert await worker.switch_version() > 0 and worker.version == 0
    model = worker.loaded[0]
    before = logits(model)

    for version in (1, 2):  # refused by safetensors; tensors that do not fit the model
        watcher.mark_complete(version)
        assert await worker.switch_version() == 0.0
        assert worker.version == 0 and worker.loaded[0] is model
        assert torch.equal(logits(model), before)  # not one tensor of the bad version was copied in
        assert len(warnings_about(caplog, version)) == 1
    rejected = {r["version"]: r["reason"] for r in worker.status()["rejected_versions"]}
    assert set(rejected) == {1, 2}
    assert "unloadable" in rejected[1] and "shapes" in rejected[2]

    loads.clear()
    for _ in range(3):  # the same files are not tried again
        assert await worker.switch_version() == 0.0
    assert loads == [] and worker.version == 0

    good = rot(world.store, world.signed[3], 1)
    watcher.mark_complete(3)
    await worker.switch_version()
    assert worker.version == 0 and 3 in {r["version"] for r in worker.status()["rejected_versions"]}
    assert "corrupt on disk" in warnings_about(caplog, 3)[0]
    assert loads == [3] and not world.store.is_complete(world.signed[3])

    world.store.put_chunk(3, 1, good)  # the relay fetched it again
    assert await worker.switch_version() > 0 and worker.version == 3
    assert {r["version"] for r in worker.status()["rejected_versions"]} == {1, 2}
    fresh = build_model("micro", seed=3)[0]
    assert torch.allclose(logits(worker.loaded[0]), logits(fresh))


async def test_a_worker_whose_only_version_does_not_load_loads_an_older_one(world):
    from trainer.roles import WorkerRole

    watcher = VersionWatcher([0, 1])
    relay = SimpleNamespace(store=world.store, watcher=watcher, config=SimpleNamespace(trusted_publishers=()))
    node = SimpleNamespace(roles={"relay": relay}, peer_id="w", config=SimpleNamespace(data_dir=world.root / "w"))
    worker = WorkerRole(node, {"model_dir": str(world.base), "model_name": "micro"})
    await worker.switch_version()
    assert worker.version == 0 and [r["version"] for r in worker.status()["rejected_versions"]] == [1]


def test_a_validator_drops_checks_of_a_version_that_does_not_load_and_keeps_its_models(world, caplog,
                                                                                     monkeypatch):
    import verify.daemon
    from verify.daemon import ModelUnavailable, RelayModelSource

    source = RelayModelSource(world.base, world.store, cache_size=1)
    first = source(0)
    before = first.forward(IDS)[1]
    loads: list[int] = []
    real = verify.daemon.load_model_folder
    monkeypatch.setattr(verify.daemon, "load_model_folder",
                        lambda *a, **k: loads.append(k["weights"][1]) or real(*a, **k))
    for _ in range(3):
        with pytest.raises(ModelUnavailable, match="version 2"):
            source(2)
    assert loads == [2]  # tried once, then refused from memory until its files change
    assert len(warnings_about(caplog, 2)) == 1
    assert [r["version"] for r in source.rejected_versions()] == [2]
    assert source.cached() == ["v0"] and source(0) is first  # the one model was not given up
    assert torch.equal(first.forward(IDS)[1], before)
