"""Hugging Face <-> megatron-core ``GPTModel`` weights and configs for Llama, Qwen2, Qwen3 and
Qwen3-MoE, at tensor-parallel size 1 and one pipeline stage (full tensors; the strategy gathers
shards before export and slices after import).

One small module per family declares what it adds to a Llama; ``_common`` holds the shared
mapping. Nothing here imports megatron-core::

    mcore_sd = hf_to_megatron(hf_sd, hf_config)            # load into GPTModel
    hf_sd = megatron_to_hf(mcore_sd, hf_config)            # exact inverse
    for name, tensor in iter_megatron_to_hf(get, hf_config): ...   # streaming, for weight sync
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

from lightning_fasync.config import ConfigError
from lightning_fasync.trainers.megatron.convert import llama, qwen2, qwen3, qwen3_moe
from lightning_fasync.trainers.megatron.convert import _common as common
from lightning_fasync.trainers.megatron.convert._common import LAYOUTS, Tensor, rope_parameters

__all__ = [
    "FAMILIES", "LAYOUTS", "family_of", "gpt_model_kwargs", "hf_to_megatron", "iter_hf_to_megatron",
    "iter_megatron_to_hf", "megatron_to_hf", "rope_parameters", "transformer_config_kwargs",
]

FAMILIES: dict[str, ModuleType] = {m.FAMILY.model_type: m for m in (llama, qwen2, qwen3, qwen3_moe)}


def family_of(cfg: Any) -> ModuleType:
    """The family module for a HF config, after refusing what the conversion cannot reproduce."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in FAMILIES:
        raise ConfigError(
            f"The model's `model_type` is {model_type!r}; the Megatron trainer supports "
            f"{', '.join(FAMILIES)}."
        )
    mod = FAMILIES[model_type]
    common.check_common(cfg, mod.FAMILY)
    if hasattr(mod, "check_config"):
        mod.check_config(cfg)
    return mod


def transformer_config_kwargs(cfg: Any, **overrides: Any) -> dict:
    """Keyword arguments of megatron-core's ``TransformerConfig`` for the HF config; ``overrides``
    (parallel sizes, dtypes, fusions, ``moe_token_dispatcher_type``...) win."""
    mod = family_of(cfg)
    kwargs = common.transformer_config_kwargs(cfg, mod.FAMILY)
    if hasattr(mod, "moe_config_kwargs"):
        kwargs.update(mod.moe_config_kwargs(cfg))
    kwargs.update(overrides)
    return kwargs


def gpt_model_kwargs(cfg: Any) -> dict:
    """Keyword arguments of megatron-core's ``GPTModel`` (vocabulary, RoPE, tied embeddings)."""
    family_of(cfg)
    return common.gpt_model_kwargs(cfg)


def _mlp(mod: ModuleType, to: str) -> Callable:
    if to == "mcore":
        return getattr(mod, "mlp_to_mcore", common.dense_mlp_to_mcore)
    return getattr(mod, "mlp_to_hf", common.dense_mlp_to_hf)


def iter_hf_to_megatron(get: Callable[[str], Tensor], cfg: Any, layout: str = "local") -> Iterator[tuple[str, Tensor]]:
    """Megatron (name, tensor) pairs in layer order from ``get(hf_name)``."""
    mod = family_of(cfg)
    return common.iter_to_mcore(get, cfg, mod.FAMILY, layout, _mlp(mod, "mcore"))


def iter_megatron_to_hf(get: Callable[[str], Tensor], cfg: Any, layout: str = "local") -> Iterator[tuple[str, Tensor]]:
    """HF checkpoint (name, tensor) pairs in layer order from ``get(megatron_name)``: the export
    path asks for one Megatron tensor at a time, so a sharded model can gather it on demand."""
    mod = family_of(cfg)
    return common.iter_to_hf(get, cfg, mod.FAMILY, layout, _mlp(mod, "hf"))


def hf_to_megatron(state_dict: Mapping[str, Tensor], cfg: Any, layout: str = "local") -> dict[str, Tensor]:
    """A whole HF checkpoint state dict -> a ``GPTModel`` state dict (no ``_extra_state``). Every
    HF tensor must be used; a tied model's ``lm_head.weight`` is dropped. transformers 5's fused
    expert tensors are accepted too."""
    mod = family_of(cfg)
    if mod.FAMILY.moe:
        state_dict = qwen3_moe.unfuse_experts(dict(state_dict))
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    return common.convert_all(
        lambda get: iter_hf_to_megatron(get, cfg, layout), state_dict, "Hugging Face",
        ignore=lambda k: tied and k == "lm_head.weight",
    )


def megatron_to_hf(state_dict: Mapping[str, Tensor], cfg: Any, layout: str = "local") -> dict[str, Tensor]:
    """A whole ``GPTModel`` state dict -> the HF checkpoint state dict; every Megatron tensor must
    be used (``_extra_state`` entries carry no weights)."""
    return common.convert_all(
        lambda get: iter_megatron_to_hf(get, cfg, layout), state_dict, "Megatron",
        ignore=lambda k: k.endswith("._extra_state"),
    )
