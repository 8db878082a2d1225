"""The learner over several ranks: FSDP2 shards, DCP checkpoints, full weights published by rank 0.

Owns `ShardedLearner`, what each rank of a `torchrun` group runs once torch.distributed is
initialised (gloo on CPU, NCCL on GPU; `trainer.ranks` starts the group and feeds it). Every rank
loads the model in float32, `fully_shard`s each decoder layer and then the root module (FSDP2: a
rank keeps 1/N of every parameter and of the AdamW state; a layer's full weights exist only while
it runs forward or backward), and is handed the same batches.

One step: admission and rewards are the one-process learner's (`trainer.learner`), deterministic,
so every rank admits the same batches. The admitted rows are cut into N contiguous shares, one per
rank; each rank weights its tokens by the whole step's token count and scales its loss by N, so
the gradient FSDP averages over the ranks is the one-process learner's gradient. A rank whose
share runs out first still runs masked placeholder passes, because every pass is collective.
Where the folder's compute dtype is bfloat16 (or float16), FSDP's mixed precision runs the passes
in it and reduces gradients in float32; the sharded parameters stay float32 (master weights).

Two kinds of checkpoint, written beside the training:
* the training state (sharded weights and AdamW state) through torch.distributed.checkpoint's
  `async_save` into `out_dir/sharded/step-{version}/`. The step pays for staging a copy; DCP's
  own thread writes the files over a gloo process group of its own, and rank 0 gives the folder
  its final name (from `.step-{version}.tmp`) only after every rank's files and the metadata are
  written, with `trainer_state.json` inside. Only one save is in flight: the next one waits for
  it. Resume loads the newest complete one into the sharded model and optimizer.
* the published version `out_dir/v{version}/`: the same model folder a one-process learner writes
  (`trainer.checkpoint`), from the full state dict gathered on rank 0 (`get_model_state_dict`
  with `full_state_dict` and `cpu_offload`) and written by rank 0's background
  `CheckpointWriter`. It holds no `optimizer.pt`: the optimizer state lives in the DCP folders.

Resume: from the newest complete DCP checkpoint; version folders newer than it (a run that died
before its training state was durable) are removed, and its own version folder is written again
if it is missing. With no DCP checkpoint, from the newest version folder's weights with a fresh
AdamW (a warning says so), as the one-process learner does when `optimizer.pt` was pruned.

Must not: open sockets, read batches from anywhere (the caller hands every rank the same ones),
or write files from any rank but 0 outside DCP.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from models.folder import ModelFolderError, compute_dtype, load_model_dir, skeleton
from p2pnet.files import atomic_write_bytes, fsync_dir
from tasks.prompts import uses_chat
from trainer.checkpoint import (STATE_FILE, CheckpointError, CheckpointWriter, Snapshot, complete_versions,
                                latest_version, remove_temporaries, version_dir, write_version)
from trainer.learner import (LearnerConfig, MicroBatch, StepStats, _jsonable, admit_batches,
                             backward_micro_batches, flatten_admitted, forget_old_keys)
from trainer.rollout import RolloutBatch

log = logging.getLogger(__name__)
SHARDED_DIR = "sharded"
_STEP_PREFIX = "step-"


@dataclass(frozen=True)
class ShardingConfig:
    checkpoint_every_steps: int = 1  # a DCP checkpoint of the training state every this many versions
    keep_checkpoints: int = 2  # complete DCP checkpoints kept (the newest); older ones are deleted

    def __post_init__(self) -> None:
        if self.checkpoint_every_steps < 1 or self.keep_checkpoints < 1:
            raise ValueError("checkpoint_every_steps and keep_checkpoints must be at least 1")


@dataclass(frozen=True)
class CheckpointTiming:
    """One DCP save: `blocking_s` is what the step paid (state dict and staging), `total_s` the
    time from its start until DCP's thread had written every file and the metadata."""

    version: int
    blocking_s: float
    total_s: float


def checkpoint_dir(out_dir: str | os.PathLike[str], version: int) -> Path:
    return Path(out_dir) / SHARDED_DIR / f"{_STEP_PREFIX}{version}"


def complete_checkpoints(out_dir: str | os.PathLike[str]) -> list[int]:
    """Versions with a complete DCP checkpoint (metadata and trainer state present), ascending."""
    root = Path(out_dir) / SHARDED_DIR
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        number = child.name.removeprefix(_STEP_PREFIX)
        if (child.name.startswith(_STEP_PREFIX) and number.isdigit() and (child / ".metadata").is_file()
                and (child / STATE_FILE).is_file()):
            found.append(int(number))
    return sorted(found)


