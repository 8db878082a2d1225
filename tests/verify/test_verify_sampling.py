"""verify.sampling: pinned noise, Gumbel-max sampling, replay and termination."""

from __future__ import annotations

import math

import pytest
import torch

from verify.errors import ProofError
from verify.sampling import (
    check_termination,
    gumbel_noise,
    replay_check,
    sample_tokens,
    token_logprobs,
)

torch.set_num_threads(1)


def test_noise_is_pinned():
    # Golden values: any change here breaks replay between peers on different versions.
    expected = [0.24170245230197906, -0.7009897828102112, 0.8595185875892639, 0.40083110332489014]
    assert gumbel_noise(0, 0, 0, 4).tolist() == expected
    assert gumbel_noise(12345, 3, 17, 3).tolist() == [
        0.9440504908561707, 0.3749139606952667, 0.6932128667831421]


def test_noise_is_deterministic_and_keyed():
    a = gumbel_noise(1, 2, 3, 1000)
    assert a.dtype == torch.float32 and a.shape == (1000,)
    assert torch.equal(a, gumbel_noise(1, 2, 3, 1000))
    for other in (gumbel_noise(2, 2, 3, 1000), gumbel_noise(1, 3, 3, 1000),
                  gumbel_noise(1, 2, 4, 1000)):
        assert not torch.equal(a, other)
    # A longer vocabulary extends the same stream: positions never overlap.
    assert torch.equal(gumbel_noise(1, 2, 3, 10), a[:10])


def test_noise_looks_gumbel():
    g = gumbel_noise(7, 0, 0, 200_000).double()
    assert abs(g.mean().item() - 0.5772) < 0.02
    assert abs(g.std().item() - math.pi / math.sqrt(6)) < 0.02


@pytest.mark.parametrize("bad", [-1, 1 << 64, 1.5, True])
def test_noise_rejects_bad_ints(bad):
    with pytest.raises(ValueError):
        gumbel_noise(bad, 0, 0, 4)


def test_sampling_follows_softmax():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    hits = sum(int(sample_tokens(logits, seed=s, rows=[0], position=0, temperature=1.0))
               for s in range(2000))
    assert abs(hits / 2000 - 0.75) < 0.04


def test_sampling_rows_differ_and_temperature_checked():
    logits = torch.zeros(8, 50)
    toks = sample_tokens(logits, seed=3, rows=list(range(8)), position=0, temperature=1.0)
    assert toks.dtype == torch.long and len(set(toks.tolist())) > 1
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            sample_tokens(logits, seed=3, rows=list(range(8)), position=0, temperature=bad)
    with pytest.raises(ValueError):
        sample_tokens(logits, seed=3, rows=[0], position=0, temperature=1.0)


def test_token_logprobs():
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    lp = token_logprobs(logits, torch.tensor([1, 0]), 1.0)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, torch.tensor([math.log(0.75), math.log(0.5)]))
    lp2 = token_logprobs(logits, torch.tensor([1, 0]), 2.0)
    assert torch.allclose(lp2[1], torch.tensor(math.log(0.5)))


def _sampled(seed=5, row=1, n=40, vocab=64, temperature=0.8):
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    toks = [int(sample_tokens(logits[i : i + 1], seed=seed, rows=[row], position=i,
                              temperature=temperature)[0]) for i in range(n)]
    return logits, toks


def test_replay_accepts_honest_and_tolerates_small_noise():
    logits, toks = _sampled()
    rep = replay_check(logits, toks, seed=5, row=1, temperature=0.8)
    assert rep.ok and rep.positions_checked == 40 and rep.max_deficit == 0.0
    noisy = logits + 0.01 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    assert replay_check(noisy, toks, seed=5, row=1, temperature=0.8).ok


def test_replay_flags_changed_tokens_wrong_seed_and_row():
    logits, toks = _sampled()
    changed = list(toks)
    changed[7] = (changed[7] + 1) % 64
    rep = replay_check(logits, changed, seed=5, row=1, temperature=0.8)
    assert 7 in rep.mismatches
    assert len(replay_check(logits, toks, seed=6, row=1, temperature=0.8).mismatches) > 10
    assert len(replay_check(logits, toks, seed=5, row=2, temperature=0.8).mismatches) > 10


