"""Shared fixtures for trainer tests: one torch thread, a tiny model folder, a fast config."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

from trainer.learner import LearnerConfig  # noqa: E402
from trainer.model import build_model, save_model_dir  # noqa: E402


@pytest.fixture(scope="session")
def tiny():
    return build_model("micro", seed=0)


@pytest.fixture()
def model_dir(tmp_path, tiny):
    model, tok = tiny
    return save_model_dir(model, tok, tmp_path / "base")


@pytest.fixture()
def learner_config() -> LearnerConfig:
    return LearnerConfig(prompts_per_batch=4, group_size=4, keep_last=0, task_seed=7)
