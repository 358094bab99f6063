"""Old-actor snapshot: compute behaviour log-probs with the step-start weights (torch only).

Within one outer training step the actor is updated after every mini-batch. The first
mini-batch computes ``old_log_probs`` with the step-start weights; the later ones must compute
them with the *same* weights, not with the already-updated actor. So the first computation
saves a snapshot, and later ones temporarily swap it in, then swap the live weights back.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

__all__ = ["OldActorSnapshot"]


def _local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank actually stores for ``param``, sharing its storage.

    For a DTensor (FSDP2, tensor parallel) that is the local shard; for FSDP1 the module's
    parameters outside forward already are the local flat shards. ``.data`` is used so the
    in-place copies neither bump the autograd version counter nor get recorded.
    """
    data = param.data
    to_local = getattr(data, "to_local", None)
    if callable(to_local):  # torch.distributed.tensor.DTensor
        data = to_local()
    return data


def _reshard_fsdp(module: nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 module in ``module``, registering its shards.

    FSDP2 keeps a module's gathered (unsharded) parameters after forward when it does not reshard
    after forward (``reshard_after_forward=False``; the root by default). Those are then what
    ``parameters()`` yields, and the next forward reuses them without gathering again: the swap
    must act on the shards, and a gathered copy of the swapped-in weights must not outlive the block.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch build without distributed
        return
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


class OldActorSnapshot:
    """Step-start weights of a module, kept on CPU, swapped in parameter by parameter on demand.

    Usage, once per mini-batch of an outer step::

        snap = OldActorSnapshot(actor, offload_to_cpu=True)
        ...
        snap.begin_step(step)                 # new outer step: the old snapshot is stale
        with torch.no_grad(), snap.use_old_weights():
            old_log_probs = compute_log_probs(actor, batch)
        loss = ...; loss.backward(); optimizer.step()

    The first ``use_old_weights()`` of a step copies the current (step-start) weights into the
    snapshot and leaves the module untouched. Every later one in the same step swaps the
    snapshot into the module's parameters in place and, on exit (also on an exception), swaps
    the live weights back bit-exactly.

    What is stored: for every trainable parameter of ``module`` (``requires_grad``) exactly the
    tensor this rank holds (``param.data``; the local shard of a DTensor/FSDP2 parameter; FSDP1's
    flat local shards), so a sharded trainer snapshots ``1/world_size`` of the model per rank. Tied
    parameters are stored once. Frozen parameters and buffers are not snapshotted: no optimizer step
    changes them, so the step-start weights of a LoRA policy (a frozen base under peft adapters) are
    its adapters' A and B alone.

    Memory bound: with ``offload_to_cpu=True`` (default) the snapshot lives in CPU memory
    (pinned when CUDA is available, for fast copies) and takes no device memory. A swap goes
    parameter by parameter: copy the live tensor to a device temporary, copy the snapshot in,
    copy the temporary into the CPU buffer (which then holds the live weights until the swap
    back). The extra device memory at any moment is therefore at most **one parameter tensor**
    (the largest local shard), never a second copy of the model; CPU memory is one copy of the
    local shards. With ``offload_to_cpu=False`` the snapshot stays on the parameters' device
    (one full extra copy of the local shards: only for small models or tests).

    Do not hold an autograd graph across a swap: the weights are changed in place underneath it.
    Not thread-safe; one instance per module.

    Args:
        module: The actor whose parameters are snapshotted.
        offload_to_cpu: Keep the snapshot in CPU memory (default True).
        pin_memory: Pin the CPU buffers; None pins exactly when CUDA is available.
    """

    def __init__(self, module: nn.Module, offload_to_cpu: bool = True, pin_memory: Optional[bool] = None) -> None:
        self.module = module
        self.offload_to_cpu = offload_to_cpu
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: list[torch.Tensor] = []
        self._step: Optional[int] = None
        self._valid = False
        self._swapped = False

    # ---- state -----------------------------------------------------------------------------

    @property
    def step(self) -> Optional[int]:
        """The outer step the snapshot belongs to (None before the first ``begin_step``)."""
        return self._step

    @property
    def has_snapshot(self) -> bool:
        """True once the current step's snapshot was taken."""
        return self._valid

    def begin_step(self, step: int) -> None:
        """Start outer step ``step``: a snapshot of another step is invalidated.

        Idempotent for the same ``step`` (calling it before every mini-batch is fine). Buffers
        are kept and reused, so steady state allocates nothing.
        """
        if self._swapped:
            raise RuntimeError("`begin_step` was called inside `use_old_weights()`; leave the context first.")
        if step != self._step:
            self._step = step
            self._valid = False

    def release(self) -> None:
        """Free the snapshot buffers (the next ``use_old_weights()`` takes a new snapshot)."""
        if self._swapped:
            raise RuntimeError("`release` was called inside `use_old_weights()`; leave the context first.")
        self._buffers = []
        self._valid = False

    # ---- snapshot and swap -------------------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        _reshard_fsdp(self.module)
        return [_local_tensor(p) for p in self.module.parameters() if p.requires_grad]

    def _allocate(self, tensors: list[torch.Tensor]) -> None:
        def fits(buf: torch.Tensor, t: torch.Tensor) -> bool:
            return buf.shape == t.shape and buf.dtype == t.dtype

        if len(self._buffers) == len(tensors) and all(fits(b, t) for b, t in zip(self._buffers, tensors)):
            return
        buffers = []
        for t in tensors:
            if self.offload_to_cpu:
                pin = self.pin_memory and t.device.type != "cpu"
                buffers.append(torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin))
            else:
                buffers.append(torch.empty_like(t, memory_format=torch.contiguous_format))
        self._buffers = buffers

    @torch.no_grad()
    def take(self) -> None:
        """Copy the module's current local weights into the snapshot (for the current step)."""
        if self._swapped:
            raise RuntimeError("`take` was called inside `use_old_weights()`; leave the context first.")
        tensors = self._params()
        self._allocate(tensors)
        for buf, t in zip(self._buffers, tensors):
            buf.copy_(t)
        if any(t.device.type == "cuda" for t in tensors):
            torch.cuda.synchronize()
        self._valid = True

    @staticmethod
    @torch.no_grad()
    def _swap_one(live: torch.Tensor, buf: torch.Tensor) -> None:
        """Exchange the contents of one live tensor and its snapshot buffer."""
        tmp = live.clone()  # the only extra device memory: one parameter tensor
        live.copy_(buf)
        buf.copy_(tmp)
        del tmp

    @contextlib.contextmanager
    def use_old_weights(self) -> Iterator[bool]:
        """Run the block with the step-start weights in the module.

        Yields:
            False when this call took the snapshot (the live weights are the step-start weights
            and nothing was swapped), True when the snapshot was swapped in.

        Raises:
            RuntimeError: when nested, or when the module's parameters changed shape or count
                since the snapshot of this step was taken.
        """
        if self._swapped:
            raise RuntimeError("`use_old_weights()` is already active; it cannot be nested.")
        if not self._valid:
            self.take()
            yield False
            return
        tensors = self._params()
        if len(tensors) != len(self._buffers) or any(
            b.shape != t.shape or b.dtype != t.dtype for b, t in zip(self._buffers, tensors)
        ):
            raise RuntimeError(
                "The module's parameters changed shape or count since the snapshot of this step was taken; "
                "call `begin_step` with a new step or `release()` first."
            )
        done = 0
        self._swapped = True
        try:
            for i, (live, buf) in enumerate(zip(tensors, self._buffers)):
                self._swap_one(live, buf)
                done = i + 1
            yield True
        finally:
            # Swap back exactly what was swapped in, even if the block (or a swap) raised; FSDP2's
            # gathered copies of the old weights are dropped first.
            _reshard_fsdp(self.module)
            for i in range(done):
                self._swap_one(tensors[i], self._buffers[i])
            if any(t.device.type == "cuda" for t in tensors):
                torch.cuda.synchronize()
            self._swapped = False
