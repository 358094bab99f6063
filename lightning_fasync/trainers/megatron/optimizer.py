"""megatron-core's optimizer as Lightning handles optimizers (its own module: the strategy and the
policy module both need it, and the module needs the strategy)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["MegatronOptimizer"]


class MegatronOptimizer(torch.optim.Optimizer):
    """megatron-core's optimizer (``get_megatron_optimizer``) as Lightning handles optimizers.

    ``param_groups`` are megatron-core's own (its inner optimizer's), so Lightning's and torch's LR
    schedulers set the learning rate it steps with. :meth:`step` runs megatron-core's step (main
    weights, gradient clipping at ``OptimizerConfig.clip_grad``, the distributed optimizer's
    gather) and keeps its gradient norm in :attr:`last_grad_norm`. Its state is checkpointed by
    :class:`~lightning_fasync.trainers.megatron.strategy.MegatronStrategy` (``dist_checkpointing``), not
    through ``state_dict()``.
    """

    def __init__(self, megatron_optimizer: Any) -> None:
        # torch's constructor wants leaf parameters; the distributed optimizer's main weights are
        # views of one buffer. Its groups replace the placeholder's: the very dicts megatron-core's
        # step reads.
        super().__init__([torch.zeros(0, requires_grad=True)], {})
        self.param_groups = megatron_optimizer.param_groups
        self.megatron = megatron_optimizer
        self.last_grad_norm: Optional[float] = None
        self.last_update_ok = True

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        ok, grad_norm, _ = self.megatron.step()
        if ok and grad_norm is None:  # a single optimizer measures the norm only to clip
            grad_norm = self.megatron.get_grad_norm()
        self.last_update_ok = bool(ok)
        self.last_grad_norm = float(grad_norm) if grad_norm is not None else None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.megatron.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("megatron-core's optimizer state is saved by MegatronStrategy (dist_checkpointing).")
