"""Running a causal LM: the prefill validators recompute, and the cached steps workers sample with.

Owns `hidden_and_logits` (one prefill of a sequence: the bf16 hidden states fed to the LM head
and the float32 logits, what `verify.check` compares against a worker's proofs), `prefill` and
`decode_step` (a batch's first pass and each next token with a KV cache, through transformers'
stable `past_key_values` API, which every supported transformers version has; `cache_keyword`
follows 5.24's rename where a model declares only the new name).

Both roles compute hidden states here, so a worker and a validator with the same weights run
the same code.

Must not: sample, build proofs, or know about tasks or files.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def hidden_and_logits(model: Any, input_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill of a single sequence [T]: (hidden bf16 [T, H] fed to the LM head, logits f32
    [T, V]), both on the CPU."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1).to(_device(model))
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden).float()
    return hidden[0].to(torch.bfloat16).cpu(), logits[0].cpu()


def cache_keyword(model: Any) -> str:
    """The name under which the decoder's forward takes its KV cache: `past_key_values` (every
    transformers 4.x and 5.x release), or `cache` where the forward declares only that (5.24
    renamed it and keeps the old name as a deprecated alias until 5.40)."""
    params = inspect.signature(type(model.model).forward).parameters
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


def _cache_of(out: Any) -> Any:
    """The cache of a forward's output: `cache` where the output has it (5.24 warns on the old
    name), else `past_key_values`."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def prefill(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The first pass of a batch of equal-length prompts [B, T]: (the last position's hidden
    state [B, H], the KV cache to continue from)."""
    out = model.model(input_ids=ids.to(_device(model)), use_cache=True)
    return out.last_hidden_state[:, -1], _cache_of(out)


@torch.no_grad()
def decode_step(model: Any, tokens: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
    """One more token per row [B]: (its hidden state [B, H], the grown cache)."""
    out = model.model(input_ids=tokens[:, None].to(_device(model)), use_cache=True,
                      **{cache_keyword(model): cache})
    return out.last_hidden_state[:, -1], _cache_of(out)


@torch.no_grad()
def lm_head_logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, V] on the CPU for hidden states [B, H]."""
    return model.lm_head(hidden).float().cpu()
