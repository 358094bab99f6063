"""Rewards for tests/integration/test_tasks_fit.py, importable by name in the trainer and its reward workers."""

from __future__ import annotations

import time

from lightning_fasync.data.rewards import math_reward


def hang_or_raise(sample, trajectory):
    """On the file's first prompt one trajectory's reward hangs, on the second one raises; the
    others get math_reward."""
    index = sample.metadata["dataset_index"]
    if index == 0 and trajectory.sample_index == 0:
        time.sleep(600)
    if index == 1 and trajectory.sample_index == 0:
        raise RuntimeError("the verifier crashed")
    return math_reward(sample, trajectory)


def needs_an_answer(sample, trajectory):
    """Reads an answer the prompt may not have (a KeyError without one)."""
    return float(sample.metadata["answer"] == trajectory.metadata.get("response_text"))
