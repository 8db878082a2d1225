"""The learner: GRPO steps on admitted rollout batches, and versioned checkpoints.

Owns: re-checking each batch it is handed (policy version within `async_level`,
generation settings, prompts equal to the ones `assign_prompts` gave that worker,
no replays), recomputing every reward itself from the task (a worker's reward is
never read), one optimizer step per call, and handing a snapshot of each new
version to the background `CheckpointWriter` so the write overlaps the next step.
A new Learner on an `out_dir` that holds versions resumes from the latest complete
one, optimizer state included (only the newest `keep_optimizer_states` versions keep it).

Versions: version 0 is the starting model; each `step` that trains produces version
n+1 and (every `save_every_steps`) the folder `out_dir/v{n+1}/`, a standard model folder in the
starting folder's compute dtype (sharded at `max_shard_bytes`).

Precision: the weights trained are float32 master weights whatever the folder's dtype; where
the folder is bfloat16 (or float16) the forward and backward passes run in that dtype
(autocast), the version is published in it, and the master weights are kept beside the
optimizer state, so a resumed run continues from them and not from rounded weights.

Must not: open sockets, check proofs (batches arrive already verified), or block on
disk writes except when `max_pending_saves` snapshots are already queued.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from models.folder import DEFAULT_SHARD_BYTES, compute_dtype, load_model_dir, skeleton, state_in_dtype
from tasks.prompts import DEFAULT_TASKS, TaskConfig, assign_prompts, prompt_ids_for, reward, uses_chat
from trainer.checkpoint import (CheckpointWriter, Snapshot, latest_version, read_version,
                                remove_temporaries, version_dir, write_version)
from trainer.grpo import GRPOConfig, group_advantages, grpo_loss
from trainer.rollout import RolloutBatch

log = logging.getLogger(__name__)


def admissible(batch_version: int, trainer_step: int, async_level: int) -> bool:
    """May a batch made by policy `batch_version` train step `trainer_step`? (0 <= lag <= async_level)"""
    if async_level < 0:
        raise ValueError("async_level must be non-negative")
    return 0 <= trainer_step - batch_version <= async_level


@dataclass(frozen=True)
class LearnerConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    async_level: int = 2
    task_seed: int = 0
    prompts_per_batch: int = 16
    group_size: int = 8
    temperature: float = 1.0
    max_new_tokens: int = 3
    micro_batch_rows: int = 256
    save_every_steps: int = 1
    keep_last: int = 3           # versions kept on disk; 0 keeps all
    keep_optimizer_states: int = 1  # versions that keep optimizer.pt; 0 keeps it in every version kept
    max_pending_saves: int = 1
    max_shard_bytes: int = DEFAULT_SHARD_BYTES  # safetensors shard size of published versions
    use_worker_logprobs: bool = True
    grpo: GRPOConfig = GRPOConfig()
    tasks: TaskConfig = DEFAULT_TASKS

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.max_grad_norm <= 0:
            raise ValueError("lr and max_grad_norm must be positive")
        if self.async_level < 0 or self.save_every_steps < 1 or self.max_pending_saves < 1:
            raise ValueError("async_level >= 0, save_every_steps >= 1, max_pending_saves >= 1")
        if self.prompts_per_batch < 1 or self.group_size < 2 or self.micro_batch_rows < 1:
            raise ValueError("prompts_per_batch >= 1, group_size >= 2, micro_batch_rows >= 1")
        if not self.temperature > 0 or self.max_new_tokens < 1:
            raise ValueError("temperature > 0 and max_new_tokens >= 1")
        if self.keep_optimizer_states < 0:
            raise ValueError("keep_optimizer_states must be >= 0")
        if self.max_shard_bytes < 1:
            raise ValueError("max_shard_bytes must be positive")
        if self.keep_last and self.keep_last <= self.async_level:
            raise ValueError("keep_last must be 0 (keep all) or exceed async_level, "
                             "so every version a worker may still use stays on disk")


@dataclass(frozen=True)
class StepStats:
    version: int                 # the policy version after this step
    trained: bool                # False when no batch was admitted (no new version)
    admitted: int
    rejected: dict[str, int] = field(default_factory=dict)
    refused: tuple[int, ...] = ()  # positions, in the batches given to `step`, of those refused: never trainable
    n_rollouts: int = 0
    n_tokens: int = 0
    reward_mean: float = 0.0
    accuracy: float = 0.0        # share of rollouts with the exact answer
    loss: float = 0.0
    clip_fraction: float = 0.0
    grad_norm: float = 0.0
    train_s: float = 0.0
    snapshot_s: float = 0.0


class Learner:
    def __init__(self, config: LearnerConfig, model_dir: str | Path, out_dir: str | Path, *,
                 on_saved: Callable[[int, Path], None] | None = None) -> None:
        self.config = config
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        remove_temporaries(self.out_dir)
        resume = latest_version(self.out_dir)
        source = version_dir(self.out_dir, resume) if resume is not None else Path(model_dir)
        self.compute_dtype = compute_dtype(source)
        self.model, self.tokenizer = load_model_dir(source, dtype=torch.float32)  # master weights
        self._shell = skeleton(self.model, self.compute_dtype)
        self.chat = uses_chat(self.tokenizer)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                           betas=(0.9, 0.99), weight_decay=config.weight_decay)
        self.version = 0
        self._seen: set[tuple[str, int]] = set()
        if resume is not None:
            optim_state, state = read_version(self.out_dir, resume)
            if optim_state is None:
                log.warning("resuming from %s without optimizer state (it was pruned): AdamW starts afresh",
                            version_dir(self.out_dir, resume))
            else:
                self._restore(optim_state)
            self.version = int(state["version"])
            self._seen = {(w, int(s)) for w, s in state.get("seen", [])}
        else:
            write_version(self.out_dir, self._snapshot())
        self._writer = CheckpointWriter(self.out_dir, max_pending=config.max_pending_saves,
                                        keep_last=config.keep_last,
                                        keep_optimizer_states=config.keep_optimizer_states, on_saved=on_saved)

    # -- public API ----------------------------------------------------------------------

    def step(self, batches: Sequence[RolloutBatch]) -> StepStats:
        """Train once on the admissible batches; returns what happened. Never reads worker rewards."""
        t0 = time.perf_counter()
        admitted, rejected, refused = admit_batches(self.config, self.tokenizer, self.chat, self.version, self._seen,
                                                    batches)
        if not admitted:
            return StepStats(version=self.version, trained=False, admitted=0, rejected=dict(rejected), refused=refused)
        stats = self._train(admitted)
        self.version += 1
        self._seen = forget_old_keys(self._seen, self.version, self.config.async_level)
        t1 = time.perf_counter()
        if self.version % self.config.save_every_steps == 0:
            self._writer.submit(self._snapshot())
        t2 = time.perf_counter()
        return StepStats(version=self.version, trained=True, admitted=len(admitted),
                         rejected=dict(rejected), refused=refused, train_s=t1 - t0, snapshot_s=t2 - t1, **stats)

    def rewards(self, batch: RolloutBatch) -> list[float]:
        """The trainer's own rewards for every rollout of a batch, from the assigned tasks."""
        return trainer_rewards(self.config, self.tokenizer, self.chat, batch)

    def flush(self) -> None:
        """Wait until every queued version is on disk (raises if a write failed)."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    @property
    def last_saved_version(self) -> int | None:
        return latest_version(self.out_dir)

    @property
    def last_write_s(self) -> float:
        """Seconds the background writer spent on the most recent version it wrote."""
        return self._writer.last_write_s

    # -- admission -------------------------------------------------------------------------

    def _check(self, batch: RolloutBatch) -> str | None:
        """None if the batch may be trained on, else a short reason (the worker's fault)."""
        return admission_reason(self.config, self.tokenizer, self.version, self._seen, batch)

    # -- one optimizer step ---------------------------------------------------------------

    def _train(self, admitted: list[tuple[RolloutBatch, list[float]]]) -> dict[str, Any]:
        cfg = self.config
        rows, advantages, rewards_t = flatten_admitted(admitted, cfg)
        n_tokens = sum(len(r.output_ids) for r in rows)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        micro = [MicroBatch(rows[s:s + cfg.micro_batch_rows], advantages[s:s + cfg.micro_batch_rows])
                 for s in range(0, len(rows), cfg.micro_batch_rows)]
        loss_sum, clipped = backward_micro_batches(self.model, micro, n_tokens, cfg, self.tokenizer.pad_id,
                                                   self._autocast)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.model.eval()
        return dict(n_rollouts=len(rows), n_tokens=n_tokens, reward_mean=float(rewards_t.mean()),
                    accuracy=float((rewards_t == 1.0).float().mean()), loss=loss_sum,
                    clip_fraction=clipped, grad_norm=float(grad_norm))

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=self.compute_dtype)

    def _snapshot(self) -> Snapshot:
        optimizer_state: dict = {"optimizer": copy.deepcopy(self.optimizer.state_dict())}
        if self.compute_dtype != torch.float32:
            optimizer_state["master_weights"] = state_in_dtype(self.model, torch.float32)
        return Snapshot(
            version=self.version,
            shell=self._shell,
            tokenizer=self.tokenizer,
            weights=state_in_dtype(self.model, self.compute_dtype),
            optimizer_state=optimizer_state,
            trainer_state={"seen": sorted(self._seen), "config": _jsonable(asdict(self.config)),
                           "compute_dtype": str(self.compute_dtype).removeprefix("torch.")},
            max_shard_bytes=self.config.max_shard_bytes,
        )

    def _restore(self, saved: dict) -> None:
        """Optimizer state (and master weights) from `optimizer.pt`; a file of earlier versions
        holds the optimizer's state dict alone."""
        if "optimizer" not in saved:
            self.optimizer.load_state_dict(saved)
            return
        master = saved.get("master_weights")
        if master is not None:
            with torch.no_grad():
                params = self.model.state_dict()
                for name, tensor in master.items():
                    params[name].copy_(tensor)
        self.optimizer.load_state_dict(saved["optimizer"])



