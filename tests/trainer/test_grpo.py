import math

import pytest
import torch

from trainer.grpo import GRPOConfig, group_advantages, grpo_loss, grpo_token_loss
from trainer.learner import admissible


def test_group_advantages_hand_computed():
    # group 1: mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> +-0.866025
    # group 2: all equal -> no signal, zero advantage
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3]), 4, eps=1e-6)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv[:4].tolist() == pytest.approx([expected, -expected, -expected, expected], abs=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert expected == pytest.approx(0.866024, abs=1e-5)


@pytest.mark.parametrize("reward", [0.1 + 0.2, 0.42000000000000004, 0.7, 1 / 3])
@pytest.mark.parametrize("group_size", [2, 3, 4, 8, 16])
def test_a_tied_group_gets_no_advantage_whatever_float32_makes_of_its_mean(reward, group_size):
    """Partial credit gives rewards like 0.3: the mean of eight in float32 is an ulp off, and
    divided by a std as small the whole group moved one way (+-0.029) though it carries no signal."""
    adv = group_advantages(torch.full((2 * group_size,), reward), group_size)
    assert adv.tolist() == [0.0] * (2 * group_size)


def test_group_advantages_three_values():
    # rewards 0, 1, 2: mean 1, unbiased std 1 -> advantages -1, 0, 1
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0]), 3, eps=0.0)
    assert adv.tolist() == pytest.approx([-1.0, 0.0, 1.0])


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(5), 4)


def _example():
    # seq 0 (A=+1): ratios 1.5, 0.5, then a padded position
    # seq 1 (A=-2): ratios 5.0, 1.1, 0.7
    old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 9.0], [5.0, 1.1, 0.7]]))
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return logp.requires_grad_(), old, adv, mask


def test_grpo_loss_hand_computed():
    logp, old, adv, mask = _example()
    per_token = grpo_token_loss(logp, old, adv)
    # A=+1: max(-1.5, -1.2) = -1.2 ; max(-0.5, -0.8) = -0.5
    # A=-2: max(10, 2.4) = 10 -> dual clip min(10, 8) = 8 ; max(2.2, 2.2) = 2.2 ;
    #       max(1.4, 1.6) = 1.6 -> min(1.6, 8) = 1.6
    assert per_token[0, :2].tolist() == pytest.approx([-1.2, -0.5], abs=1e-6)
    assert per_token[1].tolist() == pytest.approx([8.0, 2.2, 1.6], abs=1e-5)
    loss, stats = grpo_loss(logp, old, adv, mask)
    # (-1.2 - 0.5 + 8 + 2.2 + 1.6) / 5 real tokens = 10.1 / 5
    assert float(loss.detach()) == pytest.approx(2.02, abs=1e-5)
    assert stats.n_tokens == 5
    assert stats.clip_fraction == pytest.approx(4 / 5)  # 1.5, 0.5, 5.0, 0.7 lie outside [0.8, 1.2]


def test_grpo_gradients_vanish_where_clipped_and_on_padding():
    logp, old, adv, mask = _example()
    loss, _ = grpo_loss(logp, old, adv, mask)
    loss.backward()
    g = logp.grad
    assert g[0, 0] == 0.0  # ratio 1.5 clipped at 1.2 for A>0
    assert g[0, 2] == 0.0  # padding
    assert g[1, 0] == 0.0  # dual clip at 4.0 for A<0
    assert g[1, 2] == 0.0  # ratio 0.7 clipped at 0.8 for A<0
    # unclipped tokens: d/dlogp of -A * ratio / 5 = -A * ratio / 5
    assert float(g[0, 1]) == pytest.approx(-1.0 * 0.5 / 5, abs=1e-6)
    assert float(g[1, 1]) == pytest.approx(2.0 * 1.1 / 5, abs=1e-6)


def test_grpo_config_validation():
    with pytest.raises(ValueError):
        GRPOConfig(ratio_max=1.1)
    with pytest.raises(ValueError):
        GRPOConfig(clip_eps_low=1.5)


@pytest.mark.parametrize(
    "batch_version, trainer_step, async_level, ok",
    [(5, 5, 2, True), (4, 5, 2, True), (3, 5, 2, True), (2, 5, 2, False),
     (6, 5, 2, False), (5, 5, 0, True), (4, 5, 0, False), (0, 0, 2, True)],
)
def test_admissible(batch_version, trainer_step, async_level, ok):
    assert admissible(batch_version, trainer_step, async_level) is ok


def test_absurd_old_logprobs_from_a_worker_cannot_make_the_gradient_nan():
    """The old log-probs are the worker's word: finite and <= 0 is all the wire checks. -100
    against a policy near 0 made the ratio inf and its gradient NaN (every weight NaN after the
    step); bounded, those tokens are clipped, their gradient 0, and honest tokens keep theirs."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, requires_grad=True)
    logprobs = torch.log_softmax(logits, dim=-1)
    old = logprobs.detach().clone()
    old[0] = -100.0  # one sequence's log-probs, absurd
    loss, stats = grpo_loss(logprobs, old, torch.tensor([1.0, -1.0]), torch.ones(2, 3))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all() and math.isfinite(stats.ratio_mean)
    assert torch.count_nonzero(logits.grad[0]) == 0 and torch.count_nonzero(logits.grad[1]) > 0
