"""An arithmetic task that needs a tool, and the warm start that teaches the ``tiny`` policy to call one.

Each prompt asks for ``a op b`` (``digits``-digit operands, ``op`` in ``ops``) and names the
tool to use; the prompt is the user message rendered with the policy's chat template::

    <|im_start|>user
    37*48=? use calculator<|im_end|>
    <|im_start|>assistant

The ideal episode calls the tool, reads its answer and repeats it::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37*48"}}
    </tool_call></s>                                   policy, loss mask 1
    <|im_start|>user <tool_response> 1776 ...          observation, loss mask 0
    1776</s>                                           policy, loss mask 1

(``python`` asks for ``{"code": "print(37*48)"}``.) The ``tiny`` policy cannot multiply two-digit
numbers by itself, so the reward (:func:`arithmetic_reward`: 1.0 when the final answer is the
number, else 0.0) is earned through the tool.

From random weights the policy never writes a ``<tool_call>`` block, so RL alone would never
see a tool answer. :func:`warm_start` is a short supervised pass on ideal transcripts, built by
the same code the flow uses (:func:`~lightning_fasync.agents.tools.format_tool_call`,
:func:`~lightning_fasync.agents.flow.observation_ids`), with the loss on the policy's tokens
only. Run it once, then train from the directory it writes::

    python -m lightning_fasync.agents.task runs/tiny_agent_policy
    lightning-fasync fit --config configs/tiny_cpu_agent.yaml
"""

from __future__ import annotations

import argparse
import random
import re
from typing import Any, Optional, Sequence

from lightning_fasync.agents.tools import format_tool_call, tool_schemas
from lightning_fasync.pipeline.datasource import DataSource, ListDataSource
from lightning_fasync.types import PromptSample, Trajectory

__all__ = ["ArithmeticToolPrompts", "arithmetic_reward", "demonstration", "warm_start"]

_INTEGER = re.compile(r"-?\d+")


