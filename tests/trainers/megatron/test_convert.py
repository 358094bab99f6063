"""Hugging Face <-> megatron-core weight and config conversion (lightning_fasync/trainers/megatron/convert),
without megatron-core: exact round trips for a tiny model of each family in both layer-spec
namings, the fused layouts' arrangement, and the refusals. tests/trainers/megatron/test_model.py checks the
names, shapes and logits against a real megatron-core GPTModel."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lightning_fasync.config import ConfigError
from lightning_fasync.trainers.megatron import convert
from lightning_fasync.trainers.megatron.convert import _common, qwen3_moe
from tests.helpers.megatron_cpu import TINY, tiny_hf_config, tiny_hf_model

FAMILIES = list(TINY)


def hf_checkpoint_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's tensors as its safetensors checkpoint names them (per-expert MoE tensors;
    transformers 5 fuses them in the live module)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return qwen3_moe.unfuse_experts(sd) if model.config.model_type == "qwen3_moe" else sd


@pytest.mark.parametrize("layout", convert.LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_exact(family, layout):
    model = tiny_hf_model(family)
    cfg = model.config
    hf = hf_checkpoint_state_dict(model)
    mc = convert.hf_to_megatron(hf, cfg, layout)
    back = convert.megatron_to_hf(mc, cfg, layout)
    if cfg.tie_word_embeddings:  # the checkpoint of a tied model holds no lm_head
        assert "output_layer.weight" not in mc
        hf.pop("lm_head.weight")
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    # And the other way: a Megatron state dict survives Megatron -> HF -> Megatron.
    again = convert.hf_to_megatron(back, cfg, layout)
    assert again.keys() == mc.keys() and all(torch.equal(again[k], mc[k]) for k in mc)


def test_moe_checkpoint_naming_is_what_save_pretrained_writes(tmp_path):
    model = tiny_hf_model("qwen3_moe")
    model.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    ours = hf_checkpoint_state_dict(model)
    assert ours.keys() == on_disk.keys()
    assert all(torch.equal(ours[k], on_disk[k]) for k in ours)
    # hf_to_megatron takes the fused live layout as well and gives the same tensors.
    fused = convert.hf_to_megatron(model.state_dict(), model.config)
    unfused = convert.hf_to_megatron(on_disk, model.config)
    assert fused.keys() == unfused.keys() and all(torch.equal(fused[k], unfused[k]) for k in fused)


def test_qkv_is_interleaved_per_query_group():
    d = _common.Dims(num_layers=1, hidden=3, heads=4, groups=2, head_dim=2)
    # Row r of each projection holds its own label: q rows 0..7, k rows 100.., v rows 200..
    q = torch.arange(8.0)[:, None].expand(8, 3)
    k = 100 + torch.arange(4.0)[:, None].expand(4, 3)
    v = 200 + torch.arange(4.0)[:, None].expand(4, 3)
    qkv = _common.pack_qkv(q, k, v, d)
    # Group 0: its 2 query heads (rows 0-3), its key head (100, 101), its value head (200, 201).
    assert qkv[:, 0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert all(torch.equal(a, b) for a, b in zip(_common.unpack_qkv(qkv, d), (q, k, v)))
    bias = _common.pack_qkv(q[:, 0], k[:, 0], v[:, 0], d)
    assert torch.equal(bias, qkv[:, 0])


def test_fc1_is_gate_then_up():
    gate, up = torch.zeros(3, 2), torch.ones(3, 2)
    fc1 = _common.pack_gate_up(gate, up)
    # megatron's MLP.glu: x_glu, x_linear = chunk(fc1(x), 2); act(x_glu) * x_linear.
    x_glu, x_linear = fc1.chunk(2, dim=0)
    assert torch.equal(x_glu, gate) and torch.equal(x_linear, up)


def test_config_mapping_qwen3_0_6b_shape():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                               num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                               head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                               max_position_embeddings=40960, tie_word_embeddings=True)
    kw = convert.transformer_config_kwargs(cfg, bf16=True)
    assert kw["kv_channels"] == 128 and kw["hidden_size"] == 1024 and kw["num_query_groups"] == 8
    assert kw["qk_layernorm"] and not kw["add_qkv_bias"] and not kw["add_bias_linear"]
    assert kw["gated_linear_unit"] and kw["activation_func"] is torch.nn.functional.silu
    assert kw["normalization"] == "RMSNorm" and kw["layernorm_epsilon"] == 1e-6 and kw["bf16"]
    model_kw = convert.gpt_model_kwargs(cfg)
    assert model_kw["share_embeddings_and_output_weights"] and model_kw["rotary_base"] == 1000000.0
    assert model_kw["vocab_size"] == 151936 and model_kw["position_embedding_type"] == "rope"


def test_config_mapping_moe_and_llama3_rope():
    moe = convert.transformer_config_kwargs(tiny_hf_config("qwen3_moe"))
    assert (moe["num_moe_experts"], moe["moe_router_topk"], moe["moe_ffn_hidden_size"]) == (4, 2, 24)
    assert moe["moe_router_pre_softmax"] is False  # norm_topk_prob: softmax over the top k
    cfg = tiny_hf_config("qwen3_moe")
    cfg.norm_topk_prob = False
    assert convert.transformer_config_kwargs(cfg)["moe_router_pre_softmax"] is True
    llama = convert.gpt_model_kwargs(tiny_hf_config("llama"))
    assert llama["rope_scaling"] is True and llama["rope_scaling_factor"] == 8.0
    assert convert.transformer_config_kwargs(tiny_hf_config("qwen2"))["add_qkv_bias"] is True


@pytest.mark.parametrize(
    "family, change, match",
    [
        ("mistral", {}, "`model_type` is 'mistral'"),
        ("llama", {"hidden_act": "gelu"}, "`hidden_act` is 'gelu'"),
        ("qwen2", {"use_sliding_window": True}, "`use_sliding_window` is True"),
        ("llama", {"mlp_bias": True}, "`attention_bias`/`mlp_bias`"),
        ("qwen3", {"attention_bias": True}, "`attention_bias`/`mlp_bias`"),
        ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
         "RoPE type is 'yarn'"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "`mlp_only_layers` is \\[0\\]"),
    ],
)
def test_unsupported_configs_are_refused(family, change, match):
    from transformers import AutoConfig

    if family == "mistral":
        cfg = AutoConfig.for_model("mistral", num_hidden_layers=1)
    else:
        cfg = tiny_hf_config(family)
        for key, value in change.items():
            if key == "rope_scaling" and hasattr(cfg, "rope_parameters"):  # transformers 5
                key, value = "rope_parameters", {**value, "rope_theta": 10000.0}
            setattr(cfg, key, value)
    with pytest.raises(ConfigError, match=match):
        convert.transformer_config_kwargs(cfg)


def test_missing_and_unmapped_tensors_are_refused():
    model = tiny_hf_model("qwen2")
    hf = hf_checkpoint_state_dict(model)
    with pytest.raises(KeyError, match="no 'model.layers.1.self_attn.k_proj.bias'"):
        convert.hf_to_megatron({k: v for k, v in hf.items() if k != "model.layers.1.self_attn.k_proj.bias"},
                               model.config)
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        convert.hf_to_megatron({**hf, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, model.config)
    mc = convert.hf_to_megatron(hf, model.config)
    with pytest.raises(KeyError, match="decoder.layers.0.self_attention.linear_qkv.bias"):
        convert.megatron_to_hf({k: v for k, v in mc.items() if not k.endswith("linear_qkv.bias")}, model.config)
    mc["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None  # carries no weights
    assert convert.megatron_to_hf(mc, model.config).keys() == hf.keys()


def test_export_streams_in_layer_order():
    model = tiny_hf_model("qwen3")
    mc = convert.hf_to_megatron(hf_checkpoint_state_dict(model), model.config)
    asked: list[str] = []

    def get(name):
        asked.append(name)
        return mc[name]

    names = [n for n, _ in convert.iter_megatron_to_hf(get, model.config)]
    # Layer 0's tensors are all asked for before any of layer 1's: a sharded model can gather and
    # send bucket by bucket.
    last0 = max(i for i, n in enumerate(asked) if n.startswith("decoder.layers.0."))
    first1 = min(i for i, n in enumerate(asked) if n.startswith("decoder.layers.1."))
    assert last0 < first1 and names[0] == "model.embed_tokens.weight" and names[-1] == "model.norm.weight"
