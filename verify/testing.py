"""Test and calibration support for verify: a tiny random-init model and reproducible inputs.

Owns: a small Llama built from a config with a fixed seed (no downloads), an honest
token-by-token generator that records the LM-head inputs the way an inference worker does,
the ``forward`` callable a validator hands to ``verify.check``, and a platform-independent
generator of bf16 test tensors for golden vectors.

Must not: be imported by any verify core (toploc, sampling, policy, check). It exists so that
tests, benchmarks and scripts/calibrate.py share one definition; transformers is imported
lazily, inside the functions that need it.
"""

from __future__ import annotations

import copy

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from verify.sampling import sample_tokens

__all__ = [
    "Generation",
    "TinyModelConfig",
    "bf16_gaussian",
    "bf16_test_tensor",
    "generate",
    "boundary_tie_free",
    "make_forward",
    "perturb_bits",
    "tiny_model",
]


# --------------------------------------------------------------------------- golden inputs


def bf16_test_tensor(seed: int, tokens: int, hidden: int) -> torch.Tensor:
    """A heavy-tailed bf16 [tokens, hidden] tensor defined only by Philox raw bits.

    Box-Muller normals times a log-normal scale, rounded to bf16 by our own
    round-to-nearest-even, so the same seed gives the same bits on any platform.
    Heavy tails keep the top-128 sets free of ties in most chunks.
    """
    n = tokens * hidden
    raw = np.random.Philox(key=seed).random_raw(3 * n)
    u = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    u1, u2, u3 = u[:n], u[n : 2 * n], u[2 * n :]
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    scale = np.exp(1.5 * np.sqrt(-2.0 * np.log(u3)) * np.cos(2.0 * np.pi * u2 + 1.0))
    bits32 = (z * scale).astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits32 + 0x7FFF + ((bits32 >> 16) & 1)) >> 16
    bits16 = rounded.astype(np.uint16).reshape(tokens, hidden)
    return torch.from_numpy(bits16.view(np.int16).copy()).view(torch.bfloat16)


def bf16_gaussian(seed: int, tokens: int, hidden: int, *, massive_channels: int = 0) -> torch.Tensor:
    """A standard-normal bf16 [tokens, hidden] tensor from Philox raw bits (platform-independent).

    Tie-heavy on purpose: with hidden 4096 most 32-token chunks have several equal |values|
    at the 128th place. ``massive_channels`` > 0 multiplies that many fixed channels by 30,
    as the few huge channels of real LM-head inputs do (SmolLM2: |h| 8-41 in 17, 25, ...).
    """
    n = tokens * hidden
    raw = np.random.Philox(key=seed).random_raw(2 * n)
    u = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
    z = (np.sqrt(-2.0 * np.log(u[:n])) * np.cos(2.0 * np.pi * u[n:])).reshape(tokens, hidden)
    if massive_channels:
        z[:, np.arange(massive_channels) * (hidden // massive_channels)] *= 30.0
    bits32 = z.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits16 = ((bits32 + 0x7FFF + ((bits32 >> 16) & 1)) >> 16).astype(np.uint16)
    return torch.from_numpy(bits16.view(np.int16).copy()).view(torch.bfloat16)


def perturb_bits(t: torch.Tensor, seed: int, *, exp_flip_every: int = 97) -> torch.Tensor:
    """Flip the two low mantissa bits at random, and bit 7 (exponent LSB) of every
    ``exp_flip_every``-th entry: a deterministic stand-in for a slightly different model."""
    bits = t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
    raw = np.random.Philox(key=seed).random_raw(bits.size)
    out = bits ^ (raw & np.uint64(0x3)).astype(np.uint16)
    out[::exp_flip_every] ^= np.uint16(0x80)
    return torch.from_numpy(out.view(np.int16).reshape(t.shape).copy()).view(torch.bfloat16)


def boundary_tie_free(t: torch.Tensor, *, chunk_tokens: int = 32, topk: int = 128) -> bool:
    """True when no chunk of ``t`` has a tie between its topk-th and next |value|, so every
    top-k implementation must pick the same set (needed for byte-exact comparisons)."""
    for start in range(0, t.shape[0], chunk_tokens):
        flat = t[start : start + chunk_tokens].reshape(-1).float().abs()
        if flat.numel() > topk:
            top = flat.topk(topk + 1).values
            if top[-1] == top[-2]:
                return False
    return True


# --------------------------------------------------------------------------- tiny model


@dataclass(frozen=True)
class TinyModelConfig:
    """A small Llama: big enough that hidden states have structure, fast on one CPU thread."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 512
    max_positions: int = 512
    seed: int = 0
    attn_implementation: str = "eager"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide into heads, heads into kv heads")


def tiny_model(cfg: TinyModelConfig = TinyModelConfig(), dtype: torch.dtype = torch.float32):
    """Random-init LlamaForCausalLM, identical for the same cfg (weights drawn in fp32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,  # larger than usual so logits are not near-uniform
    )
    config._attn_implementation = cfg.attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype).eval()


def _lm_head_inputs(model, ids: torch.Tensor, past=None):
    if past is None:
        out = model.model(input_ids=ids, use_cache=False)
        return out.last_hidden_state, None
    # transformers 5 renamed past_key_values to cache; accept both.
    try:
        out = model.model(input_ids=ids, cache=past, use_cache=True)
    except TypeError:
        out = model.model(input_ids=ids, past_key_values=past, use_cache=True)
    return out.last_hidden_state, past


@dataclass(frozen=True)
class Generation:
    """What an honest worker produced for one sequence."""

    output_ids: list[int]
    hidden: torch.Tensor  # bf16 [n_out, H]: LM-head input at the position producing each token


@torch.no_grad()
def generate(
    model,
    prompt_ids: Sequence[int],
    *,
    seed: int,
    row: int,
    max_new_tokens: int,
    temperature: float,
    eos_token_id: int,
) -> Generation:
    """Token-by-token decoding with a KV cache and seeded Gumbel sampling, as a worker does."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    hidden_rows, out_ids = [], []
    for position in range(max_new_tokens):
        h, cache = _lm_head_inputs(model, ids, cache)
        last = h[:, -1]
        logits = model.lm_head(last).float()
        token = int(sample_tokens(logits, seed=seed, rows=[row], position=position,
                                  temperature=temperature)[0])
        hidden_rows.append(last[0].to(torch.bfloat16))
        out_ids.append(token)
        if token == eos_token_id:
            break
        ids = torch.tensor([[token]], dtype=torch.long)
    return Generation(out_ids, torch.stack(hidden_rows) if hidden_rows else
                      torch.zeros((0, model.config.hidden_size), dtype=torch.bfloat16))


def make_forward(model) -> Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]:
    """The validator's ``forward``: one prefill -> (hidden bf16 [T, H], logits fp32 [T, V])."""

    @torch.no_grad()
    def forward(input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = _lm_head_inputs(model, torch.tensor([list(input_ids)], dtype=torch.long))
        logits = model.lm_head(h).float()
        return h[0].to(torch.bfloat16), logits[0]

    return forward


def fake_quantize(model, bits: int):
    """Symmetric per-output-channel round-to-nearest of every Linear weight (not the norms).

    With tied embeddings (SmolLM2) the LM head's weight is the embedding table, so it is
    quantized too, as GGUF Q8_0 / Q4 files do."""
    q = copy.deepcopy(model)
    levels = (1 << (bits - 1)) - 1
    with torch.no_grad():
        for mod in q.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight.float()
                scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / levels
                mod.weight.copy_((w / scale).round().clamp(-levels, levels) * scale)
    return q
