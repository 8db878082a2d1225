"""verify.check on a tiny random-init Llama: honest rollouts pass, every attack is caught.

One module-scoped bf16 model and a handful of honest rollouts keep this file fast.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verify.check import (
    BAD_TERMINATION,
    MALFORMED_PROOF,
    SAMPLING_MISMATCH,
    check_rollout,
    generated_hidden_slice,
)
from verify.testing import TinyModelConfig, fake_quantize, generate, make_forward, tiny_model
from verify.policy import SAME_STACK
from verify.toploc import PRIME, build_proofs, encode_proof

torch.set_num_threads(1)

EOS, MAX_NEW, SEED = 2, 72, 7
PROMPTS = [[5, 17, 301, 44, 9, 120, 77, 3], [400, 12, 250, 31, 8, 64, 99, 150, 11, 6, 201, 7]]


@pytest.fixture(scope="module")
def worker():
    return tiny_model(dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def forward(worker):
    return make_forward(worker)


def _rollouts(model, seed=SEED):
    out = []
    for row, prompt in enumerate(PROMPTS):
        g = generate(model, prompt, seed=seed, row=row, max_new_tokens=MAX_NEW,
                     temperature=1.0, eos_token_id=EOS)
        out.append((prompt, g.output_ids, build_proofs(g.hidden)))
    return out


@pytest.fixture(scope="module")
def honest(worker):
    return _rollouts(worker)


def _check(forward, row, prompt, output, proofs, **kw):
    return check_rollout(forward, prompt, output, proofs, seed=SEED, row=row, temperature=1.0,
                         eos_token_id=EOS, max_new_tokens=MAX_NEW, **kw)


def test_slice_convention():
    rows = torch.arange(10)[:, None]
    assert generated_hidden_slice(rows, 4, 6)[:, 0].tolist() == [3, 4, 5, 6, 7, 8]
    assert generated_hidden_slice(rows, 4, 0).shape[0] == 0


def test_honest_rollouts_accepted(forward, honest):
    assert any(len(o) > 32 for _, o, _ in honest)  # several chunks, partial tail
    for row, (p, o, pr) in enumerate(honest):
        v = _check(forward, row, p, o, pr)
        assert v.accepted, v
        assert v.reasons == () and len(v.chunk_stats) == len(pr)


def test_honest_accepted_by_sdpa_fp32_validator(worker, honest):
    v32 = tiny_model(TinyModelConfig(attn_implementation="sdpa"), dtype=torch.float32)
    v32.load_state_dict({k: v.float() for k, v in worker.state_dict().items()})
    for row, (p, o, pr) in enumerate(honest):
        assert _check(make_forward(v32), row, p, o, pr).accepted


def _assert_rejected(verdicts, code):
    for v in verdicts:
        assert not v.accepted
        assert code in v.reasons, v.reasons


def test_other_model_rejected(forward):
    other = tiny_model(TinyModelConfig(seed=1), dtype=torch.bfloat16)
    vs = [_check(forward, r, *x) for r, x in enumerate(_rollouts(other))]
    _assert_rejected(vs, "toploc_exp")


def test_int4_weights_rejected(worker, forward):
    vs = [_check(forward, r, *x) for r, x in enumerate(_rollouts(fake_quantize(worker, 4)))]
    _assert_rejected(vs, "toploc_exp")


def test_int8_weights_rejected_when_validators_run_the_workers_stack(worker, forward, honest):
    """With the paper's cross-hardware defaults int8 hides in honest noise on this tiny model
    (docs/calibration.md); a bf16 worker checked by a bf16 validator is exact on this tiny model
    (not on SmolLM2, where only fp32 on both sides is), and SAME_STACK rejects it."""
    for row, (p, o, pr) in enumerate(honest):
        assert _check(forward, row, p, o, pr, thresholds=SAME_STACK).accepted
    vs = [_check(forward, r, *x, thresholds=SAME_STACK) for r, x in enumerate(_rollouts(fake_quantize(worker, 8)))]
    for v in vs:
        assert not v.accepted and any(code.startswith("toploc_") for code in v.reasons), v.reasons
        assert max(s.mant_err_mean for s in v.chunk_stats) > 1.0


def test_other_sampling_seed_rejected(worker, forward):
    vs = [_check(forward, r, *x) for r, x in enumerate(_rollouts(worker, seed=SEED + 1))]
    _assert_rejected(vs, SAMPLING_MISMATCH)


def test_changed_prompt_rejected(forward, honest):
    for row, (p, o, pr) in enumerate(honest):
        q = list(p)
        q[1] = 3 + (q[1] - 2) % 509
        v = _check(forward, row, q, o, pr)
        assert not v.accepted and "toploc_exp" in v.reasons


def test_changed_token_caught_by_sampling_even_when_toploc_passes(forward, honest):
    for row, (p, o, pr) in enumerate(honest):
        # The last token's own hidden state is never proven: TOPLOC cannot see this change.
        o2 = list(o)
        o2[-1] = 3 + (o2[-1] - 2) % 509
        v = _check(forward, row, p, o2, pr)
        assert not v.accepted and SAMPLING_MISMATCH in v.reasons
        assert all(s.exp_mismatches == 0 for s in v.chunk_stats)
        # A change in the middle is caught too.
        o3 = list(o)
        o3[10] = 3 + (o3[10] - 2) % 509
        assert SAMPLING_MISMATCH in _check(forward, row, p, o3, pr).reasons


def test_truncated_output_rejected(forward, honest):
    for row, (p, o, _) in enumerate(honest):
        cut = len(o) - 5
        proofs = build_proofs(generated_hidden_slice(forward(p + o)[0], len(p), cut))
        v = _check(forward, row, p, o[:cut], proofs)
        assert v.reasons == (BAD_TERMINATION,)


def test_eos_inside_and_too_long_rejected(forward, honest):
    p, o, pr = honest[0]
    o2 = list(o)
    o2[3] = EOS
    assert BAD_TERMINATION in _check(forward, 0, p, o2, pr).reasons
    v = check_rollout(forward, p, o, pr, seed=SEED, row=0, temperature=1.0,
                      eos_token_id=EOS, max_new_tokens=len(o) - 1)
    assert BAD_TERMINATION in v.reasons


def test_fabricated_and_copied_proofs_rejected(forward, honest):
    rng = np.random.default_rng(0)
    for row, (p, o, pr) in enumerate(honest):
        fake = [encode_proof(PRIME, rng.integers(0, PRIME, (len(x) - 2) // 2)) for x in pr]
        assert "toploc_exp" in _check(forward, row, p, o, fake).reasons
        donor = honest[1 - row][2]
        copied = (donor * 4)[: len(pr)]
        if [len(x) for x in copied] == [len(x) for x in pr]:
            assert not _check(forward, row, p, o, copied).accepted


@pytest.mark.parametrize("mutate", [
    lambda pr: pr[:-1],
    lambda pr: pr + pr[:1],
    lambda pr: [None] + pr[1:],
    lambda pr: [pr[0][:-2]] + pr[1:],
    lambda pr: [b"\x00\x00" + pr[0][2:]] + pr[1:],
    lambda pr: "not a list",
])
def test_malformed_proofs_give_a_verdict(forward, honest, mutate):
    p, o, pr = honest[0]
    v = _check(forward, 0, p, o, mutate(list(pr)))
    assert v.reasons == (MALFORMED_PROOF,) and not v.accepted


def test_malformed_ids_give_a_verdict(forward, honest):
    p, o, pr = honest[0]
    assert _check(forward, 0, [], o, pr).reasons == (MALFORMED_PROOF,)
    assert _check(forward, 0, p, [-1] + o[1:], pr).reasons == (MALFORMED_PROOF,)
    assert _check(forward, 0, p, o[:-1] + [10_000], pr, vocab_size=512).reasons == (
        MALFORMED_PROOF,)


def _one_token_forward(eos_logit: float, vocab: int = 16, hidden_size: int = 256):
    """A validator's forward for prompt [5, 6, 7] + one generated token: the row that produced the
    token gives every id logit 0 but EOS (id 2) `eos_logit`."""
    hidden = torch.randn(4, hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    logits = torch.zeros(4, vocab)
    logits[2, 2] = eos_logit

    def forward(ids):
        assert list(ids) == [5, 6, 7, 2]
        return hidden, logits

    return forward, build_proofs(generated_hidden_slice(hidden, 3, 1))


def test_an_improbable_eos_the_worker_sampled_honestly_is_accepted():
    # Seed 11, row 1418, position 0: the Gumbel noise puts EOS 8.18 above every other id, so a worker
    # sampling honestly ends with EOS at logit -7 although softmax gives it 6.1e-5 (< min_eos_prob).
    # Before, that EOS was rejected as improbable: an honest worker hit this with probability up to
    # 1e-4 for each token it generated. Claimed at logit -(8.18 + 0.75), EOS is not the sample: the
    # replay's margin (1.0) lets it pass, the termination check does not.
    kw = dict(seed=11, row=1418, temperature=1.0, eos_token_id=2, max_new_tokens=8)
    forward, proofs = _one_token_forward(-7.0)
    v = check_rollout(forward, [5, 6, 7], [2], proofs, **kw)
    assert v.accepted, v
    assert v.termination.eos_prob < 1e-4 and v.termination.seeded_eos and v.sampling.last_deficit == 0.0
    forward, proofs = _one_token_forward(-1000.0)
    gap = 1000.0 - check_rollout(forward, [5, 6, 7], [2], proofs, **kw).sampling.last_deficit  # EOS's lead
    forward, proofs = _one_token_forward(-(gap + 0.75))
    v = check_rollout(forward, [5, 6, 7], [2], proofs, **kw)
    assert v.sampling.ok and 0.5 < v.sampling.last_deficit <= 1.0
    assert v.reasons == (BAD_TERMINATION,) and v.detail == "eos_improbable"


def test_explain_shows_each_statistics_largest_value_and_every_verdict_explains():
    """The numbers behind a TOPLOC rejection are each statistic's largest value: a chunk that
    fails on the mantissa median or the sign need not be the one with the most exponent
    mismatches (the log showed that chunk, whose numbers passed, before). Malformed verdicts
    (no reports), infinite and NaN statistics and long mismatch lists explain without raising."""
    from verify.check import RolloutVerdict, explain
    from verify.sampling import SamplingReport
    from verify.toploc import ChunkStats

    stats = (ChunkStats(5, 3.0, 2.0, 0), ChunkStats(0, 9.5, 9.0, 30), ChunkStats(1, 1.0, 1.0, 1))
    line = explain(RolloutVerdict(False, ("toploc_mant_median", "toploc_sign"), chunk_stats=stats))
    assert "3 chunks, largest: exp 5 (chunk 0) mant mean 9.5 (chunk 1) median 9 (chunk 1) sign 30 (chunk 1)" in line
    assert explain(RolloutVerdict(False, (MALFORMED_PROOF,), detail="empty prompt")) == "malformed_proof; empty prompt"
    odd = (ChunkStats(128, float("inf"), float("inf"), 0), ChunkStats(0, float("nan"), 0.0, 0))
    replay = SamplingReport(20, tuple(range(10, 20)), max_deficit=float("inf"), last_deficit=float("nan"))
    line = explain(RolloutVerdict(False, ("toploc_exp", SAMPLING_MISMATCH), chunk_stats=odd, sampling=replay))
    assert "mant mean nan (chunk 1)" in line and "exp 128 (chunk 0)" in line
    assert "over margin at [10, 11, 12, 13, 14, 15, 16, 17] and 2 more" in line
