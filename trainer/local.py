"""A single-process loop for sanity: generate -> verify -> train, printing reward per step.

Owns the local demo `python -m trainer.local`: one tiny model, one in-process worker
that uses the learner's current weights (so every batch is on-policy), a validator
pass through `verify.check` over a few rollouts of each batch, and the learner.
It shows that reward rises within a few dozen steps on one CPU thread, and it is the
reference for how the trio roles will call these functions.

Must not: open sockets or spawn processes; it is the whole protocol minus the network.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from trainer.learner import Learner, LearnerConfig, StepStats
from trainer.model import build_model, forward_hidden_logits, save_model_dir
from trainer.rollout import GenerationConfig, RolloutBatch, RolloutTiming, generate_batch
from trainer.tasks import assign_prompts


@dataclass(frozen=True)
class LocalConfig:
    steps: int = 30
    model: str = "tiny"
    model_seed: int = 0
    worker_id: str = "local-worker"
    verify_rows: int = 16  # rollouts per batch checked by verify.check; 0 = off
    learner: LearnerConfig = field(default_factory=LearnerConfig)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.verify_rows < 0:
            raise ValueError("steps must be at least 1 and verify_rows non-negative")

    def generation(self) -> GenerationConfig:
        lc = self.learner
        return GenerationConfig(group_size=lc.group_size, max_new_tokens=lc.max_new_tokens,
                                temperature=lc.temperature)


@dataclass(frozen=True)
class LocalStep:
    stats: StepStats
    timing: RolloutTiming
    verify_s: float
    verified: bool | None  # None when verification is off
    reasons: tuple[str, ...]
    step_s: float


def verify_batch(model, batch: RolloutBatch, eos_id: int, vocab_size: int,
                 n_rows: int) -> tuple[bool, tuple[str, ...]]:
    """Check `n_rows` evenly spread rollouts of a batch with verify.check, as a validator would."""
    from verify.check import check_rollout

    step = max(1, len(batch.rollouts) // max(n_rows, 1))
    reasons: list[str] = []
    for r in batch.rollouts[::step][:n_rows]:
        verdict = check_rollout(
            lambda ids: forward_hidden_logits(model, ids), r.prompt_ids, r.output_ids, r.proofs,
            seed=batch.sampling_seed, row=r.row, temperature=batch.temperature, eos_token_id=eos_id,
            max_new_tokens=batch.max_new_tokens, vocab_size=vocab_size)
        reasons.extend(verdict.reasons)
    return not reasons, tuple(sorted(set(reasons)))


def run_local(config: LocalConfig, work_dir: str | Path,
              report: Callable[[int, LocalStep], None] | None = None) -> list[LocalStep]:
    work = Path(work_dir)
    base = Path(config.model) if Path(config.model).is_dir() else work / "base"
    if not base.exists():
        save_model_dir(*build_model(config.model, seed=config.model_seed), base)
    learner = Learner(config.learner, base, work / "versions")
    gen = config.generation()
    lc = config.learner
    history: list[LocalStep] = []
    try:
        while learner.version < config.steps:
            t0 = time.perf_counter()
            step = learner.version
            tasks = assign_prompts(config.worker_id, step, lc.task_seed, lc.prompts_per_batch, lc.tasks)
            batch, timing = generate_batch(learner.model, learner.tokenizer, tasks,
                                           worker_id=config.worker_id, step=step,
                                           model_version=learner.version, seed=lc.task_seed, config=gen)
            t1 = time.perf_counter()
            verified: bool | None = None
            reasons: tuple[str, ...] = ()
            if config.verify_rows:
                verified, reasons = verify_batch(learner.model, batch, learner.tokenizer.eos_id,
                                                 learner.tokenizer.vocab_size, config.verify_rows)
            verify_s = time.perf_counter() - t1
            if verified is False:  # an honest in-process worker must pass; stop rather than loop
                raise RuntimeError(f"local batch failed verification: {reasons}")
            stats = learner.step([batch])
            entry = LocalStep(stats, timing, verify_s, verified, reasons, time.perf_counter() - t0)
            history.append(entry)
            if report is not None:
                report(step, entry)
        learner.flush()
    finally:
        learner.close()
    return history


def print_step(step: int, s: LocalStep) -> None:
    st = s.stats
    print(f"step {step:3d}  reward {st.reward_mean:.3f}  exact {st.accuracy:.2f}  "
          f"loss {st.loss:+.4f}  gen {s.timing.generate_s:.2f}s  proofs {s.timing.proof_s:.3f}s  "
          f"verify {s.verify_s:.2f}s  train {st.train_s:.2f}s  step {s.step_s:.2f}s"
          + ("" if s.verified else "  (not verified)"), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default="tiny", help="tiny, micro, small, or a model folder")
    parser.add_argument("--tasks", default="arithmetic", help="task families, e.g. arithmetic,word_problems")
    parser.add_argument("--max-new-tokens", type=int, default=LearnerConfig.max_new_tokens)
    parser.add_argument("--seed", type=int, default=0, help="task and model seed")
    parser.add_argument("--lr", type=float, default=LearnerConfig.lr)
    parser.add_argument("--prompts", type=int, default=LearnerConfig.prompts_per_batch)
    parser.add_argument("--group-size", type=int, default=LearnerConfig.group_size)
    parser.add_argument("--verify-rows", type=int, default=16,
                        help="rollouts per batch checked with verify.check (0: off)")
    parser.add_argument("--work-dir", default=None, help="keep checkpoints here (default: temp)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from tasks.prompts import TaskConfig

    learner_cfg = LearnerConfig(lr=args.lr, task_seed=args.seed, prompts_per_batch=args.prompts,
                                group_size=args.group_size, max_new_tokens=args.max_new_tokens,
                                tasks=TaskConfig.from_spec(args.tasks))
    config = LocalConfig(steps=args.steps, model=args.model, model_seed=args.seed,
                         verify_rows=args.verify_rows, learner=learner_cfg)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        history = run_local(config, args.work_dir or tmp, report=print_step)
    rewards = [h.stats.reward_mean for h in history]
    k = max(1, len(rewards) // 5)
    print(f"reward mean: first {k} steps {sum(rewards[:k]) / k:.3f}, last {k} steps "
          f"{sum(rewards[-k:]) / k:.3f}; {len(history)} steps in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
