"""Procedurally generated math word problems with exact integer answers (no data set, no download).

Owns `make_word_problem`: a seeded draw of one of a few problem shapes (adding, taking away,
groups of equal size, equal sharing, and two-step buying-and-losing), with names, objects and
numbers drawn from the rng, written only in characters of `models.tokenizer.TEXT_ALPHABET`
(lowercase letters, digits, '.', ',', '?', spaces), so a character model can read them too.
Every answer is computed from the drawn numbers, never looked up.

Must not: import torch or hold global random state.
"""

from __future__ import annotations

import random

from tasks.base import Task

NAMES = ("ana", "ben", "carla", "dev", "emma", "farid", "gus", "hana", "ivan", "june", "kai", "lena")
THINGS = ("apples", "pens", "books", "coins", "stamps", "shells", "marbles", "cards", "eggs", "plums")
SHAPES = ("add", "take", "groups", "share", "two_step")


def make_word_problem(rng: random.Random, max_number: int = 12) -> Task:
    """One problem; operands are in [1, max_number] and every answer is a non-negative integer."""
    if max_number < 2:
        raise ValueError("max_number must be at least 2")
    shape = SHAPES[rng.randrange(len(SHAPES))]
    name, other = rng.sample(NAMES, 2)
    thing = THINGS[rng.randrange(len(THINGS))]
    a, b = rng.randint(1, max_number), rng.randint(1, max_number)
    if shape == "add":
        text = f"{name} has {a} {thing}. {other} gives {name} {b} more. how many {thing} does {name} have now?"
        answer = a + b
    elif shape == "take":
        a, b = max(a, b), min(a, b)
        text = f"{name} has {a} {thing} and gives {b} of them to {other}. how many {thing} does {name} have left?"
        answer = a - b
    elif shape == "groups":
        text = f"there are {a} bags with {b} {thing} in each bag. how many {thing} are there in all?"
        answer = a * b
    elif shape == "share":
        text = (f"{name} shares {a * b} {thing} equally among {a} friends. "
                f"how many {thing} does each friend get?")
        answer = b
    else:
        c = rng.randint(0, a * b)
        text = (f"{name} buys {a} boxes of {thing} with {b} in each box, then loses {c} of them. "
                f"how many {thing} does {name} have?")
        answer = a * b - c
    return Task(prompt=f"{text} =", answer=str(answer), family="word_problems",
                question=f"{text[0].upper()}{text[1:]} Give the final answer as a number.")
