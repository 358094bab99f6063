"""Your own prompts, reward and agent flow, plugged in through config entries (docs/extending.md).

Run it (about a minute on 2 CPU cores):  python examples/custom_rollout.py

- ``CountdownPrompts`` is a datasource: one letter, requested lengths ``max_len, max_len - 1, ...,
  1``, in the ``tiny`` policy's prompt format ``[BOS, letter, '*', d, d, '=']`` (``<s>c*08=``).
- ``exact_length_reward`` scores a response by its length alone: 1.0 for exactly the requested
  number of tokens before EOS.
- ``OneShotFlow`` is an agent flow: one ``/generate`` call per trajectory, resuming the partial
  trajectories a step boundary put back. (The built-in ``SingleTurnFlow`` does the same with one
  batched call per group; a multi-turn or tool-using flow has this shape.)

The config names them as ``custom_rollout:CountdownPrompts``, ``custom_rollout:exact_length_reward``
and ``custom_rollout:OneShotFlow``; the runtime imports and builds them with the one component
loader (``lightning_fasync.components``). So this file's directory must be importable in the
trainer process: :func:`main` puts it on ``sys.path`` for the run; from the command line,
``PYTHONPATH=examples lightning-fasync fit --config my.yaml`` does the same.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
from typing import Any, Optional, Sequence

import lightning.pytorch as pl

from lightning_fasync.config import FasyncConfig, load_config
from lightning_fasync.lightning import FullyAsyncCallback, RLPolicyModule, rollout_dataloader
from lightning_fasync.pipeline.datasource import DataSource, ListDataSource
from lightning_fasync.pipeline.engine_client import EngineClient, SamplingParams
from lightning_fasync.pipeline.flow import AgentFlow, RewardFn, apply_result, continuation, resume_request
from lightning_fasync.types import PromptSample, Trajectory, TrajectoryStatus

HERE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=None)
def char_ids() -> dict[str, int]:
    """Token ids of the ``tiny`` policy's char tokenizer: ``bos``, ``eos``, letters, digits, ``*``, ``=``."""
    from lightning_fasync.policy import build_char_tokenizer

    tok = build_char_tokenizer()
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789*=")
    return {"bos": tok.bos_token_id, "eos": tok.eos_token_id, **dict(zip(chars, tok.convert_tokens_to_ids(chars)))}


# ------------------------------------------------------------------------------------- datasource


class CountdownPrompts(DataSource):
    """One prompt per length ``max_len, max_len - 1, ..., 1``, all asking for ``letter``.

    Built from ``data_source.datasource_args`` (``letter``, ``max_len``, ``shuffle``, ``seed``).
    Prompt ids, epochs, the per-epoch shuffle and the recycle queue come from a wrapped
    :class:`ListDataSource`; a datasource of your own may keep them itself, as long as it keeps
    the contract of the four methods below.
    """

    def __init__(self, letter: str = "c", max_len: int = 8, shuffle: bool = True, seed: int = 0) -> None:
        if len(letter) != 1 or not "a" <= letter <= "z":
            raise ValueError(f"`letter` is {letter!r}; it must be one lowercase letter a..z.")
        if not 1 <= max_len <= 99:
            raise ValueError(f"`max_len` is {max_len}; it must be in 1..99 (two digits in the prompt).")
        self.letter, self.max_len = letter, max_len
        ids = char_ids()
        prompts = []
        for n in range(max_len, 0, -1):
            input_ids = [ids["bos"], ids[letter], ids["*"], *(ids[d] for d in f"{n:02d}"), ids["="]]
            # Metadata travels with the prompt to the reward function (and through checkpoints:
            # keep it JSON-serialisable).
            prompts.append((input_ids, {"letter": letter, "letter_id": ids[letter], "length": n}))
        self._inner = ListDataSource(prompts, shuffle=shuffle, seed=seed)

    def next_sample(self) -> Optional[PromptSample]:
        """A recycled prompt if any (oldest prompt id first), else the next new one."""
        return self._inner.next_sample()

    def recycle(self, samples: Sequence[PromptSample]) -> None:
        """Take back prompts (with their partial trajectories in ``sample.resume``)."""
        self._inner.recycle(samples)

    def state_dict(self) -> dict[str, Any]:
        """Position, RNG and recycle queue: what a checkpoint needs to continue exactly."""
        return {"letter": self.letter, "max_len": self.max_len, "prompts": self._inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["letter"], state["max_len"]) != (self.letter, self.max_len):
            raise ValueError(
                f"This checkpoint's CountdownPrompts had letter={state['letter']!r}, max_len={state['max_len']}; "
                f"this run has letter={self.letter!r}, max_len={self.max_len}."
            )
        self._inner.load_state_dict(state["prompts"])

    @property
    def num_recycled(self) -> int:
        return self._inner.num_recycled

    @property
    def max_prompt_length(self) -> int:
        """Every prompt is 6 tokens; the engines' context is sized from this (otherwise set
        ``rollout.sglang_args.context_length``)."""
        return 6


