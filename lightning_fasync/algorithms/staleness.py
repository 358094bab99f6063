"""Version lag of consumed tokens, and how the off-policy corrections behave at each lag.

Every response token carries the weight version that generated it (``weight_versions``, -1 outside
responses). The trainer consumes it at rollout step ``current_version`` (its step-start weights are
that version: the rollout step and the weight version advance together at every step boundary), so
the token's *version lag* is ``current_version - weight_version``: 0 on-policy, 1 for data generated
one step earlier, and so on. One version is ``(B x N) // M`` optimizer updates.

:func:`version_lag_metrics` gives a fixed set of ``train/*`` keys (the same keys for every batch, so
data-parallel ranks can all-reduce them): the lag's mean / max / min over trained tokens, the mean
lag of whole trajectories (consumption step minus ``start_version``, the ledger's figure), the share
of tokens at lag 0, 1, 2 and >= 3, and, when log-probs are given, per-lag statistics of the
behaviour importance ratio ``rho = pi_old / pi_rollout`` and of the PPO clip.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["LAG_BUCKETS", "VERSION_LAG_KEYS", "prox_log_probs_loglinear", "version_lag", "version_lag_metrics"]

LAG_BUCKETS = ("0", "1", "2", "ge3")
"""Lag buckets of the per-lag metrics: lag 0, 1, 2 and 3 or more."""

_PER_LAG = ("token_frac", "is_mean", "is_max", "is_trunc_ratio", "m2", "clip_ratio")

VERSION_LAG_KEYS = (
    "train/version_lag_mean",
    "train/version_lag_max",
    "train/version_lag_min",
    "train/version_lag_seq_mean",
    *(f"train/lag_{b}/{name}" for b in LAG_BUCKETS for name in _PER_LAG),
)
"""Every key :func:`version_lag_metrics` returns, always all of them. Per-lag ``is_*``, ``m2`` and
``clip_ratio`` are NaN for a bucket with no tokens (or when their inputs are not given): the step
aggregation skips non-finite values, so an empty bucket does not pull a mean towards 0."""


def version_lag(
    weight_versions: torch.Tensor,
    response_mask: torch.Tensor,
    current_version: Union[int, torch.Tensor],
) -> torch.Tensor:
    """Per-token version lag ``current_version - weight_versions``; -1 outside ``response_mask``.

    Args:
        weight_versions: ``[B, T]`` version of the weights that generated each token.
        response_mask: ``[B, T]`` tokens to measure (bool / int / float; non-zero counts).
        current_version: The consumption step (the trainer's step-start weight version), an int or
            a ``[B]`` tensor.

    Returns:
        ``[B, T]`` int64 lags. A negative lag inside the mask means a token claims a version newer
        than the trainer's weights: a version-bookkeeping error (``train/version_lag_min`` < 0).
    """
    if weight_versions.shape != response_mask.shape or weight_versions.dim() != 2:
        raise ValueError(
            f"`weight_versions` has shape {tuple(weight_versions.shape)}; it must be [B, T] and match "
            f"`response_mask` {tuple(response_mask.shape)}."
        )
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    cur = torch.as_tensor(current_version, device=weight_versions.device, dtype=torch.long)
    if cur.dim() == 1:
        cur = cur.unsqueeze(-1)
    lag = cur - weight_versions.long()
    return torch.where(mask, lag, torch.full_like(lag, -1))


def version_lag_metrics(
    weight_versions: torch.Tensor,
    response_mask: torch.Tensor,
    current_version: Union[int, torch.Tensor],
    *,
    old_log_probs: Optional[torch.Tensor] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    log_probs: Optional[torch.Tensor] = None,
    advantages: Optional[torch.Tensor] = None,
    is_c: float = 2.0,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> dict[str, float]:
    """The ``train/version_lag_*`` and ``train/lag_{0,1,2,ge3}/*`` metrics of one training batch.

    * ``train/version_lag_{mean,max,min}``: over the tokens of ``response_mask`` (the aggregation
      rule by name takes the step's max of ``_max`` and min of ``_min``).
    * ``train/version_lag_seq_mean``: mean over trajectories with a masked token of
      ``current_version - min(version)``, the lag of their oldest token (the ledger's
      ``step - start_version``).
    * ``train/lag_{b}/token_frac``: share of the masked tokens in bucket ``b`` (sums to 1).
    * With ``old_log_probs`` and ``rollout_log_probs``, per bucket, of ``rho = exp(old - rollout)``
      (``pi_old / mu``, the decoupled-PPO behaviour weight before truncation): ``is_mean``,
      ``is_max``, ``is_trunc_ratio`` (share with ``rho > is_c``, what TIS truncates) and ``m2``
      (mean ``(old - rollout)^2``, M2PO's statistic).
    * With ``log_probs`` and ``advantages`` as well: ``clip_ratio``, the share of tokens whose PPO
      term is clipped (``r = exp(log_probs - old)`` beyond ``1 + clip_high`` with ``A > 0`` or below
      ``1 - clip_low`` with ``A < 0``).

    Everything is detached and synced once. Returns Python floats for exactly
    :data:`VERSION_LAG_KEYS`; the batch-wide figures are 0 when no token is masked in.

    Args:
        weight_versions, response_mask, current_version: as in :func:`version_lag`.
        old_log_probs: ``[B, T]`` step-start (proximal) log-probs, or None.
        rollout_log_probs: ``[B, T]`` engine (behaviour) log-probs, or None.
        log_probs: ``[B, T]`` current log-probs, or None.
        advantages: ``[B]`` or ``[B, T]`` advantages, or None.
        is_c: The truncation cap whose exceedance ``is_trunc_ratio`` counts.
        clip_low, clip_high: The PPO clip range.
    """
    with torch.no_grad():
        lag = version_lag(weight_versions, response_mask, current_version)
        mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
        f64 = torch.float64
        nan = torch.full((), float("nan"), dtype=f64, device=lag.device)
        n = mask.sum()
        lagf = lag.to(f64)
        out: dict[str, torch.Tensor] = {}
        has = n > 0
        zero = torch.zeros((), dtype=f64, device=lag.device)
        out["train/version_lag_mean"] = torch.where(mask, lagf, zero).sum() / n.clamp(min=1)
        if lag.numel():
            big = torch.iinfo(torch.long).max
            mx = torch.where(mask, lag, torch.full_like(lag, -big)).amax().to(f64)
            mn = torch.where(mask, lag, torch.full_like(lag, big)).amin().to(f64)
        else:
            mx = mn = zero
        out["train/version_lag_max"] = torch.where(has, mx, zero)
        out["train/version_lag_min"] = torch.where(has, mn, zero)
        rows = mask.any(dim=-1)
        if lag.numel():
            seq_lag = torch.where(mask, lag, torch.full_like(lag, -(1 << 62))).amax(dim=-1).to(f64)
        else:
            seq_lag = torch.zeros(lag.shape[0], dtype=f64, device=lag.device)
        out["train/version_lag_seq_mean"] = torch.where(rows, seq_lag, zero).sum() / rows.sum().clamp(min=1)

        log_rho = None
        if old_log_probs is not None and rollout_log_probs is not None:
            log_rho = torch.where(mask, old_log_probs.detach().to(f64) - rollout_log_probs.detach().to(f64), zero)
            rho = log_rho.clamp(-20.0, 20.0).exp()
        clipped = None
        if log_rho is not None and log_probs is not None and advantages is not None:
            adv = advantages.detach().to(f64)
            adv = adv.unsqueeze(-1).expand(mask.shape) if adv.dim() == 1 else adv.expand(mask.shape)
            ratio = (log_probs.detach().to(f64) - old_log_probs.detach().to(f64)).clamp(-20.0, 20.0).exp()
            clipped = ((adv > 0) & (ratio > 1.0 + clip_high)) | ((adv < 0) & (ratio < 1.0 - clip_low))

        buckets = [mask & (lag == 0), mask & (lag == 1), mask & (lag == 2), mask & (lag >= 3)]
        for name, sel in zip(LAG_BUCKETS, buckets):
            k = sel.sum()
            any_ = k > 0
            denom = k.clamp(min=1).to(f64)
            pre = f"train/lag_{name}/"

            def share(flags: torch.Tensor) -> torch.Tensor:
                return torch.where(any_, (sel & flags).sum().to(f64) / denom, nan)  # noqa: B023

            out[pre + "token_frac"] = k.to(f64) / n.clamp(min=1).to(f64)
            if log_rho is not None:
                rmax = torch.where(sel, rho, torch.full_like(rho, float("-inf"))).amax() if rho.numel() else nan
                out[pre + "is_mean"] = torch.where(any_, torch.where(sel, rho, zero).sum() / denom, nan)
                out[pre + "is_max"] = torch.where(any_, rmax, nan)
                out[pre + "is_trunc_ratio"] = share(rho > is_c)
                out[pre + "m2"] = torch.where(any_, torch.where(sel, log_rho * log_rho, zero).sum() / denom, nan)
            else:
                for key in ("is_mean", "is_max", "is_trunc_ratio", "m2"):
                    out[pre + key] = nan
            out[pre + "clip_ratio"] = share(clipped) if clipped is not None else nan
        values = torch.stack([out[key].to(f64) for key in VERSION_LAG_KEYS]).tolist()
    return dict(zip(VERSION_LAG_KEYS, values))


def prox_log_probs_loglinear(
    rollout_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    weight_versions: torch.Tensor,
    response_mask: torch.Tensor,
    current_version: int,
    call_index: int,
    calls_per_step: int,
) -> torch.Tensor:
    """The proximal (step-start) policy's log-probs without a forward pass: AReaL's ``loglinear``
    approximation, ``log pi_prox = log mu + alpha (log pi_theta - log mu)`` with
    ``alpha = (v_prox - v_mu) / (v_theta - v_mu)`` per token.

    Versions are counted in optimizer updates, so that ``alpha`` knows where in its step the
    trainer is: the token's generating weights ``v_mu = weight_version x calls_per_step``, the
    step-start weights ``v_prox = current_version x calls_per_step``, the weights being trained
    ``v_theta = v_prox + call_index``. Hence exact where it can be: an on-policy token (``v_mu =
    v_prox``, alpha 0) takes the engine's log-prob, the first call of a step (``v_theta = v_prox``,
    alpha 1) the current policy's, which are then the step-start weights' own. (AReaL counts whole
    steps, ``v_theta = v_prox + 1``, so its alpha is 1/2 at lag 1 whatever the call.)

    Args:
        rollout_log_probs: ``[B, T]`` the engine's (behaviour) log-probs ``log mu``.
        log_probs: ``[B, T]`` the current policy's log-probs (detached here).
        weight_versions, response_mask, current_version: as in :func:`version_lag`.
        call_index: training calls already done in this step (0 for its first).
        calls_per_step: ``(B x N) // M``.

    Returns:
        ``[B, T]`` approximated proximal log-probs (the current policy's outside the mask, where
        the engine's may be missing).
    """
    if calls_per_step < 1 or not 0 <= call_index < calls_per_step:
        raise ValueError(f"`call_index` is {call_index} of `calls_per_step` {calls_per_step}; it must be in [0, calls_per_step).")
    lag = version_lag(weight_versions, response_mask, current_version).to(log_probs.dtype)
    gap = lag.clamp(min=0) * calls_per_step  # v_prox - v_mu, in updates (0 outside the mask)
    alpha = torch.where(gap > 0, gap / (gap + call_index), torch.zeros_like(gap))
    cur = log_probs.detach()
    mu = rollout_log_probs.to(cur.dtype)
    inside = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    return torch.where(inside, mu + alpha * (cur - mu), cur)
