"""MegatronPolicyModule: the RL policy as megatron-core ``GPTModel`` chunks under :class:`MegatronStrategy`.

The same training call as :class:`~lightning_fasync.lightning.module.RLPolicyModule` (one
``training_step`` per call of the step protocol, the same loss, corrections, snapshot and metrics),
with the model built, trained and exported the megatron-core way:

- ``configure_model``: one ``GPTModel`` per virtual-pipeline stage from the Hugging Face config,
  each rank loading only its shard of the HF weights (:mod:`~lightning_fasync.trainers.megatron.shards`);
- ``training_step``: the call's batch (this data-parallel rank's share) split into micro-batches and
  run through megatron-core's ``get_forward_backward_func`` schedule; the RL loss is computed on the
  last pipeline stage from vocab-parallel log-probs (:func:`vocab_parallel_log_probs`); then
  megatron-core's optimizer steps (gradient clipping, the distributed optimizer);
- ``engine_state_dict``: HF-named full tensors gathered one at a time from the shards (TP gather,
  PP/EP point-to-point), sent by global rank 0.

Lightning's automatic optimisation is off (``training_step`` steps the optimizer itself); clip
gradients with ``grad_clip`` (Lightning's ``gradient_clip_val`` is for automatic optimisation).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from typing_extensions import override

from lightning_fasync.config import AlgorithmConfig, ConfigError
from lightning_fasync.lightning.batch import PolicyBatch, RolloutBatch
from lightning_fasync.lightning.module import RLPolicyModule, memory_metrics
from lightning_fasync.trainers.megatron.optimizer import MegatronOptimizer
from lightning_fasync.weights.tensor_stream import TensorStream

__all__ = ["MegatronOptimizer", "MegatronPolicyModule", "vocab_parallel_log_probs"]

DTYPES = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def vocab_parallel_log_probs(logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0,
                             with_entropy: bool = False, entropy_grad: bool = False,
                             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Token log-probs (and entropy) from logits split over the vocabulary by tensor parallelism.

    ``logits`` is ``[..., V / TP]``, this TP rank's slice of the vocabulary (as megatron-core's
    output layer leaves it), ``target`` the token ids ``[...]``. The softmax's maximum, its sum and
    the target's logit are all-reduced over the TP group, through megatron-core's
    ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), so each TP
    rank's gradient reaches exactly its slice. With TP = 1 this is ``log_softmax`` and a gather.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    vmax = logits.detach().amax(dim=-1, keepdim=True)
    if tp > 1:
        dist.all_reduce(vmax, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - vmax
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(-1), group=group)
    lse = sum_exp.log()
    v_local = logits.shape[-1]
    local = target - parallel_state.get_tensor_model_parallel_rank() * v_local
    inside = (local >= 0) & (local < v_local)
    picked = shifted.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_tensor_model_parallel_region(torch.where(inside, picked, torch.zeros_like(picked)), group=group)
    log_probs = picked - lse
    if not with_entropy:
        return log_probs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        p_dot = reduce_from_tensor_model_parallel_region((exp * shifted).sum(-1), group=group)
        entropy = lse - p_dot / sum_exp
    return log_probs, entropy


def hf_source(model: str) -> tuple[Any, Any, Callable[[str], torch.Tensor]]:
    """``(hf_config, tokenizer, get)`` for a preset or a local HF directory; ``get(name)`` reads one
    HF checkpoint tensor (a directory's safetensors lazily, so a rank reads only what it holds)."""
    import json
    import os

    from lightning_fasync.policy import PRESETS, build_policy, load_tokenizer

    if model in PRESETS:
        hf_model, tokenizer = build_policy(model)
        weights = dict(hf_model.state_dict())
        return hf_model.config, tokenizer, weights.__getitem__
    from safetensors import safe_open
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    index = os.path.join(model, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            where = {k: os.path.join(model, v) for k, v in json.load(f)["weight_map"].items()}
    else:
        single = os.path.join(model, "model.safetensors")
        with safe_open(single, "pt") as f:
            where = {k: single for k in f.keys()}

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise KeyError(f"{model!r} has no tensor {name!r}.")
        with safe_open(where[name], "pt") as f:
            return f.get_tensor(name)

    return config, load_tokenizer(model), get


class MegatronPolicyModule(RLPolicyModule):
    """A Hugging Face causal LM (Llama, Qwen2, Qwen3, Qwen3-MoE) trained as megatron-core
    ``GPTModel`` chunks under :class:`~lightning_fasync.trainers.megatron.strategy.MegatronStrategy`.

    Arguments are :class:`~lightning_fasync.lightning.module.RLPolicyModule`'s, plus:
        micro_batch_size: sequences per micro-batch of the pipeline schedule (None: the whole
            share of the call in one; with PP > 1 use several micro-batches to fill the pipeline).
            It must divide this data-parallel rank's share of the call.
        grad_clip: megatron-core's gradient clipping (global norm; 0 for none).

    ``mixed_precision`` (``bf16``/``fp16``) makes megatron-core compute and keep the model in that
    dtype with float32 main weights in the optimizer; ``activation_checkpointing`` recomputes every
    layer (``recompute_granularity: full``). Weight decay follows megatron-core: not on biases and
    norms. ``algorithm.reference`` (a KL reference or teacher) is not supported yet, nor are
    ``trainer.pack_sequences: true`` and ``trainer.max_tokens_per_micro_batch`` (the schedule runs
    equal padded micro-batches; ``trainer.pack_sequences: null`` trains padded here).
    """

    packs_sequences = False

    def __init__(
        self,
        model: str = "tiny",
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.99),
        snapshot_offload: bool = True,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        activation_checkpointing: bool = False,
        mixed_precision: Optional[str] = None,
        micro_batch_size: Optional[int] = None,
        grad_clip: float = 1.0,
        algorithm: Optional[AlgorithmConfig] = None,
        use_rollout_log_probs: bool = False,
        mask_offpolicy_in_partial_rollout: bool = False,
        rollout_temperature: float = 1.0,
        pack_sequences: Optional[bool] = None,
        max_tokens_per_micro_batch: Optional[int] = None,
    ) -> None:
        if pack_sequences:
            raise ConfigError(
                "`trainer.pack_sequences` is true under MegatronStrategy, whose pipeline schedule takes equal padded "
                "micro-batches; set it to null or false (null trains padded here)."
            )
        if max_tokens_per_micro_batch is not None:
            raise ConfigError(
                f"`trainer.max_tokens_per_micro_batch` is {max_tokens_per_micro_batch} under MegatronStrategy, whose "
                "pipeline schedule cuts a call by sequences; leave it null and set `model.micro_batch_size`."
            )
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ConfigError(f"`model.micro_batch_size` is {micro_batch_size}; it must be >= 1 or null.")
        if grad_clip < 0:
            raise ConfigError(f"`model.grad_clip` is {grad_clip}; it must be >= 0 (0: no clipping).")
        if algorithm is not None and algorithm.reference.model:
            raise ConfigError(
                f"`algorithm.reference.model` is {algorithm.reference.model!r}; MegatronPolicyModule has no "
                "reference model yet: leave it unset (and `algorithm.kl_coef` 0)."
            )
        super().__init__(
            model, lr=lr, weight_decay=weight_decay, betas=betas, snapshot_offload=snapshot_offload,
            lr_schedule=lr_schedule, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
            activation_checkpointing=activation_checkpointing, mixed_precision=mixed_precision, algorithm=algorithm,
            use_rollout_log_probs=use_rollout_log_probs, mask_offpolicy_in_partial_rollout=mask_offpolicy_in_partial_rollout,
            rollout_temperature=rollout_temperature, pack_sequences=pack_sequences,
        )
        self.automatic_optimization = False

    # ------------------------------------------------------------------ building

    def _build_policy(self, model: str) -> tuple[torch.nn.Module, Any]:
        config, tokenizer, get = hf_source(model)
        self.__dict__["hf_config"] = config
        self.__dict__["_hf_get"] = get  # dropped once configure_model has loaded the shards
        return torch.nn.ModuleList(), tokenizer

    def megatron_chunks(self) -> list[torch.nn.Module]:
        return list(self.policy)

    def set_megatron_chunks(self, chunks: list[torch.nn.Module]) -> None:
        # In place: the old-actor snapshot holds this ModuleList.
        for i, chunk in enumerate(chunks):
            self.policy[i] = chunk

    def _strategy(self) -> Any:
        from lightning_fasync.trainers.megatron.strategy import MegatronStrategy

        strategy = self.trainer.strategy if self._trainer is not None else None
        if not isinstance(strategy, MegatronStrategy):
            raise ConfigError(
                f"`trainer.strategy` is {type(strategy).__name__}; MegatronPolicyModule trains under "
                "lightning_fasync.trainers.megatron.MegatronStrategy."
            )
        return strategy

    @property
    def layer_spec(self) -> str:
        return self._strategy().layer_spec

    @override
    def configure_model(self) -> None:
        if len(self.policy):
            return  # built already (Lightning may call the hook again)
        from megatron.core import parallel_state

        from lightning_fasync.trainers.megatron import shards
        from lightning_fasync.trainers.megatron.model import build_gpt_model, transformer_config
        from lightning_fasync.trainers.megatron.parallel import validate_for_model

        strategy = self._strategy()
        cfg = self.hf_config
        validate_for_model(strategy.sizes, strategy.world_size, cfg)
        layout = strategy.layer_spec
        moe = bool(getattr(cfg, "num_experts", None)) and cfg.model_type.endswith("_moe")
        dtype = DTYPES[self.hparams.mixed_precision]
        overrides: dict[str, Any] = dict(
            strategy.model_parallel_kwargs(),
            params_dtype=dtype, pipeline_dtype=dtype,
            bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            use_cpu_initialization=strategy.root_device.type != "cuda",
            # Initialised although every weight is loaded next: megatron-core marks its parameters'
            # tensor-parallel layout (``tensor_model_parallel``, ``partition_dim``) only while it
            # initialises them, and its gradient norm and clipping skip unmarked duplicates.
            perform_initialization=True,
        )
        sizes = strategy.sizes
        if moe and sizes.expert_model_parallel_size * (sizes.expert_tensor_parallel_size or 1) > 1:
            # The experts' group spans data-parallel ranks, whose shares of a call differ in length:
            # the all-to-all dispatcher exchanges token counts, the default all-gather one needs
            # equal shapes.
            overrides["moe_token_dispatcher_type"] = "alltoall"
        if self.hparams.activation_checkpointing:
            overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        vpp = strategy.sizes.virtual_pipeline_model_parallel_size
        config = transformer_config(cfg, **overrides)  # one, shared by the chunks
        chunks = []
        for i in range(vpp or 1):
            vp = i if vpp else None
            chunks.append(build_gpt_model(
                cfg, layout, vp_stage=vp, config=config,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            ).to(strategy.root_device))
        shards.load_hf_weights_sharded(chunks, self.__dict__.pop("_hf_get"), cfg, layout)
        self.policy.extend(chunks)
        self.policy.train()
        self.snapshot.release()

    def _optimizer(self) -> torch.optim.Optimizer:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        hp = self.hparams
        dtype = DTYPES[hp.mixed_precision]
        config = OptimizerConfig(
            optimizer="adam", lr=hp.lr, weight_decay=hp.weight_decay, adam_beta1=hp.betas[0], adam_beta2=hp.betas[1],
            adam_eps=1e-8, clip_grad=hp.grad_clip, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
            params_dtype=dtype, use_distributed_optimizer=self._strategy().use_distributed_optimizer,
        )
        return MegatronOptimizer(get_megatron_optimizer(config, list(self.policy)))

    # ------------------------------------------------------------------ FullyAsyncHooks

    @override
    def engine_state_dict(self) -> TensorStream:
        """HF-named full tensors gathered from the shards one at a time (every rank consumes it)."""
        from lightning_fasync.trainers.megatron import shards

        # The plan (who holds and who sends each tensor) is made once, not at every weight sync.
        cache = self.__dict__.setdefault("_export_plan", {})
        return shards.hf_weight_stream(list(self.policy), self.hf_config, self.layer_spec, cache=cache)

    def policy_shapes(self) -> dict[str, list[int]]:
        """The policy's HF tensor names and global shapes, for the checkpoint's run identity: the
        same in every parallel layout (a resume may change it), and as ``RLPolicyModule``'s."""
        from lightning_fasync.trainers.megatron import shards

        return {f"policy.{name}": shape for name, shape in shards.hf_tensor_shapes(self.hf_config).items()}

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        pass  # the shards were loaded, names and shapes checked, by MegatronStrategy.load_checkpoint

    @override
    def offload_train(self, optimizers: Any) -> None:
        """Colocate with ``colocate_offload``: megatron-core's own offload for RL, not the default's
        (which would move parameters out of megatron-core's buffers): each chunk's parameter and
        gradient buffers go to CPU memory (their storage freed on the device, every view kept), and
        the optimizer's main weights and state too. On CPU nothing moves."""
        if self.device.type != "cuda":
            return
        torch.cuda.synchronize(self.device)
        for chunk in self.policy:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                buffer.offload_to_cpu(move_params=True, move_grads=True)
        for part in _optimizer_parts(optimizers):
            part.offload_to_cpu()
        torch.cuda.empty_cache()

    @override
    def onload_train(self, optimizers: Any) -> None:
        """Undo :meth:`offload_train` (gradients come back zeroed, as each call starts)."""
        if self.device.type != "cuda":
            return
        for chunk in self.policy:
            for buffer in chunk.buffers + chunk.expert_parallel_buffers:
                buffer.reload_from_cpu(move_params=True, move_grads=True)
        for part in _optimizer_parts(optimizers):
            part.restore_from_cpu()
        torch.cuda.synchronize(self.device)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        pass  # megatron-core's step measures the norm (MegatronOptimizer.last_grad_norm)

    # ------------------------------------------------------------------ the training call

    def _micro_batches(self, batch_size: int) -> tuple[int, int]:
        mbs = self.hparams.micro_batch_size or batch_size
        if batch_size % mbs:
            raise ConfigError(
                f"`model.micro_batch_size` is {mbs}, which does not divide this data-parallel rank's {batch_size} "
                "sequences per training call; the pipeline schedule needs equal micro-batches."
            )
        return mbs, batch_size // mbs

    def _schedule(self, data: PolicyBatch, forward_only: bool,
                  loss_fn: Optional[Callable[[int, int, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]] = None,
                  ) -> Optional[tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """One pass of megatron-core's schedule over ``data``'s micro-batches. Returns, on the last
        pipeline stage, the token log-probs ``[B, L-1]`` (and, training, the entropy), detached;
        None on the other stages. Training, ``loss_fn(start, end, log_probs, entropy)`` gives each
        micro-batch's loss (rows ``start:end``)."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        input_ids = data.input_ids
        B, L = input_ids.shape
        mbs, n = self._micro_batches(B)
        device = input_ids.device
        position_ids = torch.arange(L, device=device).unsqueeze(0).expand(mbs, L)
        # Explicit causal mask (True = masked). Right padding: a padded key only follows the valid
        # queries, so causality alone keeps it out of every trained position.
        causal = torch.ones(L, L, dtype=torch.bool, device=device).triu(1)[None, None]
        targets = input_ids[:, 1:]
        temperature, algo = self.rollout_temperature, self.algorithm
        entropy_grad = algo.entropy_coef != 0.0 and not forward_only

        def forward_step(iterator: Any, model: torch.nn.Module):
            start = next(iterator)
            end = start + mbs
            output = model(input_ids[start:end], position_ids, causal)

            def loss_func(logits: torch.Tensor):
                log_probs, entropy = vocab_parallel_log_probs(
                    logits[:, :-1], targets[start:end], temperature, with_entropy=not forward_only,
                    entropy_grad=entropy_grad)
                out = {"log_probs": log_probs.detach()}
                if forward_only:
                    return log_probs.detach().sum() * 0, out
                out["entropy"] = entropy.detach()
                assert loss_fn is not None
                # megatron-core divides each micro-batch's loss by their number; the objective is
                # already the whole call's (see RLPolicyModule.policy_objective).
                return loss_fn(start, end, log_probs, entropy) * n, out

            return output, loss_func

        chunks = list(self.policy)
        iterators = [iter(range(0, B, mbs)) for _ in chunks]
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks,
            num_microbatches=n,
            seq_length=L,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None
        log_probs = torch.cat([o["log_probs"] for o in outputs])
        entropy = None if forward_only else torch.cat([o["entropy"] for o in outputs])
        return log_probs, entropy

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        algo = self.algorithm
        data, mask, advantages, nan_mask = self.call_inputs(batch)
        method = algo.prox_logp_method
        first_call = batch.call_index == 0 and not self.snapshot.has_snapshot
        old_log_probs: Optional[torch.Tensor] = None
        if self.use_rollout_log_probs:
            old_log_probs = data.rollout_log_probs
        elif method != "loglinear":
            if first_call:
                self.snapshot.take()
            if not first_call or algo.m2po.enable:
                # M2PO's mask is a batch statistic of the old log-probs: every row's are needed
                # before the first micro-batch's loss (on the first call they are the live weights').
                with torch.no_grad(), self.snapshot.use_old_weights():
                    old = self._schedule(data, forward_only=True)
                old_log_probs = old[0] if old is not None else None

        # Rows outside a micro-batch enter its objective detached (any finite value: they weigh only on
        # their own tokens, which carry no graph there).
        filler = (old_log_probs if old_log_probs is not None else torch.zeros_like(data.rollout_log_probs)).detach()

        def loss_fn(start: int, end: int, log_probs: torch.Tensor, entropy: Optional[torch.Tensor]) -> torch.Tensor:
            full_lp = torch.cat([filler[:start], log_probs, filler[end:]])
            full_ent = torch.cat([torch.zeros_like(filler[:start]), entropy, torch.zeros_like(filler[end:])])
            loss, _ = self.policy_objective(batch, data, mask, advantages, nan_mask, full_lp, full_ent, old_log_probs,
                                            None, with_metrics=False)
            return loss

        optimizer = self.optimizers()
        for chunk in self.policy:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        result = self._schedule(data, forward_only=False, loss_fn=loss_fn)
        optimizer.step()
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()

        metrics: Optional[dict[str, float]] = None
        if result is not None:  # the last pipeline stage: the call's metrics, as RLPolicyModule's
            with torch.no_grad():
                _, metrics = self.policy_objective(batch, data, mask, advantages, nan_mask, result[0], result[1],
                                                   old_log_probs, None)
        metrics = _from_last_stage(metrics)
        opt = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        if opt.last_grad_norm is not None:
            metrics["train/grad_norm"] = opt.last_grad_norm
        metrics["train/lr"] = opt.param_groups[0]["lr"]
        metrics.update(memory_metrics(self.device))
        self._metrics = metrics


def _optimizer_parts(optimizers: Any) -> list[Any]:
    """megatron-core's optimizers behind Lightning's (a chained one's parts)."""
    parts = []
    for opt in optimizers:
        opt = getattr(opt, "optimizer", opt)  # LightningOptimizer
        if isinstance(opt, MegatronOptimizer):
            parts.extend(getattr(opt.megatron, "chained_optimizers", [opt.megatron]))
    return parts


def _from_last_stage(metrics: Optional[dict[str, float]]) -> dict[str, float]:
    """The last pipeline stage's metrics on every stage of its pipeline (global rank 0, which
    reports them, is on the first)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        assert metrics is not None
        return metrics
    box = [metrics]
    dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
    return dict(box[0])
