"""``lightning-fasync export``: a trained policy out of a Lightning checkpoint, as a Hugging Face
directory (config, safetensors weights, tokenizer) that ``transformers`` and ``lightning-fasync
serve`` load; and :func:`save_hf_from_stream`, the one writer of such a directory (``trainer.save_hf``
calls it at each checkpoint with the trainer's gathered weights).

A checkpoint is a file (single device, DDP), read with ``torch.load(weights_only=True)``, or a
directory (``ModelParallelStrategy``: ``torch.distributed.checkpoint`` shards plus Lightning's
``meta.pt``; or a link to one, such as ``last.ckpt``): its ``meta.pt`` is read with
``weights_only=True``, and only the policy's tensors are read from the shards, each assembled whole
in this one process (no process group; the optimizer state is not read). A ``MegatronStrategy``
checkpoint (megatron-core ``dist_checkpointing`` shards, recognised by its ``megatron.json``) is
assembled into one unsharded ``GPTModel`` in this process and converted to Hugging Face names
(its trainer backend's ``export``, :func:`lightning_fasync.trainers.megatron.checkpoint.export_checkpoint`; the ``megatron`` extra). The policy is described by
the module's ``model`` hyperparameter (a preset or a Hugging Face directory: what ``RLPolicyModule``
was built from, or ``--model``), built on the meta device for its config, names and shapes; the
checkpoint's ``policy.*`` tensors are checked against them before any weight is read.

    lightning-fasync export --ckpt_path runs/tiny_cpu/lightning_logs/version_0/checkpoints/last.ckpt --out trained

A checkpoint of a LoRA run (``model.lora``; it holds the adapter and a fingerprint of the base) is
exported as the merged model (``--lora merged``, the default: base + B·A·scale, a plain Hugging
Face directory as above) or as the adapter alone (``--lora adapter``: peft's own ``save_pretrained``,
``adapter_config.json`` + ``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained``
loads onto the base model). Either way the base is rebuilt from the ``model`` hyperparameter (or
``--model``) with its weights and checked against the checkpoint's fingerprint first.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import re
import shutil
import sys
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch

from lightning_fasync.config import ConfigError
from lightning_fasync.lora import LORA_FINGERPRINT_KEY
from lightning_fasync.policy import policy_skeleton
from lightning_fasync.registry import TRAINERS

if TYPE_CHECKING:
    from lightning_fasync.weights.tensor_stream import TensorStream

__all__ = ["MAX_SHARD_BYTES", "export_checkpoint", "main", "policy_skeleton", "save_hf_from_stream"]

PREFIX = "policy."
"""``RLPolicyModule`` keeps the Hugging Face model as ``self.policy``."""


MAX_SHARD_BYTES = 5_000_000_000
"""The default largest safetensors file (``huggingface_hub``'s 5GB): the writer holds one such shard
plus one tensor in memory. A tensor larger than this is a shard of its own."""

META_FILENAME = "meta.pt"
"""What Lightning writes beside the shards of a sharded checkpoint: everything but model and
optimizer (``lightning.fabric.utilities.load._METADATA_FILENAME``)."""

_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


LORA_FORMATS = ("merged", "adapter")
"""``--lora``: what a LoRA run's checkpoint is exported as."""


def export_checkpoint(ckpt_path: str, out: str, model: Optional[str] = None, prefix: str = PREFIX,
                      overwrite: bool = False, lora: str = "merged") -> str:
    """Write the policy of a checkpoint to ``out`` as a Hugging Face directory; returns ``out``.

    Args:
        ckpt_path: A checkpoint written by ``lightning-fasync fit``: a file (single device, DDP) or a
            sharded checkpoint directory (``ModelParallelStrategy``), or a link to either.
        out: The directory to write (created; it must be empty unless ``overwrite``).
        model: The policy to rebuild (preset or Hugging Face directory); default: the checkpoint's
            ``model`` hyperparameter.
        prefix: The policy's prefix in the checkpoint's ``state_dict``.
        overwrite: Write into a non-empty ``out``.
        lora: For a LoRA run's checkpoint: ``merged`` (a Hugging Face directory) or ``adapter``
            (peft's format); see the module docstring.

    Raises:
        ConfigError: a missing or unreadable checkpoint, no model to rebuild, a non-empty ``out``,
            or weights whose names or shapes are not the model's (named in the message); ``--lora
            adapter`` for a checkpoint without an adapter; a base whose fingerprint is not the checkpoint's.
    """
    from lightning_fasync.weights.tensor_stream import TensorStream

    if not os.path.exists(ckpt_path):
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r} does not exist: give a checkpoint file or a sharded "
                          "checkpoint directory.")
    if lora not in LORA_FORMATS:
        raise ConfigError(f"`--lora` is {lora!r}; it must be one of {', '.join(LORA_FORMATS)}.")
    _check_out(out, overwrite, "--out", "pass --overwrite")
    for backend in TRAINERS.entries():  # a trainer backend with a checkpoint layout of its own exports it
        if backend.is_checkpoint is not None and backend.export is not None and backend.is_checkpoint(ckpt_path):
            if lora == "adapter":
                raise ConfigError(f"`--lora` is adapter, but {ckpt_path!r} is a {backend.name} checkpoint, which holds no "
                                  "LoRA adapter; export it without --lora.")
            return backend.export(ckpt_path, out, model, overwrite)
    sharded = os.path.isdir(ckpt_path)
    if sharded:
        found, hparams = _open_sharded(ckpt_path)
        shapes = {k: tuple(m.size) for k, m in found.items()}
    else:
        state_dict, hparams = _open_file(ckpt_path)
        shapes = {k: tuple(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    name = model or hparams.get("model")
    if not name:
        raise ConfigError(
            f"`--ckpt_path` {ckpt_path!r} does not say which policy it trained (no `model` hyperparameter); "
            "pass --model (a preset or a Hugging Face directory)."
        )
    if not sharded and _LORA_FINGERPRINT in state_dict:
        return _export_lora(state_dict, hparams, str(name), out, prefix, overwrite, lora, ckpt_path)
    if lora == "adapter":
        raise ConfigError(f"`--lora` is adapter, but the checkpoint {ckpt_path!r} holds no LoRA adapter (a full "
                          "fine-tuning run); export it without --lora.")
    skeleton, tokenizer = policy_skeleton(str(name), "--model")
    expected = _expected(skeleton)
    # A tied tensor's second name (a tied lm_head), which the checkpoint may list too, is not written.
    aliases = set(skeleton.state_dict()) - set(expected)
    theirs = {k[len(prefix):]: s for k, s in shapes.items() if k.startswith(prefix) and k[len(prefix):] not in aliases}
    problems = _misfit(theirs, expected)
    if problems:
        raise ConfigError(
            f"The checkpoint's `{prefix}*` weights do not fit {name!r}: {problems}. Pass the --model it was "
            "trained from (and --prefix if the module names it otherwise)."
        )
    if sharded:
        loaded = _load_sharded(ckpt_path, {prefix + k: found[prefix + k] for k in expected})
        tensors = {k: loaded[prefix + k] for k in expected}
    else:
        tensors = {k: state_dict[prefix + k] for k in expected}
    return _write_hf(TensorStream.from_mapping(tensors), skeleton, tokenizer, out, MAX_SHARD_BYTES, overwrite)


def save_hf_from_stream(stream: "TensorStream", model: str, out: str, max_shard_bytes: int = MAX_SHARD_BYTES, *,
                        overwrite: bool = False) -> str:
    """Write ``stream``'s tensors with ``model``'s config and tokenizer to ``out`` as a Hugging Face
    directory, as ``save_pretrained`` lays it out; returns ``out``.

    The weights are ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` files of at most
    ``max_shard_bytes`` each (a larger tensor alone) with ``model.safetensors.index.json``, planned
    from ``stream.specs`` (in their order) before the first tensor is taken. The stream is iterated
    exactly once, in order, on the calling thread; each tensor is copied to the CPU as it arrives
    and a shard is written as soon as it is complete, so at most one shard plus one tensor is held.
    ``config.json`` takes its ``dtype`` from the stream's first floating-point tensor.

    Everything is written to a temporary directory beside ``out`` and renamed into place once
    complete: a new or empty ``out`` appears whole or not at all. With ``overwrite``, a non-empty
    ``out`` receives the files one by one (each replaced atomically, not the set), and weight
    files of an earlier save that this one does not have are removed.

    On an exception nothing is left at ``out`` (nor the temporary directory), and the rest of the
    stream is not taken: a caller whose stream runs collectives drains it.

    Args:
        stream: The weights in Hugging Face naming, not yet consumed; a tied tensor listed once,
            under its first name (``model.embed_tokens.weight``, not a tied ``lm_head.weight``), as
            ``save_pretrained`` writes it.
        model: The policy (a preset or a local Hugging Face directory); only its config and
            tokenizer are read (it is built on the meta device, without weights).
        out: The directory to write (created with its parents).
        max_shard_bytes: The largest safetensors file.
        overwrite: Write into a non-empty ``out``.

    Raises:
        ConfigError: ``model`` is neither a preset nor a directory, ``out`` exists and is not an
            empty directory (without ``overwrite``), or the stream's names or shapes are not
            ``model``'s (checked from its specs, before any tensor is taken).
        ValueError: ``max_shard_bytes`` is not positive.
        RuntimeError: the stream was already (partly) consumed, or produced a tensor unlike its spec.
    """
    if stream.consumed:
        raise RuntimeError(f"save_hf_from_stream needs a stream nothing was taken from; {stream.consumed} of "
                           f"its {len(stream)} tensors were.")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, not {max_shard_bytes}.")
    _check_out(out, overwrite, "out", "pass overwrite=True")
    skeleton, tokenizer = policy_skeleton(model, "model")
    problems = _misfit({s.name: s.shape for s in stream.specs}, _expected(skeleton))
    if problems:
        raise ConfigError(f"The stream's tensors do not fit {model!r}: {problems}.")
    return _write_hf(stream, skeleton, tokenizer, out, max_shard_bytes, overwrite)


# ------------------------------------------------------------------------------ LoRA runs


_LORA_FINGERPRINT = LORA_FINGERPRINT_KEY
"""``RLPolicyModule``'s state-dict entry of a LoRA run (:data:`~lightning_fasync.lora.LORA_FINGERPRINT_KEY`)."""


def _export_lora(state_dict: Mapping[str, Any], hparams: Mapping[str, Any], name: str, out: str, prefix: str,
                 overwrite: bool, lora: str, ckpt_path: str) -> str:
    """A LoRA run's checkpoint as the merged model or the adapter (module docstring)."""
    from lightning_fasync.lora import apply_lora, as_lora_config, base_fingerprint, merged_state_dict
    from lightning_fasync.policy import build_policy
    from lightning_fasync.weights.tensor_stream import TensorStream

    cfg = as_lora_config(hparams.get("lora"))
    if cfg is None:
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r} holds a LoRA adapter but no `lora` hyperparameter to rebuild "
                          "it with; it was not written by RLPolicyModule.")
    try:
        base, tokenizer = build_policy(name)
    except ValueError as exc:
        raise ConfigError(f"`--model` {name!r}: {exc}") from None
    policy = apply_lora(base, cfg)
    saved = torch.as_tensor(state_dict[_LORA_FINGERPRINT]).to(torch.uint8)
    if bytes(saved.tolist()).hex() != base_fingerprint(policy):
        raise ConfigError(f"`--model` {name!r} is not the base the checkpoint's LoRA adapter was trained on (their "
                          "fingerprints differ); pass the --model it was trained from.")
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    theirs = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if set(theirs) != trainable:
        diff = sorted(set(theirs) ^ trainable)
        raise ConfigError(f"The checkpoint's `{prefix}*` adapter does not fit {name!r} with model.lora {hparams['lora']}: "
                          f"first difference {diff[0]!r}.")
    policy.load_state_dict(theirs, strict=False)
    policy.eval()
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    if lora == "adapter":
        tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.{uuid.uuid4().hex[:12]}.partial")
        try:
            policy.save_pretrained(tmp, safe_serialization=True)  # peft's format, which PeftModel.from_pretrained loads
            tokenizer.save_pretrained(tmp)
            _publish(tmp, out, overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out
    skeleton, tokenizer = policy_skeleton(name, "--model")
    merged = merged_state_dict(policy)
    tensors = {k: merged[k] for k in _expected(skeleton)}
    return _write_hf(TensorStream.from_mapping(tensors), skeleton, tokenizer, out, MAX_SHARD_BYTES, overwrite)


# ------------------------------------------------------------------------------ reading checkpoints


def _open_file(ckpt_path: str) -> tuple[Mapping[str, Any], dict[str, Any]]:
    """A checkpoint file's ``state_dict`` and hyperparameters."""
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one message
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r} cannot be read as a checkpoint: {exc}") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r} has no `state_dict`: it is not a Lightning checkpoint.")
    return ckpt["state_dict"], ckpt.get("hyper_parameters") or {}


