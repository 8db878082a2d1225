"""Batched generation of rollouts with a KV cache, replayable sampling and TOPLOC proofs.

Owns: turning tasks into prompt ids, generating G samples per prompt with
`verify.sampling.sample_tokens` (so a validator can replay every token from the
seed, row and position), recording output ids, per-token log-probs, the stop reason
and the LM-head-input hidden states of generated positions, building TOPLOC proofs
from them (timed separately), and the typed `RolloutBatch` a worker submits.

Rows: row r of a batch answers prompt r // G. Rows are grouped by prompt length so a
group needs no padding; every row's numbers are those of an unpadded run.

Proven positions: the hidden state that produced generated token i (prompt_len-1+i in
the full sequence), which is what `verify.check.generated_hidden_slice` selects.

The forward passes are `models.forward` (transformers' stable `past_key_values` API), the
prompt ids and the sampling seed `tasks.prompts` (chat template for instruct models), shared
with validators.

Must not: open sockets, compute rewards (the learner does, from the task), or sign
anything (the peer does).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from models.forward import decode_step, lm_head_logits, prefill
from tasks.base import Task
from tasks.prompts import prompt_ids_for, sampling_seed
from verify.sampling import sample_tokens, token_logprobs

STOP_EOS = "eos"
STOP_LENGTH = "length"


@dataclass(frozen=True)
class GenerationConfig:
    group_size: int = 8
    max_new_tokens: int = 4
    temperature: float = 1.0
    proofs: bool = True
    chunk_tokens: int = 32
    topk: int = 128

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError("group_size must be at least 2 (GRPO normalises within a group)")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if not self.temperature > 0.0:
            raise ValueError("temperature must be positive")
        if self.chunk_tokens < 1 or self.topk < 1:
            raise ValueError("chunk_tokens and topk must be positive")


@dataclass(frozen=True)
class Rollout:
    """One generated sequence. len(output_ids) == len(logprobs) >= 1; proofs cover output_ids
    in chunks of `chunk_tokens` (empty when proofs were not built)."""

    row: int
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    stop_reason: str
    proofs: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class RolloutBatch:
    """What a worker submits for one step: rollouts[i].row == i; rows i*G..i*G+G-1 answer prompt i.

    `step` keys the prompt assignment (trainer.tasks.assign_prompts), `model_version`
    is the policy version that generated it, `seed` is the network seed both derive from.
    """

    worker_id: str
    step: int
    model_version: int
    seed: int
    group_size: int
    temperature: float
    max_new_tokens: int
    rollouts: tuple[Rollout, ...]

    def __post_init__(self) -> None:
        if len(self.rollouts) % self.group_size:
            raise ValueError("rollouts do not split into whole groups")
        for i, r in enumerate(self.rollouts):
            if r.row != i:
                raise ValueError(f"rollout {i} carries row {r.row}")

    @property
    def n_prompts(self) -> int:
        return len(self.rollouts) // self.group_size

    @property
    def sampling_seed(self) -> int:
        return sampling_seed(self.seed, self.worker_id, self.step)

    @property
    def n_output_tokens(self) -> int:
        return sum(len(r.output_ids) for r in self.rollouts)


@dataclass
class RolloutTiming:
    generate_s: float = 0.0
    proof_s: float = 0.0
    n_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def proof_share(self) -> float:
        return self.proof_s / self.generate_s if self.generate_s > 0 else 0.0


@dataclass(frozen=True)
class _RowOut:
    output_ids: list[int]
    logprobs: list[float]
    hidden: torch.Tensor  # bf16 [n_out, H]
    stop_reason: str


@torch.no_grad()
def generate_rows(model, prompts: Sequence[Sequence[int]], rows: Sequence[int], *, seed: int,
                  eos_id: int, config: GenerationConfig) -> list[_RowOut]:
    """Generate for prompts of one length in one batch; row numbers select the sampling noise."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("generate_rows needs prompts of one length")
    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long)
    batch = ids.shape[0]
    hidden, cache = prefill(model, ids)
    tokens, logps, hiddens = [], [], []
    done = torch.zeros(batch, dtype=torch.bool)
    n_out = torch.full((batch,), config.max_new_tokens, dtype=torch.long)
    for pos in range(config.max_new_tokens):
        logits = lm_head_logits(model, hidden)
        tok = sample_tokens(logits, seed=seed, rows=list(rows), position=pos,
                            temperature=config.temperature)
        tokens.append(tok)
        logps.append(token_logprobs(logits, tok, config.temperature))
        hiddens.append(hidden.to("cpu", torch.bfloat16))
        newly = (tok == eos_id) & ~done
        n_out[newly] = pos + 1
        done |= newly
        if bool(done.all()) or pos + 1 == config.max_new_tokens:
            break
        hidden, cache = decode_step(model, tok, cache)
    tok_t, lp_t, h_t = torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(hiddens, 1)
    results = []
    for b in range(batch):
        n = int(n_out[b])
        results.append(_RowOut(
            output_ids=tok_t[b, :n].tolist(),
            logprobs=lp_t[b, :n].tolist(),
            hidden=h_t[b, :n].contiguous(),
            stop_reason=STOP_EOS if bool(done[b]) else STOP_LENGTH,
        ))
    return results


