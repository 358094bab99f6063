"""LoRA adapters through ``peft``: wrap a policy, and the views of it that leave the trainer (docs/lora.md).

The trainer side (:func:`apply_lora`, :func:`merged_state_dict`, :func:`adapter_state_dict`) uses
peft's own classes: ``peft.get_peft_model`` wraps the Hugging Face model, and the merged view adds
each layer's ``get_delta_weight`` (B·A·scale, as ``merge_and_unload`` adds it) to a copy of its
frozen base weight, never to the weight itself. The adapter travels in peft's saved format (a
directory with ``adapter_config.json`` and ``adapter_model.safetensors``, which SGLang, vLLM and
``peft.PeftModel.from_pretrained`` load): :func:`write_adapter_dir`, :func:`read_adapter_dir`.
The engine side (:func:`adapter_deltas`, :func:`merge_weight`) reads that format with torch and
safetensors alone.

This module imports nothing of the package but the config schema and ``errors``.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import json
import math
import os
import stat
from typing import Any, Iterable, Mapping, Optional

import torch

from lightning_fasync.config.schema import LoRAConfig
from lightning_fasync.errors import ConfigError

__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_CONFIG_MAX_BYTES", "ADAPTER_NAME", "ADAPTER_WEIGHTS", "ADAPTER_WEIGHTS_MAX_BYTES",
    "LORA_FINGERPRINT_KEY", "PEFT_PREFIX", "AdapterWeights", "LoRADelta", "adapter_config",
    "adapter_deltas", "adapter_state_dict", "apply_lora", "as_lora_config", "base_fingerprint", "base_weights",
    "is_lora", "merge_weight", "merged_state_dict", "merged_weights", "read_adapter_dir", "write_adapter_dir",
]

ADAPTER_NAME = "default"
"""peft's name of the one adapter the trainer trains."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What peft's saved adapter names put before the Hugging Face module names."""
LORA_FINGERPRINT_KEY = "lora_base_fingerprint"
"""The state-dict entry of a LoRA module's checkpoint that identifies the base its adapter was trained on
(``uint8`` SHA-256 bytes of :func:`base_fingerprint`): ``RLPolicyModule`` writes it, ``export/hf.py`` reads it."""


def as_lora_config(value: Any) -> Optional[LoRAConfig]:
    """``model.lora`` as a checked :class:`LoRAConfig`: given as one, as a dict of its fields
    (code, a checkpoint's hyperparameters), or None (full fine-tuning)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(LoRAConfig.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"`model.lora.{unknown[0]}` is not a key of model.lora; it takes "
                              f"{', '.join(LoRAConfig.__dataclass_fields__)}.")
        value = LoRAConfig(**{**value, "target_modules": list(value.get("target_modules") or LoRAConfig().target_modules)})
    if not isinstance(value, LoRAConfig):
        raise ConfigError(f"`model.lora` is {value!r}; it must be null or a mapping of r, alpha, dropout, "
                          "target_modules and sync.")
    value.check()
    return value


# ------------------------------------------------------------------------------ the trainer's side


def _linear_targets(model: torch.nn.Module, targets: Iterable[str]) -> dict[str, list[str]]:
    """Each target name -> the linear layers it names (by the end of their module path, as peft matches)."""
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return {t: [n for n in linears if n == t or n.endswith("." + t)] for t in targets}


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig) -> torch.nn.Module:
    """``model`` (a Hugging Face causal LM) wrapped by ``peft.get_peft_model`` with ``cfg``'s adapters:
    its own weights frozen, the adapters' A (random) and B (zeros) trainable, so the wrapped model
    computes exactly what ``model`` did until B moves.

    Raises:
        ConfigError: a target module that names no linear layer of ``model``, or one whose weight is
            tied to another (a tied ``lm_head``: a merged update would change the embeddings too).
    """
    from peft import LoraConfig, get_peft_model

    cfg.check()
    found = _linear_targets(model, cfg.target_modules)
    missing = [t for t, hits in found.items() if not hits]
    if missing:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(
            f"`model.lora.target_modules` names {missing[0]!r}, which matches no linear layer of the policy; "
            f"its linear layers are {', '.join(names)}."
        )
    tied = _tied_targets(model, [n for hits in found.values() for n in hits])
    if tied:
        raise ConfigError(
            f"`model.lora.target_modules` selects {tied[0]!r}, whose weight is tied to another parameter (tied "
            "embeddings); an adapter there would change both: leave it out."
        )
    peft_config = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, peft_config)