def test_replay_rejects_malformed():
    logits, toks = _sampled()
    with pytest.raises(ProofError):
        replay_check(logits, toks[:-1], seed=5, row=1, temperature=0.8)
    with pytest.raises(ProofError):
        replay_check(logits, toks[:-1] + [64], seed=5, row=1, temperature=0.8)
    assert replay_check(logits[:0], [], seed=5, row=1, temperature=0.8).ok


def test_replay_nan_logits_fail():
    logits, toks = _sampled()
    logits[3] = float("nan")
    assert 3 in replay_check(logits, toks, seed=5, row=1, temperature=0.8).mismatches


def test_termination_rules():
    logits = torch.zeros(10)
    logits[2] = 5.0  # EOS = 2 is likely
    kw = dict(eos_token_id=2, max_new_tokens=8, temperature=1.0)
    assert check_termination(logits, 2, n_generated=5, **kw).ok
    assert check_termination(logits, 4, n_generated=8, **kw).ok  # hit the length limit
    assert check_termination(logits, 4, n_generated=5, **kw).reason == "truncated"
    assert check_termination(logits, 4, n_generated=9, **kw).reason == "too_long"
    assert check_termination(logits, None, n_generated=0, **kw).reason == "truncated"
    improbable = torch.zeros(10)
    improbable[2] = -30.0
    rep = check_termination(improbable, 2, n_generated=5, **kw)
    assert rep.reason == "eos_improbable" and rep.eos_prob < 1e-4
    assert check_termination(logits, 3, n_generated=5, eos_token_id=[2, 3],
                             max_new_tokens=8, temperature=1.0).ok  # any EOS id counts


def test_seeded_eos_below_min_prob_is_legitimate():
    improbable = torch.zeros(10)
    improbable[2] = -30.0
    kw = dict(eos_token_id=2, max_new_tokens=8, temperature=1.0, n_generated=5)
    rep = check_termination(improbable, 2, eos_deficit=0.0, **kw)  # the replay found it sampled
    assert rep.ok and rep.seeded_eos and rep.eos_prob < 1e-4
    assert check_termination(improbable, 2, eos_deficit=0.5, **kw).ok  # honest float noise
    for deficit in (0.51, 1.0, float("nan"), None):  # the margin's slack, broken logits, no replay
        assert check_termination(improbable, 2, eos_deficit=deficit, **kw).reason == "eos_improbable"
    assert not check_termination(torch.zeros(10), 2, eos_deficit=0.0, **kw).seeded_eos  # probable anyway
    at_limit = dict(kw, n_generated=8)  # the limit ends it whatever its last token: no EOS rule there
    assert check_termination(improbable, 2, eos_deficit=0.8, **at_limit).ok
    assert check_termination(improbable, 2, **at_limit).ok


def test_replay_reports_the_last_tokens_deficit():
    logits, toks = _sampled()
    assert replay_check(logits, toks, seed=5, row=1, temperature=0.8).last_deficit == 0.0
    worse = list(toks)
    worse[-1] = int(torch.argsort(logits[-1] / 0.8 + gumbel_noise(5, 1, len(toks) - 1, 64))[0])
    rep = replay_check(logits, worse, seed=5, row=1, temperature=0.8)
    assert rep.last_deficit == rep.max_deficit > 0
    early = list(toks)  # an earlier token is off, the final one is the exact sample
    early[0] = int(torch.argsort(logits[0] / 0.8 + gumbel_noise(5, 1, 0, 64))[0])
    rep = replay_check(logits, early, seed=5, row=1, temperature=0.8)
    assert rep.max_deficit > 0 and rep.last_deficit == 0.0
    logits[-1, 0] = float("nan")  # NaN logits support no claim
    assert replay_check(logits, toks, seed=5, row=1, temperature=0.8).last_deficit == float("inf")
