"""RL algorithms for LLM policies, pure torch: advantages, policy loss, off-policy corrections.

See ``docs/algorithms.md`` for every mechanism's formula, config keys, metric and source.
"""

from lightning_fasync.algorithms.advantages import compute_advantages, grpo_advantages, nan_ratio
from lightning_fasync.algorithms.corrections import (
    IS_LEVELS,
    IS_MODES,
    is_correction_weights,
    m2po_mask,
    mask_offpolicy_tokens,
    opsm_mask,
    sequence_mean_kl,
)
from lightning_fasync.algorithms.losses import (
    LOSS_AGG_MODES,
    aggregate_loss,
    approx_kl_k3,
    k3_kl,
    masked_mean,
    ppo_clip_token_loss,
)
from lightning_fasync.algorithms.metrics import METRIC_KEYS, clip_grad_norm, grad_norm_metric, total_grad_norm
from lightning_fasync.algorithms.policy_loss import LOSS_METRIC_KEYS, REF_METRIC_KEYS, policy_loss
from lightning_fasync.algorithms.snapshot import OldActorSnapshot
from lightning_fasync.algorithms.staleness import (
    LAG_BUCKETS,
    VERSION_LAG_KEYS,
    prox_log_probs_loglinear,
    version_lag,
    version_lag_metrics,
)

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "LAG_BUCKETS",
    "LOSS_AGG_MODES",
    "LOSS_METRIC_KEYS",
    "METRIC_KEYS",
    "REF_METRIC_KEYS",
    "OldActorSnapshot",
    "VERSION_LAG_KEYS",
    "aggregate_loss",
    "approx_kl_k3",
    "clip_grad_norm",
    "compute_advantages",
    "grad_norm_metric",
    "grpo_advantages",
    "is_correction_weights",
    "k3_kl",
    "m2po_mask",
    "mask_offpolicy_tokens",
    "masked_mean",
    "nan_ratio",
    "opsm_mask",
    "policy_loss",
    "ppo_clip_token_loss",
    "prox_log_probs_loglinear",
    "sequence_mean_kl",
    "total_grad_norm",
    "version_lag",
    "version_lag_metrics",
]
