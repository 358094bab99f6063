"""``algorithm.prox_logp_method``: the proximal (step-start) log-probs without a forward pass.

The interpolation is AReaL's ``loglinear`` (areal/utils/functional: ``compute_prox_logp_approximations``),
with versions counted in optimizer updates; it is checked against AReaL's formula as that code writes
it, and end to end in the module: ``loglinear`` never runs the snapshot, ``metrics`` reports how far
the interpolation is from the recomputed truth.
"""

import copy

import pytest
import torch

from lightning_fasync.algorithms import prox_log_probs_loglinear
from lightning_fasync.config import ConfigError, FasyncConfig, validate
from lightning_fasync.lightning.batch import RolloutBatch
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus


def _areal_loglinear(old_logp, logprobs, versions, current_version):
    """AReaL's loglinear approximation, as its source defines it: v_proximal = current_version - 1,
    v_theta = current_version, alpha = (v_proximal - v_behave) / (v_theta - v_behave) clamped to
    [0, 1] and 0 where v_theta == v_behave or the token is not generated (version < 0)."""
    v_behave = versions.float()
    v_proximal, v_theta = current_version - 1, float(current_version)
    diff, gap = v_theta - v_behave, v_proximal - v_behave
    alpha = torch.where((diff > 0) & (versions >= 0), gap / diff, torch.zeros_like(v_behave)).clamp(0.0, 1.0)
    return old_logp + alpha * (logprobs - old_logp)


def _inputs(seed=0, B=6, T=9, max_lag=3, step=5):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, T, generator=g) * 3
    cur = mu + torch.randn(B, T, generator=g) * 0.5
    versions = step - torch.randint(0, max_lag + 1, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    versions = torch.where(mask, versions, torch.full_like(versions, -1))
    return mu, cur, versions, mask, step


def test_on_policy_tokens_take_the_engines_log_probs_and_a_steps_first_call_the_policys():
    mu, cur, versions, mask, step = _inputs()
    on, off = mask & (versions == step), mask & (versions < step)
    assert on.any() and off.any() and (~mask).any()  # tokens of each kind to check
    for j in range(4):
        out = prox_log_probs_loglinear(mu, cur, versions, mask, step, j, 4)
        assert torch.equal(out[on], mu[on])  # lag 0: the engine generated with the step-start weights
        assert torch.equal(out[~mask], cur[~mask])
        if j == 0:  # nothing trained yet in this step: the current weights are the step-start ones
            assert torch.allclose(out[off], cur[off], atol=1e-6)


def test_the_interpolation_is_areals_formula_with_versions_counted_in_updates():
    mu, cur, versions, mask, step = _inputs(seed=1)
    c = 4
    # One update into the step, the proximal weights are one update behind theta, as AReaL
    # assumes: its formula on versions in updates gives ours exactly.
    ours = prox_log_probs_loglinear(mu, cur, versions, mask, step, 1, c)
    in_updates = torch.where(versions >= 0, versions * c, versions)
    theirs = _areal_loglinear(mu, cur, in_updates, step * c + 1)
    assert torch.allclose(ours[mask], theirs[mask], atol=1e-6)
    for j in range(c):  # further into the step theta moves on: alpha = L c / (L c + j)
        ours = prox_log_probs_loglinear(mu, cur, versions, mask, step, j, c)
        gap = (step - versions).clamp(min=0).float() * c
        alpha = torch.where(gap > 0, gap / (gap + j), torch.zeros_like(gap))
        assert torch.allclose(ours[mask], (mu + alpha * (cur - mu))[mask], atol=1e-6)


def test_bad_call_index_is_refused():
    mu, cur, versions, mask, step = _inputs()
    with pytest.raises(ValueError, match="call_index"):
        prox_log_probs_loglinear(mu, cur, versions, mask, step, 4, 4)


def _group(step, seed):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(4):
        t = Trajectory(prompt_id=PromptId(0, seed), sample_index=i, prompt_ids=[1, 10, 11],
                       status=TrajectoryStatus.COMPLETED, reward=float(i))
        t.extend(torch.randint(4, 20, (5,), generator=g).tolist(), (-torch.rand(5, generator=g) * 2).tolist(), [step - 1] * 5)
        trajs.append(t)
    return TrajectoryGroup(PromptSample(PromptId(0, seed), [1, 10, 11]), seed, trajs)


def _module(method):
    cfg = FasyncConfig()
    cfg.algorithm.prox_logp_method = method
    torch.manual_seed(0)
    return RLPolicyModule("tiny", **RLPolicyModule.algorithm_args(cfg))


def _train_step(module, batch):
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    loss = module.training_step(batch, 0)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_loglinear_skips_the_snapshot_and_metrics_measures_the_interpolation():
    lin, met = _module("loglinear"), _module("metrics")
    met.load_state_dict(copy.deepcopy(lin.state_dict()))
    for m in (lin, met):
        m.begin_rollout_step(3)
    errs = []
    for j in range(2):
        batch = dict(groups=[_group(3, j)], rollout_step=3, call_index=j, calls_per_step=2)
        a = _train_step(lin, RolloutBatch(**batch))
        b = _train_step(met, RolloutBatch(**batch))
        errs.append(met.rollout_metrics()["train/prox_approx_abs_err"])
        if j == 0:  # both use the step-start weights exactly at a step's first call
            assert torch.allclose(a, b, atol=1e-6)
    assert not lin.snapshot.has_snapshot  # loglinear never snapshots (no memory, no forward)
    assert met.snapshot.has_snapshot
    assert errs[0] < 1e-6 < errs[1]  # exact at the first call, an approximation after an update


def test_config_refuses_unknown_methods_and_loglinear_with_rollout_log_probs():
    cfg = FasyncConfig()
    cfg.algorithm.prox_logp_method = "approx"
    with pytest.raises(ConfigError, match="algorithm.prox_logp_method"):
        validate(cfg)
    cfg = FasyncConfig()
    cfg.algorithm.prox_logp_method = "loglinear"
    cfg.trainer.use_rollout_log_probs = True
    with pytest.raises(ConfigError, match="use_rollout_log_probs"):
        validate(cfg)
