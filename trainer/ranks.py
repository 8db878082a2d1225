"""A learner over several processes: the trainer starts a torchrun group and hands it batches.

Owns both ends of the hand-off between a trainer process and the `torchrun` group that trains
for it (each rank a `trainer.sharded.ShardedLearner`, one torch thread per process):

* `LearnerGroup`, in the trainer process: starts `torchrun --standalone --nproc-per-node N -m
  trainer.ranks` as a child process group, writes each step's batches as a numbered request file
  into a private spool folder, and waits for rank 0's reply file with the step's statistics. It
  stands in for `trainer.learner.Learner` where the trainer role uses one (`version`, `step`,
  `flush`, `close`): the role's thread blocks on `step` as it would on a one-process step.
* `main`, in every rank: reads request n, runs it (every rank reads the same file, so no rank
  waits in a collective while the trainer gathers batches), and rank 0 writes reply n.

The hand-off is files in a folder, as PRIME-RL's trainer takes its batches: durable, visible,
needing no socket. Files are written under a temporary name and renamed, so a reader never sees
half of one. The versions the group publishes are the same folders a one-process learner writes
(`out_dir/v{n}/`); `flush` waits for them on disk. A rank that fails ends its process; torchrun
then stops the others, and the trainer's next wait raises `LearnerGroupError` saying so. A rank
whose trainer process has died stops on its next look at the spool.

Must not: open sockets (torchrun's own rendezvous on localhost aside), or decide what trains
(admission is the learner's).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from p2pnet.files import atomic_write_bytes
from trainer.learner import LearnerConfig, StepStats
from trainer.rollout import Rollout, RolloutBatch

log = logging.getLogger(__name__)
CONFIG_FILE = "group.json"
READY_FILE = "ready.json"
POLL_S = 0.02  # how often a waiting side looks at the spool folder


class LearnerGroupError(RuntimeError):
    """Our own learner group failed (a rank died, or it did not start)."""


def _request(spool: Path, seq: int) -> Path:
    return spool / f"request-{seq:08d}.json"


def _reply(spool: Path, seq: int) -> Path:
    return spool / f"reply-{seq:08d}.json"


def _write_json(path: Path, value: Any) -> None:
    atomic_write_bytes(path, json.dumps(value).encode(), mode=0o600)


# -- batches and settings as JSON (the spool's format) ---------------------------------------------

def batch_to_json(batch: RolloutBatch) -> dict[str, Any]:
    """A batch without its proofs (verified already; the learner never reads them)."""
    out = asdict(batch)
    for r in out["rollouts"]:
        r.pop("proofs")
    return out


def batch_from_json(data: dict[str, Any]) -> RolloutBatch:
    rollouts = tuple(Rollout(row=r["row"], prompt_ids=tuple(r["prompt_ids"]), output_ids=tuple(r["output_ids"]),
                             logprobs=tuple(r["logprobs"]), stop_reason=r["stop_reason"])
                     for r in data["rollouts"])
    return RolloutBatch(**{**data, "rollouts": rollouts})


def config_to_json(config: LearnerConfig) -> dict[str, Any]:
    return asdict(config)


def config_from_json(data: dict[str, Any]) -> LearnerConfig:
    from tasks.prompts import TaskConfig
    from trainer.grpo import GRPOConfig

    tasks = dict(data["tasks"])
    tasks["families"] = tuple(tasks["families"])
    return LearnerConfig(**{**data, "grpo": GRPOConfig(**data["grpo"]), "tasks": TaskConfig(**tasks)})


# -- the trainer's end --------------------------------------------------------------------------------

@dataclass(frozen=True)
class GroupConfig:
    ranks: int = 2
    device: str = "auto"  # auto: one GPU per rank with NCCL where CUDA is available, else CPU with gloo
    checkpoint_every_steps: int = 1
    keep_checkpoints: int = 2
    start_timeout_s: float = 600.0  # loading and sharding the model on every rank
    step_timeout_s: float = 86400.0  # a step of a large model on a loaded machine may take long

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError("ranks must be at least 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError("device must be auto, cpu or cuda")
        if not self.start_timeout_s > 0 or not self.step_timeout_s > 0:
            raise ValueError("timeouts must be positive")


class LearnerGroup:
    """A torchrun group of `ShardedLearner` ranks, driven from this process."""

    def __init__(self, config: LearnerConfig, model_dir: str | Path, out_dir: str | Path,
                 group: GroupConfig = GroupConfig()) -> None:
        self.config, self.group = config, group
        self.out_dir = Path(out_dir)
        self.spool = Path(tempfile.mkdtemp(prefix="p2pnet-ranks-"))
        self._seq = 0
        self.last_checkpoint: Any = None  # trainer.sharded.CheckpointTiming of the newest finished DCP save
        settings = {"learner": config_to_json(config), "model_dir": str(model_dir), "out_dir": str(out_dir),
                    "device": group.device, "checkpoint_every_steps": group.checkpoint_every_steps,
                    "keep_checkpoints": group.keep_checkpoints, "parent_pid": os.getpid()}
        _write_json(self.spool / CONFIG_FILE, settings)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={group.ranks}", "-m", "trainer.ranks", str(self.spool)]
        self._process = subprocess.Popen(command, start_new_session=True)
        try:
            ready = self._wait_for(self.spool / READY_FILE, group.start_timeout_s, "starting")
        except BaseException:
            self.kill()
            raise
        self.version = int(ready["version"])

    def step(self, batches: Sequence[RolloutBatch]) -> StepStats:
        """One step on every rank; the whole step's statistics (rank 0's)."""
        reply = self._call({"op": "step", "batches": [batch_to_json(b) for b in batches]})
        stats = StepStats(**{**reply["stats"], "refused": tuple(reply["stats"].get("refused", ()))})  # (JSON: a list)
        self.version = stats.version
        if reply.get("checkpoint") is not None:
            from trainer.sharded import CheckpointTiming

            self.last_checkpoint = CheckpointTiming(**reply["checkpoint"])
        return stats

    def memory(self) -> list[dict[str, int]]:
        """Each rank's peak memory so far, by rank: `max_rss_bytes` (the process) and, on a GPU,
        `cuda_max_allocated_bytes`."""
        return self._call({"op": "memory"})["ranks"]

    def flush(self) -> None:
        """Return once the newest version trained when called is on disk (its folder complete)."""
        from trainer.checkpoint import latest_version

        wanted = self.version
        deadline = time.monotonic() + self.group.step_timeout_s
        while (latest_version(self.out_dir) or 0) < wanted:
            self._check_alive("writing a version")
            if time.monotonic() > deadline:
                raise LearnerGroupError(f"version {wanted} not on disk after {self.group.step_timeout_s:.0f}s")
            time.sleep(POLL_S)

    def close(self) -> None:
        """Let every rank finish its checkpoints and exit; the spool folder is removed."""
        try:
            if self._process.poll() is None:
                self._call({"op": "close"})
                self._process.wait(timeout=self.group.start_timeout_s)
        finally:
            self._kill()
            shutil.rmtree(self.spool, ignore_errors=True)

    def kill(self) -> None:
        """Stop every rank at once (SIGKILL to the group), as a crash would; nothing is flushed."""
        self._kill()
        shutil.rmtree(self.spool, ignore_errors=True)

    @property
    def last_saved_version(self) -> int | None:
        from trainer.checkpoint import latest_version

        return latest_version(self.out_dir)

    @property
    def pid(self) -> int:
        """The torchrun process (the leader of the group's process group)."""
        return self._process.pid

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        seq, self._seq = self._seq, self._seq + 1
        _write_json(_request(self.spool, seq), request)
        reply = self._wait_for(_reply(self.spool, seq), self.group.step_timeout_s, request["op"])
        if not reply.get("ok"):
            raise LearnerGroupError(f"rank 0 failed on {request['op']}: {reply.get('error')}")
        return reply

    def _wait_for(self, path: Path, timeout_s: float, doing: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not path.is_file():
            self._check_alive(doing)
            if time.monotonic() > deadline:
                raise LearnerGroupError(f"the learner group gave no answer {doing} within {timeout_s:.0f}s")
            time.sleep(POLL_S)
        value = json.loads(path.read_text())
        path.unlink()
        return value

    def _check_alive(self, doing: str) -> None:
        code = self._process.poll()
        if code is not None:
            raise LearnerGroupError(f"the learner group (torchrun) exited with {code} while {doing}; "
                                    "its ranks' errors are in this process's log")

    def _kill(self) -> None:
        if self._process.poll() is None:
            try:
                os.killpg(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # ended between the poll and the kill
            self._process.wait()


# -- each rank's end ----------------------------------------------------------------------------------

def peak_memory(device: Any) -> dict[str, int]:
    """This process's peak resident memory and, on a GPU, the peak the caching allocator handed out."""
    import resource

    import torch

    out = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


def _next_request(spool: Path, seq: int, parent_pid: int) -> dict[str, Any]:
    path = _request(spool, seq)
    while not path.is_file():
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            raise SystemExit(f"rank: the trainer process {parent_pid} is gone; stopping") from None
        time.sleep(POLL_S)
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one rank of a trainer's learner group (started by torchrun)")
    parser.add_argument("spool", type=Path, help="the folder the trainer writes requests into")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(process)d %(name)s: %(message)s")
    settings = json.loads((args.spool / CONFIG_FILE).read_text())
    cuda = settings["device"] == "cuda" or (settings["device"] == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if cuda else "gloo")
    from trainer.sharded import ShardedLearner, ShardingConfig

    rank = dist.get_rank()
    sharding = ShardingConfig(checkpoint_every_steps=settings["checkpoint_every_steps"],
                              keep_checkpoints=settings["keep_checkpoints"])
    learner = ShardedLearner(config_from_json(settings["learner"]), settings["model_dir"], settings["out_dir"],
                             sharding=sharding)
    if rank == 0:
        _write_json(args.spool / READY_FILE, {"version": learner.version, "ranks": dist.get_world_size()})
    seq = 0
    try:
        while True:
            request = _next_request(args.spool, seq, settings["parent_pid"])
            try:
                if request["op"] == "step":
                    stats = learner.step([batch_from_json(b) for b in request["batches"]])
                    timing = learner.last_checkpoint
                    reply: dict[str, Any] = {"ok": True, "stats": asdict(stats),
                                             "checkpoint": asdict(timing) if timing is not None else None}
                elif request["op"] == "memory":
                    ranks: list[Any] = [None] * dist.get_world_size()
                    dist.all_gather_object(ranks, peak_memory(learner.device))
                    reply = {"ok": True, "ranks": ranks}
                elif request["op"] == "close":
                    learner.close()
                    reply = {"ok": True}
                else:
                    raise LearnerGroupError(f"unknown request {request['op']!r}")
            except BaseException as exc:
                if rank == 0:
                    _write_json(_reply(args.spool, seq), {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                raise
            if rank == 0:
                _write_json(_reply(args.spool, seq), reply)
            if request["op"] == "close":
                return
            seq += 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
