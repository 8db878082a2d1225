"""A worker whose newer versions do not load (rotten here, refused) keeps the one it has, but
makes nothing with it once that one is more than `async_level` behind the step: the learner would
refuse such a batch (`stale_version`) after validators spent a check on it. It waits for a
version that loads instead."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import trio

import trainer.roles as roles
from relay.loader import VersionUnloadable
from trainer.model import build_model
from trainer.roles import WorkerRole

torch.set_num_threads(1)
LATEST = 5


async def test_a_worker_stuck_on_a_version_too_old_to_train_on_waits_for_one_that_loads(monkeypatch, tmp_path):
    model, tokenizer = build_model("micro", seed=0)
    loads = {"newest": 2}  # versions 3..5 do not load here, for now (their stamp changes when fetched again)
    changed = trio.Event()
    waiting = trio.Event()

    def load_version(base, store, version, loaded):
        if version > loads["newest"]:
            raise VersionUnloadable(version, "tensors do not fit")
        return model, tokenizer

    async def wait_change():
        waiting.set()
        await changed.wait()

    async def wait_for_version(version):
        if version > LATEST:
            await trio.sleep_forever()

    monkeypatch.setattr(roles, "load_version", load_version)
    watcher = SimpleNamespace(latest=LATEST, complete_versions=lambda: list(range(LATEST + 1)), wait_change=wait_change)
    relay = SimpleNamespace(watcher=watcher, wait_for_version=wait_for_version,
                            store=SimpleNamespace(version_stamp=lambda v: (v, loads["newest"]), version_files=lambda v: ()),
                            config=SimpleNamespace(trusted_publishers=()))
    submitted = []
    done = trio.Event()

    async def publish(topic, submission):
        submitted.append(submission)
        done.set()

    async def run_core(core, name, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started(None)
        await trio.sleep_forever()

    node = SimpleNamespace(peer_id="worker-1", roles={"relay": relay}, publish=publish, run_core=run_core,
                           config=SimpleNamespace(data_dir=tmp_path))
    worker = WorkerRole(node, {"model_dir": "/nonexistent", "max_new_tokens": 3, "prompts_per_batch": 2,
                               "group_size": 2, "backend": "torch"})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.run)
        with trio.fail_after(20):  # (a safety net: the worker waits at once)
            await waiting.wait()
        assert worker.version == 2 and submitted == []  # kept, but used for nothing
        loads["newest"] = LATEST  # the version is fetched again, whole
        changed.set()
        with trio.fail_after(20):
            await done.wait()
        nursery.cancel_scope.cancel()
    [submission] = submitted
    assert (submission.step, submission.model_version) == (LATEST, LATEST)
