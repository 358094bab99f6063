"""megatron-core's ``GPTModel`` built from a Hugging Face config, and HF weights loaded into it
(needs the ``megatron`` extra; the caller has initialised ``megatron.core.parallel_state``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_fasync.trainers.megatron import convert


def layer_spec(cfg: Any, layout: str = "local"):
    """The decoder layer spec for ``layout``: ``local`` (megatron-core modules only; runs on CPU)
    or ``te`` (Transformer Engine; GPU)."""
    from megatron.core.models.gpt import gpt_layer_specs

    mod = convert.family_of(cfg)
    kwargs = dict(num_experts=cfg.num_experts if mod.FAMILY.moe else None, qk_layernorm=mod.FAMILY.qk_norm)
    if layout == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(moe_grouped_gemm=mod.FAMILY.moe, **kwargs)
    convert._common.check_layout(layout)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **kwargs)


def transformer_config(cfg: Any, **config_overrides: Any):
    """megatron-core's ``TransformerConfig`` for the HF config; ``config_overrides`` (parallel sizes,
    ``params_dtype``, ``bf16``, ``use_cpu_initialization``...) win."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**convert.transformer_config_kwargs(cfg, **config_overrides))


def build_gpt_model(cfg: Any, layout: str = "local", *, pre_process: bool = True, post_process: bool = True,
                    vp_stage: int | None = None, config: Any = None, **config_overrides: Any):
    """A ``GPTModel`` equivalent to the HF config. ``config_overrides`` go to ``TransformerConfig``
    (parallel sizes, ``params_dtype``, ``bf16``, ``use_cpu_initialization``...); or pass ``config``
    (:func:`transformer_config`), which virtual-pipeline chunks share, as megatron-core expects (its
    schedule reads hooks such as ``finalize_model_grads_func`` from the first chunk's)."""
    from megatron.core.models.gpt import GPTModel

    if config is None:
        config = transformer_config(cfg, **config_overrides)
    elif config_overrides:
        raise TypeError("build_gpt_model takes a config or config overrides, not both.")
    return GPTModel(config, layer_spec(cfg, layout), pre_process=pre_process, post_process=post_process,
                    vp_stage=vp_stage, **convert.gpt_model_kwargs(cfg))


def load_hf_weights(model: torch.nn.Module, hf_state_dict: Mapping[str, torch.Tensor], cfg: Any,
                    layout: str = "local") -> None:
    """Copy a HF checkpoint state dict into an unsharded ``GPTModel``; refuses a missing or an
    unused tensor (``_extra_state`` entries hold no weights)."""
    sd = convert.hf_to_megatron(hf_state_dict, cfg, layout)
    result = model.load_state_dict(sd, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
    if missing or result.unexpected_keys:
        raise KeyError(f"GPTModel and the converted weights differ: missing {missing[:8]}, "
                       f"unexpected {result.unexpected_keys[:8]}.")
