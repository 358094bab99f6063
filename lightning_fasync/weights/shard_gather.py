"""Full, Hugging Face-named tensors out of a sharded policy, one at a time.

FSDP2 (``fully_shard``) and tensor parallelism leave every parameter a DTensor: each rank holds a
shard and no rank holds the model. :func:`full_tensor_stream` turns such a module into a
:class:`~lightning_fasync.weights.tensor_stream.TensorStream`: its specs are the state dict's names,
global shapes and dtypes (known without communication), and taking a tensor runs
``DTensor.full_tensor()``, a collective of the tensor's mesh. Every rank builds the same stream and
consumes it in the same order: global rank 0 through the weight sync (or the Hugging Face writer),
the others with ``drain()``. Main thread only.
"""

from __future__ import annotations

from typing import Any, Union

import torch

from lightning_fasync.weights.tensor_stream import TensorSpec, TensorStream

__all__ = ["engine_weights", "full_tensor_stream", "is_sharded"]


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without distributed
        return None
    return DTensor


def is_sharded(module: torch.nn.Module) -> bool:
    """True when any parameter of ``module`` is a DTensor (FSDP2 or tensor parallel)."""
    dtensor = _dtensor_type()
    return dtensor is not None and any(isinstance(p, dtensor) for p in module.parameters())


def full_tensor_stream(module: torch.nn.Module) -> TensorStream:
    """The state dict of ``module`` as full tensors, gathered one at a time (module docstring).

    A tensor listed twice under two names (tied embeddings) appears once, under its first name,
    as the weight sync sends it and ``save_pretrained`` writes it.
    """
    dtensor = _dtensor_type()
    entries: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, value in module.state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        entries.append((name, value))
    specs = [TensorSpec(name, tuple(value.shape), value.dtype) for name, value in entries]

    def produce(i: int) -> torch.Tensor:
        value = entries[i][1]
        if dtensor is not None and isinstance(value, dtensor):
            return value.detach().full_tensor()
        return value.detach()

    return TensorStream(specs, produce)


def engine_weights(model: torch.nn.Module) -> Union[dict[str, torch.Tensor], TensorStream]:
    """What the engines get of ``model`` (a Hugging Face model): its state dict, detached, or, when
    it is sharded, :func:`full_tensor_stream` of it (every rank calls this and consumes the stream)."""
    if is_sharded(model):
        return full_tensor_stream(model)
    return {k: v.detach() for k, v in model.state_dict().items()}
