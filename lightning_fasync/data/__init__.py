"""Prompt data for RL: synthetic verifiable tasks (see :mod:`lightning_fasync.data.tasks`)."""

from lightning_fasync.data.tasks import TASKS, RepeatTask, Task, make_task, warm_start

__all__ = ["TASKS", "RepeatTask", "Task", "make_task", "warm_start"]
