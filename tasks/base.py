"""What a task is: a prompt with one verifiable answer, and how a completion is scored.

Owns `Task` (the prompt a base or character model continues, the question an instruct model is
asked, the exact answer, its family) and the answer checking every family shares: a completion
of a raw prompt must be exactly the number (`parse_answer`); an instruct model's free-text reply
is judged by the last number it states (`final_number`).

Must not: import torch, run a model, hold global random state, or read a reward from anywhere
but the task and the completion text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Protocol

_INT = re.compile(r"-?\d{1,9}")
_NUMBER_IN_TEXT = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class Task:
    """One prompt with its exact integer answer.

    `prompt` is what a base or character model continues ('7+5=' -> '12'); `question` is what an
    instruct model is asked in a chat turn ('' means: ask the prompt itself)."""

    prompt: str
    answer: str
    family: str = "arithmetic"
    question: str = ""

    @property
    def answer_int(self) -> int:
        return int(self.answer)

    @property
    def chat_text(self) -> str:
        return self.question or self.prompt


class TaskFamily(Protocol):
    """A seeded generator of verifiable tasks."""

    name: str

    def make(self, rng: random.Random) -> Task: ...


def parse_answer(completion_text: str) -> int | None:
    """The integer a completion states, or None if it is not exactly one integer."""
    text = completion_text.strip()
    return int(text) if _INT.fullmatch(text) else None


def final_number(completion_text: str) -> int | None:
    """The last number a free-text reply states ('so she has 12 apples.' -> 12); None when it
    states none, or when the last one is not a whole number."""
    found = _NUMBER_IN_TEXT.findall(completion_text)
    if not found:
        return None
    text = found[-1].replace(",", "")
    if "." in text:
        whole, _, frac = text.partition(".")
        if frac.strip("0"):
            return None
        text = whole
    try:
        return int(text)
    except ValueError:
        return None
