"""What one DiLoCo trainer peer does alone: inner AdamW steps on its own data shard, and the
durable global state (weights, outer momentum, round) it resumes from.

The task is fixed and verifiable offline: arithmetic sums ('12+7=' -> '19') drawn from a seeded
generator, the model trained with teacher forcing on the answer and the end token. Each peer
draws from its own shard of the stream (`data_seed`), so peers see different batches. The
evaluation loss is measured on a held-out set drawn from a seed no shard uses, so curves of
different runs compare.

`write_state` writes the global state to a temporary file, fsyncs it and renames it over the
previous one: a crash leaves the old state or the new one, never half of one. It is meant to
run in a worker thread while the inner steps go on in another.

This module must not do network I/O; it does not know about rounds beyond the number it saves.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2pnet.files import atomic_write_bytes
from trainer.diloco import flatten, unflatten_into

STATE_FILE = "diloco_state.pt"
EVAL_SEED = 1_000_003


@dataclass(frozen=True)
class InnerConfig:
    lr: float = 3e-3
    batch_size: int = 32
    max_operand: int = 20
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.lr < 1 or self.batch_size < 1 or self.max_operand < 1 or self.weight_decay < 0:
            raise ValueError("inner lr in (0, 1), batch_size >= 1, max_operand >= 1, weight_decay >= 0")


def _examples(tokenizer: Any, rng: random.Random, n: int, max_operand: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) for `n` sums, padded; labels are -100 except on the answer and end token."""
    rows, labels = [], []
    for _ in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        prompt = tokenizer.encode(f"{a}+{b}=", bos=tokenizer.bos_id is not None)
        answer = tokenizer.encode(str(a + b)) + [tokenizer.eos_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    ids = torch.full((n, width), tokenizer.pad_id, dtype=torch.long)
    lab = torch.full((n, width), -100, dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, :len(r)] = torch.tensor(r)
        lab[i, :len(lb)] = torch.tensor(lb)
    return ids, lab


class InnerTrainer:
    """A model, its inner AdamW, and a data shard. Not thread-safe: one thread at a time."""

    def __init__(self, model: Any, tokenizer: Any, config: InnerConfig, data_seed: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.rng = random.Random(data_seed)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.steps = 0
        self._eval = _examples(tokenizer, random.Random(EVAL_SEED), 256, config.max_operand)

    def weights(self) -> torch.Tensor:
        return flatten(self.model.state_dict())

    def load(self, weights: torch.Tensor) -> None:
        unflatten_into(weights, self.model.state_dict())

    def train(self, steps: int) -> float:
        """Take `steps` AdamW steps on the next batches of the shard; the mean training loss."""
        self.model.train()
        total = 0.0
        for _ in range(steps):
            ids, labels = _examples(self.tokenizer, self.rng, self.config.batch_size, self.config.max_operand)
            loss = self._loss(ids, labels)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            total += float(loss.detach())
            self.steps += 1
        self.model.eval()
        return total / max(steps, 1)

    def eval_loss(self, weights: torch.Tensor | None = None) -> float:
        """The held-out loss of the current weights, or of `weights` (the model is restored after)."""
        saved = self.weights() if weights is not None else None
        if weights is not None:
            self.load(weights)
        with torch.no_grad():
            loss = float(self._loss(*self._eval))
        if saved is not None:
            self.load(saved)
        return loss

    def _loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = (ids != self.tokenizer.pad_id).long()
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss


# -- the durable global state ------------------------------------------------------------------


@dataclass(frozen=True)
class GlobalState:
    round: int
    weights: torch.Tensor
    momentum: torch.Tensor


def write_state(folder: Path, state: GlobalState) -> Path:
    """Write `state` durably as folder/STATE_FILE (`p2pnet.files.atomic_write_bytes`: temporary
    file, fsync, rename, fsync dir; the serialized state is held in memory once meanwhile, as
    trainer.checkpoint does with the optimizer state)."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / STATE_FILE
    buf = io.BytesIO()
    torch.save({"round": state.round, "weights": state.weights, "momentum": state.momentum}, buf)
    atomic_write_bytes(final, buf.getvalue())
    return final


def read_state(folder: Path, length: int) -> GlobalState | None:
    """The saved state, or None when there is none; ValueError when it does not fit the model."""
    path = folder / STATE_FILE
    if not path.is_file():
        return None
    raw = torch.load(path, weights_only=True)
    state = GlobalState(int(raw["round"]), raw["weights"], raw["momentum"])
    if state.weights.numel() != length or state.momentum.numel() != length or state.round < 0:
        raise ValueError(f"{path} holds {state.weights.numel()} weights for a model of {length}")
    return state
