"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention; every layer's MLP a softmax-routed
mixture of ``num_experts`` SwiGLU experts, top-``num_experts_per_tok``, no shared expert.

Routing: HF takes the softmax over all experts, keeps the top k and (``norm_topk_prob``)
renormalises them, which equals megatron's softmax over the top-k logits
(``moe_router_pre_softmax=False``); without renormalisation it is ``moe_router_pre_softmax=True``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from lightning_fasync.config import ConfigError
from lightning_fasync.trainers.megatron.convert._common import (
    Dims,
    Family,
    Getter,
    Tensor,
    pack_gate_up,
    unpack_gate_up,
)

FAMILY = Family("qwen3_moe", qk_norm=True, moe=True)


def check_config(cfg: Any) -> None:
    if list(getattr(cfg, "mlp_only_layers", None) or []) or getattr(cfg, "decoder_sparse_step", 1) != 1:
        raise ConfigError(
            f"The model's `mlp_only_layers` is {list(cfg.mlp_only_layers or [])} and "
            f"`decoder_sparse_step` is {cfg.decoder_sparse_step}; the Megatron converter needs every "
            "layer to be a MoE layer (mlp_only_layers: [], decoder_sparse_step: 1)."
        )


def moe_config_kwargs(cfg: Any) -> dict:
    """megatron-core ``TransformerConfig`` MoE keyword arguments for the HF config."""
    return dict(
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_pre_softmax=not getattr(cfg, "norm_topk_prob", True),
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
    )


def _expert_names(m: str, e: int, layout: str) -> tuple[str, str]:
    if layout == "te":  # TEGroupedMLP: one GroupedLinear per projection, weight<e> per expert
        return m + f"mlp.experts.linear_fc1.weight{e}", m + f"mlp.experts.linear_fc2.weight{e}"
    prefix = m + f"mlp.experts.local_experts.{e}."  # SequentialMLP
    return prefix + "linear_fc1.weight", prefix + "linear_fc2.weight"


def mlp_to_mcore(hf: Getter, h: str, m: str, d: Dims, layout: str) -> Iterator[tuple[str, Tensor]]:
    yield m + "mlp.router.weight", hf(h + "mlp.gate.weight")
    for e in range(d.num_experts):
        fc1, fc2 = _expert_names(m, e, layout)
        x = h + f"mlp.experts.{e}."
        yield fc1, pack_gate_up(hf(x + "gate_proj.weight"), hf(x + "up_proj.weight"))
        yield fc2, hf(x + "down_proj.weight")


def mlp_to_hf(mc: Getter, h: str, m: str, d: Dims, layout: str) -> Iterator[tuple[str, Tensor]]:
    yield h + "mlp.gate.weight", mc(m + "mlp.router.weight")
    for e in range(d.num_experts):
        fc1, fc2 = _expert_names(m, e, layout)
        gate, up = unpack_gate_up(mc(fc1))
        x = h + f"mlp.experts.{e}."
        yield x + "gate_proj.weight", gate
        yield x + "up_proj.weight", up
        yield x + "down_proj.weight", mc(fc2)


def unfuse_experts(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers 5 keeps a live Qwen3-MoE model's experts fused (``mlp.experts.gate_up_proj``
    [E, 2F, H] = per expert [gate; up], ``mlp.experts.down_proj`` [E, H, F]); its checkpoints and
    SGLang use per-expert tensors. Returns the checkpoint naming (views, no copies)."""
    out: dict[str, Tensor] = {}
    for name, t in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e, w in enumerate(t.unbind(0)):
                out[base + f"{e}.gate_proj.weight"], out[base + f"{e}.up_proj.weight"] = w.chunk(2, dim=0)
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e, w in enumerate(t.unbind(0)):
                out[base + f"{e}.down_proj.weight"] = w
        else:
            out[name] = t
    return out
