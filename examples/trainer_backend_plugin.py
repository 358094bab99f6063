"""A trainer backend of your own: one module plus a registration (docs/extending.md).

``frozen-embeddings`` trains the policy with its token embeddings (and a head tied to them) held
fixed, on one device beside the engines. Its record says what the package does differently under
its strategy: which policy module the command line builds (``module_class``) and what it refuses
(``check_cli``); a backend with a checkpoint layout of its own would also give ``is_checkpoint`` and
``export`` (see ``lightning_fasync/trainers/megatron/__init__.py``).

Use it by listing this module in ``fully_async.plugins`` (the command line imports the plugins
before it reads the strategy) and naming its strategy::

    PYTHONPATH=examples lightning-fasync fit --config configs/tiny_cpu.yaml \\
        --fully_async.plugins='[trainer_backend_plugin]' --trainer.strategy=frozen_embeddings
"""

from __future__ import annotations

from typing import Any, Mapping

from lightning_fasync.config import ConfigError
from lightning_fasync.lightning import FullyAsyncStrategy, RLPolicyModule
from lightning_fasync.registry import TRAINERS, TrainerBackend


class FrozenEmbeddingsStrategy(FullyAsyncStrategy):
    """One device beside the engines (all of ``FullyAsyncStrategy``), under a name of its own."""


class FrozenEmbeddingsPolicy(RLPolicyModule):
    """The policy module with ``requires_grad`` off on the input embeddings: no gradient reaches
    them, so the optimizer never moves them."""

    def configure_model(self) -> None:
        super().configure_model()
        self.policy.get_input_embeddings().weight.requires_grad_(False)


def _register() -> None:
    """``--trainer.strategy=frozen_embeddings``: Lightning's strategy registry takes a name."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "frozen_embeddings" not in StrategyRegistry:
        StrategyRegistry.register("frozen_embeddings", FrozenEmbeddingsStrategy,
                                  description="one device beside the engines, token embeddings frozen")


def _check_cli(trainer: Mapping[str, Any]) -> None:
    if trainer.get("accumulate_grad_batches", 1) != 1:
        raise ConfigError(
            f"`trainer.accumulate_grad_batches` is {trainer['accumulate_grad_batches']} under FrozenEmbeddingsStrategy; "
            "it takes one optimizer step per training call (1)."
        )


TRAINERS.register("frozen-embeddings", TrainerBackend(
    name="frozen-embeddings",
    strategy_names=("frozen_embeddings", "FrozenEmbeddingsStrategy", "trainer_backend_plugin.FrozenEmbeddingsStrategy"),
    register=_register,
    module_class="trainer_backend_plugin:FrozenEmbeddingsPolicy",
    check_cli=_check_cli,
))
