"""A check that a server serves the weights just pushed: its log-probs of a fixed probe against the
same log-probs computed on the trainer from the pushed tensors.

The probe is a request: it checks what the server's forward computes, not a digest of what it
loaded (servers repack some parameters, so their ``/weights_checker`` digests are not the
trainer's). What it reaches is the prompt log-probs: on SGLang and vLLM the forward that serves; on
the embedded engine a plain forward of its Hugging Face parameters (every update writes those, then
rebuilds its fused decode copies from them), so there it covers what the engine loaded.
``rollout.vllm_args.check_weights`` runs it after every vLLM push (``/v1/completions`` with
``prompt_logprobs``), ``rollout.check_weights`` after every push to the embedded, SGLang or
external engines (SGLang's ``/generate`` with ``return_logprob`` and ``logprob_start_len: 0``; under
the loaded adapter for ``rollout.weight_sync: adapter``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Optional, Sequence

import torch

__all__ = ["PROBE_TOKENS", "TOLERANCE", "probe_ids", "probe_reference", "reference_logprobs", "sglang_served_logprobs",
           "tolerance_for", "worst_gap"]

PROBE_TOKENS = 16
"""Tokens of the probe whose log-probs the check compares (:func:`probe_ids`)."""

TOLERANCE = {torch.float32: 1e-3}
"""The largest difference of a probe token's log-prob the check accepts, per served dtype (0.1 for
half precisions: the server computes in them, the reference in the trainer's dtype)."""


def probe_ids(vocab_size: int, n: int = PROBE_TOKENS) -> list[int]:
    """A fixed sequence of ``n`` token ids spread over the vocabulary (the same on every run)."""
    return [(7919 * (i + 1)) % vocab_size for i in range(n)]


def reference_logprobs(model: str, named: Mapping[str, torch.Tensor], ids: Sequence[int]) -> Optional[list[float]]:
    """The log-probs of ``ids[1:]`` after their prefixes under the policy ``model`` (a preset or a
    Hugging Face directory) holding ``named``: the model built on the meta device and given the
    tensors themselves (no copy), its rotary tables computed. None when ``named`` does not cover its
    parameters or a buffer cannot be computed (an architecture without ``model.rotary_emb``)."""
    from lightning_fasync.policy import policy_skeleton

    skeleton, _ = policy_skeleton(model, "model.model")
    try:
        skeleton.load_state_dict(dict(named), strict=False, assign=True)
    except (RuntimeError, ValueError):
        return None
    if getattr(skeleton.config, "tie_word_embeddings", False):
        skeleton.tie_weights()
    device = next(iter(named.values())).device
    rotary = getattr(getattr(skeleton, "model", None), "rotary_emb", None)
    if rotary is not None:
        with torch.device(device):
            skeleton.model.rotary_emb = type(rotary)(config=skeleton.config)
    if any(t.is_meta for t in (*skeleton.parameters(), *skeleton.buffers())):
        return None
    with torch.no_grad():
        logits = skeleton(torch.tensor([list(ids)], device=device)).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


async def probe_reference(model: str, named: Mapping[str, torch.Tensor]) -> Optional[tuple[list[int], list[float]]]:
    """The probe's token ids and its log-probs under ``model`` holding ``named`` (the reference a
    server's are held against), None when the tensors give no vocabulary or do not cover the model."""
    embed = next((t for n, t in named.items() if n.endswith("embed_tokens.weight")), None)
    if embed is None:
        return None
    ids = probe_ids(int(embed.shape[0]))
    reference = await asyncio.to_thread(reference_logprobs, model, named, ids)
    return None if reference is None else (ids, reference)


def worst_gap(served: Sequence[float], reference: Sequence[float]) -> float:
    """The largest difference of a probe token's log-prob between a server and the reference."""
    return max(abs(a - b) for a, b in zip(served, reference))


def tolerance_for(dtype: Any) -> float:
    """The check's tolerance for weights served in ``dtype`` (:data:`TOLERANCE`; 0.1 otherwise)."""
    return TOLERANCE.get(dtype, 0.1)


async def sglang_served_logprobs(client: Any, url: str, ids: Sequence[int], timeout_s: float,
                                 lora_name: Optional[str] = None) -> list[float]:
    """The log-probs of ``ids[1:]`` as one server speaking SGLang's API computes them: ``/generate``
    with ``return_logprob`` from position 0 (``input_token_logprobs``, whose first entry has none),
    under the loaded adapter ``lora_name`` (SGLang's ``lora_path``) when given."""
    body: dict[str, Any] = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                            "return_logprob": True, "logprob_start_len": 0}
    if lora_name is not None:
        body["lora_path"] = lora_name
    answer = await client._request("POST", url + "/generate", body, timeout=timeout_s)
    entries = answer["meta_info"]["input_token_logprobs"][1:]
    return [float(entry[0]) for entry in entries]
