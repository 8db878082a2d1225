"""A worker keeps the frames of its last submissions on disk, so that after its own restart it
neither submits a step again (validators refuse and penalise that) nor loses what a restarted
trainer may ask it for. Real files in a temporary folder."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from p2pnet.wire import Codec
from tests.trainer.test_intake import CHEAT, WALL_S, WORKER, submission
from trainer.worker_frames import load, save


def frame(worker, step: int) -> bytes:
    return Codec(worker).encode(submission(worker, step), WALL_S)


def test_the_newest_frames_are_kept_and_given_back_oldest_first(tmp_path):
    for step in range(5):
        save(tmp_path, step, frame(WORKER, step), kept=3)
    assert load(tmp_path, WORKER.peer_id) == [(step, frame(WORKER, step), step) for step in (2, 3, 4)]
    assert load(tmp_path / "none", WORKER.peer_id) == []


def test_a_damaged_foreign_or_misnamed_file_is_skipped_with_a_warning(tmp_path, caplog):
    save(tmp_path, 1, frame(WORKER, 1), kept=8)
    save(tmp_path, 2, frame(WORKER, 2)[:-1] + b"\x00", kept=8)  # its signature broken
    save(tmp_path, 3, frame(CHEAT, 3), kept=8)  # another's
    save(tmp_path, 4, frame(WORKER, 5), kept=8)  # the name says another step
    (tmp_path / "x.frame").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        assert load(tmp_path, WORKER.peer_id) == [(1, frame(WORKER, 1), 1)]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 4


@pytest.mark.parametrize("network_latest, first_step", [(5, 6), (0, 0)])
async def test_a_restarted_worker_skips_the_step_it_sent_but_not_a_new_runs_steps(monkeypatch, tmp_path,
                                                                                  network_latest, first_step):
    """Frames of step 5 (made with version 5) on disk. A network at version 5 is the same run: the
    worker goes on from step 6. A network at version 0 is a new run (versions count from 0 again):
    the old frames' steps are not its, and the worker makes step 0."""
    import torch
    import trio

    import trainer.roles as roles
    from trainer.model import build_model

    torch.set_num_threads(1)
    identity = WORKER
    save(tmp_path / "submitted", 5, frame(identity, 5), kept=8)
    model, tokenizer = build_model("micro", seed=0)
    monkeypatch.setattr(roles, "load_version", lambda base, store, version, loaded: (model, tokenizer))
    watcher = SimpleNamespace(latest=network_latest, complete_versions=lambda: list(range(network_latest + 1)))

    async def wait_for_version(version):
        if version > network_latest:
            await trio.sleep_forever()

    relay = SimpleNamespace(watcher=watcher, wait_for_version=wait_for_version,
                            store=SimpleNamespace(version_stamp=lambda v: v, version_files=lambda v: ()),
                            config=SimpleNamespace(trusted_publishers=()))
    published = []
    done = trio.Event()

    async def publish(topic, body):
        published.append(body.step)
        done.set()

    async def run_core(core, name, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started(None)
        await trio.sleep_forever()

    node = SimpleNamespace(peer_id=identity.peer_id, roles={"relay": relay}, publish=publish, run_core=run_core,
                           config=SimpleNamespace(data_dir=tmp_path))
    worker = roles.WorkerRole(node, {"model_dir": "/nonexistent", "max_new_tokens": 3, "prompts_per_batch": 2,
                                     "group_size": 2, "backend": "torch"})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.run)
        with trio.fail_after(60):  # (a safety net: one micro batch)
            await done.wait()
        nursery.cancel_scope.cancel()
    assert published == [first_step]
