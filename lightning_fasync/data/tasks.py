"""Synthetic verifiable tasks generated in code: the embedded default RL workload.

A task makes prompts (token ids plus the metadata its reward needs) and scores a response in
[0, 1] without any model or download, so the ``tiny`` policy can be trained end to end on a CPU.

The registered task ``"repeat"`` asks for one letter repeated ``n`` times::

    prompt:  <s>c*07=          (BOS, letter, '*', n as two digits, '=': always 6 tokens)
    answer:  ccccccc</s>

``n`` follows a geometric law truncated to ``1..max_len``: most answers are short, a few are
long, so response lengths (and generation times) have the long tail that asynchronous rollout is
meant to absorb. The fixed prompt length lets a simple sampler batch prompts without padding.
With ``max_len`` over 99, ``n`` takes three digits (7-token prompts); ``length_law: pareto`` draws
it from a heavy-tailed law instead (tens of letters at the median, hundreds at the tail: the
long-tailed workload, ``configs/tiny_cpu_longtail.yaml``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from lightning_fasync.types import PromptSample, Trajectory

__all__ = ["Task", "RepeatTask", "TASKS", "make_task", "warm_start"]


@runtime_checkable
class Task(Protocol):
    """A verifiable task: prompt generator plus reward function.

    Attributes:
        name: The registry name.
        stop_token_ids: Token ids that end a response (EOS).
        max_new_tokens: Response length budget for the engine (longest answer plus EOS).
    """

    name: str
    stop_token_ids: list[int]
    max_new_tokens: int

    def make_prompts(self, num: int, seed: int) -> list[tuple[list[int], dict[str, Any]]]:
        """``num`` prompts as ``(token ids incl. BOS, metadata)``, deterministic in ``seed``."""
        ...

    def reward(self, sample: PromptSample, traj: Trajectory) -> float:
        """Score ``traj.response_ids`` (possibly ending with EOS) for ``sample`` in [0, 1]."""
        ...


def _default_tokenizer() -> Any:
    from lightning_fasync.policy import build_char_tokenizer

    return build_char_tokenizer()


@dataclass
class RepeatTask:
    """Repeat a letter ``n`` times, then stop.

    Reward: with ``resp`` the response up to (not including) its first EOS and ``L = n``,
    ``char = #{i < min(len(resp), L): resp[i] == letter} / max(L, len(resp))`` is the per-character
    credit; it is dense (each right letter counts) and penalises both stopping early and running
    on. The total is ``char * (1 - eos_weight)`` plus ``char * eos_weight`` for the right stop,
    so only the exact answer scores 1.0, an immediate EOS scores 0, and the stop bonus cannot be
    collected with wrong letters. The right stop is EOS right after exactly ``L`` tokens; with
    ``stop: length`` it is the engine's: every response is ``L`` tokens long (the prompt's own
    budget, ``metadata["sampling"]``, EOS ignored by the engine), and the bonus is paid when no EOS
    comes among them. The policy then learns the letters, but cannot move the response lengths,
    which follow the length law exactly (a benchmark whose every step has the same work in
    expectation, whatever the policy learns).

    Args:
        tokenizer: A char-level tokenizer with a BOS and an EOS token (default: the ``tiny``
            preset's).
        max_len: Longest answer, in letters (at most 999; ``n`` is written with two digits up to
            99, three above).
        mean_len: Mean of the untruncated geometric length law (``p = 1 / mean_len``).
        alphabet_size: Letters drawn from ``'a'`` onwards (1..26).
        eos_weight: Share of the reward that needs the exact stop.
        length_law: ``geometric`` (``mean_len``) or ``pareto``: ``n = floor(min_len / U ** (1 /
            tail_index))``, truncated to ``max_len``; a tail index at or below 1 has no mean, so a
            few answers in every batch are far longer than the median ``min_len * 2 ** (1 / tail_index)``.
        min_len: The Pareto law's smallest answer.
        tail_index: The Pareto law's shape (smaller: heavier tail).
        stop: ``eos`` (the policy ends its answer) or ``length`` (the engine ends it after ``n``
            tokens, above).
    """

    tokenizer: Any = None
    max_len: int = 64
    mean_len: float = 8.0
    alphabet_size: int = 8
    eos_weight: float = 0.2
    length_law: str = "geometric"
    min_len: int = 4
    tail_index: float = 0.8
    stop: str = "eos"
    name: str = field(default="repeat", init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.max_len <= 999:
            raise ValueError(f"`max_len` is {self.max_len}; it must be in 1..999 (at most three digits).")
        if self.length_law not in ("geometric", "pareto"):
            raise ValueError(f"`length_law` is {self.length_law!r}; it must be geometric or pareto.")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"`min_len` is {self.min_len}; it must be in 1..max_len ({self.max_len}).")
        if self.stop not in ("eos", "length"):
            raise ValueError(f"`stop` is {self.stop!r}; it must be eos or length.")
        if not self.tail_index > 0:
            raise ValueError(f"`tail_index` is {self.tail_index}; it must be > 0.")
        if not 1 <= self.alphabet_size <= 26:
            raise ValueError(f"`alphabet_size` is {self.alphabet_size}; it must be in 1..26.")
        if self.mean_len < 1:
            raise ValueError(f"`mean_len` is {self.mean_len}; it must be >= 1.")
        if not 0 <= self.eos_weight <= 1:
            raise ValueError(f"`eos_weight` is {self.eos_weight}; it must be in [0, 1].")
        if self.tokenizer is None:
            self.tokenizer = _default_tokenizer()
        tok = self.tokenizer
        self.bos_id: int = tok.bos_token_id
        self.eos_id: int = tok.eos_token_id
        self.stop_token_ids = [self.eos_id]
        self.max_new_tokens = self.max_len + 1  # room for the EOS after the longest answer
        self.digits = 2 if self.max_len <= 99 else 3
        self.letters = [chr(ord("a") + i) for i in range(self.alphabet_size)]
        # Char ids looked up once: make_prompts and reward then avoid the tokenizer entirely.
        chars = list("abcdefghijklmnopqrstuvwxyz0123456789*=")
        self._ids = dict(zip(chars, tok.convert_tokens_to_ids(chars)))
        if len(set(self._ids.values())) != len(chars) or tok.unk_token_id in self._ids.values():
            raise ValueError("The tokenizer must have one token per letter, digit, '*' and '='.")

    def sample_length(self, rng: random.Random) -> int:
        """One answer length by inverse CDF (one uniform draw), truncated to ``max_len``: geometric
        with mean ``mean_len`` (``1 + floor(log U / log(1 - p))``), or Pareto (``length_law``)."""
        if self.length_law == "pareto":
            return min(self.max_len, int(self.min_len / (1.0 - rng.random()) ** (1.0 / self.tail_index)))
        p = 1.0 / self.mean_len
        if p >= 1.0:
            return 1
        n = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
        return min(n, self.max_len)

    def make_prompts(self, num: int, seed: int) -> list[tuple[list[int], dict[str, Any]]]:
        """``num`` prompts ``([BOS, letter, '*', d, d, '='], {"letter_id", "length"})``, with
        ``"sampling"`` (the prompt's budget) under ``stop: length``.

        Deterministic in ``seed`` (a private ``random.Random``, the global RNG is untouched).
        """
        rng = random.Random(seed)
        out = []
        for _ in range(num):
            letter = rng.choice(self.letters)
            n = self.sample_length(rng)
            ids = [self.bos_id] + [self._ids[c] for c in f"{letter}*{n:0{self.digits}d}="]
            meta = {"letter_id": self._ids[letter], "length": n}
            if self.stop == "length":
                meta["sampling"] = {"max_new_tokens": n, "ignore_eos": True}
            out.append((ids, meta))
        return out

    def answer_ids(self, metadata: dict[str, Any]) -> list[int]:
        """The exact answer: ``length`` copies of the letter, then EOS."""
        return [metadata["letter_id"]] * metadata["length"] + [self.eos_id]

    def score(self, response_ids: list[int], metadata: dict[str, Any]) -> float:
        """The reward of a raw response (see the class docstring for the formula)."""
        ended = self.eos_id in response_ids
        resp = response_ids[: response_ids.index(self.eos_id)] if ended else response_ids
        target, letter = metadata["length"], metadata["letter_id"]
        matches = sum(1 for t in resp[:target] if t == letter)
        char = matches / max(target, len(resp))
        if self.stop == "length":  # the engine stopped it: right when it holds no EOS
            exact = not ended and len(resp) == target
        else:
            exact = ended and len(resp) == target
        return char * (1.0 - self.eos_weight + (self.eos_weight if exact else 0.0))

    def reward(self, sample: PromptSample, traj: Trajectory) -> float:
        """:meth:`score` of ``traj.response_ids`` against ``sample.metadata``. The status is not
        needed: a truncated response simply has no EOS and misses the stop bonus."""
        return self.score(traj.response_ids, sample.metadata)

    def demonstrate(self, metadata: dict[str, Any], noise: float, rng: random.Random) -> list[int]:
        """A noisy demonstration for :func:`warm_start`: each letter is replaced by a random
        letter with probability ``noise`` and the length is off by up to ``noise * length``, so
        imitating it gives a moderate, not a perfect, reward."""
        n = metadata["length"]
        jitter = int(round(noise * n))
        n = max(1, min(self.max_len, n + rng.randint(-jitter, jitter)))
        other = [self._ids[c] for c in self.letters]
        out = [rng.choice(other) if rng.random() < noise else metadata["letter_id"] for _ in range(n)]
        return out + [self.eos_id]


TASKS: dict[str, Callable[..., Task]] = {"repeat": RepeatTask}


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a registered task, or the user's ``package.module:Class``.

    Args:
        name: A key of :data:`TASKS`, or ``package.module:Class``.
        **kwargs: The task's parameters (e.g. ``max_len``, ``mean_len``, ``alphabet_size``,
            ``tokenizer``).

    Raises:
        ValueError: ``name`` is not registered.
    """
    if ":" in name:
        from lightning_fasync.components import instantiate

        return instantiate(name, "data_source.task", kwargs)
    if name not in TASKS:
        raise ValueError(
            f"`data_source.task` is {name!r}, which is not a registered task ({', '.join(sorted(TASKS))}) "
            "nor a package.module:Class."
        )
    return TASKS[name](**kwargs)


def warm_start(
    model: Any,
    task: Any,
    steps: int = 30,
    *,
    batch_size: int = 32,
    lr: float = 3e-3,
    noise: float = 0.5,
    seed: int = 0,
    pad_id: Optional[int] = None,
) -> list[float]:
    """A short supervised warm start on noisy demonstrations (``task.demonstrate``).

    Optional: GRPO from the ``tiny`` preset's random init already learns ``repeat`` (reward
    ~0.0 to ~0.5 within about 60 steps of 16x8 samples), but its first steps are slow, since a
    right letter is ~1 in 100 draws and random responses run to the length limit. Imitating noisy
    answers (letters, then EOS) skips that phase: the policy starts at a moderate reward
    (~0.1-0.3 with the defaults) and RL still has the right letter and the exact stop to learn.

    Args:
        model: A Hugging Face causal LM (trained in place, returned in eval mode).
        task: A task with ``make_prompts``, ``demonstrate`` and ``max_new_tokens``.
        steps: Optimiser steps.
        batch_size: Demonstrations per step.
        lr: AdamW learning rate.
        noise: Demonstration noise in [0, 1] (see ``demonstrate``).
        seed: Seeds prompts and noise (the torch RNG is not used).
        pad_id: Padding id (default: the model config's ``pad_token_id``).

    Returns:
        The loss of each step.
    """
    import torch

    pad = model.config.pad_token_id if pad_id is None else pad_id
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        rows = []
        for ids, meta in task.make_prompts(batch_size, seed * 1_000_003 + step):
            rows.append((ids, task.demonstrate(meta, noise, rng)))
        width = max(len(p) + len(a) for p, a in rows)
        inputs = torch.full((len(rows), width), pad, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)  # prompt and pad: no loss
        for i, (p, a) in enumerate(rows):
            inputs[i, : len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p) : len(p) + len(a)] = torch.tensor(a)
        # Right padding only follows the sequence, so causal attention needs no mask.
        loss = model(input_ids=inputs, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    model.eval()
    return losses


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m lightning_fasync.data.tasks OUT``: warm-start a policy on a task's noisy
    demonstrations (:func:`warm_start`) and save it to OUT, e.g. the long-tailed workload's policy::

        python -m lightning_fasync.data.tasks runs/tiny_longtail_policy \\
            --task-args '{"max_len": 400, "length_law": "pareto", "min_len": 4, "tail_index": 0.8}'
    """
    import argparse
    import json

    import torch

    from lightning_fasync.policy import build_policy, save_policy

    parser = argparse.ArgumentParser(prog="python -m lightning_fasync.data.tasks",
                                     description="Warm-start a policy on a task's noisy demonstrations and save it.")
    parser.add_argument("out", help="directory to write the Hugging Face model to")
    parser.add_argument("--model", default="tiny", help="preset or local directory to start from")
    parser.add_argument("--task", default="repeat", help="a registered task or package.module:Class")
    parser.add_argument("--task-args", default="{}", help="the task's arguments as JSON (data_source.task_args)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--noise", type=float, default=0.3, help="demonstration noise in [0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    model, tokenizer = build_policy(args.model)
    task = make_task(args.task, **json.loads(args.task_args))
    losses = warm_start(model, task, args.steps, batch_size=args.batch_size, lr=args.lr, noise=args.noise, seed=args.seed)
    save_policy(model, tokenizer, args.out)
    print(f"warm start: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; saved to {args.out}")


if __name__ == "__main__":
    main()
