"""The policy loss: sanitise inputs, apply the off-policy corrections, clip, aggregate, report.

:func:`policy_loss` reads every knob from an :class:`~lightning_fasync.config.AlgorithmConfig`
(``algorithm.*``), the config object itself.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from lightning_fasync.algorithms.corrections import (
    _broadcast_advantages,
    _is_correction_weights,
    m2po_mask,
    opsm_mask,
)
from lightning_fasync.algorithms.losses import (
    LOSS_AGG_MODES,
    _approx_kl_k3,
    aggregate_loss,
    k3_kl,
    masked_mean,
    ppo_clip_token_loss,
)
from lightning_fasync.config import AlgorithmConfig

__all__ = ["LOSS_METRIC_KEYS", "REF_METRIC_KEYS", "policy_loss"]

LOSS_METRIC_KEYS = (
    "train/loss",
    "train/pg_loss",
    "train/entropy",
    "train/approx_kl",
    "train/clip_ratio",
    "train/dual_clip_ratio",
    "train/nan_ratio",
    "train/is_mean",
    "train/is_max",
    "train/is_clip_ratio",
    "train/m2po_mask_ratio",
    "train/opsm_mask_ratio",
)
"""Keys of the metrics dict returned by :func:`policy_loss`. ``train/grad_norm`` is not among
them: it exists only after ``backward()``; see :func:`lightning_fasync.algorithms.metrics.grad_norm_metric`."""

REF_METRIC_KEYS = ("train/ref_kl",)
"""Keys :func:`policy_loss` adds when it is given ``ref_log_probs`` (whatever ``kl_coef``):
``train/ref_kl`` is the KL term ``agg(k3(log_probs, ref_log_probs))`` itself, so
``train/loss = pg_loss - entropy_coef * H + kl_coef * ref_kl``."""


def _check(name: str, t: Optional[torch.Tensor], shape: torch.Size) -> None:
    if t is not None and t.shape != shape:
        raise ValueError(f"`{name}` has shape {tuple(t.shape)}; it must match `log_probs` {tuple(shape)}.")


def _fraction(flags: torch.Tensor, over: torch.Tensor) -> torch.Tensor:
    """Fraction of ``over`` where ``flags`` holds (0 when ``over`` is empty), as a 0-dim tensor."""
    return (flags & over).sum().to(torch.float64) / over.sum().clamp(min=1).to(torch.float64)


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    rollout_log_probs: Optional[torch.Tensor],
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cfg: Optional[AlgorithmConfig] = None,
    *,
    entropy: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    nan_mask: Optional[torch.Tensor] = None,
    normalizer: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss with IS correction, M2PO, OPSM, entropy and KL terms.

    ``loss = pg_loss - entropy_coef * H + kl_coef * KL`` where

    * ``pg_loss = agg(w_t * keep_t * l_t)``: ``l_t`` is the PPO clip-higher / dual-clip token
      loss (:func:`~lightning_fasync.algorithms.losses.ppo_clip_token_loss`) against
      ``old_log_probs``; ``w_t`` the detached IS weight ``pi_old / pi_rollout``
      (:func:`~lightning_fasync.algorithms.corrections.is_correction_weights`, when enabled);
      ``keep_t`` the M2PO and OPSM masks (when enabled). The correction masks zero a token's
      term but do not change the normaliser ``agg`` divides by (the valid response tokens), as
      in the DeepSeek-V3.2 OPSM objective, so masking never up-weights the remaining tokens.
    * ``H = agg(entropy)`` and ``KL = agg(k3(log_probs, ref_log_probs))`` over the valid tokens
      (k3 estimator of ``KL(pi_theta || pi_ref)``, see
      :func:`~lightning_fasync.algorithms.losses.k3_kl`); the off-policy masks do not apply to them.

    Robustness: a sequence is *broken* when ``nan_mask`` flags it (a non-finite reward, see
    :func:`~lightning_fasync.algorithms.advantages.grpo_advantages`), or when its advantage,
    or any of its valid tokens' log-probs / entropy / reference log-probs, is non-finite. Broken
    sequences are removed from the loss entirely (values replaced by 0 with ``torch.where``, so
    no NaN reaches the value or the gradient). ``train/nan_ratio`` is the fraction of the
    batch's sequences that are broken or have no valid response token (empty response, fully
    masked). If nothing is left the loss is exactly 0, still attached to ``log_probs``' graph.

    Args:
        log_probs: ``[B, T]`` current-policy log-probs of the sampled tokens (differentiable).
        old_log_probs: ``[B, T]`` trainer old-policy log-probs (pi_old; the PPO anchor).
        rollout_log_probs: ``[B, T]`` engine (behaviour) log-probs, or None. Required by IS
            correction and M2PO; OPSM uses them as the behaviour policy when given.
        advantages: ``[B]`` per-sequence or ``[B, T]`` per-token advantages.
        response_mask: ``[B, T]`` trained response tokens (bool / int / float).
        entropy: ``[B, T]`` per-token entropy of the current policy (differentiable), or None.
        ref_log_probs: ``[B, T]`` reference-policy log-probs, or None.
        cfg: ``algorithm.*`` (an :class:`~lightning_fasync.config.AlgorithmConfig`): PPO
            clipping (``clip_low``, ``clip_high``, ``dual_clip``), ``loss_agg_mode`` (one of
            :data:`~lightning_fasync.algorithms.losses.LOSS_AGG_MODES`), ``entropy_coef``
            (non-zero needs ``entropy``), ``kl_coef`` (non-zero needs ``ref_log_probs``),
            ``is_correction.*``, ``m2po.*``, ``opsm.*``. None: the defaults (token-mean, clip
            0.2/0.28, dual clip 3.0, no entropy or KL term, the corrections off).
        nan_mask: ``[B]`` bool, True for samples whose reward was non-finite.
        normalizer: the aggregation's denominator from a count (see
            :func:`~lightning_fasync.algorithms.losses.aggregate_loss`); data-parallel training
            passes :func:`~lightning_fasync.algorithms.losses.data_parallel_normalizer`.

    Returns:
        ``(loss, metrics)``: a scalar tensor and a dict of Python floats with the keys
        :data:`LOSS_METRIC_KEYS`, plus :data:`REF_METRIC_KEYS` (``train/ref_kl``, the KL term
        with the loss's aggregation) when ``ref_log_probs`` is given. Token fractions
        (``clip_ratio``, ``dual_clip_ratio``) are over the tokens that contribute to the PG term;
        ``approx_kl`` (k3 of ``KL(pi_old || pi_theta)``) and ``entropy`` are token means over the
        valid tokens. Without an ``entropy`` tensor,
        ``train/entropy`` is the sampled-token estimate ``-mean(log_probs)``.

    Raises:
        ValueError: on a shape mismatch, an unknown mode, or a coefficient whose input is missing.
    """
    cfg = cfg if cfg is not None else AlgorithmConfig()
    clip_low, clip_high, dual_clip = cfg.clip_low, cfg.clip_high, cfg.dual_clip
    loss_agg_mode, entropy_coef, kl_coef = cfg.loss_agg_mode, cfg.entropy_coef, cfg.kl_coef
    isc, m2po, opsm = cfg.is_correction, cfg.m2po, cfg.opsm
    if log_probs.dim() != 2:
        raise ValueError(f"`log_probs` has shape {tuple(log_probs.shape)}; it must be 2-D [batch, T].")
    shape = log_probs.shape
    for name, t in (
        ("old_log_probs", old_log_probs),
        ("rollout_log_probs", rollout_log_probs),
        ("response_mask", response_mask),
        ("entropy", entropy),
        ("ref_log_probs", ref_log_probs),
    ):
        _check(name, t, shape)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"`loss_agg_mode` is {loss_agg_mode!r}; it must be one of {', '.join(LOSS_AGG_MODES)}.")
    if entropy_coef != 0 and entropy is None:
        raise ValueError(f"`entropy` is None while `entropy_coef` is {entropy_coef}; pass the per-token entropy.")
    if kl_coef != 0 and ref_log_probs is None:
        raise ValueError(f"`ref_log_probs` is None while `kl_coef` is {kl_coef}; pass the reference log-probs.")
    if (isc.enable or m2po.enable) and rollout_log_probs is None:
        raise ValueError("`rollout_log_probs` is None while IS correction or M2PO is enabled; both need them.")
    if nan_mask is not None and nan_mask.shape != shape[:1]:
        raise ValueError(f"`nan_mask` has shape {tuple(nan_mask.shape)}; it must be [{shape[0]}].")

    device = log_probs.device
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=device)
    base_mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    adv = _broadcast_advantages(advantages, base_mask).detach().to(dtype)

    # --- find broken sequences and drop them (torch.where keeps NaN out of value and grad) ----
    with torch.no_grad():
        bad_tok = ~torch.isfinite(adv)
        for t in (log_probs, old_log_probs, rollout_log_probs, entropy, ref_log_probs):
            if t is not None:
                bad_tok |= ~torch.isfinite(t.detach())
        broken = (bad_tok & base_mask).any(dim=-1)
        if nan_mask is not None:
            broken |= nan_mask.to(device=device, dtype=torch.bool)
        mask = base_mask & ~broken.unsqueeze(-1)
        empty = ~mask.any(dim=-1)
        nan_ratio = empty.sum().to(torch.float64) / max(shape[0], 1)

    def clean(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else torch.where(mask, t.to(dtype), zero)

    lp = clean(log_probs)
    old = clean(old_log_probs.detach())
    rollout = clean(rollout_log_probs.detach()) if rollout_log_probs is not None else None
    adv = torch.where(mask, adv, zero)

    # --- off-policy corrections (all detached) -------------------------------------------------
    weights = torch.ones_like(adv)
    keep = mask
    # Metrics stay 0-dim tensors until the end: one device sync for all of them.
    metrics: dict[str, torch.Tensor] = {}
    if isc.enable:
        weights, is_metrics = _is_correction_weights(
            old, rollout, mask, level=isc.level, mode=isc.mode, c=isc.c, c_low=isc.c_low, c_high=isc.c_high
        )
        metrics.update(is_metrics)
    elif rollout is not None:
        # Diagnostics only: the raw token-level mismatch, nothing is reweighted.
        _, diag = _is_correction_weights(old, rollout, mask, level="token", mode="truncate", c=float("inf"))
        metrics.update(diag)
    else:
        one = torch.ones((), dtype=torch.float64, device=device)
        metrics.update({"train/is_mean": one, "train/is_max": one, "train/is_clip_ratio": 0.0 * one})

    m2po_dropped = torch.zeros_like(mask)
    if m2po.enable:
        m2po_keep = m2po_mask(old, rollout, mask, tau=m2po.tau)
        m2po_dropped = mask & ~m2po_keep
        keep = keep & m2po_keep
    metrics["train/m2po_mask_ratio"] = _fraction(m2po_dropped, mask)

    if opsm.enable:
        behaviour = rollout if rollout is not None else old
        opsm_keep = opsm_mask(behaviour, lp.detach(), adv, mask, delta=opsm.delta)
        opsm_seq = (mask & ~opsm_keep).any(dim=-1)
        keep = keep & opsm_keep
        metrics["train/opsm_mask_ratio"] = _fraction(opsm_seq, ~empty)
    else:
        metrics["train/opsm_mask_ratio"] = torch.zeros((), dtype=torch.float64, device=device)

    # --- PPO clip and aggregation --------------------------------------------------------------
    tok_loss, clipped, dual_clipped = ppo_clip_token_loss(
        lp, old, adv, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip
    )
    pg_weight = torch.where(keep, weights.detach(), zero)
    pg_loss = aggregate_loss(tok_loss * pg_weight, mask, loss_agg_mode, normalizer)
    loss = pg_loss
    if entropy is not None:
        ent = clean(entropy)
        ent_term = aggregate_loss(ent, mask, loss_agg_mode, normalizer)
        if entropy_coef != 0:
            loss = loss - entropy_coef * ent_term
        entropy_metric = masked_mean(ent.detach(), mask)
    else:
        entropy_metric = -masked_mean(lp.detach(), mask)
    keys = LOSS_METRIC_KEYS
    if ref_log_probs is not None:
        # Also with kl_coef == 0 (a reference kept for monitoring): reported, not in the loss.
        with torch.set_grad_enabled(kl_coef != 0 and torch.is_grad_enabled()):
            kl_term = aggregate_loss(k3_kl(lp, clean(ref_log_probs.detach())), mask, loss_agg_mode, normalizer)
        if kl_coef != 0:
            loss = loss + kl_coef * kl_term
        metrics["train/ref_kl"] = kl_term.detach()
        keys = LOSS_METRIC_KEYS + REF_METRIC_KEYS

    contributing = keep & (pg_weight != 0)
    metrics.update(
        {
            "train/loss": loss.detach(),
            "train/pg_loss": pg_loss.detach(),
            "train/entropy": entropy_metric,
            "train/approx_kl": _approx_kl_k3(lp, old, mask),
            "train/clip_ratio": _fraction(clipped, contributing),
            "train/dual_clip_ratio": _fraction(dual_clipped, contributing),
            "train/nan_ratio": nan_ratio,
        }
    )
    values = torch.stack([metrics[k].to(device=device, dtype=torch.float64) for k in keys]).tolist()
    return loss, dict(zip(keys, values))
