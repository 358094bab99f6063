"""Hugging Face weights into a sharded megatron-core ``GPTModel``, and full HF-named tensors out.

A Megatron trainer holds, on each rank, a list of ``GPTModel`` chunks (one per virtual-pipeline
stage; each may be wrapped in megatron-core's ``DistributedDataParallel``). The converters of
:mod:`lightning_fasync.trainers.megatron.convert` speak full tensors; this module maps each full Megatron
tensor to the shard every rank holds, for the ``local`` layer spec (megatron-core modules only):

- Pipeline: a chunk's layer ``j`` is global layer ``layer_number - 1`` (megatron-core's own
  ``TransformerLayer.layer_number``, offset by the pipeline stage and virtual chunk). The embedding
  lives on the first stage, ``decoder.final_layernorm`` and ``output_layer`` on the last. With tied
  embeddings and more than one stage, the last stage keeps a copy of the word embeddings as
  ``output_layer.weight`` (``LanguageModule.setup_embeddings_and_output_layer``): it is loaded from
  ``model.embed_tokens.weight`` and never exported.
- Experts: a ``SequentialMLP``'s local expert ``k`` is global expert
  ``MoELayer.local_expert_indices[k]`` (= EP rank x experts per rank + k).
- Tensor parallel (expert weights over the expert-TP group, all others over the TP group): the
  embedding, ``output_layer`` (vocabulary), ``linear_qkv`` (weight and bias) and every
  ``linear_fc1`` split on dim 0; ``linear_proj`` and every ``linear_fc2`` on dim 1; norms, q/k
  norms and the router are replicated. ``linear_qkv`` is interleaved per query group, so a plain
  dim-0 slice gives each rank its groups (megatron-core all-gathers and re-slices when TP exceeds
  the groups). SwiGLU's ``linear_fc1`` has ``partition_stride`` 2: rank r holds
  ``[gate_r; up_r]``, not a slice of ``[gate; up]``. In general, a tensor is cut into
  ``stride x size`` pieces along its dim and rank r holds pieces ``r, r + size, ...``
  (``tensor_parallel.layers._initialize_affine_weight_cpu``). megatron-core divides the
  vocabulary by TP without padding (``VocabUtility``), so there is no padding to undo.
- Full shapes come from the converter run over a meta-device HF model (no memory, no
  communication). The converter reads a Megatron tensor's HF tensors right before it yields it,
  so loading asks ``get_hf`` only for what this rank holds.

Export (:func:`hf_weight_stream`): for each Megatron tensor the converter asks for, the replica
with data-parallel and context-parallel rank 0 (expert-data-parallel rank 0 for expert weights)
gathers the TP shards on its TP rank 0, which sends the full tensor to ``dst`` (or keeps it, if
it is ``dst``). Every rank runs the same converter, so the collectives match; a rank that is not
``dst`` produces meta tensors. At most one full Megatron tensor (plus its pieces) is held at a
time. Main thread only (collectives).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_fasync.trainers.megatron import convert
from lightning_fasync.trainers.megatron.convert.qwen3_moe import unfuse_experts
from lightning_fasync.weights.tensor_stream import TensorSpec, TensorStream

__all__ = ["hf_tensor_shapes", "hf_weight_stream", "load_hf_weights_sharded"]

Tensor = torch.Tensor

# Megatron name suffix -> (partition dim, partition stride) of the local spec's parallel layers;
# anything else is replicated. Cross-checked against the parameters' own ``partition_dim`` /
# ``partition_stride`` where megatron-core set them (it does only when it initialises weights).
_TP_RULES = {
    "embedding.word_embeddings.weight": (0, 1),  # VocabParallelEmbedding
    "output_layer.weight": (0, 1),  # ColumnParallelLinear over the vocabulary
    "self_attention.linear_qkv.weight": (0, 1),
    "self_attention.linear_qkv.bias": (0, 1),
    "self_attention.linear_proj.weight": (1, 1),  # RowParallelLinear
    "linear_fc1.weight": (0, 2),  # SwiGLU: [gate_r; up_r] per rank (MLP's fc1_stride)
    "linear_fc2.weight": (1, 1),
}
_TIED = "embedding.word_embeddings.weight"


@dataclass
class _Shard:
    """One local parameter and where it sits in its full tensor."""

    param: torch.nn.Parameter
    local_name: str
    dim: int | None  # partition dim; None: replicated
    stride: int
    group: Any  # the TP (or expert-TP) process group
    size: int
    rank: int
    replica0: bool  # the replica that exports (DP = CP = 0; expert DP = 0 for experts)
    copy: bool = False  # the last stage's copy of tied embeddings: loaded, never exported


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def _check_layout(layout: str) -> None:
    if layout == "te":
        raise NotImplementedError(
            "Sharded HF weights support the `local` layer spec; the `te` spec's fused norms and "
            "TEGroupedMLP experts are not mapped to shards yet (use layout='local')."
        )
    convert._common.check_layout(layout)


def _hf_meta(cfg: Any) -> dict[str, Tensor]:
    """The HF checkpoint's names and shapes, as meta tensors (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return unfuse_experts(dict(model.state_dict()))


