"""megatron-core's parallel layout refused before start (lightning_fasync/trainers/megatron/parallel.py):
one sentence naming the key, the values and the rule."""

from __future__ import annotations

import pytest

from lightning_fasync.config import ConfigError
from lightning_fasync.trainers.megatron.parallel import ParallelSizes, validate_for_model, validate_parallel
from tests.helpers.megatron_cpu import tiny_hf_config

MODEL = dict(num_layers=48, num_attention_heads=32, num_query_groups=4, num_experts=128)  # Qwen3-30B-A3B


@pytest.mark.parametrize(
    "sizes, world, dp",
    [
        (ParallelSizes(), 1, 1),
        (ParallelSizes(tensor_model_parallel_size=4), 8, 2),
        (ParallelSizes(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2), 16, 2),
        # The spec's 8-GPU trainer: TP 4 x PP 1, EP 8 with expert-TP 1 over the same 8 ranks.
        (ParallelSizes(tensor_model_parallel_size=4, expert_model_parallel_size=8, expert_tensor_parallel_size=1), 8, 2),
        (ParallelSizes(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=3), 8, 2),
    ],
)
def test_valid_layouts_give_the_data_parallel_size(sizes, world, dp):
    assert validate_parallel(sizes, world, **MODEL) == dp


@pytest.mark.parametrize(
    "sizes, world, model, match",
    [
        (ParallelSizes(tensor_model_parallel_size=3), 8, MODEL,
         r"^`trainer\.strategy\.init_args\.tensor_model_parallel_size` x pipeline_model_parallel_size x "
         r"context_parallel_size is 3 x 1 x 1 = 3, which does not divide the world size 8; TP x PP x CP x DP "
         r"must equal the world size\.$"),
        (ParallelSizes(expert_model_parallel_size=3), 6, MODEL, r"does not divide the model's 128 experts"),
        (ParallelSizes(expert_model_parallel_size=2), 2, {**MODEL, "num_experts": 0},
         r"`trainer\.strategy\.init_args\.expert_model_parallel_size` is 2 but the model has no experts"),
        (ParallelSizes(tensor_model_parallel_size=2, expert_model_parallel_size=8), 8, MODEL,
         r"expert_model_parallel_size` x expert_tensor_parallel_size x pipeline_model_parallel_size is "
         r"8 x 2 x 1 = 16, which does not divide the world size 8"),
        (ParallelSizes(virtual_pipeline_model_parallel_size=2), 8, MODEL,
         r"`trainer\.strategy\.init_args\.virtual_pipeline_model_parallel_size` is 2 with "
         r"pipeline_model_parallel_size 1; the interleaved schedule needs pipeline_model_parallel_size > 1"),
        (ParallelSizes(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=5), 8, MODEL,
         r"virtual_pipeline_model_parallel_size` gives 4 x 5 = 20 model chunks, which does not divide the "
         r"model's 48 layers"),
        (ParallelSizes(pipeline_model_parallel_size=5), 5, MODEL, r"pipeline_model_parallel_size` gives 5 x 1"),
        (ParallelSizes(tensor_model_parallel_size=8), 8, {**MODEL, "num_attention_heads": 12},
         r"`trainer\.strategy\.init_args\.tensor_model_parallel_size` is 8, which does not divide the "
         r"model's 12 attention heads"),
        (ParallelSizes(tensor_model_parallel_size=8), 8, {**MODEL, "num_query_groups": 12},
         r"tensor_model_parallel_size` is 8 and the model has 12 key/value heads; one must divide the other"),
        (ParallelSizes(context_parallel_size=0), 8, MODEL,
         r"`trainer\.strategy\.init_args\.context_parallel_size` is 0; it must be a positive integer\."),
    ],
)
def test_invalid_layouts_are_refused_naming_the_rule(sizes, world, model, match):
    with pytest.raises(ConfigError, match=match):
        validate_parallel(sizes, world, **model)


def test_sizes_are_read_from_the_hf_config():
    moe = tiny_hf_config("qwen3_moe")  # 2 layers, 4 heads, 2 key/value heads, 4 experts
    assert validate_for_model(ParallelSizes(expert_model_parallel_size=4), 4, moe) == 4
    with pytest.raises(ConfigError, match="does not divide the model's 4 experts"):
        validate_for_model(ParallelSizes(expert_model_parallel_size=3), 3, moe)
    with pytest.raises(ConfigError, match="no experts"):
        validate_for_model(ParallelSizes(expert_model_parallel_size=2), 2, tiny_hf_config("qwen3"))
    with pytest.raises(ConfigError, match="model's 2 layers"):
        validate_for_model(ParallelSizes(pipeline_model_parallel_size=4), 4, moe)


def test_test_requirement_is_the_extra():
    # scripts/test installs tests/requirements-megatron.txt; users install the `megatron` extra.
    import os
    import re

    from tests.helpers.paths import REPO, TESTS

    extra = re.search(r'^megatron = \["([^"]+)"\]', open(os.path.join(REPO, "pyproject.toml")).read(), re.M)
    assert extra and open(os.path.join(TESTS, "requirements-megatron.txt")).read().split() == [extra.group(1)]


@pytest.mark.parametrize("family, sizes, match", [
    ("qwen3", ParallelSizes(tensor_model_parallel_size=4), r"is 4, which does not divide the model's vocabulary of 98"),
    ("qwen3_moe", ParallelSizes(tensor_model_parallel_size=2),
     r"is 2 for a mixture-of-experts model; .* use TP 1 and split the experts with expert_model_parallel_size"),
])
def test_the_trainers_own_rules_for_a_model(family, sizes, match):
    cfg = tiny_hf_config(family)
    cfg.vocab_size = 98 if family == "qwen3" else cfg.vocab_size
    with pytest.raises(ConfigError, match=r"^`trainer\.strategy\.init_args\.tensor_model_parallel_size` " + match):
        validate_for_model(sizes, 4, cfg)
