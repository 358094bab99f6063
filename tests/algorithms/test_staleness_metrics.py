"""Version-lag metrics: consumption step minus each token's weight version, and per-lag IS/clip stats."""

import math

import pytest
import torch

from lightning_fasync.algorithms import VERSION_LAG_KEYS, version_lag, version_lag_metrics
from lightning_fasync.lightning.batch import collate_groups
from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus


def _traj(index, response, versions, log_probs=None):
    t = Trajectory(
        prompt_id=PromptId(0, 0), sample_index=index, prompt_ids=[1, 10, 11],
        status=TrajectoryStatus.COMPLETED, reward=float(index),
    )
    t.extend(response, log_probs or [-1.0] * len(response), versions)
    return t


def test_lag_is_the_consumption_step_minus_each_tokens_version_inside_the_mask():
    versions = torch.tensor([[-1, 3, 3, 4, -1], [-1, 5, 5, -1, -1]])
    mask = versions >= 0
    lag = version_lag(versions, mask, 5)
    assert lag.tolist() == [[-1, 2, 2, 1, -1], [-1, 0, 0, -1, -1]]
    m = version_lag_metrics(versions, mask, 5)
    assert set(m) == set(VERSION_LAG_KEYS)
    assert m["train/version_lag_mean"] == pytest.approx(5 / 5)
    assert m["train/version_lag_max"] == 2 and m["train/version_lag_min"] == 0
    # Per trajectory: the lag of its oldest token (the ledger's step - start_version): (2 + 0) / 2.
    assert m["train/version_lag_seq_mean"] == pytest.approx(1.0)
    fracs = [m[f"train/lag_{b}/token_frac"] for b in ("0", "1", "2", "ge3")]
    assert fracs == pytest.approx([0.4, 0.2, 0.4, 0.0])
    # No log-probs given: the per-lag IS and clip statistics are NaN (skipped by the aggregation).
    assert math.isnan(m["train/lag_1/is_mean"]) and math.isnan(m["train/lag_0/clip_ratio"])


def test_masked_tokens_do_not_count_and_a_future_version_shows_as_a_negative_min():
    versions = torch.tensor([[0, 1, 7]])
    loss_mask = torch.tensor([[1.0, 0.0, 1.0]])  # e.g. tool output or mask_offpolicy_in_partial_rollout
    m = version_lag_metrics(versions, loss_mask, 2)
    assert m["train/version_lag_mean"] == pytest.approx((2 - 5) / 2)
    assert m["train/version_lag_min"] == -5  # version 7 > step 2: a bookkeeping error, made visible
    assert m["train/version_lag_max"] == 2


def test_per_lag_importance_ratio_truncation_second_moment_and_clip():
    versions = torch.tensor([[2, 2, 1, 1, 0, -1]])
    mask = versions >= 0
    rollout = torch.zeros(1, 6)
    old = torch.tensor([[0.0, 0.0, 0.5, -0.5, math.log(3.0), 0.0]])  # rho = 1, 1, e^.5, e^-.5, 3
    log_probs = old + torch.tensor([[0.0, 0.0, 0.5, 0.0, -0.5, 0.0]])  # r = 1, 1, e^.5 (>1.28), 1, e^-.5 (<0.8)
    adv = torch.tensor([1.0])
    kw = dict(old_log_probs=old, rollout_log_probs=rollout, log_probs=log_probs)
    m = version_lag_metrics(versions, mask, 2, advantages=adv, **kw)
    assert m["train/lag_0/is_mean"] == pytest.approx(1.0) and m["train/lag_0/m2"] == pytest.approx(0.0)
    assert m["train/lag_1/is_mean"] == pytest.approx((math.exp(0.5) + math.exp(-0.5)) / 2)
    assert m["train/lag_1/m2"] == pytest.approx(0.25)
    assert m["train/lag_2/is_max"] == pytest.approx(3.0) and m["train/lag_2/is_trunc_ratio"] == 1.0
    assert m["train/lag_1/is_trunc_ratio"] == 0.0
    # A > 0: only r > 1 + clip_high is clipped (the lag-1 token); r < 1 - clip_low is not, for A > 0.
    assert m["train/lag_1/clip_ratio"] == pytest.approx(0.5)
    assert m["train/lag_2/clip_ratio"] == 0.0
    m_neg = version_lag_metrics(versions, mask, 2, advantages=-adv, **kw)
    assert m_neg["train/lag_2/clip_ratio"] == 1.0 and m_neg["train/lag_1/clip_ratio"] == 0.0
    assert math.isnan(m["train/lag_ge3/is_mean"]) and m["train/lag_ge3/token_frac"] == 0.0


def test_an_empty_batch_gives_zeros_not_nan_for_the_batch_wide_figures():
    m = version_lag_metrics(torch.full((2, 3), -1), torch.zeros(2, 3), 4)
    for key in ("mean", "max", "min", "seq_mean"):
        assert m[f"train/version_lag_{key}"] == 0.0


def test_works_on_a_collated_batch_with_a_partial_trajectory():
    """A trajectory resumed across a step boundary: the tokens keep the version that generated them."""
    group = TrajectoryGroup(
        PromptSample(PromptId(0, 0), [1, 10, 11]),
        0,
        [_traj(0, [20, 21, 22, 2], [3, 3, 4, 4]), _traj(1, [20, 2], [5, 5])],
    )
    data = collate_groups([group], pad_id=0)
    m = version_lag_metrics(data.weight_versions, data.response_mask, 5)
    assert version_lag(data.weight_versions, data.response_mask, 5)[0, 2:6].tolist() == [2, 2, 1, 1]
    assert m["train/version_lag_max"] == 2 and m["train/version_lag_seq_mean"] == pytest.approx(1.0)
    assert m["train/lag_2/token_frac"] == pytest.approx(2 / 6)
