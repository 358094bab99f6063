"""HF weights into a sharded ``GPTModel`` and back out as a stream (``lightning_fasync.trainers.megatron.
shards``), on 2 gloo processes on CPU under ``tests/helpers/megatron_cpu.py``'s ``cpu_training_shim``.

Each run checks three things that fail independently: every local parameter equals megatron-core's
own sharding of the unsharded conversion (``_initialize_affine_weight_cpu`` with the parameter's
own ``partition_dim`` / ``partition_stride``: the SwiGLU ``[gate_r; up_r]`` interleave, vocab- and
row-parallel splits), the sharded model's logits equal HF's, and the stream on rank 0 equals the HF
checkpoint exactly while the other rank gets meta tensors. Loading asks each rank's getter only for
the HF tensors that rank holds. (The stream alone is the inverse of the load, so a layout mistake
made in both directions shows in the first two checks, not in the round trip.) The slicing rule
itself is checked against megatron-core's without processes."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.megatron_cpu import require_megatron, run_ranks, tiny_hf_config, tiny_hf_model

require_megatron()

SEQ = 12


def test_slices_are_megatrons_own():
    # megatron-core shards a full weight with _initialize_affine_weight_cpu (stride 2: SwiGLU's fc1).
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    from lightning_fasync.trainers.megatron.shards import _Shard, _slice, _unslice

    full = torch.randn(16, 8)
    for dim in (0, 1):
        for stride in (1, 2):
            for size in (2, 4):
                parts = []
                for rank in range(size):
                    s = _Shard(None, "w", dim, stride, None, size, rank, True)
                    want = torch.empty([n // size if d == dim else n for d, n in enumerate(full.shape)])
                    _initialize_affine_weight_cpu(want, 16, 8, want.shape[dim], dim, lambda w: w.copy_(full),
                                                  stride=stride, rank=rank, world_size=size,
                                                  skip_set_tensor_parallel_attributes=True)
                    assert torch.equal(_slice(full, s), want), (dim, stride, size, rank)
                    parts.append(want)
                assert torch.equal(_unslice(parts, s), full)


def test_te_layout_is_refused():
    from lightning_fasync.trainers.megatron.shards import hf_weight_stream, load_hf_weights_sharded

    cfg = tiny_hf_config("qwen3")
    with pytest.raises(NotImplementedError, match="local"):
        load_hf_weights_sharded([], {}.__getitem__, cfg, layout="te")
    with pytest.raises(NotImplementedError, match="local"):
        hf_weight_stream([], cfg, layout="te")


def _hf_sd(hf):
    from lightning_fasync.trainers.megatron.convert import qwen3_moe

    sd = qwen3_moe.unfuse_experts(dict(hf.state_dict()))
    if hf.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


def _build(cfg, **sizes):
    from lightning_fasync.trainers.megatron.model import build_gpt_model

    return build_gpt_model(cfg, use_cpu_initialization=True, params_dtype=torch.float32, **sizes).eval()


def _load(model, sd, cfg):
    from lightning_fasync.trainers.megatron.shards import load_hf_weights_sharded

    asked = []
    load_hf_weights_sharded([model], lambda n: (asked.append(n), sd[n])[1], cfg)
    return asked


def _assert_megatron_sharding(model, mcore_full, rename, tp_rank, tp_size):
    """Each local parameter is megatron-core's own shard of the unsharded tensor ``rename(name)``."""
    from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu

    from lightning_fasync.trainers.megatron.shards import _unwrap

    for name, p in _unwrap(model).named_parameters():
        full = mcore_full[rename(name)]
        want = full
        if getattr(p, "tensor_model_parallel", False):
            full2d = full if full.dim() == 2 else full[:, None]
            want = torch.empty(p.shape if p.dim() == 2 else (p.shape[0], 1))
            _initialize_affine_weight_cpu(
                want, full2d.shape[0], full2d.shape[1], want.shape[p.partition_dim], p.partition_dim,
                lambda w: w.copy_(full2d), stride=p.partition_stride, rank=tp_rank, world_size=tp_size,
                skip_set_tensor_parallel_attributes=True)
            want = want.reshape(p.shape)
        assert torch.equal(p.detach(), want), name


def _causal():
    return torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]


def _inputs(cfg):
    torch.manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (2, SEQ)), torch.arange(SEQ).expand(2, SEQ)


