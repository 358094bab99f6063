"""Several trainer processes, one rollout side: what the Lightning callback and the Fabric loop share.

Only global rank 0 runs engines, producer and collector (docs/contract.md, "Processes"). It fetches
each training call's M // N groups on its main thread and hands them to every rank; each
data-parallel rank trains on its share (:func:`dp_share`; tensor-parallel peers share a
data-parallel rank and train the same groups), and the call's metrics are reduced over the
data-parallel group by the spec's naming rule (:func:`reduce_metrics`). Main thread only: these
are collectives. The drivers share a call's groups by tokens (:func:`group_tokens`), so that no
rank waits on another that got the long responses.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

from lightning_fasync.config import ConfigError, FasyncConfig
from lightning_fasync.pipeline.metrics import aggregation_rule
from lightning_fasync.runtime.packing import balanced_equal_count
from lightning_fasync.types import TrajectoryGroup

__all__ = ["check_minibatch_share", "data_parallel", "dp_share", "group_tokens", "reduce_metrics"]

T = TypeVar("T")


def data_parallel(strategy: Any) -> tuple[int, int, Any]:
    """This rank's data-parallel rank, the data-parallel size, and the data-parallel process group
    (None: the global one), for a Lightning or a Fabric strategy. Tensor-parallel peers share a
    data-parallel rank: they train the same groups, and the step's metrics are reduced over the
    data-parallel group only."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    rank, size = kwargs.get("rank", strategy.global_rank), kwargs.get("num_replicas", strategy.world_size)
    if size == strategy.world_size:
        return int(rank), int(size), None
    if hasattr(strategy, "data_parallel_group"):  # MegatronStrategy: megatron-core's group
        return int(rank), int(size), strategy.data_parallel_group
    mesh = getattr(strategy, "device_mesh", None)
    group = mesh["data_parallel"].get_group() if mesh is not None else None
    return int(rank), int(size), group


def check_minibatch_share(cfg: FasyncConfig, dp_size: int) -> None:
    """Refuse a training call whose M // N groups ``dp_size`` data-parallel ranks cannot share evenly."""
    if dp_size > 1 and cfg.groups_per_minibatch % dp_size:
        raise ConfigError(
            f"`trainer.mini_batch_size` is {cfg.M}: each training call has M // N = {cfg.groups_per_minibatch} "
            f"groups, which {dp_size} data-parallel ranks cannot share evenly; make M // N a multiple of "
            "the data-parallel size."
        )


def group_tokens(group: TrajectoryGroup) -> int:
    """The tokens a group trains on: prompt + response of each of its trajectories."""
    return sum(len(t.prompt_ids) + len(t.response_ids) for t in group.trajectories)


def dp_share(groups: Sequence[T], dp_rank: int, dp_size: int, tokens: Optional[Callable[[T], int]] = None) -> list[T]:
    """The groups data-parallel rank ``dp_rank`` of ``dp_size`` trains on.

    Without ``tokens``, a strided share (each rank sees the same mix of early and late groups).
    With ``tokens`` (a group's token count, e.g. :func:`group_tokens`), every rank still gets
    ``len(groups) // dp_size`` whole groups (a group's trajectories stay together: its advantages
    need them), but chosen so the ranks' token counts are balanced (the longest group first, each
    to the rank with the fewest tokens so far that has room), in call order. Every rank computes
    the same split from the same groups, so the shares are disjoint and cover the call: every
    prompt is trained exactly once."""
    if tokens is None or dp_size <= 1:
        return list(groups[dp_rank::dp_size])
    if len(groups) % dp_size:
        raise ValueError(f"{len(groups)} groups cannot be shared evenly by {dp_size} data-parallel ranks.")
    share = balanced_equal_count([tokens(g) for g in groups], dp_size)[dp_rank]
    return [groups[i] for i in share]


def reduce_metrics(
    metrics: Mapping[str, float], size: int, group: Any = None, device: Optional[Any] = None
) -> dict[str, float]:
    """All-reduce one training call's metrics over the data-parallel ranks (``group`` of ``size``;
    None: the global group) by the spec's naming rule: ``*_max`` by max, ``*_min`` by min,
    ``timing/*`` summed, the rest averaged. Every rank must pass the same names (a collective per rule)."""
    import torch
    import torch.distributed as dist

    keys = sorted(metrics)
    out: dict[str, float] = {}
    ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    for rule, op in ops.items():
        names = [k for k in keys if aggregation_rule(k) == rule]
        if not names:
            continue
        t = torch.tensor([metrics[k] for k in names], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op, group=group)
        if rule == "mean":
            t /= size
        out.update(zip(names, t.tolist()))
    return out
