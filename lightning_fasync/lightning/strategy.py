"""FullyAsyncStrategy: the trainer's Lightning strategy for single-device training beside a resident
rollout pool, and the pool's size and core split (planned by :mod:`lightning_fasync.fleet.resources`).
"""

from __future__ import annotations

from typing import Optional

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_fasync.config import ConfigError
from lightning_fasync.registry import weight_sync_choices
from lightning_fasync.fleet.resources import ResourcePlan, plan_cpu_resources


class FullyAsyncStrategy(SingleDeviceStrategy):
    """Single-device training with a resident rollout pool on its own resources.

    Arguments:
        device: the training device (default: CPU, or the first GPU when there is one).
        rollout_replicas: engine replicas to start (each gets its own cores on CPU).
        trainer_cores, rollout_cores: explicit CPU split; by default half and half.
        engine_threads: torch threads per engine replica (default: its core count).
        weight_sync: the weight-sync path, overriding ``rollout.weight_sync``: ``distributed``,
            ``tensor``, ``disk`` or ``auto`` (docs/weight_sync.md); None: the config's.
    """

    strategy_name = "fully_async"

    def __init__(
        self,
        device: Optional[str] = None,
        rollout_replicas: int = 1,
        trainer_cores: Optional[list[int]] = None,
        rollout_cores: Optional[list[int]] = None,
        engine_threads: Optional[int] = None,
        weight_sync: Optional[str] = None,
        **kwargs,
    ) -> None:
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        super().__init__(device=torch.device(device), **kwargs)
        if weight_sync is not None and weight_sync not in weight_sync_choices():
            raise ConfigError(f"`weight_sync` is {weight_sync!r}; it must be one of {', '.join(weight_sync_choices())} or None.")
        if rollout_replicas < 1:
            raise ValueError(f"`rollout_replicas` is {rollout_replicas}; at least one engine replica is needed.")
        self.rollout_replicas = rollout_replicas
        self.trainer_cores = trainer_cores
        self.rollout_cores = rollout_cores
        self.engine_threads = engine_threads
        self.weight_sync = weight_sync

    def resource_plan(self, colocate: bool = False, remote: bool = False) -> ResourcePlan:
        """The split of this host's cores (``remote``: the replicas run on other nodes, the trainer gets them all)."""
        return plan_cpu_resources(self.rollout_replicas, self.trainer_cores, self.rollout_cores, colocate=colocate,
                                  remote=remote)


def register_model_parallel() -> None:
    """``--trainer.strategy=model_parallel``: Lightning's ``ModelParallelStrategy`` with its own
    defaults (tensor parallel over a node's devices, data parallel across nodes). Sizes of your own:
    ``--trainer.strategy=ModelParallelStrategy --trainer.strategy.data_parallel_size=N
    --trainer.strategy.tensor_parallel_size=M``."""
    from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

    if "model_parallel" not in StrategyRegistry:
        StrategyRegistry.register(
            "model_parallel", ModelParallelStrategy,
            description="FSDP2 + tensor parallel (DTensor) with FullyAsyncCallback's sharded weight sync",
        )


register_model_parallel()

