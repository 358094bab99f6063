"""megatron-core's parallel layout, checked before any process group exists.

megatron-core checks the same rules, but one at a time, deep inside
``parallel_state.initialize_model_parallel``, ``TransformerConfig.__post_init__`` and
``MoELayer``, after every rank has started; here a wrong layout is refused up front with one
sentence naming the key, the values and the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from lightning_fasync.config import ConfigError

KEY_PREFIX = "trainer.strategy.init_args."
"""Where the sizes live in a LightningCLI config (``MegatronStrategy``'s arguments)."""


@dataclass(frozen=True)
class ParallelSizes:
    """megatron-core's parallel sizes (``initialize_model_parallel``'s arguments). The
    data-parallel size is what is left: world size / (TP x PP x CP)."""

    tensor_model_parallel_size: int = 1
    """TP: each layer's matrices split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: the layers split into this many consecutive stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved schedule: model chunks per pipeline rank (needs PP > 1); None for none."""
    context_parallel_size: int = 1
    """CP: each sequence split over this many ranks."""
    expert_model_parallel_size: int = 1
    """EP: the experts of each MoE layer split over this many ranks."""
    expert_tensor_parallel_size: int | None = None
    """Expert TP: each expert's matrices split over this many ranks; None means TP."""

    @property
    def model_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


def _key(name: str) -> str:
    return f"`{KEY_PREFIX}{name}`"


def validate_parallel(
    sizes: ParallelSizes,
    world_size: int,
    *,
    num_layers: int | None = None,
    num_attention_heads: int | None = None,
    num_query_groups: int | None = None,
    num_experts: int | None = None,
) -> int:
    """Check ``sizes`` against the world size and the model; returns the data-parallel size.
    The model's sizes left None are not checked (the strategy checks the world size before the
    module has read its config); ``num_experts`` 0 is a dense model.

    Raises:
        ConfigError: naming the first rule broken.
    """
    for f in fields(sizes):
        v = getattr(sizes, f.name)
        if v is None and f.name in ("virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size"):
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{_key(f.name)} is {v!r}; it must be a positive integer.")
    tp, pp, cp = sizes.tensor_model_parallel_size, sizes.pipeline_model_parallel_size, sizes.context_parallel_size
    ep = sizes.expert_model_parallel_size
    etp = sizes.expert_tensor_parallel_size or tp
    vpp = sizes.virtual_pipeline_model_parallel_size

    if world_size % sizes.model_size:
        raise ConfigError(
            f"{_key('tensor_model_parallel_size')} x pipeline_model_parallel_size x context_parallel_size "
            f"is {tp} x {pp} x {cp} = {sizes.model_size}, which does not divide the world size {world_size}; "
            "TP x PP x CP x DP must equal the world size."
        )
    dp = world_size // sizes.model_size
    if world_size % (etp * ep * pp):
        raise ConfigError(
            f"{_key('expert_model_parallel_size')} x expert_tensor_parallel_size x pipeline_model_parallel_size "
            f"is {ep} x {etp} x {pp} = {ep * etp * pp}, which does not divide the world size {world_size}; "
            "each pipeline stage's ranks must hold a whole number of EP x expert-TP groups."
        )
    if vpp is not None:
        if pp < 2:
            raise ConfigError(
                f"{_key('virtual_pipeline_model_parallel_size')} is {vpp} with pipeline_model_parallel_size {pp}; "
                "the interleaved schedule needs pipeline_model_parallel_size > 1."
            )
    if num_layers is not None:
        chunks = pp * (vpp or 1)
        if num_layers % chunks:
            name = "virtual_pipeline_model_parallel_size" if vpp else "pipeline_model_parallel_size"
            raise ConfigError(
                f"{_key(name)} gives {pp} x {vpp or 1} = {chunks} model chunks, which does not divide the "
                f"model's {num_layers} layers; every chunk must get the same number of layers."
            )
    if num_attention_heads is not None and num_attention_heads % tp:
        raise ConfigError(
            f"{_key('tensor_model_parallel_size')} is {tp}, which does not divide the model's "
            f"{num_attention_heads} attention heads; each TP rank must hold whole heads."
        )
    if num_query_groups is not None and num_query_groups % tp and tp % num_query_groups:
        raise ConfigError(
            f"{_key('tensor_model_parallel_size')} is {tp} and the model has {num_query_groups} key/value heads; "
            "one must divide the other (megatron-core's rule for grouped-query attention)."
        )
    if num_experts:
        if num_experts % ep:
            raise ConfigError(
                f"{_key('expert_model_parallel_size')} is {ep}, which does not divide the model's "
                f"{num_experts} experts; each EP rank must hold the same number of experts."
            )
    elif num_experts is not None and ep > 1:  # 0: a dense model; None: the model is not known yet
        raise ConfigError(
            f"{_key('expert_model_parallel_size')} is {ep} but the model has no experts; "
            "expert parallelism needs a mixture-of-experts model."
        )
    return dp


def validate_for_model(sizes: ParallelSizes, world_size: int, hf_config: Any) -> int:
    """:func:`validate_parallel` with the model's sizes read from a Hugging Face config, and what the
    trainer (megatron-core's local layer spec) adds: TP divides the vocabulary (each TP rank holds an
    equal slice of the embeddings and the output layer, unpadded), and a mixture-of-experts model
    trains with TP 1 (megatron-core's MoE layers train under TP only with sequence parallelism,
    whose norms the local spec lacks)."""
    heads = hf_config.num_attention_heads
    num_experts = (getattr(hf_config, "num_experts", None) or 0) if hf_config.model_type.endswith("_moe") else 0
    dp = validate_parallel(
        sizes, world_size,
        num_layers=hf_config.num_hidden_layers,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        num_experts=num_experts,
    )
    tp = sizes.tensor_model_parallel_size
    if hf_config.vocab_size % tp:
        raise ConfigError(
            f"{_key('tensor_model_parallel_size')} is {tp}, which does not divide the model's vocabulary of "
            f"{hf_config.vocab_size}; each TP rank holds an equal slice of the embeddings and the output layer."
        )
    if num_experts and tp > 1:
        raise ConfigError(
            f"{_key('tensor_model_parallel_size')} is {tp} for a mixture-of-experts model; megatron-core trains MoE "
            "layers under TP only with sequence parallelism, which the local layer spec lacks: use TP 1 and split "
            "the experts with expert_model_parallel_size."
        )
    return dp