def _assert_stream(rank, model, cfg, want):
    """The stream's names and values on rank 0 are the HF checkpoint's; rank 1 gets meta."""
    from lightning_fasync.trainers.megatron.shards import hf_weight_stream

    stream = hf_weight_stream([model], cfg)
    assert {s.name for s in stream.specs} == set(want)
    if rank == 0:
        got = dict(stream)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    else:
        while stream.consumed < len(stream):
            assert stream.take()[1].is_meta
    assert stream.consumed == len(stream)


def _tensor_parallel(rank):
    from megatron.core import parallel_state, tensor_parallel

    from lightning_fasync.trainers.megatron import convert

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    for family in ("qwen3", "qwen2"):  # tied embeddings and q/k norms; q/k/v biases
        hf = tiny_hf_model(family)
        sd = _hf_sd(hf)
        model = _build(hf.config, tensor_model_parallel_size=2)
        assert sorted(_load(model, sd, hf.config)) == sorted(sd)
        _assert_megatron_sharding(model, convert.hf_to_megatron(sd, hf.config), lambda n: n, rank, 2)
        ids, positions = _inputs(hf.config)
        with torch.no_grad():
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(
                model(ids, positions, attention_mask=_causal()))
            torch.testing.assert_close(logits, hf(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        _assert_stream(rank, model, hf.config, sd)


def _pipeline_parallel(rank):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from lightning_fasync.trainers.megatron import convert

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)
    hf = tiny_hf_model("qwen3")  # 2 layers: one per stage; tied embeddings: a copy on the last stage
    sd = _hf_sd(hf)
    module = _build(hf.config, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, pre_process=rank == 0,
                    post_process=rank == 1)
    model = DistributedDataParallel(module.config, DistributedDataParallelConfig(), module)
    asked = _load(model, sd, hf.config)
    own = {0: r"model\.(embed_tokens|layers\.0)\.", 1: r"model\.(embed_tokens|layers\.1|norm)\."}[rank]
    assert sorted(asked) == sorted(n for n in sd if re.match(own, n))
    mcore = convert.hf_to_megatron(sd, hf.config)
    rename = {0: lambda n: n,
              1: lambda n: {"output_layer.weight": "embedding.word_embeddings.weight"}.get(
                  n, n.replace("decoder.layers.0.", "decoder.layers.1."))}[rank]
    _assert_megatron_sharding(model, mcore, rename, 0, 1)
    ids, positions = _inputs(hf.config)
    with torch.no_grad():
        if rank == 0:
            dist.send(model(ids, positions, attention_mask=_causal()).contiguous(), 1)
        else:
            hidden = torch.empty(SEQ, 2, hf.config.hidden_size)
            dist.recv(hidden, 0)
            module.set_input_tensor(hidden)
            torch.testing.assert_close(model(ids, positions, attention_mask=_causal()), hf(input_ids=ids).logits,
                                       rtol=1e-4, atol=1e-4)
    _assert_stream(rank, model, hf.config, sd)


def _expert_parallel(rank):
    from megatron.core import parallel_state

    from lightning_fasync.trainers.megatron import convert

    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    hf = tiny_hf_model("qwen3_moe")  # 4 experts: 0-1 on rank 0, 2-3 on rank 1
    sd = _hf_sd(hf)
    model = _build(hf.config, expert_model_parallel_size=2)
    asked = _load(model, sd, hf.config)
    others = {2 * (1 - rank), 2 * (1 - rank) + 1}
    assert sorted(asked) == sorted(n for n in sd if not re.search(rf"\.experts\.({'|'.join(map(str, others))})\.", n))

    def rename(n):
        m = re.search(r"local_experts\.(\d+)\.", n)
        return n if m is None else n.replace(m[0], f"local_experts.{2 * rank + int(m[1])}.")

    _assert_megatron_sharding(model, convert.hf_to_megatron(sd, hf.config), rename, 0, 1)
    ids, positions = _inputs(hf.config)  # both ranks route the same tokens over all 4 experts
    with torch.no_grad():
        torch.testing.assert_close(model(ids, positions, attention_mask=_causal()), hf(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    _assert_stream(rank, model, hf.config, sd)


def _every_layout(rank):
    from megatron.core import parallel_state

    for layout in (_tensor_parallel, _pipeline_parallel, _expert_parallel):
        layout(rank)  # raises naming the layout's function
        parallel_state.destroy_model_parallel()


@pytest.mark.slow  # 2 spawned ranks importing megatron-core, the three layouts one after the other
def test_tensor_pipeline_and_expert_parallel_load_and_export():
    run_ranks(_every_layout, 2)