def _render_prompt(tokenizer: Any, expression: str, tool: str, with_schemas: bool) -> list[int]:
    messages = [{"role": "user", "content": f"{expression}=? use {tool}"}]
    text = tokenizer.apply_chat_template(messages, tools=tool_schemas([tool]) if with_schemas else None,
                                         tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def make_problems(num: int, seed: int, digits: int = 2, ops: str = "+-*",
                  tools: Sequence[str] = ("calculator",)) -> list[dict[str, Any]]:
    """``num`` problems ``{"expression", "answer", "tool"}`` on ``digits``-digit operands,
    deterministic in ``seed``."""
    rng = random.Random(seed)
    low, high = 10 ** (digits - 1), 10**digits
    out = []
    for _ in range(num):
        a, b, op = rng.randrange(low, high), rng.randrange(low, high), rng.choice(ops)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append({"expression": f"{a}{op}{b}", "answer": answer, "tool": rng.choice(list(tools))})
    return out


class ArithmeticToolPrompts(DataSource):
    """Arithmetic problems as chat prompts (module docstring), served by a :class:`ListDataSource`.

    Arguments:
        tokenizer: the policy's tokenizer (the runtime passes it).
        num_prompts: problems per epoch.
        digits: operands have this many digits (a fixed width keeps the copy into the tool call at
            a fixed offset, which a small policy learns fast).
        ops: operators drawn from (``+``, ``-``, ``*``).
        tools: the tool each prompt names, drawn per prompt (``calculator``, ``python``).
        with_schemas: put the tools' JSON schemas in a system turn (Qwen's format); too long
            for the ``tiny`` policy's 512 positions, so off by default.
        shuffle, seed: per-epoch order and the problems' seed.
    """

    def __init__(self, tokenizer: Any, num_prompts: int = 1024, digits: int = 2, ops: str = "+-*",
                 tools: Sequence[str] = ("calculator",), with_schemas: bool = False, shuffle: bool = True,
                 seed: int = 0) -> None:
        if not set(ops) <= set("+-*") or not ops:
            raise ValueError(f"`ops` is {ops!r}; it must be made of + - *.")
        unknown = [t for t in tools if t not in ("calculator", "python")]
        if unknown or not tools:
            raise ValueError(f"`tools` is {list(tools)!r}; it must list calculator and/or python.")
        prompts = []
        for problem in make_problems(num_prompts, seed, digits, ops, tools):
            prompts.append((_render_prompt(tokenizer, problem["expression"], problem["tool"], with_schemas), problem))
        self._inner = ListDataSource(prompts, shuffle=shuffle, seed=seed)

    def next_sample(self) -> Optional[PromptSample]:
        return self._inner.next_sample()

    def recycle(self, samples: Sequence[PromptSample]) -> None:
        self._inner.recycle(samples)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._inner.load_state_dict(state)

    @property
    def num_recycled(self) -> int:
        return self._inner.num_recycled

    @property
    def max_prompt_length(self) -> Optional[int]:
        return self._inner.max_prompt_length


def arithmetic_reward(sample: PromptSample, traj: Trajectory) -> float:
    """1.0 when the final answer's last integer is ``sample.metadata["answer"]``, else 0.0.

    Reads ``traj.metadata["response_text"]`` (set by the RewardRunner); ToolAgentFlow hands the
    reward its final answer only, so a tool's output is never scored as the answer.
    """
    numbers = _INTEGER.findall(traj.metadata.get("response_text", ""))
    return float(bool(numbers) and int(numbers[-1]) == int(sample.metadata["answer"]))


def demonstration(tokenizer: Any, problem: dict[str, Any]) -> list[tuple[list[int], bool]]:
    """The ideal episode's response as ``(tokens, trained)`` segments: the call (trained), the
    observation (not trained), the answer (trained); each policy turn ends with EOS."""
    from lightning_fasync.agents.flow import observation_ids

    eos = tokenizer.eos_token_id
    if problem["tool"] == "calculator":
        call = format_tool_call("calculator", {"expression": problem["expression"]})
    else:
        call = format_tool_call("python", {"code": f"print({problem['expression']})"})
    answer = str(problem["answer"])
    return [
        (list(tokenizer.encode(call, add_special_tokens=False)) + [eos], True),
        (observation_ids(tokenizer, [answer]), False),
        (list(tokenizer.encode(answer, add_special_tokens=False)) + [eos], True),
    ]


def warm_start(model: Any, tokenizer: Any, steps: int = 300, *, batch_size: int = 16, lr: float = 3e-3,
               digits: int = 2, ops: str = "+-*", tools: Sequence[str] = ("calculator",), seed: int = 0) -> list[float]:
    """Supervised steps on ideal transcripts (:func:`demonstration`), loss on the policy's tokens.

    Arguments:
        model: a Hugging Face causal LM (trained in place, returned in eval mode).
        tokenizer: its tokenizer, with the chat template.
        steps, batch_size, lr: AdamW steps, transcripts per step, learning rate.
        digits, ops, tools: the problems (as :class:`ArithmeticToolPrompts`).
        seed: seeds the problems (the torch RNG is not used).

    Returns:
        The loss of each step.
    """
    import torch

    pad = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        rows = []
        for problem in make_problems(batch_size, seed * 1_000_003 + step, digits, ops, tools):
            ids = _render_prompt(tokenizer, problem["expression"], problem["tool"], False)
            labels = [-100] * len(ids)
            for tokens, trained in demonstration(tokenizer, problem):
                ids += tokens
                labels += tokens if trained else [-100] * len(tokens)
            rows.append((ids, labels))
        width = max(len(ids) for ids, _ in rows)
        inputs = torch.full((len(rows), width), pad, dtype=torch.long)
        targets = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (ids, labels) in enumerate(rows):
            inputs[i, : len(ids)] = torch.tensor(ids)
            targets[i, : len(labels)] = torch.tensor(labels)
        # Right padding only follows the sequence, so causal attention needs no mask.
        loss = model(input_ids=inputs, labels=targets).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m lightning_fasync.agents.task OUT``: warm-start the ``tiny`` policy, save it to OUT."""
    from lightning_fasync.policy import build_policy, save_policy

    parser = argparse.ArgumentParser(description="Warm-start the tiny policy on tool-call transcripts.")
    parser.add_argument("out", help="directory to write the Hugging Face model to")
    parser.add_argument("--model", default="tiny", help="preset or local directory to start from")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--tools", default="calculator", help="comma-separated: calculator,python")
    args = parser.parse_args(argv)
    model, tokenizer = build_policy(args.model)
    losses = warm_start(model, tokenizer, args.steps, batch_size=args.batch_size, lr=args.lr,
                        tools=args.tools.split(","))
    save_policy(model, tokenizer, args.out)
    print(f"warm start: loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps; saved to {args.out}")


if __name__ == "__main__":
    main()