def generate_batch(model, tokenizer: Any, tasks: Sequence[Task], *, worker_id: str, step: int,
                   model_version: int, seed: int, config: GenerationConfig = GenerationConfig(),
                   weight_files: Sequence[Any] = ()) -> tuple[RolloutBatch, RolloutTiming]:
    """G samples for each task, with proofs; returns the batch and where the time went.

    `weight_files` (the version's verified files) matter only to engines that hold weights of
    their own (`trainer.vllm_backend`); this generator runs `model` itself."""
    timing = RolloutTiming()
    prompts = prompt_ids_for(tasks, tokenizer)
    row_prompts = [prompts[r // config.group_size] for r in range(len(prompts) * config.group_size)]
    by_len: dict[int, list[int]] = defaultdict(list)
    for row, p in enumerate(row_prompts):
        by_len[len(p)].append(row)
    outs: dict[int, _RowOut] = {}
    s_seed = sampling_seed(seed, worker_id, step)
    t0 = time.perf_counter()
    for _, rows in sorted(by_len.items()):
        group = generate_rows(model, [row_prompts[r] for r in rows], rows, seed=s_seed,
                              eos_id=tokenizer.eos_id, config=config)
        outs.update(zip(rows, group))
    timing.generate_s = time.perf_counter() - t0
    proofs = build_row_proofs(outs, config, timing)
    rollouts = tuple(
        Rollout(row=r, prompt_ids=tuple(row_prompts[r]), output_ids=tuple(outs[r].output_ids),
                logprobs=tuple(outs[r].logprobs), stop_reason=outs[r].stop_reason,
                proofs=proofs.get(r, ()))
        for r in range(len(row_prompts))
    )
    timing.n_tokens = sum(len(r.output_ids) for r in rollouts)
    batch = RolloutBatch(worker_id=worker_id, step=step, model_version=model_version, seed=seed,
                         group_size=config.group_size, temperature=config.temperature,
                         max_new_tokens=config.max_new_tokens, rollouts=rollouts)
    return batch, timing


def build_row_proofs(outs: dict[int, _RowOut], config: GenerationConfig,
                     timing: RolloutTiming) -> dict[int, tuple[bytes, ...]]:
    if not config.proofs:
        return {}
    from verify.toploc import build_proofs_many

    t0 = time.perf_counter()
    rows = list(outs)  # every row's chunks proven together (the same bytes as one by one)
    built = build_proofs_many([outs[r].hidden for r in rows], chunk_tokens=config.chunk_tokens, topk=config.topk)
    proofs = {row: tuple(p) for row, p in zip(rows, built)}
    timing.proof_s = time.perf_counter() - t0
    return proofs
