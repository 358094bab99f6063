"""Checkpoints of megatron-core model chunks and optimizer: every rank writes its shards through
``dist_checkpointing`` and global rank 0 writes the rest of Lightning's checkpoint once; a resume
loads them into any parallel layout. :func:`export_hf` writes such a checkpoint's policy as a Hugging
Face directory in one process (``lightning-fasync export``).

A checkpoint is a directory (``CheckpointFiles`` writes it under a temporary name, fsyncs and renames
it, as any distributed checkpoint):

- megatron-core's ``torch_dist`` format: ``.metadata`` and ``__<rank>_<n>.distcp`` shards,
  ``common.pt`` (the optimizer's param groups, the sharding metadata) and ``metadata.json``. The
  model chunks' ``sharded_state_dict`` names tensors by their global keys (layers stacked along a
  leading axis, Transformer Engine's names for the fused norms), so the tensor-, pipeline-,
  expert- and data-parallel sizes may all change on resume. The distributed optimizer's state
  is saved ``fully_reshardable`` (gathered over the data-parallel group and cut like the model's
  parameters; megatron-core 0.16's ``fully_sharded_model_space`` default is refused by its own
  ``ShardedTensor`` check) or, on request, ``dp_reshardable`` (each rank's buckets as they are,
  no gather; a resume may change only the data-parallel size);
- ``meta.pt``: what Lightning saves besides weights and optimizer (loops, callbacks, the run's
  exactly-once pipeline state and identity), read back with ``weights_only=True``;
- ``megatron.json``: written last, what export and a resume check need: the marker, the Hugging
  Face config, the layer spec (``local``/``te``), the parameters' dtype, the parallel layout and
  the optimizer's format.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any, Iterator, Optional, Sequence

import torch

from lightning_fasync.config import ConfigError

__all__ = ["FORMAT", "INFO_FILENAME", "OPTIMIZER_FORMATS", "export_hf", "is_megatron_checkpoint", "load_checkpoint",
           "read_info", "save_checkpoint"]

FORMAT = "lightning_fasync.trainers.megatron"
INFO_FILENAME = "megatron.json"
META_FILENAME = "meta.pt"
"""Lightning's name for the non-tensor part of a sharded checkpoint
(``lightning.fabric.utilities.load._METADATA_FILENAME``), as ``ModelParallelStrategy`` writes it."""

OPTIMIZER_FORMATS = ("fully_reshardable", "dp_reshardable")
"""The distributed optimizer's checkpoint formats (megatron-core's ``distrib_optim_sharding_type``)."""

_OPTIMIZER_KEY = re.compile(r"^(chained_\d+\.)?optimizer\.")
_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
          "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size")
_STRATEGY_KEY = "trainer.strategy.init_args."


# ------------------------------------------------------------------------------ save and load


def save_checkpoint(path: str, chunks: Sequence[torch.nn.Module], optimizer: Any, meta: dict[str, Any], *,
                    hf_config: Any = None, optimizer_format: str = "fully_reshardable") -> None:
    """Write a checkpoint directory at ``path``; every rank calls this (collectives).

    Args:
        path: the directory (global rank 0's path is used on every rank, as Lightning's
            ``ModelParallelStrategy`` does).
        chunks: this rank's model chunks (megatron-core ``DistributedDataParallel``-wrapped or bare
            ``GPTModel``s, one per virtual-pipeline stage).
        optimizer: the megatron-core optimizer of ``get_megatron_optimizer`` (distributed or not),
            or None to save the model only.
        meta: the rest of Lightning's checkpoint (no ``state_dict``), written once as ``meta.pt``.
        hf_config: the policy's Hugging Face config, recorded for export (else export reads the
            config of the ``model`` it is given).
        optimizer_format: the distributed optimizer's format, one of :data:`OPTIMIZER_FORMATS`.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    if optimizer_format not in OPTIMIZER_FORMATS:
        raise ValueError(f"optimizer_format is {optimizer_format!r}; it must be one of {', '.join(OPTIMIZER_FORMATS)}.")
    path = _rank0_path(path)
    models = _unwrap(chunks)
    metadata = _content_metadata(optimizer_format)
    state = _sharded_state(models, optimizer, metadata, is_loading=False)
    os.makedirs(path, exist_ok=True)
    # As Megatron-LM's default: replicated shards (the data-parallel copies) are written by
    # different ranks rather than all by data-parallel rank 0.
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), parallel_state.get_data_parallel_group(with_context_parallel=True))
    dist_checkpointing.save(state, path, sharded_strategy=strategy, content_metadata=dict(metadata))
    if dist.get_rank() == 0:  # after save's closing barrier: every shard is written
        torch.save(meta, os.path.join(path, META_FILENAME))
        info = {
            "format": FORMAT,
            "version": 1,
            "hf_config": hf_config.to_dict() if hf_config is not None else None,
            "layer_spec": _layer_spec(models[0]),
            "params_dtype": str(models[0].config.params_dtype).removeprefix("torch."),
            "parallel": _parallel_sizes(),
            "model_chunks": len(models),
            "optimizer": None if optimizer is None else {"distributed": _is_distributed(optimizer),
                                                         "format": optimizer_format},
        }
        with open(os.path.join(path, INFO_FILENAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(info, indent=2, sort_keys=True, default=str) + "\n")


def load_checkpoint(path: str, chunks: Sequence[torch.nn.Module], optimizer: Any = None) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_checkpoint` into this layout (it may differ from the saved
    one); every rank calls this. Returns ``meta`` (Lightning's loops, callbacks...).

    The model's tensors (names and global shapes, over all ranks) are checked against the
    checkpoint's before anything is read; the optimizer's state is loaded when ``optimizer`` is
    given.

    Raises:
        ConfigError: not a Megatron checkpoint, another model's shape (named by its first differing
            tensor), no optimizer state to resume, or a layout its optimizer format cannot change.
    """
    from megatron.core import dist_checkpointing

    path = _rank0_path(path)
    info = read_info(path)
    models = _unwrap(chunks)
    metadata = dist_checkpointing.load_content_metadata(path) or _content_metadata("fully_reshardable")
    _check_shapes(path, models, metadata, "model.model")
    if optimizer is not None:
        _check_optimizer(path, info, optimizer)
    state = _sharded_state(models, optimizer, metadata, is_loading=True)
    loaded = dist_checkpointing.load(state, path)
    for key, model in zip(_model_keys(len(models)), models):
        model.load_state_dict(loaded[key], strict=True)
    if optimizer is not None:
        _load_optimizer(optimizer, loaded["optimizer"])
    return torch.load(os.path.join(path, META_FILENAME), map_location="cpu", weights_only=True)


def is_megatron_checkpoint(path: str) -> bool:
    """Whether ``path`` (or the directory a link such as ``last.ckpt`` points to) is one."""
    return os.path.isfile(os.path.join(path, INFO_FILENAME))


def read_info(path: str) -> dict[str, Any]:
    """The checkpoint's ``megatron.json``."""
    try:
        with open(os.path.join(path, INFO_FILENAME), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"The checkpoint {path!r} has no readable {INFO_FILENAME} ({exc}): it is not a complete "
                          "Megatron checkpoint.") from None
    if info.get("format") != FORMAT:
        raise ConfigError(f"The checkpoint {path!r} has a {INFO_FILENAME} of format {info.get('format')!r}, "
                          f"not {FORMAT!r}.")
    return info


# ------------------------------------------------------------------------------ export


def export_hf(ckpt_path: str, out: str, model: str, overwrite: bool = False) -> str:
    """Write a Megatron checkpoint's policy to ``out`` as a Hugging Face directory, in this process.

    A 1-process gloo group on 127.0.0.1 with megatron-core's parallel state at sizes 1 holds one
    unsharded ``GPTModel`` (``local`` layer spec, on the CPU, in the checkpoint's dtype);
    ``dist_checkpointing`` assembles its tensors from every rank's shards (the optimizer's state
    is not read); the converter names them as Hugging Face does and
    :func:`~lightning_fasync.export.hf.save_hf_from_stream` writes them with ``model``'s
    config and tokenizer. The group and the parallel state are torn down afterwards.

    Args:
        ckpt_path: the checkpoint directory (or a link to it).
        out: the directory to write.
        model: the policy (a preset or a local Hugging Face directory): tokenizer and, when the
            checkpoint records none, config.
        overwrite: write into a non-empty ``out``.
    """
    from megatron.core import dist_checkpointing

    from lightning_fasync.export.hf import save_hf_from_stream
    from lightning_fasync.policy import policy_skeleton
    from lightning_fasync.trainers.megatron import convert
    from lightning_fasync.trainers.megatron.model import build_gpt_model
    from lightning_fasync.weights.tensor_stream import TensorStream

    info = read_info(ckpt_path)
    if info.get("hf_config"):
        from transformers import AutoConfig

        recorded = dict(info["hf_config"])
        cfg = AutoConfig.for_model(recorded.pop("model_type"), **recorded)
    else:
        cfg = policy_skeleton(model, "--model")[0].config
    dtype = getattr(torch, info.get("params_dtype") or "float32")
    with _single_process_parallel_state():
        gpt = build_gpt_model(cfg, "local", use_cpu_initialization=True, perform_initialization=False,
                              params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
        metadata = dist_checkpointing.load_content_metadata(ckpt_path) or {}
        _check_shapes(ckpt_path, [gpt], metadata, "--model")
        loaded = dist_checkpointing.load({"model": gpt.sharded_state_dict(metadata=dict(metadata))}, ckpt_path)
        gpt.load_state_dict(loaded["model"], strict=True)
        hf = convert.megatron_to_hf(gpt.state_dict(), cfg, "local")
    return save_hf_from_stream(TensorStream.from_mapping(hf), model, out, overwrite=overwrite)


@contextlib.contextmanager
def _single_process_parallel_state() -> Iterator[None]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from lightning_fasync.fleet.launch import free_port

    if dist.is_initialized():
        raise RuntimeError("Exporting a Megatron checkpoint needs a process without a torch.distributed group; "
                           "run `lightning-fasync export` on its own.")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ helpers


def _rank0_path(path: Any) -> str:
    """Global rank 0's ``path`` on every rank: a temporary name may carry each rank's pid."""
    import torch.distributed as dist

    box = [os.fspath(path)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _unwrap(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The ``GPTModel``s: the keys of a wrapper's ``sharded_state_dict`` would carry ``module.``."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(chunks))


def _model_keys(n: int) -> list[str]:
    """Megatron-LM's names for the model chunks in the state dict (the shards' keys are global)."""
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def _content_metadata(optimizer_format: str) -> dict[str, Any]:
    """How the sharded state dicts are built (Megatron-LM's ``_build_sharded_state_dict_metadata``);
    saved in the checkpoint, so a load builds the same."""
    return {"distrib_optim_sharding_type": optimizer_format, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True}


def _sharded_state(models: list[torch.nn.Module], optimizer: Any, metadata: dict[str, Any],
                   is_loading: bool) -> dict[str, Any]:
    # Each call gets a copy: megatron-core adds its process group to the dict it is given.
    state: dict[str, Any] = {key: m.sharded_state_dict(metadata=dict(metadata))
                             for key, m in zip(_model_keys(len(models)), models)}
    if optimizer is not None:
        if is_loading:
            _allocate_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=dict(metadata))
    return state


def _parts(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in _parts(optimizer))


def _allocate_optimizer_state(optimizer: Any) -> None:
    """Give a fresh distributed optimizer the state a load fills in. With torch's Adam (no
    Transformer Engine or Apex) its ``state_dict`` reads each parameter's ``step``, which exists only
    after a step; megatron-core's own remedy is a step on zero gradients, whose effect on the main
    parameters the load overwrites."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    for opt in _parts(optimizer):
        if isinstance(opt, distrib_optimizer.DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


@torch.no_grad()
def _load_optimizer(optimizer: Any, state: Any) -> None:
    """``optimizer.load_state_dict`` without autograd (megatron-core 0.16's ``dp_reshardable`` loader
    copies into the main parameters, views of the model's when these are float32, without
    ``no_grad``), and two repairs of its distributed optimizer on torch's Adam (no Transformer
    Engine or Apex), whose state holds a ``step`` per parameter:

    - its ``load_state_dict`` gives every parameter the same ``step`` tensor, which Adam then
      advances once per parameter (``_foreach_add_``): each gets a copy of its own;
    - ``load_parameter_state_from_fully_reshardable`` copies every entry of that state from the
      checkpoint, which has no ``step``: the parameter state is loaded apart, the steps put aside.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = _parts(optimizer)
    states = [state] if len(parts) == 1 else [state[i] for i in range(len(parts))]
    apart = []
    for opt, sub in zip(parts, states):
        if isinstance(sub, dict) and sub.get("param_state_sharding_type") == "fully_reshardable":
            apart.append((opt, sub.pop("param_state")))
            sub.pop("param_state_sharding_type")
    optimizer.load_state_dict(state)
    for opt in parts:
        if isinstance(opt, DistributedOptimizer):
            for s in opt.optimizer.state.values():
                if isinstance(s.get("step"), torch.Tensor):
                    s["step"] = s["step"].clone()
    for opt, param_state in apart:
        inner = opt.optimizer.state
        steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
        try:
            opt.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for p, step in steps.items():
                inner[p]["step"] = step


def _layer_spec(model: torch.nn.Module) -> str:
    """``te`` when Transformer Engine's fused linear holds the input norm, else ``local``."""
    return "te" if any(k.endswith("linear_qkv.layer_norm_weight") for k in model.state_dict()) else "local"


def _parallel_sizes() -> dict[str, Optional[int]]:
    from megatron.core import parallel_state as ps

    return {
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def _global_shapes(models: list[torch.nn.Module], metadata: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Key -> global shape of the tensors these chunks hold (a factory's built tensors)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    shapes: dict[str, tuple[int, ...]] = {}
    for model in models:
        for item in nested_values(model.sharded_state_dict(metadata=dict(metadata))):
            built = item.build() if isinstance(item, ShardedTensorFactory) else item
            for t in nested_values(built) if isinstance(built, (dict, list)) else [built]:
                if isinstance(t, ShardedTensor):
                    shapes[t.key] = tuple(t.global_shape)
    return shapes


def _check_shapes(path: str, models: list[torch.nn.Module], metadata: dict[str, Any], key: str) -> None:
    """Refuse a checkpoint whose model tensors are not these chunks' (over all ranks: a pipeline
    stage holds some of them), before a load would fail in a collective."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    ours: dict[str, tuple[int, ...]] = {}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, _global_shapes(models, metadata))
    for shapes in every:
        ours.update(shapes)
    theirs = {k: tuple(t.global_shape) for k, t in dist_checkpointing.load_tensors_metadata(path).items()
              if not _OPTIMIZER_KEY.match(k)}
    differ = sorted(set(ours) ^ set(theirs)) or sorted(k for k in ours if ours[k] != theirs[k])
    if differ:
        first = differ[0]
        raise ConfigError(
            f"`{key}` builds a policy whose shape differs from the one in the checkpoint {path} (first difference: "
            f"{first!r} is {theirs.get(first, 'absent')} there and {ours.get(first, 'absent')} here); use the "
            "model it was trained from."
        )


def _check_optimizer(path: str, info: dict[str, Any], optimizer: Any) -> None:
    saved = info.get("optimizer")
    if saved is None:
        raise ConfigError(f"The checkpoint {path} holds no optimizer state (it was saved without an optimizer); "
                          "resuming needs one.")
    distributed = _is_distributed(optimizer)
    if saved["distributed"] != distributed:
        raise ConfigError(
            f"`{_STRATEGY_KEY}use_distributed_optimizer` is {distributed} but the checkpoint {path} was saved with "
            f"{saved['distributed']}; the optimizer states differ in format: resume with the saved value."
        )
    if distributed and saved.get("format") == "dp_reshardable":
        now, then = _parallel_sizes(), info.get("parallel") or {}
        for name in _SIZES:
            if now[name] != then.get(name):
                raise ConfigError(
                    f"`{_STRATEGY_KEY}{name}` is {now[name]} but the checkpoint {path} was saved with {then.get(name)} "
                    "and its optimizer state is dp_reshardable, which resumes with another data-parallel size only."
                )


def export_checkpoint(ckpt_path: str, out: str, model: Optional[str], overwrite: bool) -> str:
    """A ``MegatronStrategy`` checkpoint (megatron-core ``dist_checkpointing`` shards): assembled and
    converted in this process by :func:`export_hf` (``lightning-fasync export``; the policy
    named by ``model`` or, when None, by the checkpoint's ``model`` hyperparameter)."""
    name = model
    if not name:
        try:
            extra = torch.load(os.path.join(ckpt_path, META_FILENAME), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one message
            raise ConfigError(f"`--ckpt_path` {ckpt_path!r}: its {META_FILENAME} cannot be read: {exc}") from None
        name = ((extra.get("hyper_parameters") if isinstance(extra, dict) else None) or {}).get("model")
    if not name:
        raise ConfigError(
            f"`--ckpt_path` {ckpt_path!r} does not say which policy it trained (no `model` hyperparameter); "
            "pass --model (a preset or a Hugging Face directory)."
        )
    return export_hf(ckpt_path, out, str(name), overwrite=overwrite)
