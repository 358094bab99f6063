"""What the four families share: reading a Hugging Face config, megatron-core's fused layouts, and
the dense decoder's tensor mapping at tensor-parallel size 1 and one pipeline stage.

Megatron names are those of megatron-core's ``GPTModel.state_dict()``. Two layer specs name the
norms differently (``megatron.core.models.gpt.gpt_layer_specs``):

- ``local`` (``get_gpt_layer_local_spec``, no Transformer Engine; runs on CPU): separate
  ``input_layernorm`` and ``pre_mlp_layernorm`` modules, experts as ``SequentialMLP``
  (``mlp.experts.local_experts.<e>.linear_fc1``);
- ``te`` (``get_gpt_layer_with_transformer_engine_spec``): the norms fold into the next linear
  (``self_attention.linear_qkv.layer_norm_weight``; dense ``mlp.linear_fc1.layer_norm_weight``,
  while MoE layers keep ``pre_mlp_layernorm``), experts as ``TEGroupedMLP``
  (``mlp.experts.linear_fc1.weight<e>``). The local spec's own ``sharded_state_dict_keys_map``
  names the same folding for checkpoints.

Hugging Face names are those of the safetensors checkpoint (what ``save_pretrained`` writes and
SGLang loads): per-expert ``mlp.experts.<e>.{gate,up,down}_proj.weight`` for MoE.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_fasync.config import ConfigError

LAYOUTS = ("local", "te")

Tensor = torch.Tensor
Getter = Callable[[str], Tensor]


@dataclass(frozen=True)
class Family:
    """One model family: what its Hugging Face config and checkpoint carry beyond a Llama.

    Arguments:
        model_type: the Hugging Face ``config.model_type``.
        qkv_bias: q/k/v projections carry biases (megatron ``add_qkv_bias``).
        qk_norm: per-head RMSNorm on queries and keys before RoPE (megatron ``qk_layernorm``).
        moe: every decoder layer's MLP is a routed mixture of experts.
    """

    model_type: str
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False


@dataclass(frozen=True)
class Dims:
    """The sizes the fused layouts need, read once from the Hugging Face config."""

    num_layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    num_experts: int = 0

    @classmethod
    def of(cls, cfg: Any, family: Family) -> "Dims":
        heads = cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            heads=heads,
            groups=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            num_experts=cfg.num_experts if family.moe else 0,
        )


# -- Hugging Face config --------------------------------------------------------------------------

def rope_parameters(cfg: Any) -> dict:
    """RoPE settings as one dict with ``rope_theta`` and ``rope_type`` (transformers 5 keeps them in
    ``rope_parameters``; 4.x in ``rope_theta`` and ``rope_scaling``)."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def check_common(cfg: Any, family: Family) -> None:
    """Refuse what megatron-core's ``GPTModel`` would compute differently from the HF model."""
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ConfigError(
            f"The model's `hidden_act` is {cfg.hidden_act!r}; the Megatron converter supports 'silu' "
            "(SwiGLU) only."
        )
    if getattr(cfg, "use_sliding_window", False):
        raise ConfigError(
            "The model's `use_sliding_window` is True; the Megatron converter supports full "
            "attention only."
        )
    if getattr(cfg, "mlp_bias", False) or (getattr(cfg, "attention_bias", False) and not family.qkv_bias):
        raise ConfigError(
            f"The {family.model_type} model has `attention_bias`/`mlp_bias` set; megatron-core's "
            "add_bias_linear puts biases on every linear, so only the families' own biases "
            "(Qwen2's q/k/v) are supported."
        )
    rope = rope_parameters(cfg)
    if rope["rope_type"] == "llama3":
        want = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        got = {k: rope.get(k) for k in want}
        if got != want:
            raise ConfigError(
                f"The model's llama3 RoPE scaling has {got}; megatron-core's `rope_scaling` "
                f"hard-codes {want}."
            )
    elif rope["rope_type"] != "default":
        raise ConfigError(
            f"The model's RoPE type is {rope['rope_type']!r}; the Megatron converter supports "
            "'default' and 'llama3'."
        )