# ------------------------------------------------------------------------------------- reward


def exact_length_reward(sample: PromptSample, traj: Trajectory) -> float:
    """1.0 when EOS comes right after exactly ``sample.metadata["length"]`` tokens; otherwise
    ``0.5 * min(n, length) / max(n, length)`` for the ``n`` tokens before EOS (or all of them, when
    the response was truncated), so a group of wrong answers still has a reward spread. The
    letters are not checked."""
    eos = char_ids()["eos"]
    response = traj.response_ids
    ended = eos in response
    n = response.index(eos) if ended else len(response)
    target = int(sample.metadata["length"])
    if ended and n == target:
        return 1.0
    return 0.5 * min(n, target) / max(n, target)


# ------------------------------------------------------------------------------------- agent flow


class OneShotFlow(AgentFlow):
    """One ``/generate`` call per trajectory, then the reward.

    The runtime builds it with ``client``, ``sampling``, ``max_response_length`` and ``reward_fn``,
    plus ``agentflow.flow_args`` (here: ``rid_prefix``).
    """

    def __init__(
        self,
        client: EngineClient,
        sampling: SamplingParams,
        max_response_length: int,
        reward_fn: Optional[RewardFn] = None,
        rid_prefix: str = "oneshot-",
    ) -> None:
        self.client, self.sampling, self.reward_fn = client, sampling, reward_fn
        self.max_response_length, self.rid_prefix = max_response_length, rid_prefix

    async def run(self, sample: PromptSample, index: int, seq: int) -> Trajectory:
        # A recycled group resumes its trajectories (prompt + tokens so far); others start empty.
        traj = continuation(sample, index, seq)
        if traj.status.finished:  # finished before the step boundary that put its group back
            return traj
        request = resume_request(traj, self.sampling, self.max_response_length, f"{self.rid_prefix}{seq}-{index}")
        if request is None:  # no token budget left
            traj.status = TrajectoryStatus.TRUNCATED
        else:
            try:
                result = await self.client.generate(request)
            except Exception as exc:  # an engine error marks this trajectory failed (group policy)
                traj.status, traj.error = TrajectoryStatus.FAILED, f"{type(exc).__name__}: {exc}"
                return traj
            apply_result(traj, result, self.max_response_length)  # sets completed/truncated/cancelled
        if traj.status.finished and self.reward_fn is not None:
            reward = self.reward_fn(sample, traj)
            traj.reward = float(await reward if inspect.isawaitable(reward) else reward)
        return traj


# ------------------------------------------------------------------------------------- the run


def make_config(rollout_steps: int = 20) -> FasyncConfig:
    """The plugin config: the three components above named by ``module:Name``."""
    return load_config(
        {
            "colocate": False,
            "fully_async": {"enable": True, "sliding_window": "windowed-fifo", "stale_steps": 1.0},
            "data_source": {
                "num_prompts_per_step": 8,
                "num_trajectories_per_prompt": 4,
                "datasource": "custom_rollout:CountdownPrompts",
                "datasource_args": {"letter": "c", "max_len": 8},
                "reward": "custom_rollout:exact_length_reward",
            },
            "agentflow": {"flow": "custom_rollout:OneShotFlow", "flow_args": {"rid_prefix": "countdown-"}},
            "trainer": {"mini_batch_size": 16, "rollout_steps": rollout_steps},
            # What ends a response (else the policy's EOS: the tiny preset's is this one too).
            "rollout": {"partial": True, "max_response_length": 16, "stop_token_ids": [char_ids()["eos"]]},
        }
    )


def main(rollout_steps: int = 20, root: str = "runs/custom_rollout") -> pl.Trainer:
    cfg = make_config(rollout_steps)
    # RLPolicyModule takes its loss settings from the same config (the callback checks they agree).
    module = RLPolicyModule("tiny", lr=2e-3, **RLPolicyModule.algorithm_args(cfg))
    calls_per_step = cfg.minibatches_per_step  # (B x N) // M training calls per rollout step
    trainer = pl.Trainer(
        max_steps=cfg.trainer.rollout_steps * calls_per_step,  # Lightning counts training calls
        callbacks=[FullyAsyncCallback(cfg)],
        default_root_dir=root,
        gradient_clip_val=1.0,
        log_every_n_steps=calls_per_step,
    )
    # `custom_rollout:...` must be importable while the callback builds the rollout side.
    added = HERE not in sys.path
    if added:
        sys.path.insert(0, HERE)
    try:
        trainer.fit(module, train_dataloaders=rollout_dataloader())
    finally:
        if added:
            sys.path.remove(HERE)
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollout-steps", type=int, default=20)
    parser.add_argument("--root", default="runs/custom_rollout")
    args = parser.parse_args()
    main(args.rollout_steps, args.root)
