import dataclasses

import pytest
import torch

from trainer.model import (ModelFolderError, WEIGHTS_FILE, build_model, forward_hidden_logits,
                           load_model_dir, save_model_dir)
from trainer.rollout import GenerationConfig, generate_batch, generate_rows, sampling_seed
from trainer.tasks import TaskConfig, assign_prompts
from trainer.tokenizer import CharTokenizer
from verify.check import check_rollout


@dataclasses.dataclass(frozen=True)
class NoEosTokenizer(CharTokenizer):
    """Never stops early: an eos id no model can sample, so every row runs to the limit."""

    @property
    def eos_id(self) -> int:
        return 10**6


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_build_model_is_seeded():
    a, _ = build_model("micro", seed=3)
    b, _ = build_model("micro", seed=3)
    c, _ = build_model("micro", seed=4)
    assert _same_weights(a, b) and not _same_weights(a, c)


def test_model_folder_roundtrip(tmp_path, tiny):
    model, tok = tiny
    path = save_model_dir(model, tok, tmp_path / "m")
    loaded, tok2 = load_model_dir(path)
    assert _same_weights(model, loaded) and tok2 == tok
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left
    with pytest.raises(ModelFolderError):
        save_model_dir(model, tok, path)  # never overwrites
    (path / WEIGHTS_FILE).unlink()
    with pytest.raises(ModelFolderError):
        load_model_dir(path)


def test_forward_hidden_logits_shapes(tiny):
    model, tok = tiny
    hidden, logits = forward_hidden_logits(model, tok.encode("3+4=5", bos=True))
    assert hidden.dtype == torch.bfloat16 and hidden.shape == (6, model.config.hidden_size)
    assert logits.dtype == torch.float32 and logits.shape == (6, tok.vocab_size)


def test_rollout_is_deterministic_and_seeded(tiny):
    model, tok = tiny
    tasks = assign_prompts("w1", 0, 5, 3)
    cfg = GenerationConfig(group_size=4, max_new_tokens=6)
    kw = dict(worker_id="w1", step=0, model_version=0, config=cfg)
    a, timing = generate_batch(model, tok, tasks, seed=5, **kw)
    b, _ = generate_batch(model, tok, tasks, seed=5, **kw)
    c, _ = generate_batch(model, tok, tasks, seed=6, **kw)
    assert a == b
    assert [r.output_ids for r in a.rollouts] != [r.output_ids for r in c.rollouts]
    assert len(a.rollouts) == 12 and a.n_prompts == 3
    assert timing.generate_s > 0 and timing.proof_s > 0
    for r in a.rollouts:
        assert r.prompt_ids == tuple(tok.encode(tasks[r.row // 4].prompt, bos=True))
        assert 1 <= len(r.output_ids) == len(r.logprobs) <= 6
        assert (r.stop_reason == "eos") == (r.output_ids[-1] == tok.eos_id)
        assert all(lp <= 0 for lp in r.logprobs)


def test_rows_match_unbatched_generation(tiny):
    """Grouping rows by prompt length gives each row the tokens it would get alone."""
    model, tok = tiny
    tasks = assign_prompts("w2", 1, 5, 4, TaskConfig(max_operand=99))  # mixed prompt lengths
    cfg = GenerationConfig(group_size=2, max_new_tokens=5, proofs=False)
    batch, _ = generate_batch(model, tok, tasks, worker_id="w2", step=1, model_version=0, seed=5,
                              config=cfg)
    seed = sampling_seed(5, "w2", 1)
    for r in batch.rollouts:
        alone = generate_rows(model, [r.prompt_ids], [r.row], seed=seed, eos_id=tok.eos_id,
                              config=cfg)[0]
        assert tuple(alone.output_ids) == r.output_ids
        assert alone.logprobs == pytest.approx(list(r.logprobs), abs=1e-4)


def test_proofs_per_32_tokens_and_validator_accepts(tiny):
    model, _ = tiny
    tok = NoEosTokenizer()
    cfg = GenerationConfig(group_size=2, max_new_tokens=40)
    batch, _ = generate_batch(model, tok, assign_prompts("w3", 2, 5, 1), worker_id="w3", step=2,
                              model_version=0, seed=5, config=cfg)
    for r in batch.rollouts:
        assert len(r.output_ids) == 40 and r.stop_reason == "length"
        assert len(r.proofs) == 2 and all(len(p) == 258 for p in r.proofs)  # 32 + 8 tokens
        verdict = check_rollout(lambda ids: forward_hidden_logits(model, ids), r.prompt_ids,
                                r.output_ids, r.proofs, seed=batch.sampling_seed, row=r.row,
                                temperature=batch.temperature, eos_token_id=tok.eos_id,
                                max_new_tokens=40)
        assert verdict.accepted, verdict.reasons
    forged = list(batch.rollouts[0].output_ids)
    forged[3] = (forged[3] + 1) % 17
    verdict = check_rollout(lambda ids: forward_hidden_logits(model, ids), batch.rollouts[0].prompt_ids,
                            forged, batch.rollouts[0].proofs, seed=batch.sampling_seed, row=0,
                            temperature=1.0, eos_token_id=tok.eos_id, max_new_tokens=40)
    assert not verdict.accepted
