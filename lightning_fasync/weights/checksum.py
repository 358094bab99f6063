"""Weight checksums as SGLang 0.5.23's ``/weights_checker`` computes them (action ``checksum``).

SGLang hashes every tensor of the served model (``srt/utils/weight_checker.py``): the parameters,
then the buffers, each to the first 8 bytes of the SHA-256 of its raw bytes (``tensor_hash`` in
``srt/managers/mm_utils.py``, the CPU path), written as 16 hex digits. Buffers recomputed from the
config (rotary caches) are left out. The embedded server answers ``/weights_checker`` with
``engine_checksum_body``; a trainer computes the same map from the tensors it pushed with
``checksums`` and checks a replica's report with ``compare``.

The bytes are hashed in the tensor's own dtype: compare tensors cast to the engine's dtype.
SGLang hashes CUDA tensors with a different function (a Triton kernel, ``gpu_tensor_hash``), so
these values match a real SGLang server only where it holds its weights on the CPU; the embedded
server always uses this rule, whatever its device.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import torch

# SGLang's ``_NON_PERSISTENT_BUFFER_PATTERNS`` (``sglang/srt/utils/weight_checker.py``, 0.5.23):
# substrings of buffer names that are derived from the config and never checksummed.
NON_PERSISTENT_BUFFER_PATTERNS = (
    "cos_sin_cache",
    "cos_cache",
    "sin_cache",
    "inv_freq",
    "freqs_cis",
    "expert_mask_gpu",
)

# The parallelism of the one rank the embedded engine has (SGLang's ``ParallelismInfo``).
_SINGLE_RANK = {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                "rank": 0, "size": 1}


def tensor_checksum(t: torch.Tensor) -> str:
    """The checksum SGLang reports for one tensor held on the CPU.

    The first 8 bytes of the SHA-256 of the tensor's raw bytes (a contiguous CPU copy, C order),
    read big-endian and written as 16 lowercase hex digits.

    Args:
        t: Any tensor (any device, dtype, layout); it is not modified.

    Returns:
        16 hex digits.
    """
    flat = t.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.sha256(memoryview(flat.view(torch.uint8).numpy())).digest()
    return f"{int.from_bytes(digest[:8], byteorder='big', signed=False):016x}"


def is_skipped(name: str, tensor: Any = None, skip: Sequence[str] = ()) -> bool:
    """True for a tensor SGLang leaves out of its checksums.

    Args:
        name: The tensor's name in the model.
        tensor: The tensor (one marked ``_skip_weight_check`` is left out, as in SGLang).
        skip: Substrings of names to leave out (SGLang's ``skip_tensor_list``).
    """
    return (
        any(pattern in name for pattern in NON_PERSISTENT_BUFFER_PATTERNS)
        or bool(getattr(tensor, "_skip_weight_check", False))
        or any(pattern in name for pattern in skip)
    )


def checksums(named: Mapping[str, torch.Tensor], skip: Sequence[str] = ()) -> dict[str, str]:
    """Checksums of named tensors, leaving out what SGLang leaves out.

    Args:
        named: Tensor name to tensor (a state dict, or the tensors of a weight update).
        skip: Substrings of names to leave out, besides SGLang's non-persistent buffers.

    Returns:
        Name to ``tensor_checksum``, in ``named``'s order.
    """
    return {name: tensor_checksum(t) for name, t in named.items() if not is_skipped(name, t, skip)}


def overall_checksum(sums: Mapping[str, str]) -> str:
    """SGLang's ``per_gpu_checksum``: SHA-256 (hex) over each name then its checksum, names sorted.

    Args:
        sums: Name to checksum, as ``checksums`` returns.
    """
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(name.encode())
        h.update(sums[name].encode())
    return h.hexdigest()


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors SGLang checksums: ``named_parameters()`` then ``named_buffers()`` (a buffer of
    the same name as a parameter wins, as in SGLang's ``dict``; tied parameters appear once)."""
    state: dict[str, torch.Tensor] = {}
    state.update(model.named_parameters())
    state.update(model.named_buffers())
    return state


def engine_checksum_body(model: torch.nn.Module, skip_tensor_list: Sequence[str] = ()) -> dict[str, Any]:
    """The ``/weights_checker`` response of a single-rank SGLang engine serving ``model``.

    Blocking (it hashes every tensor); run it off the event loop.

    Args:
        model: The served model.
        skip_tensor_list: Substrings of tensor names to leave out.

    Returns:
        ``{"success", "message", "ranks", "per_engine_checksum"}``: ``ranks`` holds one
        ``ChecksumInfo`` (``checksums``, ``per_gpu_checksum``, ``parallelism_info``, the last a
        list with the target runner's ``ParallelismInfo``); ``per_engine_checksum`` is the SHA-256
        over the ranks' ``per_gpu_checksum``.
    """
    sums = checksums(model_state(model), skip_tensor_list)
    per_gpu = overall_checksum(sums)
    rank = {"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": [{"role": "target", **_SINGLE_RANK}]}
    return {
        "success": True,
        "message": "Success.",
        "ranks": [rank],
        "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest(),
    }


def compare(expected: Mapping[str, str], reported: Mapping[str, str]) -> list[str]:
    """What differs between the checksums a replica reported and the expected ones.

    Names only in ``expected`` are not differences: the engine may leave some out (tied
    parameters, its non-persistent buffers, a ``skip_tensor_list``).

    Args:
        expected: Name to checksum of the weights the replica should hold (``checksums``).
        reported: Name to checksum the replica reported (``ranks[0]["checksums"]``).

    Returns:
        One line per difference, by name; empty when the replica holds the expected weights.
    """
    diffs: list[str] = []
    for name in sorted(reported):
        if name not in expected:
            diffs.append(f"{name}: reported by the engine ({reported[name]}) but not expected")
        elif reported[name] != expected[name]:
            diffs.append(f"{name}: checksum {reported[name]} on the engine, {expected[name]} expected")
    return diffs

