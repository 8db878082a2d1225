"""Which tasks a worker answers for a step, as token ids, and how they are scored: one home for
the trainer, the worker and the validator.

Owns `TaskConfig` (the families drawn from, and their settings; `TaskConfig.from_spec("arithmetic,
word_problems")` from a config string), `assign_prompts` (the n tasks of (worker, step, seed):
a private rng keyed by all three, so any peer recomputes them), `prompt_ids` (the ids a model
sees: the raw prompt after BOS for base and character models, the tokenizer's chat template
around the question for instruct models), `sampling_seed` (the u64 seed of a batch's Gumbel
noise, which validators recompute) and `reward`, computed on the trainer's side from the task
and the completion text alone: a reward sent by a worker is never used.

Must not: import torch, run a model, or hold global random state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from typing import Any, Sequence

import blake3

from tasks.arithmetic import ArithmeticConfig, make_task
from tasks.base import Task, final_number, parse_answer
from tasks.word_problems import make_word_problem

FAMILIES = ("arithmetic", "word_problems")


@dataclass(frozen=True)
class TaskConfig(ArithmeticConfig):
    """The task families drawn from (each task picks one uniformly when there are several) and
    their settings. With the one family 'arithmetic' the draws are those of earlier versions."""

    families: tuple[str, ...] = ("arithmetic",)
    word_max_number: int = 12

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.families or set(self.families) - set(FAMILIES) or len(set(self.families)) != len(self.families):
            raise ValueError(f"families must be distinct names from {FAMILIES}, got {self.families}")
        if self.word_max_number < 2:
            raise ValueError("word_max_number must be at least 2")

    @classmethod
    def from_spec(cls, spec: str, **settings: Any) -> "TaskConfig":
        """'arithmetic', 'word_problems' or 'arithmetic,word_problems' (ValueError otherwise)."""
        names = tuple(name.strip() for name in spec.split(",") if name.strip())
        return cls(families=names, **settings)

    @property
    def arithmetic(self) -> ArithmeticConfig:
        return ArithmeticConfig(**{f.name: getattr(self, f.name) for f in fields(ArithmeticConfig)})


DEFAULT_TASKS = TaskConfig()


def check_spec(spec: str) -> str:
    """'' when `spec` names task families, else what is wrong (for config checks)."""
    try:
        TaskConfig.from_spec(spec)
    except ValueError as exc:
        return str(exc)
    return ""


def task_rng(worker_id: str, step: int, seed: int) -> random.Random:
    """A private RNG keyed by (seed, worker, step): same inputs, same stream, on any machine."""
    key = blake3.blake3(f"p2pnet-tasks|{seed}|{step}|{worker_id}".encode()).digest()
    return random.Random(int.from_bytes(key[:16], "big"))


def draw_task(rng: random.Random, config: TaskConfig = DEFAULT_TASKS) -> Task:
    family = config.families[0] if len(config.families) == 1 else config.families[rng.randrange(len(config.families))]
    if family == "arithmetic":
        return make_task(rng, config.arithmetic)
    return make_word_problem(rng, config.word_max_number)


def assign_prompts(worker_id: str, step: int, seed: int, n: int,
                   config: TaskConfig = DEFAULT_TASKS) -> list[Task]:
    """The n tasks that `worker_id` must answer for policy step `step` under network seed `seed`."""
    if n < 0:
        raise ValueError("n must be non-negative")
    if step < 0:
        raise ValueError("step must be non-negative")
    rng = task_rng(worker_id, step, seed)
    return [draw_task(rng, config) for _ in range(n)]


def sampling_seed(seed: int, worker_id: str, step: int) -> int:
    """The u64 seed of Gumbel noise for (network seed, worker, step); validators recompute it."""
    key = blake3.blake3(f"p2pnet-sampling|{seed}|{step}|{worker_id}".encode()).digest()
    return int.from_bytes(key[:8], "little")


def uses_chat(tokenizer: Any) -> bool:
    """Whether prompts go through the tokenizer's chat template (an instruct model's tokenizer)."""
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "encode_chat")


def prompt_ids(task: Task, tokenizer: Any) -> list[int]:
    if uses_chat(tokenizer):
        return tokenizer.encode_chat(task.chat_text)
    return tokenizer.encode(task.prompt, bos=tokenizer.bos_id is not None)


def prompt_ids_for(tasks: Sequence[Task], tokenizer: Any) -> list[list[int]]:
    return [prompt_ids(t, tokenizer) for t in tasks]


def reward(task: Task, completion_text: str, config: TaskConfig | ArithmeticConfig = DEFAULT_TASKS, *,
           chat: bool = False) -> float:
    """1.0 for the exact answer, else 0 or partial credit below 1.

    A raw prompt's completion must be exactly the number; partial credit (`format_reward` for a
    completion that is one integer, plus up to `closeness_reward` shrinking linearly with the
    distance, zero at >= 10) gives a random-init model a gradient toward well-formed answers. A
    chat reply (`chat=True`) scores 1.0 when the last number it states is the answer."""
    if chat:
        return 1.0 if final_number(completion_text) == task.answer_int else 0.0
    value = parse_answer(completion_text)
    if value is None:
        return 0.0
    if value == task.answer_int:
        return 1.0
    closeness = max(0.0, 1.0 - abs(value - task.answer_int) / 10.0)
    return config.format_reward + config.closeness_reward * closeness
