"""FullyAsyncStrategy: the trainer's Lightning strategy plus the split between trainer and rollout
resources and the weight-sync channel.

On a CPU machine "resources" are cores: the trainer process (its torch threads) is pinned to one
set and each engine replica to its own, disjoint set, so training and generation do not fight for
the same core. On GPUs the same split is GPUs (``trainer.num_gpus_per_node`` vs the rollout pool).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy


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


class FullyAsyncStrategy(SingleDeviceStrategy):
    """Single-device training with a resident rollout pool on its own resources.

    Arguments:
        device: the training device (default: CPU, or the first GPU when there is one).
        rollout_replicas: engine replicas to start (each gets its own cores on CPU).
        trainer_cores, rollout_cores: explicit CPU split; by default half and half.
        engine_threads: torch threads per engine replica (default: its core count).
        weight_sync: ``tensor`` (same host: one safetensors file in shared memory) or ``disk``.
    """

    strategy_name = "fully_async"

    def __init__(
        self,
        device: Optional[str] = None,
        rollout_replicas: int = 1,
        trainer_cores: Optional[list[int]] = None,
        rollout_cores: Optional[list[int]] = None,
        engine_threads: Optional[int] = None,
        weight_sync: str = "tensor",
        **kwargs,
    ) -> None:
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        super().__init__(device=torch.device(device), **kwargs)
        if weight_sync not in ("tensor", "disk"):
            raise ValueError(f"`weight_sync` is {weight_sync!r}; it must be tensor or disk.")
        if rollout_replicas < 1:
            raise ValueError(f"`rollout_replicas` is {rollout_replicas}; at least one engine replica is needed.")
        self.rollout_replicas = rollout_replicas
        self.trainer_cores = trainer_cores
        self.rollout_cores = rollout_cores
        self.engine_threads = engine_threads
        self.weight_sync = weight_sync

    def resource_plan(self, colocate: bool = False) -> ResourcePlan:
        return plan_cpu_resources(self.rollout_replicas, self.trainer_cores, self.rollout_cores, colocate=colocate)