def transformer_config_kwargs(cfg: Any, family: Family) -> dict:
    """megatron-core ``TransformerConfig`` keyword arguments equivalent to the HF config (dense
    part; MoE families add theirs)."""
    dims = Dims.of(cfg, family)
    return dict(
        num_layers=dims.num_layers,
        hidden_size=dims.hidden,
        num_attention_heads=dims.heads,
        num_query_groups=dims.groups,
        kv_channels=dims.head_dim,
        ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        init_method_std=getattr(cfg, "initializer_range", 0.02),
    )


def gpt_model_kwargs(cfg: Any) -> dict:
    """megatron-core ``GPTModel`` keyword arguments (vocabulary, RoPE, tying) for the HF config."""
    rope = rope_parameters(cfg)
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope["rope_theta"],
        share_embeddings_and_output_weights=bool(getattr(cfg, "tie_word_embeddings", False)),
    )
    if rope["rope_type"] == "llama3":
        kwargs.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    return kwargs


# -- fused layouts --------------------------------------------------------------------------------

def pack_qkv(q: Tensor, k: Tensor, v: Tensor, d: Dims) -> Tensor:
    """HF q/k/v projections (weights or biases) -> megatron's ``linear_qkv``, interleaved per
    query group as ``[q_1..q_{h/g}, k, v]`` for each of the g groups (``SelfAttention.
    get_query_key_value_tensors`` splits it that way)."""
    tail = q.shape[1:]
    per_group = d.heads // d.groups * d.head_dim
    return torch.cat(
        [q.reshape(d.groups, per_group, *tail), k.reshape(d.groups, d.head_dim, *tail),
         v.reshape(d.groups, d.head_dim, *tail)],
        dim=1,
    ).reshape(-1, *tail)


def unpack_qkv(qkv: Tensor, d: Dims) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`pack_qkv`."""
    tail = qkv.shape[1:]
    per_group = d.heads // d.groups * d.head_dim
    q, k, v = qkv.reshape(d.groups, per_group + 2 * d.head_dim, *tail).split(
        [per_group, d.head_dim, d.head_dim], dim=1
    )
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def pack_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's gate and up projections -> megatron's ``linear_fc1`` (``MLP.glu`` chunks its output
    in two and applies the activation to the first half)."""
    return torch.cat([gate, up], dim=0)


