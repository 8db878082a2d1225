"""Seeded, verifiable arithmetic tasks and their rewards.

Owns: the task generator (`make_task`), the deterministic assignment of prompts to a
worker for a step (`assign_prompts`, which validators and the learner recompute to
check that a worker answered the prompts it was given), and the reward function.

Rewards are computed on the trainer side from the task and the completion text; a
reward sent by a worker is never used. Everything here is pure: no torch, no I/O, no
global random state.

Must not: import torch, run a model, or read a reward from anywhere but `reward`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import blake3

_INT = re.compile(r"-?\d{1,6}")


@dataclass(frozen=True)
class TaskConfig:
    """Which tasks are drawn: operands in [0, max_operand], operators from `ops`.

    The default (addition of operands 0-4, exact-match reward only) is what the tiny
    model learns from scratch in a few dozen CPU steps: reward about 0.03 at step 0
    and 0.2-0.3 by step 40. Partial credit (`format_reward`, `closeness_reward`)
    raises the reward sooner but tempts the model to collapse onto one middle answer.
    """

    max_operand: int = 4
    ops: str = "+"
    format_reward: float = 0.0
    closeness_reward: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_operand <= 9999:
            raise ValueError("max_operand must be in [1, 9999]")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError("ops must be a non-empty subset of '+-*'")
        if self.format_reward < 0 or self.closeness_reward < 0 or self.format_reward + self.closeness_reward >= 1:
            raise ValueError("partial rewards must be >= 0 and sum to less than 1")


DEFAULT_TASKS = TaskConfig()


@dataclass(frozen=True)
class Task:
    """One prompt with its exact answer, e.g. prompt '7+5=' and answer '12'."""

    prompt: str
    answer: str

    @property
    def answer_int(self) -> int:
        return int(self.answer)


def make_task(rng: random.Random, config: TaskConfig = DEFAULT_TASKS) -> Task:
    a = rng.randint(0, config.max_operand)
    b = rng.randint(0, config.max_operand)
    op = config.ops[rng.randrange(len(config.ops))]
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return Task(prompt=f"{a}{op}{b}=", answer=str(value))


def task_rng(worker_id: str, step: int, seed: int) -> random.Random:
    """A private RNG keyed by (seed, worker, step): same inputs, same stream, on any machine."""
    key = blake3.blake3(f"p2pnet-tasks|{seed}|{step}|{worker_id}".encode()).digest()
    return random.Random(int.from_bytes(key[:16], "big"))


def assign_prompts(worker_id: str, step: int, seed: int, n: int,
                   config: TaskConfig = DEFAULT_TASKS) -> list[Task]:
    """The n tasks that `worker_id` must answer for policy step `step` under network seed `seed`."""
    if n < 0:
        raise ValueError("n must be non-negative")
    if step < 0:
        raise ValueError("step must be non-negative")
    rng = task_rng(worker_id, step, seed)
    return [make_task(rng, config) for _ in range(n)]


def parse_answer(completion_text: str) -> int | None:
    """The integer a completion states, or None if it is not exactly one integer."""
    text = completion_text.strip()
    return int(text) if _INT.fullmatch(text) else None


def reward(task: Task, completion_text: str, config: TaskConfig = DEFAULT_TASKS) -> float:
    """1.0 for the exact answer; optional partial credit, below 1, for a well-formed miss.

    Partial credit: `format_reward` for a completion that is exactly one integer, plus
    up to `closeness_reward` shrinking linearly with the distance to the answer (zero at
    distance >= 10). It gives a random-init model a gradient toward well-formed answers
    before it ever hits the exact one.
    """
    value = parse_answer(completion_text)
    if value is None:
        return 0.0
    if value == task.answer_int:
        return 1.0
    closeness = max(0.0, 1.0 - abs(value - task.answer_int) / 10.0)
    return config.format_reward + config.closeness_reward * closeness
