"""Metric names of the algorithms package, the ``train/grad_norm`` helper, and gradient clipping
by norm that works on sharded (DTensor) gradients.

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

__all__ = ["METRIC_KEYS", "clip_grad_norm", "grad_norm_metric", "total_grad_norm"]

# The loss's own keys plus train/grad_norm (which only exists after backward()).
METRIC_KEYS = (*LOSS_METRIC_KEYS[:3], "train/grad_norm", *LOSS_METRIC_KEYS[3:])
"""Every ``train/*`` metric of the algorithms package, ``train/grad_norm`` included."""


def _grads_by_mesh(parameters: Union[torch.Tensor, Iterable[torch.Tensor]]) -> dict[object, list[torch.Tensor]]:
    """The parameters that have a ``.grad``, grouped by their gradient's DTensor mesh (None: plain
    tensors), in parameter order: the same groups in the same order on every rank."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups


def total_grad_norm(parameters: Union[torch.Tensor, Iterable[torch.Tensor]], norm_type: float = 2.0) -> torch.Tensor:
    """The total norm of the ``.grad`` of ``parameters`` as a plain 0-dim tensor (0 when none has one).

    DTensor gradients (FSDP2, tensor parallel) give the norm of the whole gradient, the same on
    every rank: each rank must call it (it runs collectives). Plain tensors count as this process
    holds them (DDP's gradients are the same on every rank).
    """
    # DTensors of one mesh reduce together (DTensor sums the shards' parts). A policy sharded with
    # FSDP2 over the data-parallel sub-mesh and tensor parallel over the whole mesh has grads on
    # two meshes, which torch's foreach norm (and so clip_grad_norm_) refuses to mix; the per-mesh
    # norms combine as a norm of norms.
    norms = []
    for params in _grads_by_mesh(parameters).values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=norm_type)
        full_tensor = getattr(norm, "full_tensor", None)
        norms.append(full_tensor() if callable(full_tensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    return norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, norm_type=norm_type)


def clip_grad_norm(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also takes DTensor gradients on several meshes (FSDP2
    with tensor parallel): scales every gradient by ``max_norm / total norm`` when that is below 1.

    Returns:
        The total norm before clipping (:func:`total_grad_norm`).
    """
    groups = _grads_by_mesh(parameters)
    total = total_grad_norm([p for params in groups.values() for p in params], norm_type)
    for params in groups.values():  # the scale (a 0-dim tensor) must meet each mesh's grads apart
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def grad_norm_metric(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]], norm_type: float = 2.0
) -> dict[str, float]:
    """``{"train/grad_norm": total norm of the .grad of parameters}`` (0.0 when none has a grad).

    Call it after ``backward()`` and before ``optimizer.step()`` (and before clipping, to log the
    unclipped norm). DTensor gradients (FSDP2, tensor parallel) give the norm of the whole
    gradient, the same on every rank: each rank must call it (it runs collectives). Plain tensors
    count as this process holds them (DDP's gradients are the same on every rank). FSDP1's flat
    shards are plain tensors too: with it, log the norm its ``clip_grad_norm_`` returns instead. A
    non-finite norm is reported as is (it signals a bad step).
    """
    return {"train/grad_norm": float(total_grad_norm(parameters, norm_type).item())}