def hf_tensor_shapes(cfg: Any) -> dict[str, list[int]]:
    """The HF checkpoint's tensor names and global shapes (whatever the parallel layout)."""
    return {name: list(t.shape) for name, t in _hf_meta(cfg).items()}


def _megatron_plan(cfg: Any, layout: str) -> tuple[dict[str, Tensor], dict[str, Tensor], list[str]]:
    """The HF and the full Megatron tensors as meta tensors, and the Megatron names in the
    converter's order."""
    hf_meta = _hf_meta(cfg)
    full = dict(convert.iter_hf_to_megatron(hf_meta.__getitem__, cfg, layout))
    return hf_meta, full, list(full)


def _global_name(model: torch.nn.Module, name: str) -> str:
    """A chunk's parameter name -> the unsharded model's (global layer and expert indices)."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m is None:
        return name
    layer = model.decoder.layers[int(m[1])]
    rest = m[2]
    e = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(.*)", rest)
    if e is not None:
        rest = f"mlp.experts.local_experts.{layer.mlp.local_expert_indices[int(e[1])]}.{e[2]}"
    return f"decoder.layers.{layer.layer_number - 1}.{rest}"


def _rule(name: str) -> tuple[int | None, int]:
    for suffix, rule in _TP_RULES.items():
        if name == suffix or name.endswith("." + suffix):
            return rule
    return None, 1


def _local_shards(chunks: Sequence[torch.nn.Module], full: dict[str, Tensor]) -> dict[str, list[_Shard]]:
    """Global Megatron name -> this rank's shards of it, checked against the full shapes."""
    from megatron.core import parallel_state as ps

    dense = (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
             ps.get_tensor_model_parallel_rank(),
             ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
    expert = (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size(),
              ps.get_expert_tensor_parallel_rank(), ps.get_expert_data_parallel_rank() == 0)
    shards: dict[str, list[_Shard]] = {}
    for chunk in chunks:
        model = _unwrap(chunk)
        tied_copy = model.share_embeddings_and_output_weights and model.post_process and not model.pre_process
        for local_name, param in model.named_parameters():
            name = _global_name(model, local_name)
            copy = tied_copy and name == "output_layer.weight"
            if copy:
                name = _TIED
            if name not in full:
                raise KeyError(f"The GPTModel parameter {local_name!r} ({name}) has no Hugging Face counterpart.")
            dim, stride = _rule(name)
            group, size, rank, replica0 = expert if ".mlp.experts." in name else dense
            if getattr(param, "tensor_model_parallel", False) and size > 1:
                if (param.partition_dim, param.partition_stride) != (dim, stride):
                    raise RuntimeError(
                        f"{local_name} is split on dim {param.partition_dim} with stride "
                        f"{param.partition_stride}; the shard map expects dim {dim}, stride {stride}.")
            want = list(full[name].shape)
            if dim is not None:
                want[dim] //= size
            if list(param.shape) != want:
                raise RuntimeError(f"{local_name} is {tuple(param.shape)}; its shard of {name} "
                                   f"{tuple(full[name].shape)} should be {tuple(want)}.")
            shards.setdefault(name, []).append(
                _Shard(param, local_name, dim if size > 1 else None, stride, group, size, rank, replica0, copy))
    return shards


def _slice(full: Tensor, s: _Shard) -> Tensor:
    """This rank's part of ``full``: pieces ``rank, rank + size, ...`` of ``stride x size``."""
    if s.dim is None:
        return full
    pieces = full.chunk(s.stride * s.size, dim=s.dim)
    return torch.cat(pieces[s.rank::s.size], dim=s.dim)


def _unslice(parts: list[Tensor], s: _Shard) -> Tensor:
    """Inverse of :func:`_slice` over the group's parts, in group-rank order."""
    split = [p.chunk(s.stride, dim=s.dim) for p in parts]
    return torch.cat([split[r][j] for j in range(s.stride) for r in range(s.size)], dim=s.dim)


def load_hf_weights_sharded(chunks: Sequence[torch.nn.Module], get_hf: Callable[[str], Tensor], cfg: Any,
                            layout: str = "local") -> None:
    """Copy this rank's shard of every HF tensor into the model chunks (module docstring).

    Arguments:
        chunks: this rank's ``GPTModel`` chunks (or megatron-core DDP wrappers of them).
        get_hf: ``hf_name -> full tensor`` (a state dict's ``__getitem__``, a lazy safetensors read);
            asked only for what this rank holds. Checkpoint names: per-expert tensors for MoE.
        cfg: the Hugging Face config (a transformers ``PretrainedConfig``).

    Load before megatron-core's optimizer is built (it copies the parameters into its main params).
    Raises if a local parameter has no counterpart or is not assigned exactly once.
    """
    _check_layout(layout)
    hf_meta, full, order = _megatron_plan(cfg, layout)
    shards = _local_shards(chunks, full)
    position = 0  # the converter reads item ``position``'s HF tensors right before it yields it

    def get(hf_name: str) -> Tensor:
        if order[position] in shards:
            return get_hf(hf_name)
        return hf_meta[hf_name]  # another stage's or EP rank's: left unread

    assigned: set[int] = set()  # by parameter: virtual-pipeline chunks repeat local names
    with torch.no_grad():
        for i, (name, tensor) in enumerate(convert.iter_hf_to_megatron(get, cfg, layout)):
            position = i + 1
            for s in shards.get(name, ()):
                if id(s.param) in assigned:
                    raise RuntimeError(f"The GPTModel parameter {s.local_name!r} ({name}) was loaded twice.")
                s.param.copy_(_slice(tensor, s))
                assigned.add(id(s.param))
            del tensor
    for s in (s for group in shards.values() for s in group):
        if id(s.param) not in assigned:
            raise RuntimeError(f"The GPTModel parameter {s.local_name!r} was not loaded.")


def hf_weight_stream(chunks: Sequence[torch.nn.Module], cfg: Any, layout: str = "local", dst: int = 0,
                     cache: dict | None = None) -> TensorStream:
    """The model's weights as a :class:`TensorStream` of full HF checkpoint tensors on global rank
    ``dst`` (names and order of ``convert.iter_megatron_to_hf``; a tied model has no
    ``lm_head.weight``). Every rank builds it (one ``all_gather_object`` of who sends what) and
    consumes it in the same order: ``dst`` through the weight sync, the others with ``drain()``,
    which yields meta tensors. Main thread only.

    ``cache``: a dict kept by the caller across calls for the same chunks; the plan (which shard
    is whose, who sends what, the specs) is made on the first call only, not at every weight sync.
    """
    if cache and cache.get("key") == (tuple(id(c) for c in chunks), layout, dst):
        return _stream(cfg, layout, dst, *cache["plan"])
    _check_layout(layout)
    _, full, _ = _megatron_plan(cfg, layout)
    shards = _local_shards(chunks, full)
    # Under bf16 the local spec's norms stay float32 (torch's RMSNorm is not cast): the engines get
    # the model's dtype for every tensor, as a checkpoint holds them.
    dtype = _unwrap(chunks[0]).config.params_dtype
    device = next(s.param.device for group in shards.values() for s in group)

    # Who sends each Megatron tensor: the exporting replica's TP rank 0 that holds it.
    exporters = {n: next(s for s in group if not s.copy) for n, group in shards.items()
                 if any(not s.copy for s in group)}
    mine = sorted(n for n, s in exporters.items() if s.replica0 and s.rank == 0)
    tables: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(tables, mine)
    source: dict[str, int] = {}
    for rank, names in enumerate(tables):
        for n in names:
            if n in source:
                raise RuntimeError(f"{n} is exported by ranks {source[n]} and {rank}.")
            source[n] = rank
    missing = sorted(set(full) - set(source))
    if missing:
        raise RuntimeError(f"No rank exports {missing[:8]}; the model chunks do not cover the model.")
    specs = [TensorSpec(n, tuple(t.shape), dtype) for n, t in convert.iter_megatron_to_hf(
        lambda n: torch.empty(full[n].shape, dtype=dtype, device="meta"), cfg, layout)]
    plan = (full, exporters, source, dtype, device, specs)
    if cache is not None:
        cache.update(key=(tuple(id(c) for c in chunks), layout, dst), plan=plan)
    return _stream(cfg, layout, dst, *plan)


def _stream(cfg: Any, layout: str, dst: int, full: dict[str, Tensor], exporters: dict[str, Any],
            source: dict[str, int], dtype: torch.dtype, device: torch.device, specs: list[TensorSpec]) -> TensorStream:
    me = dist.get_rank()

    def fetch(name: str) -> Tensor:
        shape, tensor = full[name].shape, None
        s = exporters.get(name)
        if s is not None and s.replica0:
            data = s.param.detach().to(dtype)
            if s.dim is None:
                tensor = data if s.rank == 0 else None
            else:
                parts = [torch.empty_like(data) for _ in range(s.size)] if s.rank == 0 else None
                dist.gather(data.contiguous(), parts, dst=dist.get_global_rank(s.group, 0), group=s.group)
                tensor = _unslice(parts, s) if parts is not None else None
        src = source[name]
        if me == dst:
            if src != dst:
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(tensor, src)
            return tensor
        if me == src:
            dist.send(tensor.contiguous(), dst)
        return torch.empty(shape, dtype=dtype, device="meta")

    pairs = iter(convert.iter_megatron_to_hf(fetch, cfg, layout))

    def produce(i: int) -> Tensor:
        name, tensor = next(pairs)
        assert name == specs[i].name, (name, specs[i].name)
        return tensor

    return TensorStream(specs, produce)
