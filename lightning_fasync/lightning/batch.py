"""Training batches: what the dataloader yields, and groups → padded tensors.

Lightning's fit loop prefetches one batch ahead, which would pull a mini-batch out of the
PipelineBuffer before the step boundary that should precede it. So the dataloader yields an empty
:class:`RolloutBatch` ticket, and :class:`~lightning_fasync.lightning.callback.FullyAsyncCallback`
fills it in ``on_train_batch_start`` (main thread, exactly when the spec's trainer fetches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import IterableDataset

from lightning_fasync.types import TrajectoryGroup


@dataclass
class RolloutBatch:
    """One training call's data: M // N complete groups (filled at ``on_train_batch_start``)."""

    groups: Optional[list[TrajectoryGroup]] = None
    rollout_step: int = -1
    data: Any = None  # the module's prepared tensors (``prepare_rollout_batch``), when it has one
    call_index: int = 0
    """Training calls (optimizer updates) already done in this rollout step."""
    calls_per_step: int = 1
    """(B × N) // M: training calls per rollout step, i.e. per weight version."""



class RolloutTickets(IterableDataset):
    """An endless stream of empty :class:`RolloutBatch` tickets (the run ends at ``max_steps``)."""

    def __iter__(self) -> Iterator[RolloutBatch]:
        while True:
            yield RolloutBatch()


def rollout_dataloader() -> torch.utils.data.DataLoader:
    """The dataloader a fully-async LightningModule returns from ``train_dataloader``."""
    return torch.utils.data.DataLoader(RolloutTickets(), batch_size=None, num_workers=0)


@dataclass
class PolicyBatch:
    """Right-padded tensors for a causal LM over prompt + response.

    ``response_mask``, ``rollout_log_probs`` and ``weight_versions`` are aligned with the
    response positions inside ``input_ids`` shifted by one (position t predicts token t + 1), so
    they index the logits directly: ``logits[:, :-1]`` gathered at ``input_ids[:, 1:]``.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L-1] float
    rollout_log_probs: torch.Tensor  # [B, L-1]
    weight_versions: torch.Tensor  # [B, L-1], -1 outside responses
    rewards: torch.Tensor  # [G, N]


def collate_groups(groups: list[TrajectoryGroup], pad_id: int) -> PolicyBatch:
    """Pad prompt + response of every trajectory; rewards as [groups, N] (NaN when missing)."""
    trajs = [t for g in groups for t in g.trajectories]
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajs]
    L = max(max(lengths, default=1), 2)
    B = len(trajs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1), dtype=torch.float32)
    rollout_lp = torch.zeros((B, L - 1), dtype=torch.float32)
    versions = torch.full((B, L - 1), -1, dtype=torch.long)
    for i, t in enumerate(trajs):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, :p] = torch.tensor(t.prompt_ids, dtype=torch.long)
        if r:
            input_ids[i, p : p + r] = torch.tensor(list(t.response_ids), dtype=torch.long)
            # Response token j sits at position p + j and is predicted from position p + j - 1.
            mask[i, p - 1 : p - 1 + r] = torch.tensor(list(t.loss_mask), dtype=torch.float32)
            rollout_lp[i, p - 1 : p - 1 + r] = torch.tensor(list(t.rollout_log_probs), dtype=torch.float32)
            versions[i, p - 1 : p - 1 + r] = torch.tensor(list(t.weight_versions), dtype=torch.long)
        attention[i, : p + r] = 1
    rewards = torch.tensor(
        [[float("nan") if t.reward is None else float(t.reward) for t in g.trajectories] for g in groups],
        dtype=torch.float32,
    )
    return PolicyBatch(input_ids, attention, mask, rollout_lp, versions, rewards)
