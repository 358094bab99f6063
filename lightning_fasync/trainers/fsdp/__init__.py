"""FSDP2 (``fully_shard``) and tensor parallel for Hugging Face policies under Lightning's
``ModelParallelStrategy`` (docs/sharding.md): :func:`~lightning_fasync.trainers.fsdp.sharding.shard_policy`
lays the policy out, :mod:`lightning_fasync.weights.shard_gather` gathers it for the engines.
:data:`BACKEND` is its record in :data:`lightning_fasync.registry.TRAINERS`.
"""

from __future__ import annotations

from typing import Any

from lightning_fasync.registry import TrainerBackend


def _register() -> None:
    from lightning_fasync.lightning.strategy import register_model_parallel

    register_model_parallel()


def _shard(module: Any, device_mesh: Any) -> None:
    """``RLPolicyModule.configure_model`` under the strategy's mesh: TP, then FSDP2, as the module's
    ``activation_checkpointing`` and ``mixed_precision`` say."""
    from lightning_fasync.trainers.fsdp.sharding import shard_policy

    shard_policy(module.policy, device_mesh, activation_checkpointing=module.hparams.activation_checkpointing,
                 mixed_precision=module.hparams.mixed_precision)


BACKEND = TrainerBackend(
    name="fsdp2",
    strategy_names=("model_parallel", "ModelParallelStrategy", "lightning.pytorch.strategies.ModelParallelStrategy"),
    register=_register,
    shard=_shard,
)
