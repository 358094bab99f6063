"""Metric names of the algorithms package and the ``train/grad_norm`` helper.

The loss function returns every ``train/*`` metric it can know (see
:data:`~lightning_fasync.algorithms.policy_loss.LOSS_METRIC_KEYS`). ``train/grad_norm`` exists
only after ``backward()``, so the caller adds it: either with the total norm returned by its
gradient clipping (``torch.nn.utils.clip_grad_norm_``, FSDP's ``clip_grad_norm_``, Lightning's
``configure_gradient_clipping``), or with :func:`grad_norm_metric` below.
"""

from __future__ import annotations

from typing import Iterable, Union

import torch

from lightning_fasync.algorithms.policy_loss import LOSS_METRIC_KEYS

__all__ = ["METRIC_KEYS", "grad_norm_metric"]

# The loss's own keys plus train/grad_norm (which only exists after backward()).
METRIC_KEYS = (*LOSS_METRIC_KEYS[:3], "train/grad_norm", *LOSS_METRIC_KEYS[3:])
"""Every ``train/*`` metric of the algorithms package, ``train/grad_norm`` included."""


def grad_norm_metric(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]], norm_type: float = 2.0
) -> dict[str, float]:
    """``{"train/grad_norm": total norm of the .grad of parameters}`` (0.0 when none has a grad).

    Call it after ``backward()`` and before ``optimizer.step()`` (and before clipping, to log the
    unclipped norm). It is the norm of the gradients this process holds: with a sharded trainer
    (FSDP) every rank holds a shard, so log the norm returned by the strategy's clipping instead,
    which all-reduces it. A non-finite norm is reported as is (it signals a bad step).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return {"train/grad_norm": 0.0}
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
    return {"train/grad_norm": float(total.item())}
