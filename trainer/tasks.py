"""Compatibility name: tasks, prompt assignment and rewards live in the `tasks` package."""

from tasks.arithmetic import ArithmeticConfig, make_task  # noqa: F401
from tasks.base import Task, final_number, parse_answer  # noqa: F401
from tasks.prompts import (DEFAULT_TASKS, TaskConfig, assign_prompts, prompt_ids, prompt_ids_for,  # noqa: F401
                           reward, sampling_seed, task_rng, uses_chat)
