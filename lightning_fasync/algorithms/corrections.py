"""Off-policy corrections: truncated/masked IS, M2PO, OPSM and the partial-rollout token mask.

All functions take ``[batch, T]`` padded tensors and a ``response_mask`` (bool, int or float;
non-zero means "a response token that is trained on"). Masks and weights they return are
detached: they select or reweight the policy-gradient term, they are never differentiated.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "LOG_RATIO_CLAMP",
    "is_correction_weights",
    "m2po_mask",
    "opsm_mask",
    "sequence_mean_kl",
    "mask_offpolicy_tokens",
]

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` so a wild token cannot overflow to inf
(exp(20) ~ 4.9e8 is far above any sensible truncation cap or mask bound)."""


def _check_same_shape(name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if tensor.shape != ref.shape:
        raise ValueError(f"`{name}` has shape {tuple(tensor.shape)}; it must match `{ref_name}` {tuple(ref.shape)}.")


def _as_bool_mask(mask: torch.Tensor, name: str = "response_mask") -> torch.Tensor:
    if mask.dim() != 2:
        raise ValueError(f"`{name}` has shape {tuple(mask.shape)}; it must be 2-D [batch, T].")
    return mask if mask.dtype == torch.bool else mask != 0


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    # bf16/fp16 log-probs are upcast: ratios and sums over long responses need fp32 at least.
    return torch.promote_types(t.dtype, torch.float32)


def is_correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    c: float = 2.0,
    c_low: float = 0.5,
    c_high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights ``pi_old / pi_rollout`` correcting the rollout/trainer mismatch.

    Source: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training" (truncated importance sampling, TIS): the PG term of each token is multiplied by
    the detached weight ``min(rho, C)`` with ``rho = pi_old(y_t) / pi_rollout(y_t)``. The masking
    mode is their follow-up "masked IS" (MIS): ``rho * 1[C_low <= rho <= C_high]``.

    * ``level="token"``: ``rho_t = exp(old_t - rollout_t)`` per token.
    * ``level="sequence"``: ``rho = exp(sum_t (old_t - rollout_t))`` over the response mask, one
      value broadcast to every token of the sequence.
    * ``mode="truncate"``: ``w = min(rho, c)`` (default ``c = 2.0``).
    * ``mode="mask"``: ``w = rho`` inside ``[c_low, c_high]`` (defaults 0.5, 2.0), ``w = 0``
      outside, i.e. the token (token level) or the whole sequence (sequence level) is dropped.

    Log-ratios are clamped to +-:data:`LOG_RATIO_CLAMP` before ``exp``.

    Args:
        old_log_probs: ``[B, T]`` trainer log-probs of the sampled tokens under pi_old.
        rollout_log_probs: ``[B, T]`` engine (behaviour) log-probs of the same tokens.
        response_mask: ``[B, T]`` valid response tokens.
        level: ``token`` or ``sequence``.
        mode: ``truncate`` or ``mask``.
        c: Truncation cap (mode truncate), > 0.
        c_low: Lower bound (mode mask).
        c_high: Upper bound (mode mask), >= c_low.

    Returns:
        ``(weights, metrics)``: detached ``[B, T]`` weights (0 outside the response mask) and
        ``train/is_mean``, ``train/is_max`` (of the raw ratio ``rho`` over valid tokens, or over
        non-empty sequences at sequence level) and ``train/is_clip_ratio`` (fraction of those
        whose weight was truncated or masked, i.e. differs from ``rho``).

    Raises:
        ValueError: on an unknown level/mode, a shape mismatch or invalid bounds.
    """
    w, metrics = _is_correction_weights(
        old_log_probs, rollout_log_probs, response_mask, level=level, mode=mode, c=c, c_low=c_low, c_high=c_high
    )
    values = torch.stack(list(metrics.values())).tolist()  # one device sync for all three
    return w, dict(zip(metrics, values))


def _is_stats(rho: torch.Tensor, changed: torch.Tensor, unit: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean/max of ``rho`` and the changed fraction over ``unit``; 1/1/0 when ``unit`` is empty."""
    n = unit.sum()
    has = n > 0
    one = torch.ones((), dtype=rho.dtype, device=rho.device)
    mean = torch.where(unit, rho, 0.0).sum() / n.clamp(min=1)
    if rho.numel():
        mx = torch.where(unit, rho, float("-inf")).amax()
    else:
        mx = one
    frac = (changed & unit).sum().to(rho.dtype) / n.clamp(min=1)
    return {
        "train/is_mean": torch.where(has, mean, one),
        "train/is_max": torch.where(has, mx, one),
        "train/is_clip_ratio": torch.where(has, frac, 0.0 * one),
    }


def _is_correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    c: float = 2.0,
    c_low: float = 0.5,
    c_high: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`is_correction_weights` with 0-dim tensor metrics (no device sync)."""
    if level not in IS_LEVELS:
        raise ValueError(f"`level` is {level!r}; it must be one of {', '.join(IS_LEVELS)}.")
    if mode not in IS_MODES:
        raise ValueError(f"`mode` is {mode!r}; it must be one of {', '.join(IS_MODES)}.")
    if mode == "truncate" and not c > 0:
        raise ValueError(f"`c` is {c}; the truncation cap must be > 0.")
    if mode == "mask" and not (0 <= c_low <= c_high):
        raise ValueError(f"`c_low`/`c_high` are {c_low}/{c_high}; they must satisfy 0 <= c_low <= c_high.")
    mask = _as_bool_mask(response_mask)
    _check_same_shape("old_log_probs", old_log_probs, "response_mask", mask)
    _check_same_shape("rollout_log_probs", rollout_log_probs, "response_mask", mask)
    dtype = _work_dtype(old_log_probs)
    with torch.no_grad():
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        log_ratio = torch.where(mask, old_log_probs.detach().to(dtype) - rollout_log_probs.detach().to(dtype), zero)
        if level == "token":
            rho = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            unit = mask  # statistics over valid tokens
            rho_seq = rho
        else:
            seq_log_ratio = log_ratio.sum(dim=-1)
            rho_seq = torch.exp(seq_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            rho = rho_seq.unsqueeze(-1).expand_as(log_ratio)
            unit = mask.any(dim=-1)  # statistics over non-empty sequences
        if mode == "truncate":
            w = torch.clamp(rho, max=c)
            changed = rho_seq > c
        else:
            inside = (rho >= c_low) & (rho <= c_high)
            w = torch.where(inside, rho, zero)
            changed = ~((rho_seq >= c_low) & (rho_seq <= c_high))
        w = torch.where(mask, w, zero)
        metrics = _is_stats(rho_seq, changed, unit)
    return w, metrics


def m2po_mask(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    tau: float = 0.04,
) -> torch.Tensor:
    """M2PO second-moment token mask: drop the largest ``(old - rollout)^2`` until the mean <= tau.

    Source: Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with
    Stale Data on LLMs?" (M2PO, arXiv 2510.01161). The second moment of the log importance
    ratio, ``M2_t = (log pi_old(y_t) - log pi_rollout(y_t))^2``, is computed for every valid
    token of the batch; tokens are removed greedily, largest ``M2`` first, until the mean ``M2``
    over the kept tokens is ``<= tau`` (default 0.04).

    Because the mean of the k smallest values grows with k, the greedy result is "keep the
    largest k whose k smallest values have mean <= tau"; it is computed with one sort and a
    float64 cumulative sum. If even the single smallest value exceeds tau, every token is
    dropped (the greedy loop never becomes satisfied). Ties are broken deterministically by
    position (a stable sort). The statistic is over the batch given (one mini-batch on one rank;
    it is not all-reduced across data-parallel ranks).

    Args:
        old_log_probs: ``[B, T]`` trainer old log-probs.
        rollout_log_probs: ``[B, T]`` engine log-probs.
        response_mask: ``[B, T]`` valid (loss-mask) tokens.
        tau: Threshold on the mean second moment, >= 0.

    Returns:
        ``[B, T]`` bool keep-mask: True for valid tokens that are kept, False for dropped and
        for invalid tokens.

    Raises:
        ValueError: on a shape mismatch or a negative ``tau``.
    """
    if not tau >= 0:
        raise ValueError(f"`tau` is {tau}; it must be >= 0.")
    mask = _as_bool_mask(response_mask)
    _check_same_shape("old_log_probs", old_log_probs, "response_mask", mask)
    _check_same_shape("rollout_log_probs", rollout_log_probs, "response_mask", mask)
    with torch.no_grad():
        diff = old_log_probs.detach().to(torch.float64) - rollout_log_probs.detach().to(torch.float64)
        # Invalid tokens become +inf: they sort last and can never be part of a satisfied prefix.
        # (A non-finite M2 on a valid token likewise makes every prefix containing it fail.)
        m2 = torch.where(mask, diff * diff, float("inf")).reshape(-1)
        n = m2.numel()
        if n == 0:
            return mask.clone()
        sorted_m2, order = torch.sort(m2, stable=True)
        positions = torch.arange(n, device=m2.device)
        prefix_mean = torch.cumsum(sorted_m2, dim=0) / (positions + 1).to(torch.float64)
        # prefix_mean is non-decreasing, so the satisfied prefixes form a leading run of length k
        # (a tensor: no device sync).
        k = (prefix_mean <= tau).sum()
        rank = torch.empty_like(positions)
        rank[order] = positions
        return mask & (rank < k).reshape(mask.shape)


def sequence_mean_kl(
    behaviour_log_probs: torch.Tensor, log_probs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Per-sequence ``(1/|o_i|) sum_t (behaviour_t - current_t)`` over the response mask (k1 KL).

    This is the KL estimator of DeepSeek-V3.2's Off-Policy Sequence Masking: the mean over the
    sequence's response tokens of ``log pi_behaviour(y_t) - log pi_theta(y_t)``, a Monte-Carlo
    estimate of ``KL(pi_behaviour || pi_theta)`` on tokens sampled from the behaviour policy.
    Empty sequences get 0. Detached. Returns a ``[B]`` tensor.
    """
    mask = _as_bool_mask(response_mask)
    _check_same_shape("behaviour_log_probs", behaviour_log_probs, "response_mask", mask)
    _check_same_shape("log_probs", log_probs, "response_mask", mask)
    dtype = _work_dtype(log_probs)
    with torch.no_grad():
        d = behaviour_log_probs.detach().to(dtype) - log_probs.detach().to(dtype)
        d = torch.where(mask, d, torch.zeros((), dtype=dtype, device=d.device))
        return d.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(dtype)


def opsm_mask(
    behaviour_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    delta: float = 1e-4,
) -> torch.Tensor:
    """Off-Policy Sequence Masking: drop negative-advantage sequences that drifted more than delta.

    Source: DeepSeek-AI 2025, "DeepSeek-V3.2" technical report, Off-Policy Sequence Masking:
    ``M_{i,t} = 0`` if ``A_{i,t} < 0`` and ``(1/|o_i|) sum_t log(pi_old(o_t) / pi_theta(o_t)) > delta``,
    else 1, where ``pi_old`` is the behaviour (sampling) policy. The KL estimator is the per-token
    log-ratio ``behaviour - current`` averaged over the response tokens
    (:func:`sequence_mean_kl`). Positive-advantage sequences are never masked (learning from
    one's own good samples is safe even off-policy; the report's rationale).

    Args:
        behaviour_log_probs: ``[B, T]`` behaviour log-probs (rollout log-probs if the engine
            returned them, else the trainer's old log-probs).
        log_probs: ``[B, T]`` current-policy log-probs.
        advantages: ``[B]`` per-sequence or ``[B, T]`` per-token advantages.
        response_mask: ``[B, T]`` valid response tokens.
        delta: KL threshold (``algorithm.opsm.delta``, default 1e-4).

    Returns:
        ``[B, T]`` bool keep-mask (False for masked and for invalid tokens). With per-sequence
        advantages a sequence is either fully kept or fully masked.
    """
    mask = _as_bool_mask(response_mask)
    adv = _broadcast_advantages(advantages, mask)
    with torch.no_grad():
        kl = sequence_mean_kl(behaviour_log_probs, log_probs, mask)
        drop = (adv.detach() < 0) & (kl > delta).unsqueeze(-1)
        return mask & ~drop


def _broadcast_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` or ``[B, 1]`` or ``[B, T]`` advantages as ``[B, T]``."""
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        return advantages.unsqueeze(-1).expand(mask.shape)
    if advantages.dim() == 2 and advantages.shape[0] == mask.shape[0] and advantages.shape[1] in (1, mask.shape[1]):
        return advantages.expand(mask.shape)
    raise ValueError(
        f"`advantages` has shape {tuple(advantages.shape)}; it must be per-sequence [{mask.shape[0]}] "
        f"or per-token {tuple(mask.shape)}."
    )


MaskLike = Union[torch.Tensor, Sequence]


def mask_offpolicy_tokens(
    loss_mask: MaskLike,
    weight_versions: MaskLike,
    current_version: Optional[Union[int, torch.Tensor, Sequence[int]]] = None,
) -> MaskLike:
    """Zero the loss mask of response tokens generated by an older weight version.

    Used on restore of a partial rollout when ``rollout.mask_offpolicy_in_partial_rollout: true``:
    a trajectory resumed across a weight update holds tokens from several versions; only the
    tokens of the newest one (the trajectory's last/end version, or ``current_version``) keep
    their loss mask. Tokens already masked (e.g. tool output) stay masked.

    Accepted forms (the result has the same form and dtype as ``loss_mask``):

    * one trajectory as lists: ``loss_mask: list[int]``, ``weight_versions: list[int]``;
    * a batch as a list of such lists (``current_version`` may then be a list, one per item);
    * a tensor ``[T]`` or padded ``[B, T]``; ``current_version`` an int or a ``[B]`` tensor.

    When ``current_version`` is None the reference is the trajectory's last version: the last
    entry of each list, or the row maximum of a tensor (versions never decrease along a
    trajectory, so the maximum is the end version; pad ``weight_versions`` with a value <= the
    real ones, e.g. -1 or 0).

    Raises:
        ValueError: when ``loss_mask`` and ``weight_versions`` differ in length or shape.
    """
    if isinstance(loss_mask, torch.Tensor):
        wv = torch.as_tensor(weight_versions, device=loss_mask.device)
        if wv.shape != loss_mask.shape:
            raise ValueError(
                f"`weight_versions` has shape {tuple(wv.shape)}; it must match `loss_mask` {tuple(loss_mask.shape)}."
            )
        if loss_mask.dim() not in (1, 2):
            raise ValueError(f"`loss_mask` has shape {tuple(loss_mask.shape)}; it must be [T] or [B, T].")
        if wv.numel() == 0:
            return loss_mask.clone()
        if current_version is None:
            ref = wv.max(dim=-1, keepdim=True).values
        else:
            ref = torch.as_tensor(current_version, device=wv.device, dtype=wv.dtype)
            if ref.dim() == 1 and wv.dim() == 2:
                if ref.shape[0] != wv.shape[0]:
                    raise ValueError(
                        f"`current_version` has {ref.shape[0]} entries; it must have one per row ({wv.shape[0]})."
                    )
                ref = ref.unsqueeze(-1)
        stale = wv < ref
        return torch.where(stale, torch.zeros_like(loss_mask), loss_mask)

    loss_mask = list(loss_mask)
    weight_versions = list(weight_versions)
    if len(loss_mask) != len(weight_versions):
        raise ValueError(
            f"`weight_versions` has {len(weight_versions)} entries; it must match `loss_mask` ({len(loss_mask)})."
        )
    if loss_mask and isinstance(loss_mask[0], (list, tuple)):
        if current_version is None or isinstance(current_version, int):
            versions = [current_version] * len(loss_mask)
        else:
            versions = list(current_version)
            if len(versions) != len(loss_mask):
                raise ValueError(
                    f"`current_version` has {len(versions)} entries; "
                    f"it must have one per trajectory ({len(loss_mask)})."
                )
        return [mask_offpolicy_tokens(m, v, cv) for m, v, cv in zip(loss_mask, weight_versions, versions)]
    if not weight_versions:
        return []
    ref = weight_versions[-1] if current_version is None else int(current_version)
    return [0 if v < ref else m for m, v in zip(loss_mask, weight_versions)]
