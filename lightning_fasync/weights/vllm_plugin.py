"""The ``fasync-gloo`` weight-transfer engine, loaded into vLLM's own processes (docs/backends.md, "vLLM").

vLLM's built-in transfer engines (``nccl``, ``ipc``) need CUDA; this one moves the trainer's weights
over a gloo group, so the four calls of vLLM's RL API (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) run on CPU exactly as a GPU
run makes them. The trainer's side is :mod:`lightning_fasync.weights.vllm_sync`.

vLLM finds it through its ``vllm.general_plugins`` entry point (this project's ``pyproject.toml``):
:func:`register` runs in every vLLM process, and a server started with
``--weight-transfer-config '{"backend": "fasync-gloo"}'`` creates :class:`GlooWeightTransferEngine`
in each worker. Install the project into the server's environment without its dependencies
(``pip install --no-deps lightning-fasync``): this module imports only torch, vLLM and
:mod:`lightning_fasync.weights.wire` (torch and the standard library).

The protocol, per worker (TP rank ``r`` of the engine whose ranks start at ``rank_offset``):

- ``init_info``: ``master_address``, ``master_port`` (the trainer's rendezvous store),
  ``rank_offset``, ``world_size``, ``group_name``, ``timeout_s``. The worker joins the group at rank
  ``rank_offset + r`` (the trainer is rank 0), as SGLang's ``init_custom_process_group`` does.
- ``update_info`` (one bucket): ``names``, ``dtype_names``, ``shapes`` and ``sha256`` of the
  bucket's bytes. The worker receives one ``uint8`` broadcast of the bucket laid out as
  :func:`~lightning_fasync.weights.wire.layout` says, checks its digest, and loads the tensors
  through the model's own ``load_weights`` (Hugging Face names in, vLLM's fused parameters out),
  inside vLLM's layerwise reload, as its NCCL engine does.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Optional

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo,
)

from lightning_fasync.weights import wire

BACKEND = "fasync-gloo"
"""The name servers give in ``--weight-transfer-config``."""


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Where the trainer's group is and this engine's place in it."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset is {self.rank_offset}; it must be in [1, world_size {self.world_size}).")


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: its tensors in order and the digest of its bytes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    sha256: str

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"names, dtype_names and shapes differ in length "
                             f"({len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}).")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM's ``WeightTransferEngine`` over a gloo broadcast (module docstring)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self.group is not None:
            self.shutdown()
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = wire.init_custom_process_group(
            "gloo", f"tcp://{init_info.master_address}:{init_info.master_port}", init_info.world_size,
            init_info.rank_offset + worker_rank, init_info.group_name,
            timeout=datetime.timedelta(seconds=init_info.timeout_s),
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator afterwards; a gloo receive has completed when it returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("The fasync-gloo weight transfer is not initialized; call /init_weight_transfer_engine first.")
        metadata = wire.layout(update_info.names, [wire.parse_dtype(d) for d in update_info.dtype_names],
                               update_info.shapes)
        flat = torch.empty(wire.bucket_bytes(metadata), dtype=torch.uint8)
        torch.distributed.broadcast(flat, src=0, group=self.group)
        digest = wire.bucket_sha256(flat)
        if digest != update_info.sha256:
            raise RuntimeError(f"The bucket of {len(update_info.names)} tensors ({update_info.names[0]}, ...) arrived "
                               f"with sha256 {digest}, not the trainer's {update_info.sha256}.")
        tensors = [(name, t.to(self.device)) for name, t in wire.unflatten(flat, metadata)]
        self.model.load_weights(weights=tensors)

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            wire.destroy_process_group(group)


def register() -> Optional[str]:
    """The ``vllm.general_plugins`` entry point: make ``fasync-gloo`` a transfer backend (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    return BACKEND
