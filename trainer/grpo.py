"""GRPO: group-normalised advantages and the clipped policy loss, as pure tensor functions.

Owns the arithmetic of one policy-gradient step as PRIME-RL / INTELLECT-2 do it:

* advantages: within each group of G samples of one prompt, (r - mean) / (std + eps),
  with the unbiased (Bessel-corrected) standard deviation, as in DeepSeekMath and TRL;
* loss per token: PPO clipping at 1 +/- 0.2 on both sides, and the dual clip that
  bounds the ratio at 4.0 for negative advantages (so a token whose probability rose
  a lot under a stale policy cannot produce an unbounded push-down); no KL term;
* masking: the loss is the mean over real (unmasked) tokens of the whole batch;
* the log-ratio is bounded (`MAX_LOG_RATIO`) before it is exponentiated: the old log-probs are
  the worker's word (validators check hidden states, not log-probs), and one finite but absurd
  value (-100) made the ratio inf, its gradient 0 x inf = NaN and every weight NaN after the
  step. A token that far out is clipped either way, so the bound changes no honest token's loss.

Must not: touch models, optimizers, files, or rewards' origin. Inputs are tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOG_RATIO = 20.0  # |log p - log p_old| beyond this is clipped anyway (ratio_max and 1 + eps are far below e^20)


@dataclass(frozen=True)
class GRPOConfig:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    ratio_max: float = 4.0
    adv_eps: float = 1e-6

    def __post_init__(self) -> None:
        if not 0.0 < self.clip_eps_low < 1.0 or self.clip_eps_high <= 0.0:
            raise ValueError("clip eps must be in (0, 1) (low) and > 0 (high)")
        if self.ratio_max <= 1.0 + self.clip_eps_high:
            raise ValueError("ratio_max must exceed 1 + clip_eps_high")
        if self.adv_eps <= 0.0:
            raise ValueError("adv_eps must be positive")


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps) for consecutive groups of `group_size`; shape kept.

    A group whose rewards are all equal gets zero advantage (it carries no signal).
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    if group_size < 2 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size} (need >= 2)")
    g = r.view(-1, group_size)
    adv = (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + eps)
    # float32's mean of G equal rewards can miss them by an ulp, and that ulp over a std as small
    # gave the whole group +-0.03 (8 x 0.3), not 0: a tied group is set to 0 outright
    tied = (g == g[:, :1]).all(dim=1, keepdim=True)
    return adv.masked_fill(tied, 0.0).reshape(-1)


def grpo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    config: GRPOConfig = GRPOConfig()) -> torch.Tensor:
    """Per-token loss [N, T] (before masking); advantages are per sequence [N]."""
    adv = advantages.reshape(-1, 1).to(logprobs.dtype)
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    clipped = torch.clamp(ratio, 1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    dual = torch.minimum(pg, -adv * config.ratio_max)
    return torch.where(adv < 0, dual, pg)


@dataclass(frozen=True)
class LossStats:
    loss: float
    n_tokens: int
    ratio_mean: float
    clip_fraction: float


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, config: GRPOConfig = GRPOConfig()) -> tuple[torch.Tensor, LossStats]:
    """Token-level mean of the GRPO loss over `mask` (1 = real generated token, 0 = padding)."""
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError("logprobs, old_logprobs and mask must have the same shape [N, T]")
    m = mask.to(logprobs.dtype)
    n_tokens = int(m.sum().item())
    per_token = grpo_token_loss(logprobs, old_logprobs.detach(), advantages, config)
    loss = (per_token * m).sum() / max(n_tokens, 1)
    with torch.no_grad():
        ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO))
        outside = (ratio < 1.0 - config.clip_eps_low) | (ratio > 1.0 + config.clip_eps_high)
        denom = max(n_tokens, 1)
        stats = LossStats(
            loss=float(loss.detach()),
            n_tokens=n_tokens,
            ratio_mean=float((ratio * m).sum() / denom),
            clip_fraction=float((outside.to(m.dtype) * m).sum() / denom),
        )
    return loss, stats