def unpack_gate_up(fc1: Tensor) -> tuple[Tensor, Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


# -- name tables ----------------------------------------------------------------------------------

def norm_names(layout: str, moe: bool) -> tuple[str, str]:
    """Megatron names (within a layer) of the attention's and the MLP's input norms."""
    if layout == "te":
        return ("self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight")
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ConfigError(f"The Megatron layer spec is {layout!r}; it must be one of {', '.join(LAYOUTS)}.")


# -- conversion of a dense decoder (the MoE family swaps the MLP part) ----------------------------

MlpToMcore = Callable[[Getter, str, str, Dims, str], Iterator[tuple[str, Tensor]]]
MlpToHf = Callable[[Getter, str, str, Dims, str], Iterator[tuple[str, Tensor]]]


def dense_mlp_to_mcore(hf: Getter, h: str, m: str, d: Dims, layout: str) -> Iterator[tuple[str, Tensor]]:
    yield m + "mlp.linear_fc1.weight", pack_gate_up(hf(h + "mlp.gate_proj.weight"), hf(h + "mlp.up_proj.weight"))
    yield m + "mlp.linear_fc2.weight", hf(h + "mlp.down_proj.weight")


def dense_mlp_to_hf(mc: Getter, h: str, m: str, d: Dims, layout: str) -> Iterator[tuple[str, Tensor]]:
    gate, up = unpack_gate_up(mc(m + "mlp.linear_fc1.weight"))
    yield h + "mlp.gate_proj.weight", gate
    yield h + "mlp.up_proj.weight", up
    yield h + "mlp.down_proj.weight", mc(m + "mlp.linear_fc2.weight")


def iter_to_mcore(hf: Getter, cfg: Any, family: Family, layout: str, mlp: MlpToMcore) -> Iterator[tuple[str, Tensor]]:
    """Megatron (name, tensor) pairs, layer by layer, from a getter of HF tensors."""
    check_layout(layout)
    d = Dims.of(cfg, family)
    attn_norm, mlp_norm = norm_names(layout, family.moe)
    yield "embedding.word_embeddings.weight", hf("model.embed_tokens.weight")
    for i in range(d.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield m + attn_norm, hf(h + "input_layernorm.weight")
        yield m + "self_attention.linear_qkv.weight", pack_qkv(
            hf(h + "self_attn.q_proj.weight"), hf(h + "self_attn.k_proj.weight"), hf(h + "self_attn.v_proj.weight"), d)
        if family.qkv_bias:
            yield m + "self_attention.linear_qkv.bias", pack_qkv(
                hf(h + "self_attn.q_proj.bias"), hf(h + "self_attn.k_proj.bias"), hf(h + "self_attn.v_proj.bias"), d)
        if family.qk_norm:
            yield m + "self_attention.q_layernorm.weight", hf(h + "self_attn.q_norm.weight")
            yield m + "self_attention.k_layernorm.weight", hf(h + "self_attn.k_norm.weight")
        yield m + "self_attention.linear_proj.weight", hf(h + "self_attn.o_proj.weight")
        yield m + mlp_norm, hf(h + "post_attention_layernorm.weight")
        yield from mlp(hf, h, m, d, layout)
    yield "decoder.final_layernorm.weight", hf("model.norm.weight")
    if not getattr(cfg, "tie_word_embeddings", False):
        yield "output_layer.weight", hf("lm_head.weight")


def iter_to_hf(mc: Getter, cfg: Any, family: Family, layout: str, mlp: MlpToHf) -> Iterator[tuple[str, Tensor]]:
    """HF checkpoint (name, tensor) pairs, layer by layer, from a getter of Megatron tensors. A tied
    model yields no ``lm_head.weight``, as its safetensors checkpoint holds none."""
    check_layout(layout)
    d = Dims.of(cfg, family)
    attn_norm, mlp_norm = norm_names(layout, family.moe)
    yield "model.embed_tokens.weight", mc("embedding.word_embeddings.weight")
    for i in range(d.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield h + "input_layernorm.weight", mc(m + attn_norm)
        q, k, v = unpack_qkv(mc(m + "self_attention.linear_qkv.weight"), d)
        yield from ((h + f"self_attn.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v)))
        if family.qkv_bias:
            q, k, v = unpack_qkv(mc(m + "self_attention.linear_qkv.bias"), d)
            yield from ((h + f"self_attn.{n}_proj.bias", t) for n, t in zip("qkv", (q, k, v)))
        if family.qk_norm:
            yield h + "self_attn.q_norm.weight", mc(m + "self_attention.q_layernorm.weight")
            yield h + "self_attn.k_norm.weight", mc(m + "self_attention.k_layernorm.weight")
        yield h + "self_attn.o_proj.weight", mc(m + "self_attention.linear_proj.weight")
        yield h + "post_attention_layernorm.weight", mc(m + mlp_norm)
        yield from mlp(mc, h, m, d, layout)
    yield "model.norm.weight", mc("decoder.final_layernorm.weight")
    if not getattr(cfg, "tie_word_embeddings", False):
        yield "lm_head.weight", mc("output_layer.weight")


def convert_all(pairs: Callable[[Getter], Iterator[tuple[str, Tensor]]], source: Mapping[str, Tensor],
                side: str, ignore: Callable[[str], bool]) -> dict[str, Tensor]:
    """Run a converter over a whole state dict; every source tensor must be used exactly once
    (``ignore`` names the keys that carry nothing: megatron's ``_extra_state``, a tied
    ``lm_head.weight``)."""
    used: set[str] = set()

    def get(name: str) -> Tensor:
        if name not in source:
            raise KeyError(f"The {side} state dict has no {name!r}, which the conversion needs.")
        used.add(name)
        return source[name]

    out = dict(pairs(get))
    extra = sorted(k for k in source if k not in used and not ignore(k))
    if extra:
        raise KeyError(f"The {side} state dict has tensors the conversion does not map: {extra[:8]}"
                       + (f" and {len(extra) - 8} more." if len(extra) > 8 else "."))
    return out
