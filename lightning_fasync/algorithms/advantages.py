"""GRPO group-relative advantages, robust to broken (NaN) rewards.

Source: Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
Language Models" (GRPO, section 4.1.2, outcome supervision): each response's advantage is its
reward minus the mean reward of its group, optionally divided by the group's reward std.
"""

from __future__ import annotations

from typing import Optional

import torch

from lightning_fasync.config import AlgorithmConfig

__all__ = ["grpo_advantages", "compute_advantages", "nan_ratio"]


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: Optional[torch.Tensor] = None,
    *,
    norm_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` (GRPO).

    Source: Shao et al. 2024 (DeepSeekMath), GRPO outcome supervision:
    ``A_i = (r_i - mean(r)) / std(r)`` over the G responses to one prompt. ``eps`` is added to the
    std as in common implementations (verl, TRL) so that near-constant groups stay finite.

    Robustness rules (why: one broken reward must not poison its whole group):

    * A non-finite reward (NaN or +-inf, e.g. a crashed reward function) is excluded from its
      group's mean and std, gets advantage 0 and is flagged in the returned ``nan_mask``; pass that
      mask to :func:`~lightning_fasync.algorithms.policy_loss.policy_loss` (``nan_mask=``) so
      the sample is dropped from the loss and counted in ``train/nan_ratio``.
    * The std is the unbiased (Bessel-corrected) sample std over the group's finite rewards, as
      ``torch.std`` in the reference implementations. A group with fewer than two finite rewards
      has std 0.
    * A zero-variance group (all finite rewards equal, including a single finite reward) gets
      advantage exactly 0 for every member (no 0/0, no rounding residue).

    Args:
        rewards: ``[num_groups, N]`` rewards (one row per prompt group), or a flat ``[n]`` tensor
            together with ``group_ids``.
        group_ids: ``[n]`` integer group id of each flat reward (any integers; members of a group
            need not be contiguous). Must be None when ``rewards`` is 2-D.
        norm_std: Divide by ``std + eps`` (``algorithm.advantage_norm_std``). False gives the
            plain mean baseline ``r_i - mean(r)``.
        eps: Added to the std before dividing.

    Returns:
        ``(advantages, nan_mask)``, both shaped like ``rewards``: float advantages (0 where the
        reward is non-finite) and a bool mask that is True where the reward is non-finite.

    Raises:
        ValueError: on a shape mismatch or a negative ``eps``.
    """
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.as_tensor(rewards)
    if eps < 0:
        raise ValueError(f"`eps` is {eps}; it must be >= 0.")
    dtype = torch.promote_types(rewards.dtype, torch.float32) if rewards.is_floating_point() else torch.float32
    r = rewards.detach().to(dtype)
    if r.dim() == 2:
        if group_ids is not None:
            raise ValueError("`group_ids` must be None when `rewards` is 2-D [num_groups, N] (the row is the group).")
        num_groups, n = r.shape
        flat = r.reshape(-1)
        inverse = torch.arange(num_groups, device=r.device).repeat_interleave(n)
    elif r.dim() == 1:
        if group_ids is None:
            raise ValueError(
                "`group_ids` is required when `rewards` is flat (1-D); pass [num_groups, N] rewards otherwise."
            )
        group_ids = torch.as_tensor(group_ids, device=r.device)
        if group_ids.shape != r.shape:
            raise ValueError(
                f"`group_ids` has shape {tuple(group_ids.shape)}; it must match `rewards` {tuple(r.shape)}."
            )
        flat = r
        uniques, inverse = torch.unique(group_ids, return_inverse=True)
        num_groups = uniques.numel()
    else:
        raise ValueError(
            f"`rewards` has shape {tuple(r.shape)}; it must be [num_groups, N] or flat [n] with group_ids."
        )

    nan_mask = ~torch.isfinite(flat)
    valid = ~nan_mask
    # Broken rewards become 0 *and* are excluded from the counts, so they cannot move the stats.
    x = torch.where(valid, flat, torch.zeros_like(flat))
    zeros = torch.zeros(num_groups, dtype=dtype, device=r.device)
    count = zeros.index_add(0, inverse, valid.to(dtype))
    total = zeros.index_add(0, inverse, x)
    mean = total / count.clamp(min=1)
    dev = torch.where(valid, x - mean[inverse], torch.zeros_like(x))
    sq = zeros.index_add(0, inverse, dev * dev)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.zeros_like(sq))
    std = var.sqrt()
    big = torch.finfo(dtype).max
    gmax = torch.full_like(zeros, -big).scatter_reduce(
        0, inverse, torch.where(valid, x, torch.full_like(x, -big)), reduce="amax"
    )
    gmin = torch.full_like(zeros, big).scatter_reduce(
        0, inverse, torch.where(valid, x, torch.full_like(x, big)), reduce="amin"
    )
    constant = gmax <= gmin  # zero-variance (or empty / single-sample) group

    adv = dev / (std[inverse] + eps) if norm_std else dev
    adv = torch.where(valid & ~constant[inverse], adv, torch.zeros_like(adv))
    if eps == 0 and norm_std:
        adv = torch.nan_to_num(adv, nan=0.0, posinf=0.0, neginf=0.0)
    return adv.reshape(rewards.shape), nan_mask.reshape(rewards.shape)


def compute_advantages(
    rewards: torch.Tensor,
    cfg: Optional[AlgorithmConfig] = None,
    group_ids: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`grpo_advantages` configured from ``algorithm.advantage_norm_std`` (default True)."""
    cfg = cfg if cfg is not None else AlgorithmConfig()
    return grpo_advantages(rewards, group_ids, norm_std=cfg.advantage_norm_std, eps=eps)


def nan_ratio(nan_mask: torch.Tensor) -> float:
    """Fraction of True entries of a ``nan_mask`` (0.0 for an empty mask), for ``train/nan_ratio``."""
    n = nan_mask.numel()
    return float(nan_mask.sum().item()) / n if n else 0.0
