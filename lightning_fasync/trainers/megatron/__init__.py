"""megatron-core as the trainer's model: Hugging Face <-> megatron-core conversion, model building,
and the parallel layout's validation (docs/megatron.md).

``convert`` and ``parallel`` need only torch; ``model``, ``shards``, ``checkpoint`` and the
Lightning pieces, :class:`MegatronStrategy` and :class:`MegatronPolicyModule`, import megatron-core
(the ``megatron`` extra: ``pip install -e ".[megatron]"``).
"""

from typing import Any, Mapping, Optional

from lightning_fasync.errors import ConfigError
from lightning_fasync.registry import TrainerBackend

__all__ = ["BACKEND", "MegatronPolicyModule", "MegatronStrategy"]


def __getattr__(name: str):
    # Lazily: these import Lightning (and, when used, megatron-core); ``convert`` and ``parallel`` do not.
    if name == "MegatronStrategy":
        from lightning_fasync.trainers.megatron.strategy import MegatronStrategy

        return MegatronStrategy
    if name == "MegatronPolicyModule":
        from lightning_fasync.trainers.megatron.module import MegatronPolicyModule

        return MegatronPolicyModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_cli(trainer: Mapping[str, Any]) -> None:
    """Lightning clips only under automatic optimisation; megatron-core's optimizer clips itself."""
    if trainer.get("gradient_clip_val") is not None:
        raise ConfigError(
            f"`trainer.gradient_clip_val` is {trainer['gradient_clip_val']} under MegatronStrategy, whose optimizer "
            f"is megatron-core's: set `model.grad_clip: {trainer['gradient_clip_val']}` and "
            "`trainer.gradient_clip_val: null` (Lightning clips only under automatic optimisation)."
        )


def _is_checkpoint(path: str) -> bool:
    from lightning_fasync.trainers.megatron.checkpoint import is_megatron_checkpoint

    return is_megatron_checkpoint(path)


def _export(ckpt_path: str, out: str, model: Optional[str], overwrite: bool) -> str:
    from lightning_fasync.trainers.megatron.checkpoint import export_checkpoint

    return export_checkpoint(ckpt_path, out, model, overwrite)


BACKEND = TrainerBackend(
    name="megatron",
    strategy_names=("MegatronStrategy", "megatron", "lightning_fasync.trainers.megatron.MegatronStrategy",
                    "lightning_fasync.trainers.megatron.strategy.MegatronStrategy"),
    strategy_class="lightning_fasync.trainers.megatron.strategy:MegatronStrategy",
    module_class="lightning_fasync.trainers.megatron.module:MegatronPolicyModule",
    check_cli=_check_cli,
    is_checkpoint=_is_checkpoint,
    export=_export,
)
"""megatron-core as the trainer (docs/megatron.md): its strategy, its policy module, its checkpoint layout."""
