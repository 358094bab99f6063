"""RLPolicyModule: a causal-LM policy trained with GRPO/PPO and the off-policy corrections.

One ``training_step`` is one training call of the spec's step protocol: M // N complete groups
(filled into the :class:`~lightning_fasync.lightning.batch.RolloutBatch` by the callback) →
padded tensors → old log-probs under the step-start snapshot → loss → metrics. The metrics of
each call reach the driver through :meth:`~FullyAsyncHooks.rollout_metrics`; it aggregates them at
the step boundary and logs them once per rollout step, so nothing here calls ``self.log``.
"""

from __future__ import annotations

import copy
import resource
import time
from dataclasses import asdict
from typing import Any, Callable, Mapping, Optional, Union

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_fasync.algorithms import (
    OldActorSnapshot,
    clip_grad_norm,
    compute_advantages,
    policy_loss,
    grad_norm_metric,
    mask_offpolicy_tokens,
    masked_mean,
    prox_log_probs_loglinear,
    version_lag_metrics,
)
from lightning_fasync.config import (MIXED_PRECISION, REFERENCE_DTYPES, AlgorithmConfig, ConfigError, FasyncConfig, LoRAConfig,
                                     ReferenceConfig)
from lightning_fasync.lightning.batch import (PACKED_ATTENTION, PolicyBatch, RolloutBatch, collate_groups, forward_log_probs,
                                             plan_forwards, rollout_dataloader)
from lightning_fasync.lightning.hooks import FullyAsyncHooks
from lightning_fasync.lora import LORA_FINGERPRINT_KEY
from lightning_fasync.weights.tensor_stream import TensorStream
from lightning_fasync.registry import TRAINERS
from lightning_fasync.types import TrajectoryGroup


def token_log_probs(model: torch.nn.Module, batch: PolicyBatch, with_entropy: bool = False, entropy_grad: bool = False,
                    temperature: float = 1.0):
    """Log-probs of each next token (``[B, L-1]``), and optionally the per-token entropy.

    ``temperature`` is the rollout's sampling temperature: the logits are divided by it, so the
    log-probs are of the distribution the engine sampled from (as SGLang reports them, and as verl's
    and slime's actors compute them).

    The entropy keeps its graph only with ``entropy_grad`` (an entropy bonus in the loss); for the
    ``train/entropy`` metric alone it is computed without one, which saves a ``[B, L, vocab]``
    activation.

    With ``batch.forwards`` planned (packed sequences, token-budget micro-batches) the forwards are
    the plan's, one micro-batch after another, and their scores land in the same ``[B, L-1]``
    layout; positions past a sequence's end are 0 there (the padded forward scores padding, which
    every mask leaves out).
    """
    plan = batch.forwards
    if plan is not None:
        B = batch.input_ids.shape[0]
        log_probs = batch.rollout_log_probs.new_zeros((B, plan.width))
        entropy = log_probs.clone() if with_entropy else None
        for mb in plan.micro_batches:
            lp, ent, _ = forward_log_probs(model, mb, plan.width, with_entropy, entropy_grad, temperature)
            log_probs = log_probs.index_put((mb.rows,), lp)
            if entropy is not None:
                entropy = entropy.index_put((mb.rows,), ent)
        return log_probs, entropy
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs_all = torch.log_softmax(logits, dim=-1)
    target = batch.input_ids[:, 1:].unsqueeze(-1)
    log_probs = log_probs_all.gather(-1, target).squeeze(-1)
    if not with_entropy:
        return log_probs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(log_probs_all.exp() * log_probs_all).sum(-1)
    return log_probs, entropy


