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

The answer is the policy's text, and some of reasoning-gym's scorers run it as code in the process
that scores: Python's ``eval`` (``EVAL_SCORED``) or sympy's ``parse_expr``, itself an ``eval``
(``SYMPY_SCORED``). :func:`gym_reward` hands those scorers only answers that cannot run anything
(:func:`screen_answer`: literals only for ``eval``; numbers, operators and math names for sympy),
scores any other answer 0, and gives no scorer more than ``MAX_ANSWER_CHARS`` characters.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from typing import Any, Callable, Optional

from lightning_fasync.data.files import Prompt, chat_messages, check_identity, keep_short, render_prompt
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.types import PromptSample, Trajectory

__all__ = ["ReasoningGymDataSource", "gym_reward", "screen_answer"]


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


MAX_ANSWER_CHARS = 2000
"""Longest answer a scorer is given (longer ones score 0): the answers these tasks ask for are short,
and a scorer's parse of a policy's 100 KB of text would hold the reward's worker."""

EVAL_SCORED = frozenset({"binary_matrix", "n_queens", "spiral_matrix", "string_insertion"})
"""reasoning-gym 0.1.25 tasks whose ``score_answer`` passes the answer to Python's ``eval``."""

SYMPY_SCORED = frozenset({"countdown", "intermediate_integration", "polynomial_multiplication", "puzzle24",
                          "simple_integration"})
"""reasoning-gym 0.1.25 tasks whose ``score_answer`` passes the answer to sympy's ``parse_expr``."""

_MATH_FUNCTIONS = frozenset({
    "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh", "tanh", "exp", "log",
    "ln", "sqrt", "abs", "Abs",
})
_MATH_NAMES = _MATH_FUNCTIONS | {"pi", "oo"}
_SYMPY_CHARS = re.compile(r"[0-9A-Za-z+\-*/^().,\s]*")  # no `!`: sympy reads `n!` as factorial(n)
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_CALL = re.compile(r"([A-Za-z][A-Za-z0-9]*)\s*\(")
_POWER = re.compile(r"(\*\*|\^)\s*([0-9.]+)")  # a bracketed exponent is refused before this
_MAX_EXPONENT = 64
_MAX_POWERS = 64


def _is_literal(node: ast.AST) -> bool:
    """A constant, a bare name (``AACBCC``: looked up, never called) or lists and tuples of them."""
    if isinstance(node, ast.Name):
        return True
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, str)) and not isinstance(node.value, bool)
    if isinstance(node, (ast.List, ast.Tuple)):
        return all(_is_literal(e) for e in node.elts)
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and _is_literal(node.operand)


def screen_answer(task: str, answer: str) -> bool:
    """Whether ``task``'s scorer may be given ``answer``: for the ``EVAL_SCORED`` tasks, text that
    is not Python (``eval`` fails on it) or is a literal (numbers, strings, lists, tuples: nothing
    to call, nothing to multiply out); for the ``SYMPY_SCORED`` ones, digits, operators, brackets
    and names that are single letters or math functions, calling only math functions (no quotes,
    underscores, attribute dots, factorials or calls to anything else), with no exponent above 64
    or power towers; any answer of another task. Answers longer than ``MAX_ANSWER_CHARS`` never
    pass."""
    if len(answer) > MAX_ANSWER_CHARS:
        return False
    if task in EVAL_SCORED:
        try:
            tree = ast.parse(answer.strip(), mode="eval")
        except (SyntaxError, ValueError):
            return True
        return _is_literal(tree.body)
    if task in SYMPY_SCORED:
        if not _SYMPY_CHARS.fullmatch(answer):
            return False
        if any(len(name) > 1 and name not in _MATH_NAMES for name in _NAME.findall(answer)):
            return False
        # Only math functions are called: a single letter may be a variable, but sympy's N, S, O and
        # Q are functions too (``N(pi, 10**8)`` computes 10^8 digits).
        if any(name not in _MATH_FUNCTIONS for name in _CALL.findall(answer)):
            return False
        return _bounded_powers(answer)
    return True


def _bounded_powers(answer: str) -> bool:
    """No exponent above ``_MAX_EXPONENT``, none bracketed or itself raised (``9**9**9``), and no
    power of a bracketed expression that holds a power (``((10**64)**64)**64``): what sympy would
    multiply out stays small."""
    if answer.count("**") + answer.count("^") > _MAX_POWERS:  # each is looked back from once below
        return False
    if re.search(r"(\*\*|\^)\s*\(", answer) or re.search(r"(\*\*|\^)\s*[\w.]+\s*(\*\*|\^)", answer):
        return False
    if any(float(exp) > _MAX_EXPONENT for _, exp in _POWER.findall(answer) if exp.count(".") <= 1):
        return False
    for power in re.finditer(r"\)\s*(\*\*|\^)", answer):
        depth, i = 0, power.start()
        while i >= 0:  # back to the bracket this one closes
            depth += {")": 1, "(": -1}.get(answer[i], 0)
            if depth == 0:
                break
            i -= 1
        if "**" in answer[i : power.start()] or "^" in answer[i : power.start()]:
            return False
    return True


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
    answer = extract_answer(text[-4 * MAX_ANSWER_CHARS :])  # the last tags; an answer past the cap scores 0 anyway
    answer = text.strip() if answer is None else answer
    if not screen_answer(source, answer):
        return 0.0
    score = _scorer(source, json.dumps(task_args, sort_keys=True))(answer, entry)
    return min(1.0, max(0.0, float(score)))
