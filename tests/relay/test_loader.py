"""Loading a published checkpoint into torch, and the VersionWatcher."""

import torch
import trio
import trio.testing
from safetensors.torch import save_file

import pytest

from p2pnet.identity import Identity
from relay.errors import ChunkMissing, VersionIncomplete, VersionUnknown, VersionUnloadable
from relay.loader import VersionWatcher, load_into, load_state_dict
from relay.store import ChunkStore
from tests.relay.disk import rot_chunk

torch.set_num_threads(1)
NOW = 1_800_000_000.0
TRAINER = Identity.from_seed_text("trainer")


def tensors(seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    first = {"layer.0.weight": torch.randn(17, 9, generator=g), "layer.0.bias": torch.zeros(9, dtype=torch.bfloat16)}
    second = {"head.weight": torch.randint(-5, 5, (3, 4, 5), generator=g, dtype=torch.int32)}
    return first, second


def test_load_state_dict_returns_the_published_tensors(tmp_path):
    first, second = tensors(0)
    save_file(first, str(tmp_path / "a.safetensors"))
    save_file(second, str(tmp_path / "b.safetensors"))
    store = ChunkStore(tmp_path / "store", budget_bytes=10**8, trusted_publishers=[TRAINER.peer_id], fsync=False)
    store.publish_files(TRAINER, [tmp_path / "a.safetensors", tmp_path / "b.safetensors"], model="m",
                        version=4, chunk_bytes=256, now_s=NOW)
    state = load_state_dict(store, 4)
    assert set(state) == set(first) | set(second)
    for name, tensor in {**first, **second}.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor)
    with pytest.raises(VersionUnknown):
        load_state_dict(store, 5)


def test_load_refuses_an_incomplete_version(tmp_path):
    first, _ = tensors(1)
    save_file(first, str(tmp_path / "a.safetensors"))
    source = ChunkStore(tmp_path / "src", budget_bytes=10**8, trusted_publishers=[TRAINER.peer_id], fsync=False)
    signed = source.publish_files(TRAINER, [tmp_path / "a.safetensors"], model="m", version=1, chunk_bytes=256,
                                  now_s=NOW)
    sink = ChunkStore(tmp_path / "sink", budget_bytes=10**8, trusted_publishers=[TRAINER.peer_id], fsync=False)
    sink.add_manifest(signed)
    with pytest.raises(VersionIncomplete):
        load_state_dict(sink, 1)


class Net(torch.nn.Module):
    """A model whose state dict has the names `tensors()` publishes in its first file."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.ModuleList([torch.nn.Linear(17, 9)])
        self.layer[0].weight = torch.nn.Parameter(torch.zeros(9, 17))
        self.layer[0].bias = torch.nn.Parameter(torch.zeros(9))


def test_load_into_copies_the_tensors_into_the_model_and_a_misfit_changes_nothing(tmp_path):
    g = torch.Generator().manual_seed(3)
    good = {"layer.0.weight": torch.randn(9, 17, generator=g), "layer.0.bias": torch.randn(9, generator=g)}
    save_file(good, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"layers": 1}')  # travels with the version, not loaded
    store = ChunkStore(tmp_path / "store", budget_bytes=10**8, trusted_publishers=[TRAINER.peer_id], fsync=False)
    store.publish_files(TRAINER, [tmp_path / "model.safetensors", tmp_path / "config.json"], model="m", version=1,
                        chunk_bytes=256, now_s=NOW, place="copy")
    model = Net()
    weight = model.layer[0].weight
    load_into(model, store, 1)
    assert model.layer[0].weight is weight  # filled in place, not replaced
    assert all(torch.equal(model.state_dict()[k], v) for k, v in good.items())

    save_file({"layer.0.weight": torch.ones(9, 16), "layer.0.bias": torch.ones(9)}, str(tmp_path / "bad.safetensors"))
    store.publish_files(TRAINER, [tmp_path / "bad.safetensors"], model="m", version=2, chunk_bytes=256, now_s=NOW,
                        place="copy")
    with pytest.raises(VersionUnloadable, match="wrong shapes"):
        load_into(model, store, 2)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in good.items())  # the bias was not copied either

    rot_chunk(store, 1, 3)
    with pytest.raises(ChunkMissing):
        load_into(model, store, 1)


async def test_watcher_yields_each_newer_version_once_in_order():
    watcher = VersionWatcher([1])
    heard = []
    watcher.on_complete(heard.append)
    seen = []

    async def consume(task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        async for version in watcher.subscribe():
            seen.append(version)
            if version >= 4:
                return

    async with trio.open_nursery() as nursery:
        await nursery.start(consume)
        assert watcher.mark_complete(2) and not watcher.mark_complete(2)
        await trio.testing.wait_all_tasks_blocked()
        watcher.mark_complete(4)
        await trio.testing.wait_all_tasks_blocked()
        watcher.mark_complete(3)  # older than one already yielded: skipped by the subscription
    assert seen == [2, 4] and heard == [2, 4, 3] and watcher.latest == 4


async def test_wait_newer_returns_immediately_when_already_there():
    watcher = VersionWatcher([3, 7])
    assert await watcher.wait_newer(2) == 3
    assert await watcher.wait_newer(3, at_least=5) == 7
    watcher.forget(7)
    assert watcher.latest == 3 and not watcher.is_complete(7)
