"""The split of a machine between the trainer and the rollout engines.

On a CPU machine the resources are cores: the trainer process (its torch threads) is pinned to one
set and each engine replica to its own, disjoint set, so training and generation do not fight for
the same core. Colocate mode lets every party use every core (they take turns).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch


@dataclass
class ResourcePlan:
    """Which cores the trainer uses and which each engine replica uses."""

    trainer_cores: list[int] = field(default_factory=list)
    replica_cores: list[list[int]] = field(default_factory=list)
    trainer_threads: Optional[int] = None
    """Torch threads of this trainer process; None: one per trainer core."""

    @property
    def num_replicas(self) -> int:
        return len(self.replica_cores)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def plan_cpu_resources(
    num_replicas: int = 1,
    trainer_cores: Optional[Sequence[int]] = None,
    rollout_cores: Optional[Sequence[int]] = None,
    colocate: bool = False,
    remote: bool = False,
) -> ResourcePlan:
    """Split the process's cores between the trainer and ``num_replicas`` engines.

    Default split: the trainer gets the first half (at least one core), the engines share the rest
    evenly. With ``colocate`` every party may use every core (they take turns). With ``remote`` the
    engines run on other nodes (``rollout.placement: ray``): the trainer gets every core (or
    ``trainer_cores``), the replicas none here.

    Raises:
        ValueError: when the cores cannot give every replica at least one core of its own.
    """
    cores = available_cores()
    if remote:
        return ResourcePlan(trainer_cores=list(trainer_cores or cores), replica_cores=[[] for _ in range(num_replicas)])
    if colocate:
        return ResourcePlan(trainer_cores=list(cores), replica_cores=[list(cores) for _ in range(num_replicas)])
    if trainer_cores is None:
        half = max(1, len(cores) // 2) if len(cores) > 1 else 1
        trainer_cores = cores[:half]
    if rollout_cores is None:
        rollout_cores = [c for c in cores if c not in set(trainer_cores)] or list(cores)
    rollout_cores = list(rollout_cores)
    if len(rollout_cores) < num_replicas:
        raise ValueError(
            f"{num_replicas} rollout replicas need at least {num_replicas} rollout cores; only "
            f"{rollout_cores} are free of the trainer's {list(trainer_cores)}. Lower the replica count or free cores."
        )
    per = len(rollout_cores) // num_replicas
    replicas = [rollout_cores[i * per : (i + 1) * per] for i in range(num_replicas)]
    return ResourcePlan(trainer_cores=list(trainer_cores), replica_cores=replicas)


@dataclass
class GPUReplica:
    """One ``rollout.backend: sglang`` server: its replica kind, index within the kind, and GPUs."""

    kind: str
    index: int
    indices: list[int]
    """Device indices on this host, as the trainer process numbers them."""
    gpus: list[str]
    """The same devices as the server's ``CUDA_VISIBLE_DEVICES`` entries (through this process's own
    ``CUDA_VISIBLE_DEVICES`` when it has one)."""

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"


def plan_rollout_gpus(cfg: Any, visible: Optional[str] = None) -> list[GPUReplica]:
    """The GPUs of each ``rollout.backend: sglang`` server on this host.

    The trainer's ``trainer.num_gpus_per_node`` devices come first (none with ``colocate: true``,
    where rollout and training share the devices); then each replica kind of
    ``rollout.sglang_replicas``, in order, gets ``rollout.num_gpus_per_node`` devices, split into
    replicas of ``num_gpus_per_replica``. ``visible`` (default: this process's
    ``CUDA_VISIBLE_DEVICES``) maps the indices to the devices the servers are given.

    Raises:
        ConfigError: the plan needs more devices than ``CUDA_VISIBLE_DEVICES`` lists.
    """
    from lightning_fasync.config import ConfigError

    ro = cfg.rollout
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    listed = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    nxt = 0 if cfg.colocate else cfg.trainer.num_gpus_per_node
    replicas = []
    for kind, spec in ro.sglang_replicas.items():
        for i in range(ro.num_gpus_per_node // spec.num_gpus_per_replica):
            indices = list(range(nxt, nxt + spec.num_gpus_per_replica))
            nxt += spec.num_gpus_per_replica
            if listed is not None and indices[-1] >= len(listed):
                raise ConfigError(
                    f"`rollout.sglang_replicas.{kind}` needs device {indices[-1]} on this host (after the trainer's "
                    f"`trainer.num_gpus_per_node` unless colocated), but CUDA_VISIBLE_DEVICES lists {len(listed)}; "
                    "lower the GPU counts or make the devices visible."
                )
            gpus = [listed[j] for j in indices] if listed is not None else [str(j) for j in indices]
            replicas.append(GPUReplica(kind, i, indices, gpus))
    return replicas


def pin_trainer(cores: Sequence[int], threads: Optional[int] = None) -> None:
    """Pin this process and its torch intra-op threads (``threads``; default one per core) to ``cores``."""
    if hasattr(os, "sched_setaffinity") and cores:
        os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(threads or max(1, len(cores)))


def trainer_share(plan: ResourcePlan, local_rank: int, local_world: int) -> ResourcePlan:
    """One of ``local_world`` trainer processes' share of ``plan.trainer_cores``: a slice of its own
    when there are enough cores, else all of them; every process gets the same thread count.

    The same count matters beyond speed: CPU kernels split their reductions by thread, so processes
    with different counts compute the same gradient to different last bits, and the parameters
    tensor-parallel ranks each hold whole (norms, embeddings) would drift apart step by step."""
    cores = list(plan.trainer_cores)
    per = len(cores) // local_world
    mine = cores[local_rank * per:(local_rank + 1) * per] if per >= 1 else cores
    return ResourcePlan(mine, plan.replica_cores, trainer_threads=max(1, per))