def _open_sharded(ckpt_path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A sharded checkpoint's ``state_dict`` tensors as DCP describes them (global shape, dtype),
    and the hyperparameters from its ``meta.pt``; no tensor is read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not os.path.isfile(os.path.join(ckpt_path, ".metadata")):
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r} is a directory without `.metadata`: it is not a sharded "
                          "(torch.distributed.checkpoint) checkpoint.")
    try:
        metadata = FileSystemReader(ckpt_path).read_metadata()
        meta_file = os.path.join(ckpt_path, META_FILENAME)
        extra = torch.load(meta_file, map_location="cpu", weights_only=True) if os.path.isfile(meta_file) else {}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one message
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r} cannot be read as a sharded checkpoint: {exc}") from None
    # DCP flattens {"state_dict": {"policy.x": t}} to the key "state_dict.policy.x"; its planner
    # data maps each key back to its path in the nested dict.
    planner_data = metadata.planner_data or {}
    found = {}
    for key, item in metadata.state_dict_metadata.items():
        where = planner_data.get(key) or tuple(key.split(".", 1))
        if len(where) == 2 and where[0] == "state_dict" and isinstance(item, TensorStorageMetadata):
            found[where[1]] = item
    if not found:
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r} has no `state_dict`: it is not a Lightning checkpoint.")
    hparams = extra.get("hyper_parameters") if isinstance(extra, dict) else None
    return found, hparams or {}


