"""Per-request sampling for a batch of next-token logits, vectorised over the batch.

Log-probs follow SGLang 0.5.23's sampler (``srt/layers/sampler.py``): they are of the distribution
the token was drawn from *before* top-k / top-p / min-p filtering, i.e. ``log_softmax(logits / T)``
at the request's temperature ``T`` (after ``min_new_tokens`` holds back the stop tokens), and of the
unscaled logits for greedy requests. With ``original=True`` (SGLang's
``SGLANG_RETURN_ORIGINAL_LOGPROB``) they are of the raw logits at temperature 1. At temperature 1
both are what a trainer recomputes with a plain forward pass; at another temperature the trainer
divides its logits by the same ``T`` (``RLPolicyModule(rollout_temperature=...)``).

Tokens are drawn by inverse-CDF sampling: one uniform number per row, one ``cumsum`` and one
``searchsorted`` for the whole batch. That is exactly a draw from the (filtered, tempered)
distribution, and on CPU it is an order of magnitude cheaper than ``torch.multinomial``, which
dominated the sampling cost of a decode step. Unseeded rows share one uniform draw from the
engine's generator; a seeded request draws its uniform from its own generator, so its tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

GREEDY_EPS = 1e-6  # temperature below this means greedy, as in SGLang


def sample(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    top_ks: Sequence[int],
    generators: Sequence[Optional[torch.Generator]],
    default_generator: Optional[torch.Generator] = None,
    min_ps: Optional[Sequence[float]] = None,
    banned: Optional[Sequence[Optional[Sequence[int]]]] = None,
    original: bool = False,
) -> tuple[list[int], list[float]]:
    """Sample one token per row.

    Args:
        logits: ``[batch, vocab]`` float32 logits.
        temperatures: Per row; ``< GREEDY_EPS`` is greedy.
        top_ps: Per row nucleus threshold (1.0 disables).
        top_ks: Per row top-k (``<= 0`` disables).
        generators: Per row generator for seeded requests, or None.
        default_generator: Generator for the unseeded rows.
        min_ps: Per row min-p threshold (0 disables): tokens whose probability is below
            ``min_p`` times the most likely token's are dropped (after temperature, as SGLang).
        banned: Per row token ids that must not be sampled (``min_new_tokens`` holds back the stop
            tokens this way), or None.
        original: Log-probs of the raw logits (temperature 1, nothing held back) instead of SGLang's
            default (see the module docstring).

    Returns:
        ``(token_ids, log_probs)``: the sampled tokens and their log-probs.
    """
    batch, vocab = logits.shape
    # Batch-level checks at C speed (min/max over the lists), not a Python loop per row.
    uniform_t = min(temperatures) == 1.0 == max(temperatures)
    greedy = min(temperatures) < GREEDY_EPS
    filtered = min(top_ps) < 1.0 or (max(top_ks) > 0 and any(0 < k < vocab for k in top_ks))
    use_min_p = min_ps is not None and max(min_ps) > 0.0
    seeded = [i for i, g in enumerate(generators) if g is not None]
    raw = logits
    if banned is not None and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, list(ids)] = float("-inf")
    if uniform_t and not filtered and not use_min_p and raw is logits:
        # The common RL case (temperature 1, no filters): sample from the raw distribution itself
        # and take the log of the sampled tokens' probabilities only (a sampled token's probability
        # is > 0, so its log is as exact as log_softmax's, to float32 rounding).
        probs = torch.softmax(logits, dim=-1)
        tokens = _inverse_cdf(probs, seeded, generators, default_generator)
        return tokens.tolist(), probs.gather(1, tokens.unsqueeze(1)).log_().squeeze(1).tolist()
    # Greedy rows are scaled (and sampled) at temperature 1 here and replaced by their argmax below.
    scaled = logits if uniform_t or max(temperatures) < GREEDY_EPS else logits / _temps(temperatures, logits)
    reported = torch.log_softmax(raw if original else scaled, dim=-1)
    if max(temperatures) < GREEDY_EPS:
        tokens = logits.argmax(dim=-1)
    else:
        if filtered:
            scaled = _filter_top_k_top_p(scaled, top_ks, top_ps)
        if use_min_p:
            probs = torch.softmax(scaled, dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
            scaled = scaled.masked_fill(probs < floor, float("-inf"))
        tokens = _inverse_cdf(torch.softmax(scaled, dim=-1), seeded, generators, default_generator)
        if greedy:
            is_greedy = torch.tensor([t < GREEDY_EPS for t in temperatures], device=logits.device)
            tokens = torch.where(is_greedy, logits.argmax(dim=-1), tokens)
    chosen = reported.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), chosen.tolist()


def _temps(temperatures: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    """``[batch, 1]`` temperatures, greedy rows (``< GREEDY_EPS``) at 1."""
    return torch.tensor([t if t >= GREEDY_EPS else 1.0 for t in temperatures], device=like.device,
                        dtype=like.dtype).unsqueeze(1)


def reported_logprobs(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    banned: Optional[Sequence[Optional[Sequence[int]]]] = None,
    original: bool = False,
) -> torch.Tensor:
    """``[batch, vocab]`` log-probs of the distribution ``sample`` reports (for top-k and chosen-id
    log-probs): temperature-scaled with stop tokens held back, or raw with ``original``."""
    if original:
        return torch.log_softmax(logits, dim=-1)
    if banned is not None and any(banned):
        logits = logits.clone()
        for i, ids in enumerate(banned):
            if ids:
                logits[i, list(ids)] = float("-inf")
    return torch.log_softmax(logits / _temps(temperatures, logits), dim=-1)


def _inverse_cdf(
    probs: torch.Tensor,
    seeded: list[int],
    generators: Sequence[Optional[torch.Generator]],
    default_generator: Optional[torch.Generator],
) -> torch.Tensor:
    """One token per row of (possibly unnormalised) ``probs``: the first index whose CDF exceeds u.

    The CDF is accumulated in float64, so a token of zero probability (filtered out) is never
    picked: its CDF entry equals its predecessor's, and ``searchsorted(..., right=True)`` returns
    the first entry strictly above ``u``.
    """
    batch, vocab = probs.shape
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    if len(seeded) == batch:
        u = torch.empty((batch, 1), dtype=torch.float64, device=probs.device)
    else:
        u = torch.rand((batch, 1), dtype=torch.float64, device=probs.device, generator=default_generator)
    for i in seeded:  # a seeded request draws from its own stream: reproducible in any batch
        u[i] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=generators[i])
    u.mul_(cdf[:, -1:])
    return torch.searchsorted(cdf, u, right=True).clamp_(max=vocab - 1).squeeze(1)


def _filter_top_k_top_p(scaled: torch.Tensor, ks: Sequence[int], ps: Sequence[float]) -> torch.Tensor:
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    k_t = torch.tensor([k if 0 < k < vocab else vocab for k in ks], device=scaled.device)
    ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    drop = ranks >= k_t.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    p_t = torch.tensor(ps, device=scaled.device, dtype=probs.dtype)
    # Keep a token when the mass before it is below top_p (the first token is always kept).
    drop |= (probs.cumsum(dim=-1) - probs) >= p_t.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
