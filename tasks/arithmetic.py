"""Seeded arithmetic tasks ('7+5=' -> '12'), what the tiny models learn from scratch.

Owns `ArithmeticConfig` (operand range, operators, optional partial credit) and `make_task`.

Must not: import torch or hold global random state.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tasks.base import Task


@dataclass(frozen=True)
class ArithmeticConfig:
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


def make_task(rng: random.Random, config: ArithmeticConfig = ArithmeticConfig()) -> Task:
    a = rng.randint(0, config.max_operand)
    b = rng.randint(0, config.max_operand)
    op = config.ops[rng.randrange(len(config.ops))]
    value = a + b if op == "+" else a - b if op == "-" else a * b
    spoken = {"+": "plus", "-": "minus", "*": "times"}[op]
    return Task(prompt=f"{a}{op}{b}=", answer=str(value), family="arithmetic",
                question=f"What is {a} {spoken} {b}? Reply with the number only.")