def _load_sharded(ckpt_path: str, items: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Full tensors for the ``state_dict`` entries ``items`` (key -> DCP metadata), each assembled
    from every rank's shards by ``torch.distributed.checkpoint.load`` in this one process."""
    from torch.distributed.checkpoint import FileSystemReader, load

    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in items.items()}
    try:
        with warnings.catch_warnings():  # no_dist says it already: one process, no process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # no_dist (torch >= 2.7): no collectives even inside a distributed job; older torch
            # reads in one process when no process group is initialised.
            single = {"no_dist": True} if "no_dist" in inspect.signature(load).parameters else {}
            load({"state_dict": state}, storage_reader=FileSystemReader(ckpt_path), **single)
    except Exception as exc:  # noqa: BLE001 - a damaged shard is one message
        raise ConfigError(f"`--ckpt_path` {ckpt_path!r}: the policy's shards cannot be read: {exc}") from None
    return state


# ------------------------------------------------------------------------------ the policy's layout


def _expected(skeleton: Any) -> dict[str, tuple[int, ...]]:
    """The tensors a Hugging Face directory of ``skeleton`` holds, in its state-dict order: a tied
    tensor once, under its first name (``embed_tokens``, as ``save_pretrained`` writes it)."""
    seen: set[int] = set()
    expected: dict[str, tuple[int, ...]] = {}
    for name, tensor in skeleton.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            expected[name] = tuple(tensor.shape)
    return expected


