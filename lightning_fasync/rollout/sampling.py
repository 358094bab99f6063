"""Per-request sampling for a batch of next-token logits.

Log-probs follow SGLang's default: they are of the *raw* model distribution (``log_softmax`` of the
logits, temperature 1.0, before top-k/top-p), whatever temperature the token was sampled at. That
is what a trainer recomputes with a plain forward pass, so rollout and trainer log-probs agree.
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
) -> tuple[list[int], list[float]]:
    """Sample one token per row.

    Args:
        logits: ``[batch, vocab]`` float32 logits.
        temperatures: Per row; ``< GREEDY_EPS`` is greedy.
        top_ps: Per row nucleus threshold (1.0 disables).
        top_ks: Per row top-k (``<= 0`` disables).
        generators: Per row generator for seeded requests, or None.
        default_generator: Generator for the unseeded rows.

    Returns:
        ``(token_ids, log_probs)``: the sampled tokens and their raw-distribution log-probs.
    """
    batch, vocab = logits.shape
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    plain = all(
        t >= GREEDY_EPS and p >= 1.0 and not 0 < k < vocab and g is None
        for t, p, k, g in zip(temperatures, top_ps, top_ks, generators)
    )
    if plain:  # the common RL case, in a handful of ops
        if all(t == 1.0 for t in temperatures):
            probs = raw_logprobs.exp()
        else:
            temp = torch.tensor(temperatures, device=logits.device, dtype=logits.dtype)
            probs = torch.softmax(logits / temp.unsqueeze(1), dim=-1)
        picked = torch.multinomial(probs, 1, generator=default_generator)
        return picked.view(-1).tolist(), raw_logprobs.gather(1, picked).view(-1).tolist()
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    greedy = [i for i, t in enumerate(temperatures) if t < GREEDY_EPS]
    stochastic = [i for i, t in enumerate(temperatures) if t >= GREEDY_EPS]
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        tokens[idx] = logits[idx].argmax(dim=-1)
    if stochastic:
        idx = torch.tensor(stochastic, device=logits.device)
        temp = torch.tensor([temperatures[i] for i in stochastic], device=logits.device)
        scaled = logits[idx] / temp.unsqueeze(1)
        ks = [top_ks[i] for i in stochastic]
        ps = [top_ps[i] for i in stochastic]
        if any(0 < k < vocab for k in ks) or any(p < 1.0 for p in ps):
            scaled = _filter_top_k_top_p(scaled, ks, ps)
        probs = torch.softmax(scaled, dim=-1)
        seeded = [j for j, i in enumerate(stochastic) if generators[i] is not None]
        if len(seeded) == len(stochastic):
            picked = torch.empty(len(stochastic), dtype=torch.long, device=logits.device)
        else:
            picked = torch.multinomial(probs, 1, generator=default_generator).squeeze(1)
        for j in seeded:  # a seeded request draws from its own stream: reproducible in any batch
            picked[j] = torch.multinomial(probs[j], 1, generator=generators[stochastic[j]])[0]
        tokens[idx] = picked
    chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), chosen.tolist()


def _filter_top_k_top_p(scaled: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
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
