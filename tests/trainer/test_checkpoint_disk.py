"""What the trainer leaves on disk: the newest versions only, and optimizer state (twice the size
of the weights) only in the newest; resuming still restores it."""

import dataclasses

import torch

from trainer.checkpoint import OPTIMIZER_FILE, complete_versions, version_dir
from trainer.learner import Learner
from tests.trainer.test_learner import make_batch


def train(learner, steps):
    for _ in range(steps):
        learner.step([make_batch(learner)])
    learner.flush()


def test_only_the_newest_version_keeps_its_optimizer_state(tmp_path, model_dir, learner_config):
    config = dataclasses.replace(learner_config, keep_last=3)
    out = tmp_path / "out"
    learner = Learner(config, model_dir, out)
    train(learner, 4)
    learner.close()
    assert complete_versions(out) == [2, 3, 4]
    assert [v for v in complete_versions(out) if (version_dir(out, v) / OPTIMIZER_FILE).exists()] == [4]
    again = Learner(config, model_dir, out)
    assert again.version == 4
    s1, s2 = learner.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)
    again.close()


def test_keep_optimizer_states_zero_keeps_every_one(tmp_path, model_dir, learner_config):
    config = dataclasses.replace(learner_config, keep_last=3, keep_optimizer_states=0)
    out = tmp_path / "out"
    learner = Learner(config, model_dir, out)
    train(learner, 3)
    learner.close()
    assert all((version_dir(out, v) / OPTIMIZER_FILE).exists() for v in complete_versions(out))


def test_a_version_without_optimizer_state_still_resumes(tmp_path, model_dir, learner_config):
    out = tmp_path / "out"
    learner = Learner(learner_config, model_dir, out)
    train(learner, 1)
    learner.close()
    (version_dir(out, 1) / OPTIMIZER_FILE).unlink()
    again = Learner(learner_config, model_dir, out)
    assert again.version == 1 and again.optimizer.state_dict()["state"] == {}
    for k, v in learner.model.state_dict().items():
        assert torch.equal(v, again.model.state_dict()[k])
    again.close()
