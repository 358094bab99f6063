"""The contract between a policy module and the fully-async drivers.

:class:`FullyAsyncHooks` is to :class:`~lightning_fasync.lightning.FullyAsyncCallback` and
:class:`~lightning_fasync.lightning.FullyAsyncFabricLoop` what Lightning's ``ModelHooks`` is to the
Trainer: a mixin of documented hooks with working defaults. A module opts in by listing it among
its bases (``class MyPolicy(FullyAsyncHooks, LightningModule)``) and overrides what it needs; both
drivers require it and call exactly these hooks, nothing looked up by name.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import torch

from lightning_fasync.weights.tensor_stream import TensorStream
from lightning_fasync.types import TrajectoryGroup

__all__ = ["FullyAsyncHooks", "require_hooks"]


class FullyAsyncHooks:
    """Hooks a policy module offers the fully-async drivers (all optional to override)."""

    engine_model: Optional[str] = None
    """What the rollout engines load at start: a preset name (``tiny``) or a local Hugging Face
    directory. The engines receive the trainer's weights before they generate, so only the
    architecture must match. The driver's own ``engine_model=`` argument takes precedence."""

    def engine_state_dict(self) -> Union[dict[str, torch.Tensor], TensorStream]:
        """The weights pushed to the engines at every step boundary, under the engines' (Hugging
        Face) names. Default: the state dict of the one Hugging Face model the module holds (the
        module itself or one of its children), so names carry no wrapper prefix; when that model
        is sharded (DTensor parameters), a :class:`TensorStream` that gathers them one at a time.

        Every rank calls this at every weight sync: global rank 0 pushes what it returns, and a
        stream is drained on every rank, so its collectives match."""
        from transformers import PreTrainedModel

        module: Any = self
        if isinstance(module, PreTrainedModel):
            found = [module]
        else:
            found = [m for m in module.children() if isinstance(m, PreTrainedModel)]
        if len(found) != 1:
            raise TypeError(
                f"Cannot tell which weights the engines serve: {type(self).__name__} holds {len(found)} Hugging Face "
                "models; override engine_state_dict()."
            )
        from lightning_fasync.weights.shard_gather import engine_weights

        return engine_weights(found[0])

    def prepare_rollout_batch(self, groups: list[TrajectoryGroup]) -> Any:
        """Turn one training call's M // N groups into what ``training_step`` reads as
        ``batch.data`` (timed as ``timing/process_traj``, outside the training block). Default:
        the groups themselves."""
        return groups

    def begin_rollout_step(self, step: int) -> None:
        """Rollout step ``step`` starts (every rank, before its first training call)."""

    def rollout_metrics(self) -> Mapping[str, float]:
        """Metrics of the training call that just ended (``train/*``, ``timing/*``); the driver
        aggregates them by name at the step boundary and logs them once per rollout step."""
        return {}

    def check_fasync_config(self, cfg: Any) -> None:
        """Refuse (raise ``ConfigError``) a plugin config that disagrees with how the module was
        built; called once by the driver before anything starts."""

    def offload_train(self, optimizers: Sequence[Any]) -> None:
        """Colocate with ``colocate_offload``: the rollout phase starts, move the training state off
        the accelerator so the engines get its memory (``timing/offload_train``; every rank, after
        the step's checkpoint). Default: this module's parameters, gradients and buffers and the
        ``optimizers``' state go to CPU memory when they are on CUDA (see
        :mod:`~lightning_fasync.runtime.offload`); on CPU nothing moves. Override for state the
        default does not reach (e.g. tensors kept outside the module)."""
        from lightning_fasync.runtime.offload import offload_training_state

        if isinstance(self, torch.nn.Module):
            offload_training_state(self, optimizers)

    def onload_train(self, optimizers: Sequence[Any]) -> None:
        """Colocate with ``colocate_offload``: training starts, bring back what :meth:`offload_train`
        moved (``timing/onload_train``; every rank, before the step's first training call)."""
        from lightning_fasync.runtime.offload import onload_training_state

        if isinstance(self, torch.nn.Module):
            onload_training_state(self, optimizers)


def require_hooks(module: Any, driver: str) -> FullyAsyncHooks:
    """The module behind ``module`` (unwrapping Fabric's wrapper), checked to implement the contract."""
    inner = getattr(module, "module", module) if not isinstance(module, FullyAsyncHooks) else module
    if not isinstance(inner, FullyAsyncHooks):
        raise TypeError(
            f"{driver} needs a module that implements lightning_fasync.lightning.FullyAsyncHooks; "
            f"{type(inner).__name__} does not. Add it to the bases: class {type(inner).__name__}(FullyAsyncHooks, ...)."
        )
    return inner