def decoder_layers(model: Any) -> Sequence[torch.nn.Module]:
    """The repeated blocks of a transformers causal LM (`model.model.layers`): FSDP's units."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ModelFolderError(f"{type(model).__name__} has no model.layers to shard (not a decoder-only causal LM)")
    return layers


def rank_device() -> torch.device:
    """The device of this rank: its GPU under NCCL (LOCAL_RANK), else the CPU."""
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


class ShardedLearner:
    """The learner of one rank. Every rank must call `step`, `flush` and `close` with the same
    arguments in the same order (each is collective)."""

    def __init__(self, config: LearnerConfig, model_dir: str | Path, out_dir: str | Path, *,
                 sharding: ShardingConfig = ShardingConfig(),
                 on_saved: Callable[[int, Path], None] | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ShardedLearner needs torch.distributed initialised (run under torchrun)")
        self.config, self.sharding = config, sharding
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = rank_device()
        self.out_dir = Path(out_dir)
        self.last_checkpoint: CheckpointTiming | None = None
        self._pending: tuple[int, Path, Any, float, float, list[float], dict] | None = None
        self._ckpt_group = dist.new_group(backend="gloo")  # DCP's thread must not share the step's group
        resume, start = self._prepare_out_dir()
        source = version_dir(self.out_dir, start) if start is not None else Path(model_dir)
        self.compute_dtype = compute_dtype(model_dir)
        model, self.tokenizer = load_model_dir(source, dtype=torch.float32)
        self._shell = skeleton(model, self.compute_dtype)
        self._published_keys = _distinct_keys(model)
        self.chat = uses_chat(self.tokenizer)
        self.version, self._seen = 0, set[tuple[str, int]]()
        if start is not None:
            self.version, self._seen = _read_trainer_state(version_dir(self.out_dir, start))
            if start > 0:
                log.warning("no sharded checkpoint in %s: starting from %s with a fresh AdamW",
                            self.out_dir / SHARDED_DIR, source)
        elif resume is None and self.rank == 0:
            write_version(self.out_dir, self._snapshot(_full_state(model, self._published_keys, self.compute_dtype)))
        self.model = self._shard(model.to(self.device))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=(0.9, 0.99),
                                           weight_decay=config.weight_decay)
        self._writer = (CheckpointWriter(self.out_dir, max_pending=config.max_pending_saves,
                                         keep_last=config.keep_last,
                                         keep_optimizer_states=config.keep_optimizer_states, on_saved=on_saved)
                        if self.rank == 0 else None)
        if resume is not None:
            self._load(resume)
            if not version_dir(self.out_dir, resume).is_dir():  # it died before its folder was written
                self._publish()
        dist.barrier()

    # -- public API (collective) --------------------------------------------------------------

    def step(self, batches: Sequence[RolloutBatch]) -> StepStats:
        """Train once on the admissible batches (the same on every rank); the returned loss and
        norms are those of the whole step, equal on every rank."""
        self._finish_checkpoint(wait=False)
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
            self._publish()
        if self.version % self.sharding.checkpoint_every_steps == 0:
            self._checkpoint()
        t2 = time.perf_counter()
        return StepStats(version=self.version, trained=True, admitted=len(admitted), rejected=dict(rejected),
                         refused=refused, train_s=t1 - t0, snapshot_s=t2 - t1, **stats)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole float32 state dict on rank 0 (CPU), {} on the others (collective)."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dict(get_model_state_dict(self.model, options=options))

    def flush(self) -> None:
        """Return once the newest DCP checkpoint and every queued version are on disk."""
        self._finish_checkpoint(wait=True)
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()

    @property
    def last_saved_version(self) -> int | None:
        return latest_version(self.out_dir)

    # -- one optimizer step ----------------------------------------------------------------------

    def _train(self, admitted: list[tuple[RolloutBatch, list[float]]]) -> dict[str, Any]:
        cfg = self.config
        rows, advantages, rewards_t = flatten_admitted(admitted, cfg)
        n_tokens = sum(len(r.output_ids) for r in rows)
        share = math.ceil(len(rows) / self.world)
        first = min(self.rank * share, len(rows))
        mine, my_advs = rows[first:first + share], advantages[first:first + share]
        micro = []
        for start in range(0, share, cfg.micro_batch_rows):  # the same count on every rank
            part = mine[start:start + cfg.micro_batch_rows]
            micro.append(MicroBatch(part, my_advs[start:start + len(part)]) if part
                         else MicroBatch(rows[:1], torch.zeros(1), live=False))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, clipped = backward_micro_batches(self.model, micro, n_tokens, cfg, self.tokenizer.pad_id,
                                               contextlib.nullcontext, loss_scale=float(self.world))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.model.eval()
        totals = torch.tensor([loss, clipped], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        return dict(n_rollouts=len(rows), n_tokens=n_tokens, reward_mean=float(rewards_t.mean()),
                    accuracy=float((rewards_t == 1.0).float().mean()), loss=float(totals[0]),
                    clip_fraction=float(totals[1]), grad_norm=float(norm))

    def _shard(self, model: Any) -> Any:
        mesh = init_device_mesh(self.device.type, (self.world,))
        mixed = (MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
                 if self.compute_dtype != torch.float32 else MixedPrecisionPolicy())
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mixed)
        fully_shard(model, mesh=mesh, mp_policy=mixed)
        return model

    # -- publishing and checkpoints --------------------------------------------------------------

    def _trainer_state(self) -> dict[str, Any]:
        return {"version": self.version, "seen": sorted(self._seen), "config": _jsonable(asdict(self.config)),
                "compute_dtype": str(self.compute_dtype).removeprefix("torch."), "ranks": self.world}

    def _snapshot(self, weights: dict[str, torch.Tensor]) -> Snapshot:
        return Snapshot(version=self.version, shell=self._shell, tokenizer=self.tokenizer, weights=weights,
                        optimizer_state=None, trainer_state=self._trainer_state(),
                        max_shard_bytes=self.config.max_shard_bytes)

    def _publish(self) -> None:
        """Gather the full weights on rank 0 and queue the version folder (collective)."""
        full = self.full_state()
        if self._writer is not None:
            self._writer.submit(self._snapshot(_in_dtype(full, self._published_keys, self.compute_dtype)))

    def _checkpoint(self) -> None:
        """Start the DCP save of this version; only the wait for the previous one and the
        staging block the step."""
        self._finish_checkpoint(wait=True)
        started = time.perf_counter()
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        tmp = self.out_dir / SHARDED_DIR / f".{_STEP_PREFIX}{self.version}.tmp"
        future = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp),
                                process_group=self._ckpt_group)
        blocking = time.perf_counter() - started
        done_at: list[float] = []  # appended once, by DCP's thread, when its files are written
        future.add_done_callback(lambda _future: done_at.append(time.perf_counter()))
        self._pending = (self.version, tmp, future, started, blocking, done_at, self._trainer_state())

    def _finish_checkpoint(self, *, wait: bool) -> None:
        """Once the save in flight is done: rank 0 adds the trainer state and renames the folder."""
        if self._pending is None:
            return
        version, tmp, future, started, blocking, done_at, state = self._pending
        if not wait and not future.done():
            return
        self._pending = None
        try:
            future.result()
        except Exception as exc:  # DCP's thread failed: our own disk or state
            raise CheckpointError(f"the sharded checkpoint of version {version} failed") from exc
        if self.rank == 0:
            atomic_write_bytes(tmp / STATE_FILE, json.dumps(state, sort_keys=True).encode())
            fsync_dir(tmp)
            final = checkpoint_dir(self.out_dir, version)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(final.parent)
            for old in complete_checkpoints(self.out_dir)[:-self.sharding.keep_checkpoints]:
                shutil.rmtree(checkpoint_dir(self.out_dir, old), ignore_errors=True)
        self.last_checkpoint = CheckpointTiming(version, blocking, (done_at[0] if done_at else time.perf_counter())
                                                - started)

    def _prepare_out_dir(self) -> tuple[int | None, int | None]:
        """Rank 0 clears torn writes and versions newer than the resume point. Returns (the
        newest complete DCP checkpoint, else None; where there is none, the newest version
        folder, else None), the same on every rank."""
        if self.rank == 0:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            remove_temporaries(self.out_dir)
            root = self.out_dir / SHARDED_DIR
            if root.is_dir():
                for child in root.iterdir():
                    if child.name.startswith(f".{_STEP_PREFIX}"):
                        shutil.rmtree(child, ignore_errors=True)
            saved = complete_checkpoints(self.out_dir)
            if saved:
                for v in complete_versions(self.out_dir):
                    if v > saved[-1]:
                        log.warning("removing %s: newer than the last sharded checkpoint (step-%d)",
                                    version_dir(self.out_dir, v), saved[-1])
                        shutil.rmtree(version_dir(self.out_dir, v))
        dist.barrier()
        saved = complete_checkpoints(self.out_dir)
        start = None if saved else latest_version(self.out_dir)
        dist.barrier()  # nobody writes version 0 before every rank has looked
        return (saved[-1] if saved else None), start

    def _load(self, version: int) -> None:
        folder = checkpoint_dir(self.out_dir, version)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(folder), process_group=self._ckpt_group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.version, self._seen = _read_trainer_state(folder)
        if self.version != version:
            raise CheckpointError(f"{folder} holds the state of version {self.version}")


def _read_trainer_state(folder: Path) -> tuple[int, set[tuple[str, int]]]:
    state = json.loads((folder / STATE_FILE).read_text())
    return int(state["version"]), {(w, int(s)) for w, s in state.get("seen", [])}


def _distinct_keys(model: Any) -> list[str]:
    """The state-dict names a one-process learner publishes: the first name of each storage (a
    tied output embedding is saved once, under the input embedding's name)."""
    seen: set[int] = set()
    keys = []
    for name, tensor in model.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            keys.append(name)
    return keys


def _in_dtype(full: dict[str, torch.Tensor], keys: Sequence[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: full[k].to("cpu", dtype=dtype if full[k].is_floating_point() else full[k].dtype).contiguous()
            for k in keys}


def _full_state(model: Any, keys: Sequence[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The published weights of a model that is not sharded yet (version 0)."""
    state = model.state_dict()
    return {k: state[k].detach().to("cpu", dtype=dtype if state[k].is_floating_point() else state[k].dtype,
                                    copy=True).contiguous() for k in keys}
