"""A batch the validators accepted but the learner refuses (settings they do not know: here a
worker sampling at temperature 0.7 where the trainer trains at 1.0) is neither trained on nor
credited as trained, and is not offered to the learner again: handed back, one alone made the
trainer step at once, over and over, each pass a row of metrics.jsonl."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import trio

from tasks.prompts import assign_prompts
from tests.trainer.test_intake import CHEAT, WORKER, Directory, envelope, verdict
from tests.trainer.test_intake_restart import FakeNode
from trainer.intake import Intake, IntakeConfig
from trainer.learner import Learner, LearnerConfig
from trainer.model import build_model, save_model_dir
from trainer.roles import TrainerRole
from trainer.rollout import GenerationConfig, generate_batch
from verify.messages import submission_from_batch, submission_id

torch.set_num_threads(1)
SETTINGS = dict(prompts_per_batch=2, group_size=2, max_new_tokens=3)


@pytest.fixture
async def trainer(tmp_path):
    model, tokenizer = build_model("micro", seed=0)
    base = save_model_dir(model, tokenizer, tmp_path / "base")
    role = TrainerRole(FakeNode(tmp_path), {"model_dir": str(base), "out_dir": str(tmp_path / "out"), "steps": 1,
                                            **SETTINGS})
    learner = Learner(LearnerConfig(task_seed=0, keep_last=0, **SETTINGS), base, tmp_path / "out")
    calls = []
    step = learner.step
    learner.step = lambda batches: calls.append(len(batches)) or step(batches)
    role._build_learner = lambda: learner
    role.relay = SimpleNamespace(watcher=SimpleNamespace(is_complete=lambda version: True))  # (published already)
    yield role, learner, calls
    learner.close()


def deliver(role, learner, worker, temperature):
    """`worker`'s batch for step 0, sampled at `temperature`, accepted by a validator."""
    tasks = assign_prompts(worker.peer_id, 0, 0, SETTINGS["prompts_per_batch"], learner.config.tasks)
    generation = GenerationConfig(group_size=SETTINGS["group_size"], max_new_tokens=SETTINGS["max_new_tokens"],
                                  temperature=temperature)
    batch, _ = generate_batch(learner.model, learner.tokenizer, tasks, worker_id=worker.peer_id, step=0,
                              model_version=0, seed=0, config=generation)
    env = envelope(worker, submission_from_batch(batch, model="tiny", prompts_per_submission=2,
                                                 nonce=random.randbytes(16)))
    role.intake.on_message(1.0, env)
    verdict(role.intake, submission_id(env), worker, 0, True, now=2.0)


async def test_a_refused_batch_beside_honest_ones_is_not_credited_as_trained(trainer):
    role, learner, calls = trainer
    deliver(role, learner, WORKER, 1.0)
    deliver(role, learner, CHEAT, 0.7)
    with trio.fail_after(300):  # (a safety net: one step of a micro model)
        await role._train(None, trio.TASK_STATUS_IGNORED)  # its one step
    assert role.version == 1 and calls == [2] and role.history[0]["learner_rejected"] == {"wrong_settings": 1}
    trained = {w["peer_id"]: w["trained_batches"] for w in role.intake.workers_json()}
    assert trained == {WORKER.peer_id: 1, CHEAT.peer_id: 0}
    assert role.intake.contributions.workers[CHEAT.peer_id].trained_tokens == 0
    assert role.intake.dropped["learner_refused"] == 1


async def test_a_refused_batch_alone_is_not_offered_to_the_learner_again(trainer):
    role, learner, calls = trainer
    role.intake.membership.directory.entries.pop(WORKER.peer_id)  # a one-worker network, its worker misconfigured
    deliver(role, learner, CHEAT, 0.7)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(role._train, None, trio.TASK_STATUS_IGNORED)
        with trio.fail_after(300):
            while not role.history:  # the learner's first answer
                await trio.sleep(0.01)
        assert role.intake.admissible(trio.current_time(), 0) == []  # so the trainer waits for another batch
        nursery.cancel_scope.cancel()
    assert calls == [1] and len(role.history) == 1 and role.version == 0