# -- shared by the one-process learner and the sharded one (trainer.sharded) -------------------

def admission_reason(cfg: LearnerConfig, tokenizer, version: int, seen: set[tuple[str, int]],
                     batch: RolloutBatch) -> str | None:
    """None if `batch` may train the step after `version`, else a short reason (the worker's
    fault). Deterministic: every rank of a sharded learner reaches the same answer."""
    if batch.model_version > version:
        return "future_version"
    if not admissible(batch.model_version, version, cfg.async_level):
        return "stale_version"
    if not admissible(batch.step, version, cfg.async_level) or batch.model_version > batch.step:
        return "wrong_step"
    if batch.seed != cfg.task_seed:
        return "wrong_seed"
    if (batch.worker_id, batch.step) in seen:
        return "duplicate"
    if (batch.n_prompts != cfg.prompts_per_batch or batch.group_size != cfg.group_size
            or batch.temperature != cfg.temperature or batch.max_new_tokens != cfg.max_new_tokens):
        return "wrong_settings"
    tasks = assign_prompts(batch.worker_id, batch.step, cfg.task_seed, batch.n_prompts, cfg.tasks)
    expected = prompt_ids_for(tasks, tokenizer)
    vocab = tokenizer.vocab_size
    for r in batch.rollouts:
        if list(r.prompt_ids) != expected[r.row // batch.group_size]:
            return "wrong_prompt"
        n = len(r.output_ids)
        if not 1 <= n <= cfg.max_new_tokens or len(r.logprobs) != n:
            return "bad_lengths"
        if any(not 0 <= t < vocab for t in r.output_ids):
            return "bad_token"
    return None


def admit_batches(cfg: LearnerConfig, tokenizer, chat: bool, version: int, seen: set[tuple[str, int]],
                  batches: Sequence[RolloutBatch]
                  ) -> tuple[list[tuple[RolloutBatch, list[float]]], Counter[str], tuple[int, ...]]:
    """The batches that may train the step after `version`, each with the trainer's own rewards,
    the count of refused ones by reason, and the refused ones' positions in `batches` (every
    reason holds for good: versions only grow). Admitted batches' (worker, step) keys join `seen`."""
    rejected: Counter[str] = Counter()
    admitted: list[tuple[RolloutBatch, list[float]]] = []
    refused: list[int] = []
    for position, batch in enumerate(batches):
        reason = admission_reason(cfg, tokenizer, version, seen, batch)
        if reason is None:
            admitted.append((batch, trainer_rewards(cfg, tokenizer, chat, batch)))
            seen.add((batch.worker_id, batch.step))
        else:
            rejected[reason] += 1
            refused.append(position)
    return admitted, rejected, tuple(refused)


def forget_old_keys(seen: set[tuple[str, int]], version: int, async_level: int) -> set[tuple[str, int]]:
    """The (worker, step) keys still inside the async window after `version`."""
    horizon = version - async_level - 1
    return {k for k in seen if k[1] >= horizon}


def trainer_rewards(cfg: LearnerConfig, tokenizer, chat: bool, batch: RolloutBatch) -> list[float]:
    """The trainer's own rewards for every rollout of a batch, from the assigned tasks."""
    tasks = assign_prompts(batch.worker_id, batch.step, cfg.task_seed, batch.n_prompts, cfg.tasks)
    return [reward(tasks[r.row // batch.group_size], tokenizer.decode(r.output_ids), cfg.tasks, chat=chat)
            for r in batch.rollouts]


def flatten_admitted(admitted: Sequence[tuple[RolloutBatch, list[float]]],
                     cfg: LearnerConfig) -> tuple[list, torch.Tensor, torch.Tensor]:
    """(every rollout in order, its group-normalised advantage, its reward)."""
    rows: list[Any] = []
    advs: list[torch.Tensor] = []
    all_rewards: list[float] = []
    for batch, rewards in admitted:
        advs.append(group_advantages(torch.tensor(rewards), batch.group_size, cfg.grpo.adv_eps))
        rows.extend(batch.rollouts)
        all_rewards.extend(rewards)
    return rows, torch.cat(advs), torch.tensor(all_rewards)


@dataclass(frozen=True)
class MicroBatch:
    """Rollouts run through one forward and backward pass. `live=False` marks a placeholder: a
    rank of a sharded learner with no rows left still runs the pass (the others wait on its
    collectives) with every token masked out, so it adds nothing to the gradient."""

    rows: Sequence
    advantages: torch.Tensor
    live: bool = True


def backward_micro_batches(model, micro: Sequence[MicroBatch], n_tokens: int, cfg: LearnerConfig, pad_id: int,
                           autocast: Callable[[], contextlib.AbstractContextManager],
                           loss_scale: float = 1.0) -> tuple[float, float]:
    """Accumulate the gradient of the token-mean GRPO loss over `n_tokens` (the whole step's
    tokens, not only these rows') times `loss_scale`; returns (this share of the loss, of the
    clip fraction), unscaled."""
    device = next(model.parameters()).device
    loss_sum, clipped = 0.0, 0.0
    for part in micro:
        ids, mask, old = pack_rows(part.rows, pad_id)
        ids, mask, old = ids.to(device), mask.to(device), old.to(device)
        if not part.live:
            mask = torch.zeros_like(mask)
        with autocast():
            logp = sequence_logprobs(model, ids, cfg.temperature)
        if not cfg.use_worker_logprobs or not part.live:
            old = logp.detach()
        loss, ls = grpo_loss(logp, old, part.advantages.to(device), mask, cfg.grpo)
        weight = ls.n_tokens / max(n_tokens, 1)
        (loss * (weight * loss_scale)).backward()
        loss_sum += ls.loss * weight
        clipped += ls.clip_fraction * weight
    return loss_sum, clipped

def pack_rows(rows, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+output ids [N, L] and, aligned with next-token positions [N, L-1],
    the output mask and the worker's log-probs."""
    length = max(len(r.prompt_ids) + len(r.output_ids) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length - 1))
    old = torch.zeros((len(rows), length - 1))
    for i, r in enumerate(rows):
        p, n = len(r.prompt_ids), len(r.output_ids)
        ids[i, :p + n] = torch.tensor(list(r.prompt_ids) + list(r.output_ids))
        mask[i, p - 1:p - 1 + n] = 1.0
        old[i, p - 1:p - 1 + n] = torch.tensor(r.logprobs)
    return ids, mask, old


def sequence_logprobs(model, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(ids[:, j+1] | ids[:, :j+1]) at temperature, [N, L-1]; right padding is harmless (causal)."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(2, ids[:, 1:, None])[..., 0]


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