def _tied_targets(model: torch.nn.Module, modules: list[str]) -> list[str]:
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    subs = dict(model.named_modules())
    return [n for n in modules if owners.get(id(subs[n].weight), 0) > 1]


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a peft-wrapped policy (:func:`apply_lora`)."""
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency; without it nothing can be wrapped
        return False
    return isinstance(model, PeftModel)


def _lora_layers(peft_model: Any) -> dict[str, Any]:
    """Module path (Hugging Face naming) -> peft LoRA layer, for every layer with an adapter."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in peft_model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


def _hf_name(key: str) -> str:
    """A wrapped model's state-dict key as the unwrapped model names it."""
    return key.replace(".base_layer.", ".")


@torch.no_grad()
def merged_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The policy as a plain Hugging Face state dict, each adapted weight replaced by base + B·A·scale.

    Keys are the unwrapped model's (no ``base_model.model.`` prefix, no ``base_layer``, no
    ``lora_`` tensors), in its state-dict order, a tied tensor under both names as in any state dict.
    The merged tensors are new (peft's ``get_delta_weight`` of the active adapter added to the base
    weight, as ``merge_and_unload`` adds it in place); every other tensor is the model's own,
    detached. Nothing of the model is modified.
    """
    layers = _lora_layers(peft_model)
    merged = {name + ".base_layer.weight": m for name, m in layers.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in peft_model.get_base_model().state_dict().items():
        if ".lora_" in key:
            continue
        layer = merged.get(key)
        if layer is not None:
            value = value + layer.get_delta_weight(ADAPTER_NAME).to(value.dtype)
        out[_hf_name(key)] = value.detach()
    return out


def base_weights(peft_model: Any) -> dict[str, torch.Tensor]:
    """The frozen base weights under Hugging Face names (the model's own tensors, not copies)."""
    return {_hf_name(k): v.detach() for k, v in peft_model.get_base_model().state_dict().items() if ".lora_" not in k}


def adapter_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The trained adapter as peft saves it (``get_peft_model_state_dict``: ``base_model.model.<module>.lora_A.weight``
    and ``lora_B``), detached; the tensors are the model's own, not copies."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: with lm_head (or the embeddings) targeted peft would add their frozen
    # base weights to the adapter; they are the base's, unchanged, and not the adapter's to send.
    state = get_peft_model_state_dict(peft_model, adapter_name=ADAPTER_NAME, save_embedding_layers=False)
    return {k: v.detach() for k, v in state.items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def adapter_config(peft_model: Any, base_model_name_or_path: Optional[str] = None) -> dict[str, Any]:
    """The ``adapter_config.json`` peft's ``save_pretrained`` writes for the trained adapter (inference mode)."""
    config = _jsonable(peft_model.peft_config[ADAPTER_NAME].to_dict())
    config["inference_mode"] = True
    if base_model_name_or_path is not None:
        config["base_model_name_or_path"] = base_model_name_or_path
    return config


class AdapterWeights(dict):
    """What ``RLPolicyModule.engine_state_dict()`` gives with ``model.lora.sync: adapter``: the adapter's
    tensors in peft's saved naming (a plain mapping to every path), with what an adapter push needs beside them.

    Attributes:
        config: the ``adapter_config.json`` contents.
        base: the frozen base weights under Hugging Face names (references): what an engine restarted
            from the base model holds before it loads the adapter.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                 base: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        super().__init__(tensors)
        self.config = dict(config)
        self.base = base


def write_adapter_dir(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], directory: str) -> str:
    """Write an adapter in peft's saved format into ``directory`` (created): ``adapter_model.safetensors``
    (each tensor a contiguous CPU copy) and ``adapter_config.json``. Returns ``directory``."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()},
              os.path.join(directory, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(directory, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(dict(config), f, indent=2, sort_keys=True)
    return directory


ADAPTER_CONFIG_MAX_BYTES = 2**20
"""The largest ``adapter_config.json`` :func:`read_adapter_dir` reads (peft's are a few hundred bytes)."""
ADAPTER_WEIGHTS_MAX_BYTES = 4 * 2**30
"""The largest ``adapter_model.safetensors`` :func:`read_adapter_dir` reads."""


def _open_adapter_file(path: str, limit: int) -> int:
    """A read-only descriptor of ``path``, an adapter directory's own file: a regular file of at most
    ``limit`` bytes, and not a symbolic link (``O_NOFOLLOW``: a link could point anywhere, past the
    check of the directory). ``O_NONBLOCK`` keeps a FIFO from blocking the open.

    Raises:
        ValueError: anything else (the message names the file).
    """
    name = os.path.basename(path)
    if not hasattr(os, "O_NOFOLLOW") and os.path.islink(path):  # no O_NOFOLLOW (Windows): check first
        raise ValueError(f"{path!r} is a symbolic link; an adapter's {name} must be a regular file in its directory.")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ValueError(f"{path!r} does not exist: an adapter directory holds {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS}.") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise ValueError(f"{path!r} is a symbolic link; an adapter's {name} must be a regular file in its "
                             "directory.") from None
        raise ValueError(f"{path!r} cannot be opened: {exc.strerror or exc}.") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path!r} is not a regular file; an adapter's {name} must be one.")
        if info.st_size > limit:
            raise ValueError(f"{path!r} is {info.st_size} bytes, more than the {limit} bytes an adapter's {name} "
                             "may hold.")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_adapter_dir(directory: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An adapter directory's config and tensors (safetensors only: no pickle is ever read).

    Each file is read through a descriptor opened without following links, and must be a regular
    file within its size cap (:data:`ADAPTER_CONFIG_MAX_BYTES`, :data:`ADAPTER_WEIGHTS_MAX_BYTES`):
    the directory may have been checked (the engine's LoRA directory, ``engine/lora.py``), a link
    inside it could lead anywhere.

    Raises:
        ValueError: a missing, linked, oversized or malformed file (the message names it).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load, load_file

    config_path, weights_path = os.path.join(directory, ADAPTER_CONFIG), os.path.join(directory, ADAPTER_WEIGHTS)
    config_fd = _open_adapter_file(config_path, ADAPTER_CONFIG_MAX_BYTES)
    try:
        weights_fd = _open_adapter_file(weights_path, ADAPTER_WEIGHTS_MAX_BYTES)
    except BaseException:
        os.close(config_fd)
        raise
    try:
        with os.fdopen(config_fd, "rb") as f:
            raw = f.read(ADAPTER_CONFIG_MAX_BYTES + 1)
        if len(raw) > ADAPTER_CONFIG_MAX_BYTES:  # it grew since it was checked
            raise ValueError(f"{config_path!r} is more than the {ADAPTER_CONFIG_MAX_BYTES} bytes an adapter's "
                             f"{ADAPTER_CONFIG} may hold.")
        try:
            config = json.loads(raw.decode("utf-8"))
        except ValueError as exc:  # UnicodeDecodeError included
            raise ValueError(f"{config_path!r} is not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"{config_path!r} must hold a JSON object.")
        # The file this descriptor opened, whatever the name points to now: /dev/fd/N reopens it
        # (Linux, macOS) for safetensors' own reader; elsewhere its bytes are read.
        fd_path = f"/dev/fd/{weights_fd}"
        try:
            if os.path.exists(fd_path):
                tensors = load_file(fd_path)
            else:
                with os.fdopen(weights_fd, "rb") as f:
                    weights_fd = -1
                    data = f.read(ADAPTER_WEIGHTS_MAX_BYTES + 1)
                if len(data) > ADAPTER_WEIGHTS_MAX_BYTES:  # it grew since it was checked
                    raise ValueError(f"{weights_path!r} is more than the {ADAPTER_WEIGHTS_MAX_BYTES} bytes an "
                                     f"adapter's {ADAPTER_WEIGHTS} may hold.")
                tensors = load(data)
        except SafetensorError as exc:
            raise ValueError(f"{weights_path!r} is not a safetensors file: {exc}") from None
    finally:
        if weights_fd >= 0:
            os.close(weights_fd)
    return config, tensors


# ------------------------------------------------------------------------------ the engine's side


class LoRADelta:
    """One adapted linear layer of a loaded adapter: ``weight += scale * B @ A`` (transposed with
    ``fan_in_fan_out``)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool) -> None:
        self.a, self.b, self.scale, self.fan_in_fan_out = a, b, scale, fan_in_fan_out


def lora_scale(config: Mapping[str, Any]) -> float:
    """peft's scaling of the update: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``."""
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or not isinstance(alpha, (int, float)):
        raise ValueError(f"adapter_config.json must give an integer r > 0 and a number lora_alpha, got r={r!r}, "
                         f"lora_alpha={alpha!r}.")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


_UNSUPPORTED = ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layer_replication", "lora_bias",
                "trainable_token_indices", "target_parameters")


def adapter_deltas(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, LoRADelta]:
    """Hugging Face weight name (``model.layers.0.self_attn.q_proj.weight``) -> its :class:`LoRADelta`,
    from an adapter in peft's saved format.

    Raises:
        ValueError: not a LoRA adapter, a peft feature this merge does not apply (DoRA, per-layer
            ranks, extra trained modules), or tensors that do not pair up as A and B of one rank.
    """
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter_config.json has peft_type {config.get('peft_type')!r}; only LORA adapters load.")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise ValueError(f"adapter_config.json sets {key}, which this engine does not apply; train the adapter "
                             "without it.")
    scale = lora_scale(config)
    fan_in_fan_out = bool(config.get("fan_in_fan_out"))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        module, sep, part = name.rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight"):
            raise ValueError(f"adapter tensor {key!r} is neither a lora_A nor a lora_B weight.")
        pairs.setdefault(module, {})[part[0]] = tensor
    deltas: dict[str, LoRADelta] = {}
    for module, ab in pairs.items():
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise ValueError(f"the adapter of {module!r} has lora_{'B' if a is not None else 'A'} without its pair.")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] != config["r"]:
            raise ValueError(f"the adapter of {module!r} has A {tuple(a.shape)} and B {tuple(b.shape)}, which are not "
                             f"the two factors of one rank-{config['r']} update.")
        deltas[module + ".weight"] = LoRADelta(a, b, scale, fan_in_fan_out)
    if not deltas:
        raise ValueError("the adapter holds no tensors.")
    return deltas


@torch.no_grad()
def merge_weight(base: torch.Tensor, delta: LoRADelta) -> torch.Tensor:
    """``base + (B @ A) * scale`` as a new tensor of ``base``'s dtype and device: peft's own merge
    (``get_delta_weight`` added to the weight), computed in float32 (a bfloat16 or float16 base is
    cast up for it and the sum cast back once).

    The engine (loading an adapter) and the trainer (computing what a restarted engine must hold,
    :class:`~lightning_fasync.weights.lora_sync.AdapterKept`) call this with the same inputs and
    compare checksums; the product's sum over the rank runs in one order on CPU whatever the thread
    count (tests/lora checks it at 1 and 2 threads), so both get the same bits, and a replica whose
    bits differed would fail its check loudly rather than serve unchecked weights.

    Raises:
        ValueError: the update's shape is not ``base``'s.
    """
    b, a = delta.b.to(base.device, torch.float32), delta.a.to(base.device, torch.float32)
    update = b @ a
    if delta.fan_in_fan_out:
        update = update.t()
    if tuple(update.shape) != tuple(base.shape):
        raise ValueError(f"the adapter's update has shape {tuple(update.shape)}, the weight {tuple(base.shape)}.")
    if base.dtype == torch.float32:
        return base + update * delta.scale
    return (base.to(torch.float32) + update * delta.scale).to(base.dtype)


def merged_weights(base: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                   tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``base`` (Hugging Face names) with each adapted weight merged by :func:`merge_weight`: what an
    engine that loaded the adapter onto ``base`` holds.

    Raises:
        ValueError: an adapted weight that ``base`` lacks, or one of another shape.
    """
    deltas = adapter_deltas(config, tensors)
    unknown = sorted(set(deltas) - set(base))
    if unknown:
        raise ValueError(f"the adapter targets {unknown[0]!r}, which is not a weight of the model.")
    return {name: (merge_weight(t, deltas[name]) if name in deltas else t) for name, t in base.items()}


def base_fingerprint(peft_model: Any, sample: int = 4096) -> str:
    """A SHA-256 (hex) over the base weights' names, shapes, dtypes and a strided sample of each one's
    values: cheap at any size, and it tells a base rebuilt from another model (or another seed) from
    the one a checkpoint's adapter was trained on."""
    h = hashlib.sha256()
    for name, tensor in base_weights(peft_model).items():
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // sample)
        picked = flat[::step][:sample].to("cpu").contiguous()
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(memoryview(picked.view(torch.uint8).numpy()) if picked.numel() else b"")
    return h.hexdigest()
