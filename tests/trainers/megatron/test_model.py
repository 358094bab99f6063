"""The converters against a real megatron-core ``GPTModel`` built on CPU (local layer spec,
``use_cpu_initialization``, a 1-process gloo group): the converted names and shapes are exactly
the model's, the Transformer Engine naming is megatron's own mapping of the local one, and the
converted model's logits equal the Hugging Face model's (fp32), for every family. The forward runs
under ``tests/helpers/megatron_cpu.py``'s ``cpu_forward_shim``, which patches two CUDA-only calls and
nothing else."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.helpers.megatron_cpu import (
    TINY, cpu_forward_shim, require_megatron, single_process_parallel_state, tiny_hf_model,
)

require_megatron()

from lightning_fasync.trainers.megatron import convert  # noqa: E402
from lightning_fasync.trainers.megatron.convert import qwen3_moe  # noqa: E402
from lightning_fasync.trainers.megatron.model import build_gpt_model, layer_spec, load_hf_weights  # noqa: E402

FAMILIES = list(TINY)


@pytest.fixture(scope="module", autouse=True)
def parallel_state():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Apex/Transformer Engine not installed" on every import
        import megatron.core.models.gpt  # noqa: F401
    with single_process_parallel_state(tensor_model_parallel_size=1, pipeline_model_parallel_size=1):
        yield


def build(hf_model):
    return build_gpt_model(hf_model.config, use_cpu_initialization=True, params_dtype=torch.float32).eval()


def hf_sd(hf_model):
    sd = dict(hf_model.state_dict())
    return qwen3_moe.unfuse_experts(sd) if hf_model.config.model_type == "qwen3_moe" else sd


def tensors(sd):
    return {k: tuple(v.shape) for k, v in sd.items() if not k.endswith("._extra_state")}


@pytest.mark.parametrize("family", FAMILIES)
def test_names_and_shapes_are_gptmodels(family):
    hf = tiny_hf_model(family)
    model = build(hf)
    converted = tensors(convert.hf_to_megatron(hf_sd(hf), hf.config))
    assert converted == tensors(model.state_dict())  # every tensor covered, nothing extra


@pytest.mark.parametrize("family", FAMILIES)
def test_te_names_are_megatrons_mapping_of_the_local_ones(family):
    # The local spec names how its norms fold into Transformer Engine's fused linears for
    # checkpoints (TransformerLayerSubmodules.sharded_state_dict_keys_map); dense layers fold both
    # norms, MoE layers keep pre_mlp_layernorm (get_gpt_layer_with_transformer_engine_spec).
    hf = tiny_hf_model(family)
    keys_map = dict(layer_spec(hf.config, "local").submodules.sharded_state_dict_keys_map)
    if hf.config.model_type == "qwen3_moe":
        keys_map.pop("pre_mlp_layernorm.")

    def to_te(name):
        for old, new in keys_map.items():
            name = name.replace("." + old, "." + new)
        expert = name.split(".mlp.experts.local_experts.")
        if len(expert) == 2:  # SequentialMLP -> TEGroupedMLP (one GroupedLinear per projection)
            e, rest = expert[1].split(".", 1)
            name = f"{expert[0]}.mlp.experts.{rest}{e}"
        return name

    local = convert.hf_to_megatron(hf_sd(hf), hf.config, "local")
    te = convert.hf_to_megatron(hf_sd(hf), hf.config, "te")
    assert {to_te(k): v.shape for k, v in local.items()} == {k: v.shape for k, v in te.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_hf(family):
    hf = tiny_hf_model(family)
    model = build(hf)
    load_hf_weights(model, hf_sd(hf), hf.config)
    torch.manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (2, 12))
    positions = torch.arange(12).expand(2, 12)
    causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), diagonal=1)[None, None]  # True: masked
    with torch.no_grad(), cpu_forward_shim():
        logits = model(ids, positions, attention_mask=causal)
        want = hf(input_ids=ids).logits
    assert logits.shape == want.shape
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    # The trained model's weights go back to HF through the same mapping, unchanged.
    back = convert.megatron_to_hf(model.state_dict(), hf.config)
    ref = hf_sd(hf)
    if hf.config.tie_word_embeddings:
        ref.pop("lm_head.weight")
    assert back.keys() == ref.keys() and all(torch.equal(back[k], ref[k]) for k in ref)
