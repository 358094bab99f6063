"""The split of a machine between the trainer and the rollout engines.

On a CPU machine the resources are cores: the trainer process (its torch threads) is pinned to one
set and each engine replica to its own, disjoint set, so training and generation do not fight for
the same core. Colocate mode lets every party use every core (they take turns).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass
class ResourcePlan:
    """Which cores the trainer uses and which each engine replica uses."""

    trainer_cores: list[int] = field(default_factory=list)
    replica_cores: list[list[int]] = field(default_factory=list)

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
) -> ResourcePlan:
    """Split the process's cores between the trainer and ``num_replicas`` engines.

    Default split: the trainer gets the first half (at least one core), the engines share the rest
    evenly. With ``colocate`` every party may use every core (they take turns).

    Raises:
        ValueError: when the cores cannot give every replica at least one core of its own.
    """
    cores = available_cores()
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


def pin_trainer(cores: Sequence[int]) -> None:
    """Pin this process and its torch intra-op threads to ``cores``."""
    if hasattr(os, "sched_setaffinity") and cores:
        os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(max(1, len(cores)))
