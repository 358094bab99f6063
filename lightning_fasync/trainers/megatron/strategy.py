"""MegatronStrategy: megatron-core's parallel state, DDP and distributed optimizer under Lightning.

Launched as Lightning's DDP is (one process per device), it adds what megatron-core needs around the
module (after NeMo's ``MegatronStrategy``, without NeMo; docs/megatron.md):

- ``setup_distributed``: Lightning's process group, then the layout checked
  (:func:`~lightning_fasync.trainers.megatron.parallel.validate_parallel`, one sentence naming the key),
  ``parallel_state.initialize_model_parallel`` (TP, PP, virtual PP, CP, EP, expert TP) and the
  model-parallel RNG seeds;
- ``configure_ddp``: each model chunk of the module (:class:`MegatronChunks`) wrapped in
  megatron-core's ``DistributedDataParallel`` (gradient buffers, reduce-scatter for the distributed
  optimizer), and the schedule's ``finalize_model_grads`` hooked in. No torch DDP wrapper;
- checkpoints through megatron-core's ``dist_checkpointing`` (each rank writes its shards, into
  any layout on resume; :mod:`~lightning_fasync.trainers.megatron.checkpoint`);
- ``teardown``: ``destroy_model_parallel``.

The module (:class:`~lightning_fasync.trainers.megatron.module.MegatronPolicyModule`) builds the chunks in
``configure_model`` and runs each training call through ``get_forward_backward_func``.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Protocol, runtime_checkable

import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_fasync.config import ConfigError
from lightning_fasync.trainers.megatron.optimizer import MegatronOptimizer
from lightning_fasync.trainers.megatron.parallel import ParallelSizes, validate_parallel

__all__ = ["MegatronChunks", "MegatronStrategy"]

@runtime_checkable
class MegatronChunks(Protocol):
    """What :class:`MegatronStrategy` needs of a LightningModule: its megatron-core model chunks
    (one per virtual-pipeline stage), built in ``configure_model``, and a way to replace them by
    their ``DistributedDataParallel`` wrappers."""

    def megatron_chunks(self) -> list[torch.nn.Module]: ...

    def set_megatron_chunks(self, chunks: list[torch.nn.Module]) -> None: ...


class MegatronStrategy(DDPStrategy):
    """Data, tensor, pipeline, context and expert parallelism with megatron-core.

    Arguments:
        tensor_model_parallel_size: TP; each layer's matrices split over this many ranks.
        pipeline_model_parallel_size: PP; the layers split into this many consecutive stages.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (the interleaved
            schedule; needs PP > 1); None for one.
        context_parallel_size: CP; each sequence split over this many ranks. Context parallelism
            needs Transformer Engine's attention, which the model does not use yet (it is built
            from megatron-core's ``local`` layer spec): only 1 is accepted for now.
        expert_model_parallel_size: EP; each MoE layer's experts split over this many ranks.
        expert_tensor_parallel_size: each expert's matrices split over this many ranks; None: TP.
        sequence_parallel: split the activations outside attention and MLP over the TP ranks.
            megatron-core's local layer spec (the one the model is built from) has no sequence-parallel
            norms (they need Transformer Engine or Apex): only false is accepted for now.
        use_distributed_optimizer: shard the optimizer state and the float32 main weights over the
            data-parallel ranks (megatron-core's distributed optimizer, ZeRO-1 style).
        overlap_grad_reduce: overlap the gradients' reduce-scatter with the backward pass.
        checkpoint_optimizer_format: how the distributed optimizer's state is saved:
            ``fully_reshardable`` (a resume may change any parallel size; the save gathers each
            model-parallel shard's state over the data-parallel ranks for a moment) or
            ``dp_reshardable`` (each rank's buckets as they are, no gather; a resume may change
            only the data-parallel size).
        seed: the model-parallel RNG seed (megatron-core's ``model_parallel_cuda_manual_seed``).

    The data-parallel size is what is left: world size / (TP x PP x CP). Everything else (devices,
    nodes, ``process_group_backend``, ``timeout``) is Lightning's ``DDPStrategy``'s.
    """

    strategy_name = "megatron"

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: Optional[int] = None,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: Optional[int] = None,
        sequence_parallel: bool = False,
        use_distributed_optimizer: bool = True,
        overlap_grad_reduce: bool = False,
        checkpoint_optimizer_format: str = "fully_reshardable",
        seed: int = 1234,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.sizes = ParallelSizes(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            context_parallel_size=context_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
        )
        if context_parallel_size != 1:
            raise ConfigError(
                f"`trainer.strategy.init_args.context_parallel_size` is {context_parallel_size}; context parallelism "
                "needs Transformer Engine's attention, and the model is built from megatron-core's local layer spec, "
                "so only 1 is supported for now."
            )
        if sequence_parallel:
            raise ConfigError(
                "`trainer.strategy.init_args.sequence_parallel` is true; megatron-core's local layer spec, which the "
                "model is built from, has no sequence-parallel norms (they need Transformer Engine), so only false "
                "is supported for now."
            )
        from lightning_fasync.trainers.megatron.checkpoint import OPTIMIZER_FORMATS

        if checkpoint_optimizer_format not in OPTIMIZER_FORMATS:
            raise ConfigError(
                f"`trainer.strategy.init_args.checkpoint_optimizer_format` is {checkpoint_optimizer_format!r}; it must "
                f"be one of {', '.join(OPTIMIZER_FORMATS)}."
            )
        self.checkpoint_optimizer_format = checkpoint_optimizer_format
        self.sequence_parallel = sequence_parallel
        self.use_distributed_optimizer = use_distributed_optimizer
        self.overlap_grad_reduce = overlap_grad_reduce
        self.seed = seed
        self._megatron_initialized = False

    # ------------------------------------------------------------------ layout

    layer_spec = "local"
    """The decoder layer spec the module builds with: megatron-core's own modules (no Transformer
    Engine), the layout :mod:`~lightning_fasync.trainers.megatron.shards` loads and exports."""

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel rank and size (megatron-core's; TP/PP/CP peers share a data-parallel rank)."""
        if not self._megatron_initialized:
            return super().distributed_sampler_kwargs
        from megatron.core import parallel_state

        return {"num_replicas": parallel_state.get_data_parallel_world_size(),
                "rank": parallel_state.get_data_parallel_rank()}

    @property
    def data_parallel_group(self) -> Any:
        """The data-parallel process group (metrics and the loss's denominator are reduced over it)."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def model_parallel_kwargs(self) -> dict[str, Any]:
        """``TransformerConfig`` keyword arguments of this layout."""
        s = self.sizes
        return dict(
            tensor_model_parallel_size=s.tensor_model_parallel_size,
            pipeline_model_parallel_size=s.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=s.virtual_pipeline_model_parallel_size,
            context_parallel_size=s.context_parallel_size,
            expert_model_parallel_size=s.expert_model_parallel_size,
            expert_tensor_parallel_size=s.expert_tensor_parallel_size or s.tensor_model_parallel_size,
            sequence_parallel=self.sequence_parallel,
            # The interleaved schedule sends activations and gradients between the same two ranks
            # at once (with PP = 2 a rank's next and previous stage are one rank): batched, the two
            # messages can be matched to each other's receives. Megatron-LM's default for it:
            # overlapped, unbatched p2p, one direction on the pipeline group and one on another.
            **(dict(overlap_p2p_comm=True, batch_p2p_comm=False) if s.virtual_pipeline_model_parallel_size else {}),
        )

    # ------------------------------------------------------------------ Lightning

    @override
    def setup_distributed(self) -> None:
        precision = getattr(self.precision_plugin, "precision", "32-true")
        if precision not in ("32-true", "32"):
            raise ConfigError(
                f"`trainer.precision` is {precision!r}; under MegatronStrategy megatron-core computes in reduced "
                "precision itself: leave trainer.precision at 32-true and set `model.mixed_precision: bf16` (or fp16)."
            )
        validate_parallel(self.sizes, self.num_nodes * self.num_processes)  # before any process group exists
        super().setup_distributed()
        from megatron.core import parallel_state, tensor_parallel

        s = self.sizes
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=s.tensor_model_parallel_size,
            pipeline_model_parallel_size=s.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=s.virtual_pipeline_model_parallel_size,
            context_parallel_size=s.context_parallel_size,
            expert_model_parallel_size=s.expert_model_parallel_size,
            expert_tensor_parallel_size=s.expert_tensor_parallel_size,
        )
        self._megatron_initialized = True
        # The global RNG stays `seed_everything`'s; megatron-core's tracker gets its own streams.
        if self.root_device.type == "cuda":
            # Per-rank streams for dropout and initialisation inside TP regions (and the same
            # stream across TP peers where weights must agree).
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)

    @override
    def configure_ddp(self) -> None:
        module = self.lightning_module
        if not isinstance(module, MegatronChunks):
            raise TypeError(
                f"MegatronStrategy needs a module with megatron-core model chunks (megatron_chunks()); "
                f"{type(module).__name__} has none. Use lightning_fasync.trainers.megatron.MegatronPolicyModule."
            )
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        chunks = module.megatron_chunks()
        if not chunks:
            raise RuntimeError("The module built no megatron-core model chunk in configure_model().")
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=self.overlap_grad_reduce,
            use_distributed_optimizer=self.use_distributed_optimizer,
        )
        wrapped = [
            # Only the first chunk's buckets are bucketed for overlap (megatron-core's rule for the
            # interleaved schedule: later chunks' gradients are ready first).
            DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)
        ]
        config = chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        if self.overlap_grad_reduce:
            config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
            config.grad_sync_func = ([c.start_grad_sync for c in wrapped] if len(wrapped) > 1
                                     else wrapped[0].start_grad_sync)
        module.set_megatron_chunks(wrapped)

    @override
    def teardown(self) -> None:
        super().teardown()
        if self._megatron_initialized:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            self._megatron_initialized = False

    # ------------------------------------------------------------------ checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards load into the wrapped chunks and the built optimizer

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights go through dist_checkpointing (save_checkpoint)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A directory: every rank writes its model and optimizer shards (``dist_checkpointing``),
        global rank 0 the rest of Lightning's checkpoint (``meta.pt``)."""
        from lightning_fasync.trainers.megatron import checkpoint as mcheckpoint

        module = self.lightning_module
        # The tensors are in the shards; Lightning's restore looks for the optimizers' key.
        checkpoint.pop("state_dict", None)
        checkpoint["optimizer_states"] = []
        mcheckpoint.save_checkpoint(os.fspath(filepath), module.megatron_chunks(), _megatron_optimizer(self),
                                    checkpoint, hf_config=getattr(module, "hf_config", None),
                                    optimizer_format=self.checkpoint_optimizer_format)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Model and optimizer shards into this layout (any other layout's checkpoint works), and
        Lightning's state."""
        from lightning_fasync.trainers.megatron import checkpoint as mcheckpoint

        module = self.lightning_module
        return mcheckpoint.load_checkpoint(os.fspath(checkpoint_path), module.megatron_chunks(),
                                           _megatron_optimizer(self))

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded in load_checkpoint


def _megatron_optimizer(strategy: MegatronStrategy) -> Any:
    for opt in strategy.optimizers:
        if isinstance(opt, MegatronOptimizer):
            return opt.megatron
    return None


def register_megatron() -> None:
    """``--trainer.strategy=megatron``: :class:`MegatronStrategy` with its defaults (its sizes as
    ``--trainer.strategy=MegatronStrategy --trainer.strategy.tensor_model_parallel_size=N ...``)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "megatron" not in StrategyRegistry:
        StrategyRegistry.register("megatron", MegatronStrategy,
                                  description="megatron-core TP/PP/CP/EP with FullyAsyncCallback's weight sync")


register_megatron()
