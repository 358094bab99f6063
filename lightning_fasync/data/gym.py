"""Prompts and rewards from reasoning-gym's procedural tasks (``pip install reasoning-gym``).

reasoning-gym generates verifiable problems in code (arithmetic, logic, puzzles, ... about a
hundred tasks) from a task name, a size and a seed, and scores an answer with the task's own
``score_answer``. ``ReasoningGymDataSource`` makes ``size`` entries of one task into prompts
(rendered as in :class:`~lightning_fasync.data.files.FileDataSource`), and :func:`gym_reward`
scores a response with the scorer of the entry's source task::

    data_source:
      datasource: lightning_fasync.data.gym:ReasoningGymDataSource
      datasource_args: {task: basic_arithmetic, size: 2000, seed: 0}
      reward: lightning_fasync.data.gym:gym_reward

The model is expected to put its final answer in ``<answer>...</answer>`` tags (reasoning-gym's
convention, e.g. its ``SYSTEM_PROMPTS["default"]``); a response without tags is scored whole.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Optional

from lightning_fasync.data.files import Prompt, chat_messages, check_identity, keep_short, render_prompt
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.types import PromptSample, Trajectory

__all__ = ["ReasoningGymDataSource", "gym_reward"]


def _jsonable(value: Any) -> Any:
    """``value`` with tuples as lists, non-string keys as strings and other objects as ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def _registry() -> dict[str, Any]:
    from reasoning_gym.factory import DATASETS

    return DATASETS


class ReasoningGymDataSource(ListDataSource):
    """``size`` entries of a reasoning-gym task as prompts.

    Each prompt's metadata is ``{"answer", "gym_task", "gym_task_args", "gym_entry",
    "prompt_text", "dataset_index"}``; ``gym_entry`` is reasoning-gym's entry (question, answer,
    metadata) made JSON-serialisable, which :func:`gym_reward` scores against.

    Args:
        task: A reasoning-gym task name (``basic_arithmetic``, ``leg_counting``, ...).
        tokenizer: The policy's Hugging Face tokenizer.
        size: Entries generated (one epoch).
        seed: Seeds the entries and the per-epoch permutation.
        task_args: The task's config fields (its difficulty ranges and so on).
        system_prompt: A system message put first (e.g. ``reasoning_gym.utils.SYSTEM_PROMPTS["default"]``).
        max_prompt_length: Drop prompts longer than this many tokens (``self.dropped_long`` counts them).
        shuffle: Permute each epoch.
        num_epochs: Stop after this many epochs (None: never).
    """

    def __init__(
        self,
        task: str,
        tokenizer: Any,
        size: int = 1000,
        seed: int = 0,
        task_args: Optional[dict] = None,
        system_prompt: Optional[str] = None,
        max_prompt_length: Optional[int] = None,
        shuffle: bool = True,
        num_epochs: Optional[int] = None,
    ) -> None:
        import reasoning_gym

        registry = _registry()
        if task not in registry:
            names = sorted(registry)
            raise ValueError(
                f"`datasource_args.task` {task!r} is not a reasoning-gym task; valid ones include "
                f"{', '.join(names[:8])}, ... ({len(names)} in all: see reasoning_gym.factory.DATASETS)."
            )
        self.task, self.size, self.task_args = task, size, dict(task_args or {})
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **self.task_args)
        prompts: list[Prompt] = []
        for i in range(size):
            entry = _jsonable(dataset[i])
            ids, text = render_prompt(tokenizer, chat_messages(entry["question"], system_prompt, f"{task} entry {i}"))
            meta = {"answer": entry["answer"], "gym_task": task, "gym_task_args": _jsonable(self.task_args)}
            prompts.append((ids, {**meta, "gym_entry": entry, "prompt_text": text, "dataset_index": i}))
        prompts, self.dropped_long = keep_short(prompts, max_prompt_length, type(self).__name__)
        super().__init__(prompts, shuffle=shuffle, seed=seed, num_epochs=num_epochs)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "task": self.task, "num_prompts": len(self._prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_identity(state, "task", self.task, len(self._prompts), "data_source.datasource_args", "the saved task and size")
        super().load_state_dict(state)


@functools.lru_cache(maxsize=None)
def _scorer(name: str, task_args_json: str) -> Callable[[Optional[str], dict[str, Any]], float]:
    # The configured task's own scorer (a few depend on the config); a composite's parts: defaults.
    import reasoning_gym

    if name not in _registry():
        raise ValueError(f"{name!r} is not a reasoning-gym task, so the response cannot be scored.")
    return reasoning_gym.create_dataset(name, size=1, seed=0, **json.loads(task_args_json)).score_answer


def gym_reward(sample: PromptSample, trajectory: Trajectory) -> float:
    """Score a response with reasoning-gym's scorer for the sample's entry.

    The final answer is the content of the last ``<answer>...</answer>`` tags
    (``reasoning_gym.utils.extract_answer``), or the whole stripped response when it has none.

    Args:
        sample: A prompt of :class:`ReasoningGymDataSource` (``metadata["gym_entry"]``).
        trajectory: Its response; the reward runner puts the decoded text in
            ``trajectory.metadata["response_text"]``.

    Returns:
        The score in [0, 1].
    """
    from reasoning_gym.utils import extract_answer

    text = trajectory.metadata.get("response_text")
    if text is None:
        raise ValueError("gym_reward needs the decoded response in trajectory.metadata['response_text'], and it is missing.")
    meta = sample.metadata
    entry = meta["gym_entry"]
    task = meta["gym_task"]
    source = (entry.get("metadata") or {}).get("source_dataset") or task
    task_args = (meta.get("gym_task_args") or {}) if source == task else {}
    answer = extract_answer(text)
    score = _scorer(source, json.dumps(task_args, sort_keys=True))(text.strip() if answer is None else answer, entry)
    return min(1.0, max(0.0, float(score)))
