"""Per-token loss primitives: PPO clip (clip-higher, dual clip), k3 KL, and loss aggregation.

These are the building blocks of :func:`lightning_fasync.algorithms.policy_loss.policy_loss`;
each works on ``[batch, T]`` padded tensors and is usable on its own.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = [
    "LOSS_AGG_MODES",
    "masked_mean",
    "aggregate_loss",
    "ppo_clip_token_loss",
    "k3_kl",
    "approx_kl_k3",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

KL_LOG_RATIO_CLAMP = 20.0
"""``k3`` uses ``exp`` of a log-ratio; clamping it to +-20 keeps the value and its gradient finite."""


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is true; 0 (still in the graph) when the mask is empty.

    Masked-out entries are replaced with 0 by ``torch.where`` rather than multiplied by 0, so a
    NaN/inf at a padding position can neither leak into the value nor into the gradient.
    """
    mask = mask if mask.dtype == torch.bool else mask != 0
    picked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return picked.sum() / mask.sum().clamp(min=1).to(values.dtype)


def aggregate_loss(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   normalizer: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar.

    Modes (``algorithm.loss_agg_mode``):

    * ``token-mean``: ``sum_{i,t} m_it l_it / sum_{i,t} m_it``: every valid token weighs the same
      (DAPO's token-level loss, Yu et al. 2025, section 3.3).
    * ``seq-mean-token-sum``: ``(1/S) sum_i sum_t m_it l_it``.
    * ``seq-mean-token-mean``: ``(1/S) sum_i (sum_t m_it l_it / sum_t m_it)`` (the original GRPO
      objective, Shao et al. 2024, eq. 3).

    ``S`` is the number of sequences with at least one valid token: empty responses and fully
    masked sequences neither contribute nor dilute. Every denominator is clamped to >= 1, so an
    all-masked batch gives exactly 0 with a valid (all-zero) gradient.

    Args:
        loss_mat: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` valid tokens (the normaliser). Entries outside it are ignored even if
            non-finite.
        mode: One of :data:`LOSS_AGG_MODES`.
        normalizer: the denominator from this batch's count (tokens or sequences); default
            ``count.clamp(min=1)``. Data-parallel training passes :func:`data_parallel_normalizer`,
            so that the averaged gradients of the ranks' shares are those of the whole batch.

    Raises:
        ValueError: on an unknown ``mode`` or a shape mismatch.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"`mode` is {mode!r}; it must be one of {', '.join(LOSS_AGG_MODES)}.")
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"`loss_mat` has shape {tuple(loss_mat.shape)}; it must be [B, T] and match `mask` {tuple(mask.shape)}."
        )
    mask = mask if mask.dtype == torch.bool else mask != 0
    zero = torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)
    picked = torch.where(mask, loss_mat, zero)
    norm = normalizer if normalizer is not None else (lambda count: count.clamp(min=1))
    if mode == "token-mean":
        return picked.sum() / norm(mask.sum()).to(loss_mat.dtype)
    tokens_per_seq = mask.sum(dim=-1)
    nonempty = tokens_per_seq > 0
    num_seqs = norm(nonempty.sum()).to(loss_mat.dtype)
    seq_sum = picked.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / num_seqs
    seq_mean = seq_sum / tokens_per_seq.clamp(min=1).to(loss_mat.dtype)
    return seq_mean.sum() / num_seqs


def data_parallel_normalizer(size: int, group: Any = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The loss denominator for one of ``size`` data-parallel ranks (process ``group``; None: the
    global one): the batch's count summed over the ranks (clamped to >= 1), divided by ``size``.
    Each rank's loss is then ``sum(local) * size / total``, and the ranks' mean gradient (what DDP
    and FSDP average) is the gradient of ``sum(all) / total``: the single-process loss of the whole
    batch, whatever each rank's share of tokens. One small all-reduce per call (main thread)."""
    import torch.distributed as dist

    def normalize(count: torch.Tensor) -> torch.Tensor:
        total = count.detach().to(torch.float64).reshape(1).clone()
        dist.all_reduce(total, group=group)
        return (total.clamp(min=1) / size).reshape(())

    return normalize


def ppo_clip_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: Optional[float] = 3.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss with clip-higher and dual clip.

    With ``r = exp(log_probs - old_log_probs)``:

    * PPO (Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7), written as a
      loss: ``l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``.
    * Clip-higher (Yu et al. 2025, "DAPO", section 3.1): separate ``clip_low`` / ``clip_high``
      (defaults 0.2 / 0.28) so low-probability tokens can grow further.
    * Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL", eq. 5):
      for ``A < 0`` the loss is additionally capped, ``l = min(l, -A c)`` with ``c = dual_clip``
      (> 1; default 3.0), so a huge ratio on a bad token cannot produce an unbounded update.

    The log-ratio is clamped to +-20 before ``exp`` (finite values and gradients).

    Args:
        log_probs: ``[B, T]`` current log-probs (differentiable).
        old_log_probs: ``[B, T]`` old-policy log-probs (detached here).
        advantages: ``[B, T]`` advantages (detached here).
        clip_low: Lower clip epsilon (``ratio >= 1 - clip_low``), >= 0.
        clip_high: Upper clip epsilon (``ratio <= 1 + clip_high``), >= 0.
        dual_clip: Dual-clip bound ``c`` (> 1) or None to disable.

    Returns:
        ``(loss, clipped, dual_clipped)``: ``[B, T]`` per-token loss, and bool masks of the tokens
        where the clipped branch was strictly larger (``train/clip_ratio``) and where the dual
        clip bound was active (``train/dual_clip_ratio``).

    Raises:
        ValueError: on invalid clip parameters or a shape mismatch.
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"`clip_low`/`clip_high` are {clip_low}/{clip_high}; both must be >= 0.")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"`dual_clip` is {dual_clip}; it must be > 1 or None.")
    for name, t in (("old_log_probs", old_log_probs), ("advantages", advantages)):
        if t.shape != log_probs.shape:
            raise ValueError(
                f"`{name}` has shape {tuple(t.shape)}; it must match `log_probs` {tuple(log_probs.shape)}."
            )
    adv = advantages.detach()
    log_ratio = (log_probs - old_log_probs.detach()).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped_loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip is None:
        return clipped_loss, clipped, torch.zeros_like(clipped)
    pg3 = -adv * dual_clip
    negative = adv < 0
    dual_clipped = negative & (pg3 < clipped_loss)
    loss = torch.where(negative, torch.minimum(clipped_loss, pg3), clipped_loss)
    return loss, clipped, dual_clipped


def k3_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of ``KL(pi_theta || pi_ref)``: ``exp(d) - d - 1`` with ``d = ref - cur``.

    Source: J. Schulman, "Approximating KL Divergence" (2020), the ``k3`` estimator; used as
    the KL penalty in GRPO (Shao et al. 2024, eq. 4). Unbiased on tokens sampled from
    ``pi_theta``, always >= 0, low variance. ``d`` is clamped to +-20 before ``exp``.
    Gradients flow through ``log_probs`` only (the reference is detached).
    """
    if ref_log_probs.shape != log_probs.shape:
        raise ValueError(
            f"`ref_log_probs` has shape {tuple(ref_log_probs.shape)}; "
            f"it must match `log_probs` {tuple(log_probs.shape)}."
        )
    d = (ref_log_probs.detach() - log_probs).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    # expm1(d) - d, not exp(d) - d - 1: for |d| ~ 1e-10 the latter rounds to a tiny negative value,
    # while expm1(d) >= d holds in floating point too, so the estimator stays >= 0.
    return torch.expm1(d) - d


def approx_kl_k3(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> float:
    """``train/approx_kl``: masked mean of the k3 estimator of ``KL(pi_old || pi_theta)``.

    Per token ``(r - 1) - log r`` with ``r = pi_theta / pi_old`` (Schulman 2020, k3, samples from
    ``pi_old``); >= 0 and exactly 0 on-policy. Detached; returns a Python float.
    """
    return float(_approx_kl_k3(log_probs, old_log_probs, mask).item())


def _approx_kl_k3(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`approx_kl_k3` as a detached 0-dim tensor (no device sync)."""
    with torch.no_grad():
        log_r = (log_probs.detach() - old_log_probs.detach()).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        return masked_mean(torch.expm1(log_r) - log_r, mask)