def _misfit(theirs: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> str:
    """What keeps ``theirs`` (name -> shape) from being the model's ``expected``; empty if nothing."""
    def few(keys: list[str]) -> str:
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    missing = sorted(set(expected) - set(theirs))
    unexpected = sorted(set(theirs) - set(expected))
    shapes = sorted(k for k in set(expected) & set(theirs) if tuple(expected[k]) != tuple(theirs[k]))
    problems = [f"{len(missing)} of the model's tensors are missing ({few(missing)})" if missing else "",
                f"{len(unexpected)} are not the model's ({few(unexpected)})" if unexpected else "",
                f"{len(shapes)} have another shape ({few(shapes)})" if shapes else ""]
    return "; ".join(p for p in problems if p)


# ------------------------------------------------------------------------------ writing


def _check_out(out: str, overwrite: bool, key: str, hint: str) -> None:
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ConfigError(f"`{key}` {out!r} exists and is not a directory; choose another path.")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ConfigError(f"`{key}` {out!r} exists and is not empty; choose another directory or {hint}.")


def _write_hf(stream: "TensorStream", skeleton: Any, tokenizer: Any, out: str, max_shard_bytes: int,
              overwrite: bool) -> str:
    """The one writer behind :func:`save_hf_from_stream` and :func:`export_checkpoint` (checked inputs)."""
    from huggingface_hub import split_state_dict_into_shards_factory
    from safetensors.torch import save_file

    # The shards are planned from the specs by the rule save_pretrained uses (in order; a new file
    # when the next tensor would pass the limit), so each is complete before the next one starts
    # (only a tensor over the limit, a file of its own, comes between).
    split = split_state_dict_into_shards_factory({s.name: s for s in stream.specs}, get_storage_size=lambda s: s.nbytes,
                                                 filename_pattern="model{suffix}.safetensors",
                                                 max_shard_size=max_shard_bytes)
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    # Beside `out`, so the final rename stays on one filesystem; os.mkdir (not mkdtemp, which is
    # private to the owner) so the directory gets the permissions any other would.
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.{uuid.uuid4().hex[:12]}.partial")
    os.mkdir(tmp)
    try:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in stream:
            filename = split.tensor_to_filename[name]
            shard = pending.setdefault(filename, {})
            # A copy of its own: a producer may reuse its buffer for the next tensor, and
            # safetensors refuses tensors that share storage.
            shard[name] = tensor.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            if len(shard) == len(split.filename_to_tensors[filename]):
                save_file(pending.pop(filename), os.path.join(tmp, filename), metadata={"format": "pt"})
        config = skeleton.config
        config.architectures = [type(skeleton).__name__]
        floating = [s.dtype for s in stream.specs if s.dtype.is_floating_point]
        if floating:
            config.dtype = str(floating[0]).split(".")[1]
        config.save_pretrained(tmp)
        if skeleton.can_generate():
            skeleton.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if split.is_sharded:
            total_parameters = sum(math.prod(s.shape) for s in stream.specs)
            index = {"metadata": {"total_parameters": total_parameters, **split.metadata},
                     "weight_map": split.tensor_to_filename}
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _publish(tmp: str, out: str, overwrite: bool) -> None:
    """Move the complete directory ``tmp`` to ``out``: one rename when ``out`` is new or empty
    (rename(2) replaces an empty directory); file by file into a non-empty ``out`` (``overwrite``),
    config last, then the earlier save's weight files that this one lacks are removed (as
    ``save_pretrained`` does: a stale ``model.safetensors`` would be loaded before an index)."""
    if not os.path.isdir(out) or not os.listdir(out):
        os.rename(tmp, out)
        return
    if not overwrite:  # it filled up while the stream was written
        raise ConfigError(f"`out` {out!r} exists and is not empty; choose another directory or pass overwrite=True.")
    written = sorted(os.listdir(tmp), key=lambda n: n == "config.json")
    for name in written:
        os.replace(os.path.join(tmp, name), os.path.join(out, name))
    for name in os.listdir(out):
        if name not in written and _WEIGHT_FILE.fullmatch(name):
            os.remove(os.path.join(out, name))
    os.rmdir(tmp)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-fasync export",
        description="Write a trained policy out of a `lightning-fasync fit` checkpoint as a Hugging Face directory "
                    "(config, safetensors weights, tokenizer) that transformers and `lightning-fasync serve` load.")
    parser.add_argument("--ckpt_path", required=True,
                        help="a checkpoint written by `lightning-fasync fit`: a file (single device, DDP), a sharded "
                             "checkpoint directory (model_parallel, megatron), or a link to either such as last.ckpt")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
    parser.add_argument("--model", default=None, help="the policy it trained (default: the checkpoint's `model`)")
    parser.add_argument("--prefix", default=PREFIX, help=f"the policy's prefix in the state_dict (default {PREFIX!r})")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    parser.add_argument("--lora", choices=LORA_FORMATS, default="merged",
                        help="a LoRA run's checkpoint: write the merged model (default) or the adapter alone in peft's "
                             "format (PeftModel.from_pretrained loads it onto the base model)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    out = export_checkpoint(args.ckpt_path, args.out, model=args.model, prefix=args.prefix, overwrite=args.overwrite,
                            lora=args.lora)
    if args.lora == "adapter" and os.path.isfile(os.path.join(out, "adapter_config.json")):
        print(f"Wrote {out}: peft.PeftModel.from_pretrained(base_model, {out!r}) loads the adapter onto the base model.")
        return 0
    print(f"Wrote {out}: transformers.AutoModelForCausalLM.from_pretrained({out!r}) loads it, "
          f"and `lightning-fasync serve --model {out}` serves it.")
    return 0
