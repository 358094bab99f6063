"""The composed policy loss against a plain-Python float64 reference, plus its edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from lightning_fasync.algorithms import (
    LOSS_METRIC_KEYS,
    METRIC_KEYS,
    grad_norm_metric,
    grpo_advantages,
    policy_loss,
)
from lightning_fasync.config import AlgorithmConfig, ISCorrectionConfig, M2POConfig, OPSMConfig
from tests.helpers.algorithms import (
    NEAR,
    SETTINGS,
    adv_tensor,
    adv_tok,
    batches,
    close,
    ppo_near_boundary,
    ref_agg,
    ref_is,
    ref_m2po,
    ref_opsm,
    ref_ppo,
    t64,
)


def ref_policy_loss(d, nan_mask, p):
    """The whole objective from the formulas, Python floats only. Returns (loss, metrics)."""
    b, t = d["b"], d["t"]
    valid = [[bool(d["mask"][i][j]) and not nan_mask[i] for j in range(t)] for i in range(b)]
    nonempty = [any(row) for row in valid]
    if p["is_enable"]:
        w, rhos, changed = ref_is(
            d["old"], d["ro"], valid, p["is_level"], p["is_mode"], p["c"], p["c_low"], p["c_high"]
        )
    else:
        w = [[1.0] * t for _ in range(b)]
        _, rhos, _ = ref_is(d["old"], d["ro"], valid, "token", "truncate", math.inf, 0, 0)
        changed = [False] * len(rhos)
    keep = [row[:] for row in valid]
    m2po_dropped = 0
    if p["m2po"]:
        kept_vals, dropped_vals, _ = ref_m2po(d["old"], d["ro"], valid, p["tau"])
        # No ties at the cut (the test assumes it), so "dropped" is a value set.
        cut = min(dropped_vals) if dropped_vals else math.inf
        for i in range(b):
            for j in range(t):
                if valid[i][j] and (d["old"][i][j] - d["ro"][i][j]) ** 2 >= cut:
                    keep[i][j] = False
                    m2po_dropped += 1
    opsm_seqs = 0
    if p["opsm"]:
        okeep, _ = ref_opsm(d["ro"], d["lp"], lambda i, j: adv_tok(d, i, j), valid, p["delta"])
        for i in range(b):
            if any(valid[i][j] and not okeep[i][j] for j in range(t)):
                opsm_seqs += 1
            for j in range(t):
                keep[i][j] = keep[i][j] and okeep[i][j]
    pg = [[0.0] * t for _ in range(b)]
    n_contrib = n_clip = n_dual = 0
    for i in range(b):
        for j in range(t):
            if not valid[i][j]:
                continue
            loss, clipped, dual, _ = ref_ppo(d["lp"][i][j], d["old"][i][j], adv_tok(d, i, j), p["cl"], p["ch"], p["dc"])
            weight = w[i][j] if keep[i][j] else 0.0
            pg[i][j] = loss * weight
            if weight != 0:
                n_contrib += 1
                n_clip += clipped
                n_dual += dual
    pg_loss = ref_agg(pg, valid, p["agg"])
    ent = ref_agg(d["ent"], valid, p["agg"])
    kl = [
        [math.exp(d["ref"][i][j] - d["lp"][i][j]) - (d["ref"][i][j] - d["lp"][i][j]) - 1 for j in range(t)]
        for i in range(b)
    ]
    ref_kl = ref_agg(kl, valid, p["agg"])
    total = pg_loss - p["ent_coef"] * ent + p["kl_coef"] * ref_kl
    n_valid = sum(sum(row) for row in valid)
    approx = [
        math.expm1(d["lp"][i][j] - d["old"][i][j]) - (d["lp"][i][j] - d["old"][i][j])
        for i in range(b)
        for j in range(t)
        if valid[i][j]
    ]
    metrics = {
        "train/loss": total,
        "train/pg_loss": pg_loss,
        "train/entropy": ref_agg(d["ent"], valid, "token-mean"),
        "train/approx_kl": sum(approx) / max(len(approx), 1),
        "train/clip_ratio": n_clip / n_contrib if n_contrib else 0.0,
        "train/dual_clip_ratio": n_dual / n_contrib if n_contrib else 0.0,
        "train/nan_ratio": sum(1 for x in nonempty if not x) / b,
        "train/is_mean": sum(rhos) / len(rhos) if rhos else 1.0,
        "train/is_max": max(rhos) if rhos else 1.0,
        "train/is_clip_ratio": sum(changed) / len(changed) if changed else 0.0,
        "train/m2po_mask_ratio": m2po_dropped / n_valid if n_valid else 0.0,
        "train/opsm_mask_ratio": opsm_seqs / max(sum(nonempty), 1),
        "train/ref_kl": ref_kl,  # reported whenever ref_log_probs is given, whatever kl_coef
    }
    return total, metrics


params = st.fixed_dictionaries(
    {
        "cl": st.sampled_from([0.1, 0.2]),
        "ch": st.sampled_from([0.2, 0.28]),
        "dc": st.sampled_from([None, 3.0]),
        "agg": st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]),
        "ent_coef": st.sampled_from([0.0, 0.01]),
        "kl_coef": st.sampled_from([0.0, 0.1]),
        "is_enable": st.booleans(),
        "is_level": st.sampled_from(["token", "sequence"]),
        "is_mode": st.sampled_from(["truncate", "mask"]),
        "c": st.sampled_from([1.5, 2.0]),
        "c_low": st.just(0.5),
        "c_high": st.sampled_from([1.5, 2.0]),
        "m2po": st.booleans(),
        "tau": st.sampled_from([0.01, 0.04]),
        "opsm": st.booleans(),
        "delta": st.sampled_from([1e-4, 0.1]),
    }
)


def to_cfg(p) -> AlgorithmConfig:
    return AlgorithmConfig(
        clip_low=p["cl"],
        clip_high=p["ch"],
        dual_clip=p["dc"],
        loss_agg_mode=p["agg"],
        entropy_coef=p["ent_coef"],
        kl_coef=p["kl_coef"],
        is_correction=ISCorrectionConfig(
            enable=p["is_enable"],
            level=p["is_level"],
            mode=p["is_mode"],
            c=p["c"],
            c_low=p["c_low"],
            c_high=p["c_high"],
        ),
        m2po=M2POConfig(enable=p["m2po"], tau=p["tau"]),
        opsm=OPSMConfig(enable=p["opsm"], delta=p["delta"]),
    )


@SETTINGS
@given(d=batches(), p=params, nan_flags=st.lists(st.booleans(), min_size=4, max_size=4))
def test_policy_loss_matches_reference(d, p, nan_flags):
    b, t = d["b"], d["t"]
    nan_mask = nan_flags[:b]
    valid = [[bool(d["mask"][i][j]) and not nan_mask[i] for j in range(t)] for i in range(b)]
    # Skip inputs on a decision boundary (see the module docstring of test_algorithms).
    for i in range(b):
        for j in range(t):
            assume(not ppo_near_boundary(d["lp"][i][j], d["old"][i][j], adv_tok(d, i, j), p["cl"], p["ch"], p["dc"]))
    _, rhos, _ = ref_is(d["old"], d["ro"], valid, p["is_level"], p["is_mode"], p["c"], p["c_low"], p["c_high"])
    assume(all(abs(r - x) > NEAR for r in rhos for x in (p["c"], p["c_low"], p["c_high"])))
    kept, dropped, means = ref_m2po(d["old"], d["ro"], valid, p["tau"])
    assume(all(abs(mu - p["tau"]) > NEAR for mu in means))
    assume(not (kept and dropped and max(kept) >= min(dropped) - NEAR))
    _, kls = ref_opsm(d["ro"], d["lp"], lambda i, j: adv_tok(d, i, j), valid, p["delta"])
    assume(all(abs(kl - p["delta"]) > NEAR for kl in kls))

    lp = t64(d["lp"]).requires_grad_(True)
    ent = t64(d["ent"]).requires_grad_(True)
    loss, metrics = policy_loss(
        lp,
        t64(d["old"]),
        t64(d["ro"]),
        adv_tensor(d),
        torch.tensor(d["mask"]),
        to_cfg(p),
        entropy=ent,
        ref_log_probs=t64(d["ref"]),
        nan_mask=torch.tensor(nan_mask),
    )
    ref_loss, ref_metrics = ref_policy_loss(d, nan_mask, p)
    assert close(loss.item(), ref_loss), (loss.item(), ref_loss)
    assert set(metrics) == set(LOSS_METRIC_KEYS) | {"train/ref_kl"}
    assert all(isinstance(v, float) for v in metrics.values())
    for key, value in ref_metrics.items():
        assert close(metrics[key], value), (key, metrics[key], value)
    loss.backward()
    ent_grad = ent.grad if ent.grad is not None else torch.zeros_like(ent)  # None when ent_coef == 0
    assert torch.isfinite(lp.grad).all() and torch.isfinite(ent_grad).all()
    # Gradients only reach valid tokens.
    for i in range(b):
        for j in range(t):
            if not valid[i][j]:
                assert lp.grad[i, j] == 0 and ent_grad[i, j] == 0


@SETTINGS
@given(d=batches(per_token_adv=False), cl=st.sampled_from([0.1, 0.2]), ch=st.sampled_from([0.2, 0.28]))
def test_token_mean_gradient_matches_reference(d, cl, ch):
    """d loss / d log_probs = -A r / N on unclipped valid tokens, 0 elsewhere (PPO, token-mean)."""
    b, t = d["b"], d["t"]
    for i in range(b):
        for j in range(t):
            assume(not ppo_near_boundary(d["lp"][i][j], d["old"][i][j], d["adv"][i], cl, ch, 3.0))
    lp = t64(d["lp"]).requires_grad_(True)
    loss, _ = policy_loss(lp, t64(d["old"]), None, adv_tensor(d), torch.tensor(d["mask"]),
                          AlgorithmConfig(clip_low=cl, clip_high=ch))
    loss.backward()
    n = max(sum(sum(row) for row in d["mask"]), 1)
    for i in range(b):
        for j in range(t):
            g = ref_ppo(d["lp"][i][j], d["old"][i][j], d["adv"][i], cl, ch, 3.0)[3] / n if d["mask"][i][j] else 0.0
            assert close(lp.grad[i, j].item(), g)


# ----------------------------------------------------------------------------------------------
# Edge cases: never a NaN step
# ----------------------------------------------------------------------------------------------


def _all_on_cfg() -> AlgorithmConfig:
    return AlgorithmConfig(
        entropy_coef=0.01,
        kl_coef=0.1,
        is_correction=ISCorrectionConfig(enable=True, level="sequence", mode="mask"),
        m2po=M2POConfig(enable=True),
        opsm=OPSMConfig(enable=True),
    )


def _run(lp, old, ro, adv, mask, cfg, nan_mask=None, ent=None, ref=None):
    lp = lp.clone().requires_grad_(True)
    ent = (torch.rand_like(lp) if ent is None else ent).requires_grad_(True)
    ref = torch.randn_like(lp) if ref is None else ref
    loss, metrics = policy_loss(lp, old, ro, adv, mask, cfg, entropy=ent, ref_log_probs=ref, nan_mask=nan_mask)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(lp.grad).all()
    assert ent.grad is None or torch.isfinite(ent.grad).all()  # None when entropy_coef == 0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    return loss, metrics, lp.grad


@pytest.mark.parametrize("cfg", [AlgorithmConfig(), _all_on_cfg()], ids=["default", "all-on"])
def test_all_masked_batch_gives_zero_loss_with_a_graph(cfg):
    lp = torch.randn(3, 5)
    loss, metrics, grad = _run(lp, lp + 0.1, lp - 0.1, torch.randn(3), torch.zeros(3, 5), cfg)
    assert loss.item() == 0.0 and loss.requires_grad
    assert grad.eq(0).all()
    assert metrics["train/nan_ratio"] == 1.0


@pytest.mark.parametrize("cfg", [AlgorithmConfig(), _all_on_cfg()], ids=["default", "all-on"])
def test_nan_rewards_and_empty_responses_are_dropped_and_counted(cfg):
    rewards = torch.tensor([[1.0, float("nan"), 0.0, 1.0]])
    adv, nan_mask = grpo_advantages(rewards)
    adv, nan_mask = adv.reshape(-1), nan_mask.reshape(-1)
    lp = torch.randn(4, 6) - 1
    mask = torch.ones(4, 6)
    mask[3] = 0  # empty response
    loss, metrics, grad = _run(lp, lp.detach(), lp.detach(), adv, mask, cfg, nan_mask=nan_mask)
    assert metrics["train/nan_ratio"] == 0.5  # the NaN-reward sample and the empty one
    assert grad[1].eq(0).all() and grad[3].eq(0).all()
    assert grad[0].ne(0).any()


def test_nan_and_inf_inputs_never_reach_loss_or_gradient():
    lp = torch.randn(4, 5) - 1
    mask = torch.ones(4, 5)
    mask[:, 4] = 0
    lp[:, 4] = float("-inf")  # padding garbage: ignored without dropping the sequence
    old = lp.clone()
    old[1, 2] = float("nan")  # a broken valid token: its whole sequence is dropped
    adv = torch.tensor([1.0, -1.0, float("nan"), 0.5])  # a NaN advantage drops sequence 2
    ent = torch.rand(4, 5)
    ent[3, 4] = float("nan")
    loss, metrics, grad = _run(lp, old, lp.clone(), adv, mask, _all_on_cfg(), ent=ent)
    assert metrics["train/nan_ratio"] == 0.5
    assert grad[1].eq(0).all() and grad[2].eq(0).all() and grad[:, 4].eq(0).all()


def test_empty_batch_and_zero_length_responses():
    for b, t in ((0, 5), (3, 0)):
        lp = torch.zeros(b, t)
        loss, metrics, _ = _run(lp, lp, lp, torch.zeros(b), torch.ones(b, t), _all_on_cfg())
        assert loss.item() == 0.0
        assert metrics["train/nan_ratio"] == (1.0 if b else 0.0)


def test_bf16_inputs_are_upcast():
    lp = (torch.randn(2, 4) - 1).to(torch.bfloat16).requires_grad_(True)
    loss, _ = policy_loss(lp, lp.detach().float(), None, torch.tensor([1.0, -1.0]), torch.ones(2, 4))
    loss.backward()
    assert loss.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16


def test_loss_responds_to_each_mechanism():
    """Each switch changes the loss on an input built to trigger it (guards against no-ops)."""
    torch.manual_seed(0)
    lp = torch.randn(4, 8, dtype=torch.float64) - 1
    old = lp + 1.5 * torch.randn_like(lp)  # ratios well beyond the clip and dual-clip bounds
    ro = old + torch.randn_like(lp)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=torch.float64)
    mask = torch.ones(4, 8)
    base, _ = policy_loss(lp, old, ro, adv, mask, AlgorithmConfig(dual_clip=None))
    for cfg, key in (
        (AlgorithmConfig(), "train/dual_clip_ratio"),
        (AlgorithmConfig(dual_clip=None, is_correction=ISCorrectionConfig(enable=True)), "train/is_clip_ratio"),
        (AlgorithmConfig(dual_clip=None, m2po=M2POConfig(enable=True)), "train/m2po_mask_ratio"),
        (AlgorithmConfig(dual_clip=None, opsm=OPSMConfig(enable=True, delta=0.0)), "train/opsm_mask_ratio"),
    ):
        loss, metrics = policy_loss(lp, old, ro, adv, mask, cfg)
        assert metrics[key] > 0, key
        assert not torch.isclose(loss, base), key


def test_opsm_uses_old_log_probs_as_behaviour_without_rollout():
    torch.manual_seed(2)
    lp = torch.randn(4, 6, dtype=torch.float64) - 1
    old = lp + 0.3 * torch.randn_like(lp)
    adv, mask = torch.tensor([-1.0, -0.5, 1.0, -2.0], dtype=torch.float64), torch.ones(4, 6)
    cfg = AlgorithmConfig(opsm=OPSMConfig(enable=True, delta=0.0))
    without = policy_loss(lp, old, None, adv, mask, cfg)
    same = policy_loss(lp, old, old.clone(), adv, mask, cfg)
    assert without[0].item() == same[0].item()
    assert without[1]["train/opsm_mask_ratio"] == same[1]["train/opsm_mask_ratio"] > 0


def test_no_config_is_the_default_config():
    torch.manual_seed(1)
    lp, old, ro = (torch.randn(3, 4, dtype=torch.float64) for _ in range(3))
    adv, mask = torch.randn(3, 4, dtype=torch.float64), torch.rand(3, 4) > 0.3
    a = policy_loss(lp, old, ro, adv, mask)
    b = policy_loss(lp, old, ro, adv, mask, AlgorithmConfig())
    assert a[0].item() == b[0].item() and a[1] == b[1]
    c = policy_loss(lp, old, ro, adv, mask, _all_on_cfg(), entropy=torch.rand(3, 4, dtype=torch.float64),
                    ref_log_probs=torch.randn(3, 4, dtype=torch.float64))
    assert c[0].item() != a[0].item()  # the config is read, not its defaults


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_agg_mode="sum"), "`loss_agg_mode`"),
        (dict(is_correction=ISCorrectionConfig(enable=True, level="batch")), "`level`"),
        (dict(is_correction=ISCorrectionConfig(enable=True, mode="clip")), "`mode`"),
        (dict(dual_clip=0.5), "`dual_clip`"),
        (dict(entropy_coef=0.1), "`entropy`"),
        (dict(kl_coef=0.1), "`ref_log_probs`"),
    ],
)
def test_bad_arguments_raise_one_clear_sentence(kwargs, match):
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        policy_loss(lp, lp, lp, torch.zeros(2), torch.ones(2, 3), AlgorithmConfig(**kwargs))


def test_shape_mismatch_names_the_argument():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="`old_log_probs`"):
        policy_loss(lp, torch.zeros(2, 4), None, torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="`advantages`"):
        policy_loss(lp, lp, None, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="`rollout_log_probs`"):
        policy_loss(lp, lp, None, torch.zeros(2), torch.ones(2, 3), AlgorithmConfig(m2po=M2POConfig(enable=True)))


def test_grad_norm_metric_matches_reference():
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(2))
    c = torch.nn.Parameter(torch.zeros(1))  # no grad: ignored
    a.grad = torch.tensor([1.0, 2.0, 2.0])
    b.grad = torch.tensor([0.0, 4.0])
    assert grad_norm_metric([a, b, c]) == {"train/grad_norm": pytest.approx(math.sqrt(25.0))}
    assert grad_norm_metric([c]) == {"train/grad_norm": 0.0}
    assert set(METRIC_KEYS) == set(LOSS_METRIC_KEYS) | {"train/grad_norm"}
