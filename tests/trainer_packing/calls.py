"""Training calls with long-tailed lengths, partial-rollout versions and multi-turn loss masks, and
the same two calls of one rollout step run by modules that differ only in how they forward."""

from __future__ import annotations

import math
import random
from typing import Any, Optional

import torch

from lightning_fasync.config import load_config
from lightning_fasync.lightning.batch import RolloutBatch
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus

LENGTHS = (1, 2, 3, 5, 8, 13, 21, 34)


def make_groups(seed: int, num_groups: int = 3, n: int = 4, vocab: int = 90, tool_masks: bool = True,
                lengths: tuple[int, ...] = LENGTHS) -> list[TrajectoryGroup]:
    """``num_groups`` groups of ``n``: prompts of 3-6 tokens, responses long-tailed over ``lengths``,
    tokens of weight versions 0 and 1 (a resumed partial rollout), rewards in [0, 1]; with
    ``tool_masks`` some responses carry loss-mask zeros inside them (tool output of a multi-turn
    episode)."""
    rng = random.Random(seed)
    out = []
    for g in range(num_groups):
        prompt = [1] + [rng.randrange(4, vocab) for _ in range(rng.randrange(2, 6))]
        trajs = []
        for i in range(n):
            t = Trajectory(prompt_id=PromptId(seed, g), sample_index=i, prompt_ids=prompt,
                           status=TrajectoryStatus.COMPLETED, reward=rng.random())
            size = rng.choice(lengths)
            cut = rng.randrange(0, size + 1)  # tokens before the cut came from version 0, the rest from 1
            t.extend([rng.randrange(4, vocab) for _ in range(size)], [-0.2 - 2.5 * rng.random() for _ in range(size)],
                     [0] * cut + [1] * (size - cut))
            if tool_masks and size >= 5 and rng.random() < 0.5:
                start = rng.randrange(1, size - 2)
                t.loss_mask[start:start + 2] = [0, 0]
            trajs.append(t)
        out.append(TrajectoryGroup(PromptSample(PromptId(seed, g), prompt), 0, trajs))
    return out


def small_qwen3() -> torch.nn.Module:
    """A small Qwen3 from a config (per-head q/k norms, grouped-query attention, tied embeddings)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         initializer_range=0.1, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return AutoModelForCausalLM.from_config(config)


class Qwen3Module(RLPolicyModule):
    """``RLPolicyModule`` over :func:`small_qwen3` (the ``tiny`` preset's tokenizer)."""

    def _build_policy(self, model: str) -> tuple[torch.nn.Module, Any]:
        _, tokenizer = super()._build_policy("tiny")
        return small_qwen3(), tokenizer


def module(algorithm: Optional[dict[str, Any]] = None, rollout: Optional[dict[str, Any]] = None,
           cls: type = RLPolicyModule, **overrides: Any) -> RLPolicyModule:
    """A ``cls`` on the ``tiny`` preset built from a plugin config (``algorithm.*``, ``rollout.*``)
    with ``overrides`` of its constructor arguments (``pack_sequences``, ``max_tokens_per_micro_batch``)."""
    spec: dict[str, Any] = {"algorithm": algorithm or {}}
    if rollout:
        spec["rollout"] = rollout
    cfg = load_config(spec)
    return cls("tiny", **{**RLPolicyModule.algorithm_args(cfg), **overrides})


def two_calls(m: RLPolicyModule, seed: int = 0, lr: float = 0.5, step: int = 1,
              like: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """Both training calls of rollout step ``step`` with plain SGD between them (so the second call's
    old log-probs, from the step-start snapshot or the loglinear interpolation, differ from the live
    policy's): each call's loss, metrics, gradients and forward plan, and the parameters the second
    call started from.

    ``like``: the reference's ``two_calls``; the second call then starts from the reference's
    parameters after its SGD step, so each call compares one call's arithmetic (float32 rounding of
    the first call's gradients, carried by the step into the second call, is not counted twice)."""
    m.begin_rollout_step(step)
    opt = torch.optim.SGD(m.policy.parameters(), lr=lr)
    out = []
    for call in range(2):
        if call == 1:
            if like is not None:
                with torch.no_grad():
                    for name, p in m.policy.named_parameters():
                        p.copy_(like[1]["params"][name])
            params = {n: p.detach().clone() for n, p in m.policy.named_parameters()}
        else:
            params = {}
        groups = make_groups(seed + call)
        batch = RolloutBatch(groups=groups, rollout_step=step, call_index=call, calls_per_step=2,
                             data=m.prepare_rollout_batch(groups))
        opt.zero_grad(set_to_none=True)
        loss = m.training_step(batch, call)
        loss.backward()
        m.on_before_optimizer_step(opt)
        grads = {n: p.grad.detach().clone() for n, p in m.policy.named_parameters()}
        out.append({"loss": loss.item(), "metrics": dict(m.rollout_metrics()), "grads": grads,
                    "plan": batch.data.forwards, "params": params})
        opt.step()
    return out


def assert_same_calls(got: list[dict[str, Any]], want: list[dict[str, Any]], tol: float = 1e-6) -> None:
    """Loss, every ``train/*`` metric and every gradient tensor within ``tol`` (float32; relative to
    the value's or the tensor's largest magnitude when that is above 1)."""
    for call, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g["loss"] - w["loss"]) <= tol * max(1.0, abs(w["loss"])), (call, g["loss"], w["loss"])
        keys = {k for k in w["metrics"] if k.startswith("train/") and k != "train/lr"}
        assert keys == {k for k in g["metrics"] if k.startswith("train/") and k != "train/lr"}
        for key in sorted(keys):
            a, b = g["metrics"][key], w["metrics"][key]
            if math.isnan(b):  # a metric of an empty set (a lag no token has) is NaN on both paths
                assert math.isnan(a), (call, key, a)
                continue
            assert abs(a - b) <= tol * max(1.0, abs(b)), (call, key, a, b)
        for name, grad in w["grads"].items():
            gap = (g["grads"][name] - grad).abs().max().item()
            assert gap <= tol * max(1.0, grad.abs().max().item()), (call, name, gap)
