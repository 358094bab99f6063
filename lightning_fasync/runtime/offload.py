"""Move a trainer's model and optimizer state off its accelerator and back (``colocate_offload``).

In colocate mode the engines and the trainer take turns on the same devices (docs/colocate.md):
while the engines generate, the trainer's parameters, gradients, buffers and optimizer state wait
in CPU memory; before training they come back (verl's parameter and optimizer offload around a
colocated rollout), for any ``nn.Module`` and ``torch.optim`` optimizer:

- parameters move in place (``Module.to`` assigns ``param.data``), so optimizers, DDP and hooks
  keep referring to the same ``Parameter`` objects;
- an optimizer's state tensors move only when they sit on the trainer's device (Adam's ``step``
  counter stays where the optimizer keeps it), and come back to exactly where they were;
- after the move off, CUDA's caching allocator returns the freed blocks to the device, where the
  engine processes can allocate them.

On a CPU trainer nothing moves: its device is the memory the engines share anyway.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

__all__ = ["offload_training_state", "onload_training_state"]

_RECORD = "_fasync_offloaded"  # in the module's __dict__: (device, [(state dict, key), ...]) while off


def _optimizer(opt: Any) -> Any:
    """The torch optimizer behind a Lightning/Fabric wrapper."""
    return getattr(opt, "optimizer", opt)


def _device(module: torch.nn.Module) -> Optional[torch.device]:
    for tensor in module.parameters():
        return tensor.device
    return None


def offload_training_state(module: torch.nn.Module, optimizers: Iterable[Any]) -> None:
    """Move ``module`` and the state of ``optimizers`` to CPU memory when they live on an
    accelerator; a no-op on CPU, or when they are off already. Undone by
    :func:`onload_training_state`."""
    device = _device(module)
    if device is None or device.type == "cpu" or _RECORD in module.__dict__:
        return
    moved: list[tuple[dict, str]] = []
    with torch.no_grad():
        module.to("cpu")
        for opt in optimizers:
            for state in _optimizer(opt).state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.device == device:
                        state[key] = value.to("cpu")
                        moved.append((state, key))
    module.__dict__[_RECORD] = (device, moved)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the blocks back to the device, for the engines


def onload_training_state(module: torch.nn.Module, optimizers: Iterable[Any]) -> None:
    """Bring back what :func:`offload_training_state` moved, to the device it came from; a no-op
    when nothing was moved. (``optimizers`` is accepted for symmetry: the moved state is recorded.)"""
    record = module.__dict__.pop(_RECORD, None)
    if record is None:
        return
    device, moved = record
    with torch.no_grad():
        module.to(device)
        for state, key in moved:
            state[key] = state[key].to(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the stage's time is the copy's, not its launch's