def memory_metrics(device: torch.device) -> dict[str, float]:
    """``perf/train_memory_{allocated,reserved}_max`` in GiB: CUDA's peak counters on GPU; on CPU
    the process's peak resident set size (both keys), the closest CPU notion."""
    if device.type == "cuda":
        return {
            "perf/train_memory_allocated_max": torch.cuda.max_memory_allocated(device) / 2**30,
            "perf/train_memory_reserved_max": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # KiB on Linux
    return {"perf/train_memory_allocated_max": rss, "perf/train_memory_reserved_max": rss}


REFERENCE_POLICY = "policy"
"""``algorithm.reference.model: policy``: the reference is a frozen copy of the policy's initial weights."""


def build_reference(spec: ReferenceConfig, policy: torch.nn.Module, tokenizer: Any) -> torch.nn.Module:
    """The frozen reference (or teacher) model of ``algorithm.reference``: in eval mode (no
    dropout), without gradients, in ``spec.dtype`` (default: the policy's).

    ``policy`` is copied as it is now (at construction: its initial weights) for
    ``spec.model == "policy"``; any other value is built with :func:`~lightning_fasync.policy.build_policy`
    and must come with the policy's vocabulary (same tokenizer size and token ids). A LoRA policy
    (``model.lora``) at construction is its base model (B is zero): its reference of ``policy`` is
    the policy itself run with the adapter disabled (peft's ``disable_adapter()``), no copy, unless
    ``spec.dtype`` asks for another dtype (then a merged copy of the base in that dtype).

    Raises:
        ConfigError: an unknown dtype, a model that cannot be built, or another vocabulary.
    """
    from lightning_fasync.policy import build_policy

    if spec.dtype is not None and spec.dtype not in REFERENCE_DTYPES:
        raise ConfigError(
            f"`algorithm.reference.dtype` is {spec.dtype!r}; it must be null or one of {', '.join(REFERENCE_DTYPES)}."
        )
    dtype = getattr(torch, spec.dtype) if spec.dtype is not None else next(policy.parameters()).dtype
    from lightning_fasync.lora import is_lora

    if spec.model == REFERENCE_POLICY and is_lora(policy):
        if dtype == next(policy.parameters()).dtype:
            return BaseOfAdapted(policy)
        reference = copy.deepcopy(policy).merge_and_unload().to(dtype)
    elif spec.model == REFERENCE_POLICY:
        reference = copy.deepcopy(policy).to(dtype)
    else:
        try:
            reference, ref_tokenizer = build_policy(spec.model, dtype=dtype)
        except ValueError as exc:
            raise ConfigError(f"`algorithm.reference.model` is {spec.model!r}: {exc}") from None
        if len(ref_tokenizer) != len(tokenizer) or ref_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(
                f"`algorithm.reference.model` is {spec.model!r}, whose tokenizer ({len(ref_tokenizer)} tokens) is not the "
                f"policy's ({len(tokenizer)} tokens); the reference must score the same token ids, so use a model with "
                "the policy's vocabulary."
            )
    reference.requires_grad_(False)
    return reference.eval()


class BaseOfAdapted(torch.nn.Module):
    """The base model under a peft-wrapped policy, as a frozen module: its forward runs the policy with
    the adapter disabled (``disable_adapter()``) and in eval mode (the policy's training mode is put
    back after). It shares the policy's tensors: none is registered here, so it adds nothing to any
    ``state_dict()``, and ``train()``, ``requires_grad_()`` and device moves of it leave the policy
    alone (the policy moves with its own module). ``parameters()``, ``config`` and
    ``get_input_embeddings()`` are the policy's, for code that asks a model where it runs and what
    its vocabulary is (the packed-attention probe)."""

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["policy"] = policy

    @property
    def config(self) -> Any:
        return self.__dict__["policy"].config

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.__dict__["policy"].get_input_embeddings()

    def parameters(self, recurse: bool = True) -> Any:
        return self.__dict__["policy"].parameters(recurse)

    def requires_grad_(self, requires_grad: bool = True) -> "BaseOfAdapted":
        return self  # the base is frozen already; the policy's adapters must go on training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        policy = self.__dict__["policy"]
        training = policy.training
        policy.eval()
        try:
            with policy.disable_adapter():
                return policy(*args, **kwargs)
        finally:
            policy.train(training)


LR_SCHEDULES = ("constant", "cosine", "linear")


def lr_factor(schedule: str, warmup_steps: int, min_lr_ratio: float, total_steps: int):
    """``step -> lr multiplier``: linear warm-up over ``warmup_steps``, then ``constant``, or
    ``cosine`` / ``linear`` decay to ``min_lr_ratio`` at ``total_steps``."""
    import math

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor


class RLPolicyModule(FullyAsyncHooks, pl.LightningModule):
    """A Hugging Face causal LM trained on fully-async rollouts.

    Arguments:
        model: a local Hugging Face directory (config + safetensors + tokenizer) or a preset name
            (``tiny``: the embedded default, built from a config, no download).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        betas: AdamW betas.
        snapshot_offload: keep the old-actor snapshot in CPU memory (see ``OldActorSnapshot``).
        lr_schedule: ``constant``, or ``cosine`` / ``linear`` decay from ``lr`` to
            ``lr * min_lr_ratio`` over the run's training calls (Lightning's ``max_steps``), after
            ``warmup_steps`` calls of linear warm-up.
        warmup_steps: training calls of linear warm-up (0: none).
        min_lr_ratio: the decayed schedules' final learning rate, as a share of ``lr``.
        activation_checkpointing: under ``ModelParallelStrategy``, recompute each decoder layer in
            backward instead of keeping its activations (Hugging Face's gradient checkpointing).
        mixed_precision: under ``ModelParallelStrategy``, ``bf16`` or ``fp16``: the sharded policy
            computes in that dtype and reduces gradients in float32 (parameters and optimizer stay
            float32); None: float32 throughout. Other strategies: use Lightning's ``precision``.
        algorithm: ``algorithm.*``: advantages, policy loss, off-policy corrections, and the
            reference model of the KL term (default: the spec's defaults). ``lightning-fasync fit``
            links the top-level keys here.
        use_rollout_log_probs: ``trainer.use_rollout_log_probs``.
        mask_offpolicy_in_partial_rollout: ``rollout.mask_offpolicy_in_partial_rollout``.
        rollout_temperature: ``rollout.temperature``: the policy's log-probs are taken at the
            temperature the engines sampled at, as the engines report them.
        pack_sequences: ``trainer.pack_sequences``: the forwards take the call's sequences packed
            without padding (docs/packing.md); None: packed where the policy's attention keeps packed
            sequences apart (:data:`~lightning_fasync.lightning.batch.PACKED_ATTENTION`).
        max_tokens_per_micro_batch: ``trainer.max_tokens_per_micro_batch``: the call's forwards
            and backwards run in micro-batches of at most this many tokens, one optimizer update and
            the whole call's loss normalisation (None: one forward).
        lora: ``model.lora``: train peft LoRA adapters on the frozen policy instead of every weight
            (:class:`~lightning_fasync.config.LoRAConfig`, or a dict of its fields; None: full
            fine-tuning). Then only the adapters are in the optimizer, the old-actor snapshot and
            ``state_dict()`` (so in checkpoints, beside a fingerprint of the base, which a load
            rebuilds from ``model`` and checks); ``engine_state_dict()`` is the merged model or the
            adapter, by ``lora.sync`` (docs/lora.md).

    :meth:`algorithm_args` gives ``algorithm`` to ``max_tokens_per_micro_batch`` from a plugin
    config; the drivers refuse a config that disagrees with them (:meth:`check_fasync_config`).

    With ``algorithm.reference.model`` set the module holds a frozen reference (:attr:`reference`,
    see :func:`build_reference`) that scores each training call's tokens at the rollout
    temperature (``timing/teacher``, ``train/ref_kl``; ``algorithm.kl_coef`` weighs the KL term).
    It is deliberately not a registered submodule: it is not in ``parameters()`` (so not in the
    optimizer), not in ``state_dict()`` (so not in checkpoints, whose keys are the same with or
    without a reference), not in ``engine_state_dict()``, and ``train()`` never reaches it; it
    follows the module's device and dtype moves (:meth:`_apply`). It is rebuilt at construction,
    so on resume ``policy`` is again the initial weights, not the checkpoint's.
    """

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
        algorithm: Optional[AlgorithmConfig] = None,
        use_rollout_log_probs: bool = False,
        mask_offpolicy_in_partial_rollout: bool = False,
        rollout_temperature: float = 1.0,
        pack_sequences: Optional[bool] = None,
        max_tokens_per_micro_batch: Optional[int] = None,
        lora: Optional[LoRAConfig] = None,
    ) -> None:
        super().__init__()
        from lightning_fasync.lora import as_lora_config

        if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 1:
            raise ConfigError(
                f"`trainer.max_tokens_per_micro_batch` is {max_tokens_per_micro_batch}; it must be >= 1 tokens "
                "(null: the whole training call in one forward)."
            )
        if lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"`model.lr_schedule` is {lr_schedule!r}; it must be one of {', '.join(LR_SCHEDULES)}.")
        if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ConfigError(
                f"`model.warmup_steps` is {warmup_steps} and `model.min_lr_ratio` {min_lr_ratio}; "
                "they must be >= 0 and in [0, 1]."
            )
        if mixed_precision is not None and mixed_precision not in MIXED_PRECISION:
            raise ConfigError(
                f"`model.mixed_precision` is {mixed_precision!r}; it must be null or one of {', '.join(MIXED_PRECISION)}."
            )
        self.save_hyperparameters(ignore=["algorithm", "lora"])
        self.lora = as_lora_config(lora)
        # A plain dict in the hyperparameters (checkpoints load with weights_only=True): what export rebuilds.
        self.hparams["lora"] = asdict(self.lora) if self.lora is not None else None
        self.algorithm = algorithm if algorithm is not None else AlgorithmConfig()
        self.use_rollout_log_probs = use_rollout_log_probs
        self.mask_offpolicy_in_partial_rollout = mask_offpolicy_in_partial_rollout
        if not rollout_temperature > 0:
            raise ConfigError(f"`rollout.temperature` is {rollout_temperature}; training needs a sampled rollout (> 0).")
        self.rollout_temperature = rollout_temperature
        ref = self.algorithm.reference
        if self.algorithm.kl_coef != 0 and not ref.model:
            raise ConfigError(
                f"`algorithm.kl_coef` is {self.algorithm.kl_coef} while `algorithm.reference.model` is not set; "
                "the KL penalty needs a reference model (e.g. `policy`, a frozen copy of the initial policy)."
            )
        self.model_name_or_path = model
        self.policy, self.tokenizer = self._build_policy(model)
        # The base as built, before any precision plugin or device move casts it: a resumed run and
        # export rebuild it the same way, whatever the trained run's precision did to it after.
        self._lora_fingerprint: Optional[torch.Tensor] = None
        if self.lora is not None:
            from lightning_fasync.lora import base_fingerprint

            self._lora_fingerprint = torch.frombuffer(bytearray.fromhex(base_fingerprint(self.policy)), dtype=torch.uint8)
        # Kept out of nn.Module's registry (see the class docstring): __dict__, not setattr. Built
        # from the policy as built, i.e. its initial weights.
        self.__dict__["_reference"] = build_reference(ref, self.policy, self.tokenizer) if ref.model else None
        self.policy.train()
        self.snapshot = OldActorSnapshot(self.policy, offload_to_cpu=snapshot_offload)
        self._metrics: dict[str, float] = {}
        self.pack_sequences = pack_sequences
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self._packing = self._packed_layout(pack_sequences)
        self._accumulated = False  # this call's first micro-batches are in the gradients (optimizer_zero_grad)

    packs_sequences: bool = True
    """Whether ``trainer.pack_sequences: null`` packs this module's forwards (where the policy's
    attention allows it); a subclass whose forwards cannot take packed rows sets False."""

    def _packed_layout(self, pack_sequences: Optional[bool]) -> Optional[str]:
        """The packed layout of the policy's attention (``rows`` or ``flat``), or None: not packed."""
        if pack_sequences is False or (pack_sequences is None and not self.packs_sequences):
            return None
        attn = getattr(getattr(self.policy, "config", None), "_attn_implementation", None)
        layout = PACKED_ATTENTION.get(attn) if isinstance(attn, str) else None
        if layout is None and pack_sequences:
            raise ConfigError(
                f"`trainer.pack_sequences` is true, but the policy's attention implementation is {attn!r}, in which "
                f"transformers is not known to keep packed sequences apart (known: {', '.join(PACKED_ATTENTION)}); "
                "load the policy with one of those, or set `trainer.pack_sequences` to null or false."
            )
        return layout

    def _build_policy(self, model: str) -> tuple[torch.nn.Module, Any]:
        """The policy and its tokenizer for ``model`` (a preset or a local HF directory), wrapped
        with peft's LoRA adapters when ``model.lora`` is set (:func:`~lightning_fasync.lora.apply_lora`)."""
        from lightning_fasync.lora import apply_lora
        from lightning_fasync.policy import build_policy

        policy, tokenizer = build_policy(model)
        if self.lora is not None:
            policy = apply_lora(policy, self.lora)
        return policy, tokenizer

    @property
    def reference(self) -> Optional[torch.nn.Module]:
        """The frozen reference / teacher model, or None without ``algorithm.reference.model``."""
        return self.__dict__.get("_reference")

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        # .to(device) / .cuda() / .half() of the module also move the unregistered reference.
        super()._apply(fn, recurse)
        if self.reference is not None:
            self.reference._apply(fn)
        return self

    def reference_log_probs(self, data: PolicyBatch) -> tuple[torch.Tensor, float]:
        """The reference's token log-probs at the rollout temperature, without a graph, and the
        seconds they took (CUDA synchronized on GPU, so the time is the reference's own)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        with torch.no_grad():
            ref_log_probs, _ = token_log_probs(self.reference, data, temperature=self.rollout_temperature)
        if cuda:
            torch.cuda.synchronize(self.device)
        return ref_log_probs, time.perf_counter() - start

    @staticmethod
    def algorithm_args(cfg: FasyncConfig) -> dict[str, Any]:
        """The constructor arguments that come from the plugin config."""
        return {
            "algorithm": cfg.algorithm,
            "use_rollout_log_probs": cfg.trainer.use_rollout_log_probs,
            "mask_offpolicy_in_partial_rollout": cfg.rollout.mask_offpolicy_in_partial_rollout,
            "rollout_temperature": cfg.rollout.temperature,
            "pack_sequences": cfg.trainer.pack_sequences,
            "max_tokens_per_micro_batch": cfg.trainer.max_tokens_per_micro_batch,
        }

    # ------------------------------------------------------------------ FullyAsyncHooks

    @property
    def engine_model(self) -> str:  # type: ignore[override]
        """What the rollout engines load at start: the same preset or directory."""
        return self.model_name_or_path

    @override
    def engine_state_dict(self) -> Union[dict[str, torch.Tensor], TensorStream]:
        """The weights pushed to the engines at each step boundary (Hugging Face names): the
        policy's only, never the reference's. A sharded policy (``configure_model`` under
        ``ModelParallelStrategy``) gives a :class:`TensorStream` that gathers one tensor at a time;
        every rank calls this and consumes it (see :mod:`~lightning_fasync.weights.shard_gather`).

        With ``model.lora``: ``sync: merged`` gives the merged model (base + B·A·scale, new tensors;
        the trained ones are not touched) under the plain Hugging Face names, so every weight-sync
        path sends it unchanged; ``sync: adapter`` gives the adapter alone, an
        :class:`~lightning_fasync.lora.AdapterWeights` for ``rollout.weight_sync: adapter``."""
        if self.lora is not None:
            from lightning_fasync.lora import AdapterWeights, adapter_config, adapter_state_dict, base_weights, merged_state_dict

            if self.lora.sync == "merged":
                return merged_state_dict(self.policy)
            return AdapterWeights(adapter_state_dict(self.policy), adapter_config(self.policy, self.model_name_or_path),
                                  base=base_weights(self.policy))
        from lightning_fasync.weights.shard_gather import engine_weights

        return engine_weights(self.policy)

    @override
    def begin_rollout_step(self, step: int) -> None:
        """A new outer step starts: the old-actor snapshot of the previous one is stale."""
        self.snapshot.begin_step(step)

    @override
    def prepare_rollout_batch(self, groups: list[TrajectoryGroup]) -> PolicyBatch:
        """Groups → padded tensors on this module's device, with the call's forwards planned
        (packed, and cut by ``max_tokens_per_micro_batch``) when either is on."""
        data = collate_groups(groups, self.tokenizer.pad_token_id)
        data = PolicyBatch(**{k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in vars(data).items()})
        return self.plan_forwards(data)

    def plan_forwards(self, data: PolicyBatch, micro_batches: int = 1) -> PolicyBatch:
        """``data`` with its forwards planned (:func:`~lightning_fasync.lightning.batch.plan_forwards`),
        in at least ``micro_batches`` micro-batches; unchanged when the module neither packs nor
        cuts the call into micro-batches."""
        if self._packing is None and self.max_tokens_per_micro_batch is None:
            return data
        data.forwards = plan_forwards(data, self.tokenizer.pad_token_id, pack=self._packing is not None,
                                      max_tokens=self.max_tokens_per_micro_batch, layout=self._packing or "rows",
                                      micro_batches=micro_batches)
        return data

    @override
    def rollout_metrics(self) -> dict[str, float]:
        return self._metrics

    @override
    def check_fasync_config(self, cfg: FasyncConfig) -> None:
        for key, value in self.algorithm_args(cfg).items():
            mine = getattr(self, key)
            if mine != value:
                name = {"algorithm": "algorithm", "use_rollout_log_probs": "trainer.use_rollout_log_probs",
                        "rollout_temperature": "rollout.temperature", "pack_sequences": "trainer.pack_sequences",
                        "max_tokens_per_micro_batch": "trainer.max_tokens_per_micro_batch",
                        }.get(key, "rollout.mask_offpolicy_in_partial_rollout")
                raise ConfigError(
                    f"`{name}` in the plugin config is {value!r}, but RLPolicyModule was built with {mine!r}; build it "
                    "with RLPolicyModule(..., **RLPolicyModule.algorithm_args(cfg)) so the loss uses the config's settings."
                )
        self._check_lora_sync(cfg)

    def _check_lora_sync(self, cfg: FasyncConfig) -> None:
        """``model.lora.sync: adapter`` and ``rollout.weight_sync: adapter`` go together (the path sends
        what ``engine_state_dict()`` gives: the adapter, or full Hugging Face weights)."""
        from lightning_fasync.weights.sync import resolve_weight_sync

        path = resolve_weight_sync(cfg)
        lora = getattr(self, "lora", None)
        adapter = lora is not None and lora.sync == "adapter"
        if adapter and path != "adapter":
            raise ConfigError(
                f"`model.lora.sync` is adapter while `rollout.weight_sync` is {cfg.rollout.weight_sync} ({path}); the "
                "adapter goes to the engines only over `rollout.weight_sync: adapter` (or set model.lora.sync: merged)."
            )
        if path == "adapter" and not adapter:
            raise ConfigError(
                "`rollout.weight_sync` is adapter while "
                + ("`model.lora` is not set" if lora is None else "`model.lora.sync` is merged")
                + "; it sends a LoRA adapter, so set model.lora with sync: adapter (or pick another weight-sync path)."
            )

    # ------------------------------------------------------------------ Lightning

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse, in one sentence, a checkpoint of a policy with another shape (before Lightning loads it),
        or one of a LoRA run into a full fine-tuning module and the other way round."""
        if "state_dict" not in checkpoint:
            return  # a distributed checkpoint: its reader loaded the weights, checking names and shapes
        saved = checkpoint["state_dict"] or {}
        theirs_lora = LORA_FINGERPRINT_KEY in saved
        if theirs_lora != (self.lora is not None):
            raise ConfigError(
                f"`model.lora` is {'set' if self.lora is not None else 'null'}, but the checkpoint was trained "
                f"{'with LoRA adapters' if theirs_lora else 'without them (full fine-tuning)'}; resume with the "
                "model.lora it was trained with."
            )
        mine = {k: v for k, v in self.state_dict().items() if k.startswith("policy.")}
        theirs = {k: v for k, v in saved.items() if k.startswith("policy.")}
        diff = sorted(set(mine) ^ set(theirs)) or sorted(k for k in mine if tuple(mine[k].shape) != tuple(theirs[k].shape))
        if diff:
            key = "model.lora" if self.lora is not None else "model.model"
            raise ConfigError(
                f"`{key}` is {self.hparams[key.split('.')[1]]!r}, whose policy differs in shape from the checkpoint's "
                f"(first difference: {diff[0]!r}); resume with the {key} the checkpoint was trained with."
            )

    # ------------------------------------------------------------------ LoRA: adapter-only state

    def _lora_base_fingerprint(self) -> torch.Tensor:
        """:func:`~lightning_fasync.lora.base_fingerprint` of the base as built (``uint8`` bytes)."""
        assert self._lora_fingerprint is not None
        return self._lora_fingerprint.clone()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """``nn.Module.state_dict``; with ``model.lora`` only the trainable adapter tensors of the policy,
        plus :data:`LORA_FINGERPRINT_KEY`: the frozen base is rebuilt from ``model.model`` on load
        (:meth:`load_state_dict`), so a checkpoint holds only what training changed."""
        state = super().state_dict(*args, **kwargs)
        if getattr(self, "lora", None) is None:
            return state
        prefix = kwargs.get("prefix", "")
        trainable = {f"{prefix}policy.{n}" for n, p in self.policy.named_parameters() if p.requires_grad}
        for key in [k for k in state if k.startswith(prefix + "policy.") and k not in trainable]:
            del state[key]
        state[prefix + LORA_FINGERPRINT_KEY] = self._lora_base_fingerprint()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``; with ``model.lora``, an adapter-only state (:meth:`state_dict`)
        is completed with this module's own base tensors, after checking that its base fingerprint is
        this base's (a base rebuilt from another model or seed would not reproduce the run)."""
        if getattr(self, "lora", None) is None or LORA_FINGERPRINT_KEY not in state_dict:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        state = dict(state_dict)
        saved = state.pop(LORA_FINGERPRINT_KEY)
        if not torch.equal(torch.as_tensor(saved).to("cpu", torch.uint8), self._lora_base_fingerprint()):
            raise ConfigError(
                f"`model.model` is {self.model_name_or_path!r}, whose weights are not the base the checkpoint's LoRA "
                "adapter was trained on (their fingerprints differ); resume with the model it was trained from."
            )
        for key, value in super().state_dict(keep_vars=True).items():
            if key.startswith("policy.") and key not in state:
                state[key] = value
        return super().load_state_dict(state, strict=strict, assign=assign)

    @override
    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (which sets the device mesh before this hook), shard the
        policy: tensor parallel over the mesh's ``tensor_parallel`` dim, FSDP2 over its
        ``data_parallel`` dim (:func:`~lightning_fasync.trainers.fsdp.sharding.shard_policy`). Without a
        mesh nothing changes. Lightning may call the hook again: the policy is sharded once."""
        if self._device_mesh is None:
            return
        if self.lora is not None:
            raise ConfigError("`model.lora` is set under ModelParallelStrategy (FSDP2, tensor parallel), which does not "
                              "shard a peft-wrapped policy yet; train LoRA on one device or with DDP.")
        TRAINERS.get("fsdp2").shard(self, self._device_mesh)
        # The snapshot reads the parameters when it is taken, so it sees the shards; buffers sized
        # for the unsharded parameters (none unless one was taken already) are dropped.
        self.snapshot.release()

    @override
    def train_dataloader(self):
        return rollout_dataloader()

    def _optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the policy's trainable parameters: every one, or with ``model.lora`` the adapters'."""
        hp = self.hparams
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=hp.lr, weight_decay=hp.weight_decay, betas=hp.betas)

    @override
    def configure_optimizers(self):
        hp = self.hparams
        optimizer = self._optimizer()
        if hp.lr_schedule == "constant" and hp.warmup_steps == 0:
            return optimizer
        total = self.trainer.max_steps if self._trainer is not None else -1
        if hp.lr_schedule != "constant" and (total is None or total <= 0):
            raise ConfigError(
                f"`model.lr_schedule` is {hp.lr_schedule!r}, which decays over the run: set `trainer.rollout_steps` "
                "(or Lightning's max_steps)."
            )
        factor = lr_factor(hp.lr_schedule, hp.warmup_steps, hp.min_lr_ratio, total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        """One training call: old and reference log-probs, the policy's forward, the loss.

        With several micro-batches (``max_tokens_per_micro_batch``) all but the last are
        backpropagated here (:meth:`_micro_batched_objective`), and the last one's loss is returned
        for the driver's backward, clipping and optimizer step: one update, as without them."""
        algo = self.algorithm
        self._accumulated = False  # not left over from a call that raised before its update
        data, mask, advantages, nan_mask = self.call_inputs(batch)
        data = self._agree_on_micro_batches(data)
        method = algo.prox_logp_method
        # The step's first training call trains the step-start weights themselves: its own forward
        # gives the old log-probs, so the snapshot is only taken (for the later calls), not run.
        first_call = batch.call_index == 0 and not self.snapshot.has_snapshot
        old_log_probs: Optional[torch.Tensor] = None
        if self.use_rollout_log_probs:
            old_log_probs = data.rollout_log_probs
        elif method != "loglinear":
            if first_call:
                self.snapshot.take()
            else:
                with torch.no_grad(), self.snapshot.use_old_weights():
                    old_log_probs, _ = token_log_probs(self.policy, data, temperature=self.rollout_temperature)
        ref_log_probs, teacher_s = None, None
        if self.reference is not None:
            # Also with kl_coef 0 (validate warns): then only reported as train/ref_kl.
            ref_log_probs, teacher_s = self.reference_log_probs(data)
        if data.forwards is not None and len(data.forwards.micro_batches) > 1:
            loss, metrics = self._micro_batched_objective(batch, batch_idx, data, mask, advantages, nan_mask,
                                                          old_log_probs, ref_log_probs)
        else:
            log_probs, entropy = token_log_probs(self.policy, data, with_entropy=True,
                                                 entropy_grad=algo.entropy_coef != 0.0, temperature=self.rollout_temperature)
            loss, metrics = self.policy_objective(batch, data, mask, advantages, nan_mask, log_probs, entropy,
                                                  old_log_probs, ref_log_probs)
        if teacher_s is not None:
            metrics["timing/teacher"] = teacher_s  # seconds of this call; the step sums timing/*
        if self._trainer is not None and self.trainer.optimizers:
            metrics["train/lr"] = self.trainer.optimizers[0].param_groups[0]["lr"]
        metrics.update(memory_metrics(self.device))
        self._metrics = metrics
        return loss

    def _agree_on_micro_batches(self, data: PolicyBatch) -> PolicyBatch:
        """With several data-parallel ranks and a token budget, every rank runs as many
        micro-batches as the one that needs the most (one small all-reduce per call): a sharded
        policy's forwards and backwards are collectives. A rank with fewer splits its own
        (:func:`~lightning_fasync.runtime.packing.split_to`)."""
        if data.forwards is None or self.max_tokens_per_micro_batch is None:
            return data
        driver = self._fabric if self._fabric is not None else self._trainer
        if driver is None or driver.world_size <= 1:
            return data
        import torch.distributed as dist

        from lightning_fasync.runtime.ranks import data_parallel

        _, size, group = data_parallel(driver.strategy)
        if size <= 1:
            return data
        mine = len(data.forwards.micro_batches)
        most = torch.tensor([mine], dtype=torch.int64, device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=group)
        return self.plan_forwards(data, int(most.item())) if int(most.item()) > mine else data

    def _micro_batched_objective(self, batch: RolloutBatch, batch_idx: int, data: PolicyBatch, mask: torch.Tensor,
                                 advantages: torch.Tensor, nan_mask: torch.Tensor, old_log_probs: Optional[torch.Tensor],
                                 ref_log_probs: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The call's objective over several micro-batch forwards, with the whole call's gradient.

        Each micro-batch's loss is :meth:`policy_objective` over the whole call, its own rows
        carrying the graph and every other row entering detached (the scores of the rows done so
        far, else a placeholder): the objective is a sum over tokens whose batch-level quantities
        are fixed before the forwards, so the micro-batches' gradients sum to the whole call's.

        * The denominators (``algorithm.loss_agg_mode``'s token or sequence count, over the
          data-parallel ranks) come from the inputs before any forward. A row whose own
          log-probs turn out non-finite is dropped as in one forward; the last micro-batch then
          counts again, and the gradients already accumulated are rescaled to that count.
        * M2PO's mask is a statistic of every row's old log-probs: when they are the live
          policy's (the step's first call, or ``prox_logp_method: loglinear``), a forward without
          gradient over every micro-batch first gives them all.
        * The metrics are the last micro-batch's objective's, which sees every row's real scores:
          those of the whole call.

        All but the last micro-batch are backpropagated here, through the driver (Fabric's
        ``backward``, the Lightning strategy's, so precision plugins scale them); the last one's
        loss is returned. Under DDP these backwards run inside the wrapped forward, before DDP
        prepares its reduction, so they accumulate locally and the driver's backward of the
        returned loss reduces the sum once; FSDP2 reduce-scatters each micro-batch's gradients
        into the sharded ones. Lightning's ``zero_grad``, which comes after ``training_step``, is
        skipped for this call (:meth:`optimizer_zero_grad`); the gradients are zeroed here first.
        """
        algo = self.algorithm
        plan = data.forwards
        assert plan is not None
        temperature, entropy_grad = self.rollout_temperature, algo.entropy_coef != 0.0
        live_old = old_log_probs is None
        if live_old and algo.m2po.enable:
            with torch.no_grad():
                filler, _ = token_log_probs(self.policy, data, temperature=temperature)
        else:
            filler = (old_log_probs if old_log_probs is not None else torch.zeros_like(data.rollout_log_probs)).detach()
        done_lp, done_ent = filler.clone(), torch.zeros_like(filler)

        denominators: list[torch.Tensor] = []
        plain = self._loss_normalizer() or (lambda count: count.clamp(min=1))

        def recording(count: torch.Tensor) -> torch.Tensor:
            out = plain(count)
            denominators.append(out.detach())
            return out

        with torch.no_grad():
            self.policy_objective(batch, data, mask, advantages, nan_mask, done_lp, done_ent, old_log_probs,
                                  ref_log_probs, with_metrics=False, normalizer=recording)
        fixed = denominators[0] if denominators else None
        denominators.clear()

        if self._trainer is not None and self._fabric is None and self.automatic_optimization:
            # What Lightning's closure does before its backward (one call is one update: the callback
            # refuses accumulate_grad_batches).
            for optimizer in self.trainer.optimizers:
                optimizer.zero_grad()
            self._accumulated = True
        last = len(plan.micro_batches) - 1
        for k, mb in enumerate(plan.micro_batches):
            lp, ent, anchor = forward_log_probs(self.policy, mb, plan.width, True, entropy_grad, temperature)
            full_lp, full_ent = done_lp.index_put((mb.rows,), lp), done_ent.index_put((mb.rows,), ent)
            if k < last:
                loss, _ = self.policy_objective(batch, data, mask, advantages, nan_mask, full_lp, full_ent, old_log_probs,
                                                ref_log_probs, with_metrics=False,
                                                normalizer=lambda count: fixed.to(count.device))
                self._backward_micro_batch(loss + anchor)
                done_lp[mb.rows], done_ent[mb.rows] = lp.detach(), ent.detach()
                continue
            loss, metrics = self.policy_objective(batch, data, mask, advantages, nan_mask, full_lp, full_ent,
                                                  old_log_probs, ref_log_probs, normalizer=recording)
            if fixed is not None and denominators and not torch.equal(denominators[0], fixed):
                # Rows dropped for non-finite log-probs: what the earlier micro-batches divided by was too large.
                scale = (fixed / denominators[0]).item()
                for p in self.policy.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
            return loss + anchor, metrics
        raise AssertionError("a forward plan has at least one micro-batch")

    def _backward_micro_batch(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's loss through the driver: Fabric's ``backward``, the
        Lightning strategy's (its precision plugin scales the loss, hooks fire as for each
        accumulated batch), or plain autograd without one."""
        if self._fabric is not None:
            self._fabric.backward(loss)
        elif self._trainer is not None:
            optimizers = self.trainer.optimizers
            self.trainer.strategy.backward(loss, optimizers[0] if optimizers else None)
        else:
            loss.backward()

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Lightning's ``zero_grad`` comes after ``training_step``: skipped for a call whose first
        micro-batches are already in the gradients (``training_step`` zeroed them before)."""
        if self._accumulated:
            self._accumulated = False
            return
        optimizer.zero_grad()

    def call_inputs(self, batch: RolloutBatch) -> tuple[PolicyBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One training call's tensors: the batch, the trained-token mask (without the tokens of
        older weights under ``rollout.mask_offpolicy_in_partial_rollout``), the per-sequence
        advantages and the mask of sequences whose reward is NaN."""
        if batch.groups is None:
            raise RuntimeError("training_step got an unfilled RolloutBatch: add FullyAsyncCallback to the Trainer.")
        data = batch.data if batch.data is not None else self.prepare_rollout_batch(batch.groups)
        mask = data.response_mask
        if self.mask_offpolicy_in_partial_rollout:
            mask = mask_offpolicy_tokens(mask, data.weight_versions).to(mask.dtype)
        advantages, nan_mask = compute_advantages(data.rewards, self.algorithm)
        return data, mask, advantages.reshape(-1).to(self.device), nan_mask.reshape(-1).to(self.device)

    def policy_objective(self, batch: RolloutBatch, data: PolicyBatch, mask: torch.Tensor, advantages: torch.Tensor,
                         nan_mask: torch.Tensor, log_probs: torch.Tensor, entropy: Optional[torch.Tensor],
                         old_log_probs: Optional[torch.Tensor], ref_log_probs: Optional[torch.Tensor],
                         with_metrics: bool = True, normalizer: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                         ) -> tuple[torch.Tensor, dict[str, float]]:
        """The training call's loss and ``train/*`` metrics from the policy's token log-probs (and
        entropy) over the call's whole batch: the proximal log-probs of ``algorithm.prox_logp_method``
        when ``old_log_probs`` is None, the policy loss with its corrections, and the lag metrics.

        Every batch-level quantity (the aggregation's denominators, M2PO's mask) comes from inputs
        fixed before the forward, so rows whose ``log_probs`` carry no graph only weigh on their own
        tokens: a pipeline schedule passes one micro-batch's rows with a graph and the others
        detached, and the micro-batches' gradients sum to the whole batch's (so does
        :meth:`_micro_batched_objective`). The exceptions, which those callers handle: M2PO's mask
        when the old log-probs are the live policy's, and a row dropped for non-finite log-probs,
        which leaves the denominators. ``normalizer`` replaces the aggregation's denominator
        (default: :meth:`_loss_normalizer`'s)."""
        algo = self.algorithm
        method = algo.prox_logp_method
        approx: Optional[torch.Tensor] = None
        if method != "recompute" and not self.use_rollout_log_probs:
            if batch.rollout_step < 0:
                raise RuntimeError(f"`algorithm.prox_logp_method: {method}` needs the batch's rollout step (a RolloutBatch "
                                   "filled by FullyAsyncCallback or FullyAsyncFabricLoop).")
            approx = prox_log_probs_loglinear(data.rollout_log_probs, log_probs, data.weight_versions, mask,
                                              batch.rollout_step, batch.call_index, batch.calls_per_step)
        if old_log_probs is None:
            old_log_probs = approx if method == "loglinear" else log_probs.detach()
        loss, metrics = policy_loss(
            log_probs,
            old_log_probs,
            data.rollout_log_probs,
            advantages,
            mask,
            algo,
            entropy=entropy,
            ref_log_probs=ref_log_probs,
            nan_mask=nan_mask,
            normalizer=normalizer if normalizer is not None else self._loss_normalizer(),
        )
        if not with_metrics:
            return loss, {}
        if method == "metrics" and approx is not None:
            metrics["train/prox_approx_abs_err"] = masked_mean((approx - old_log_probs).abs(), mask).item()
        if batch.rollout_step >= 0:
            # How old the trained tokens are, and how the corrections behave at each lag.
            metrics.update(
                version_lag_metrics(
                    data.weight_versions, mask, batch.rollout_step, old_log_probs=old_log_probs,
                    rollout_log_probs=data.rollout_log_probs, log_probs=log_probs.detach(), advantages=advantages,
                    is_c=algo.is_correction.c, clip_low=algo.clip_low, clip_high=algo.clip_high,
                )
            )
        return loss, metrics

    def _loss_normalizer(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """With several data-parallel ranks (DDP, FSDP2), the loss's denominator is the whole
        mini-batch's count, so the averaged gradient is the single-process one; None otherwise."""
        driver = self._fabric if self._fabric is not None else self._trainer  # Fabric, or Lightning's Trainer
        if driver is None or driver.world_size <= 1:
            return None
        from lightning_fasync.algorithms.losses import data_parallel_normalizer
        from lightning_fasync.runtime.ranks import data_parallel

        _, size, group = data_parallel(driver.strategy)
        return data_parallel_normalizer(size, group) if size > 1 else None

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Before Lightning's gradient clipping: the unclipped norm.
        self._metrics.update(grad_norm_metric(self.policy.parameters()))

    @override
    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: Optional[float] = None,
                                    gradient_clip_algorithm: Optional[str] = None) -> None:
        """Lightning's clipping, except by norm over a sharded policy's DTensor gradients: with tensor
        parallel they live on two meshes (FSDP2's data-parallel one and the 2-D one), which torch's
        ``clip_grad_norm_`` cannot mix; :func:`~lightning_fasync.algorithms.clip_grad_norm` can."""
        sharded = any(hasattr(p.grad, "device_mesh") for p in self.policy.parameters())
        if gradient_clip_val and (gradient_clip_algorithm or "norm") == "norm" and sharded:
            clip_grad_norm(self.policy.parameters(), gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
