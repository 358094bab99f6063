"""Advantages, losses and off-policy corrections against plain-Python float64 references.

Every reference (``tests/helpers/algorithms.py``) is written from the formula with Python floats
and loops (``math`` only), independently of the implementation; inputs are drawn by hypothesis.
Cases that sit within 1e-9 of a decision boundary (clip edge, threshold) are skipped with ``assume`` because
two correct float64 computations may legitimately round to different sides there.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from lightning_fasync.algorithms import (
    aggregate_loss,
    compute_advantages,
    grpo_advantages,
    is_correction_weights,
    k3_kl,
    m2po_mask,
    mask_offpolicy_tokens,
    opsm_mask,
    ppo_clip_token_loss,
)
from lightning_fasync.config import AlgorithmConfig
from tests.helpers.algorithms import (
    NEAR,
    SETTINGS,
    adv_tensor,
    adv_tok,
    batches,
    close,
    ppo_near_boundary,
    ref_agg,
    ref_grpo,
    ref_is,
    ref_m2po,
    ref_opsm,
    ref_ppo,
    t64,
)

# ----------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------


@SETTINGS
@given(
    groups=st.integers(1, 4).flatmap(
        lambda n: st.lists(
            st.lists(st.one_of(st.floats(-5, 5), st.sampled_from([0.0, 1.0, float("nan")])), min_size=n, max_size=n),
            min_size=1,
            max_size=5,
        )
    ),
    norm_std=st.booleans(),
)
def test_grpo_advantages_match_reference(groups, norm_std):
    adv, nan = grpo_advantages(t64(groups), norm_std=norm_std, eps=1e-6)
    ref, ref_nan = ref_grpo(groups, norm_std, 1e-6)
    assert nan.tolist() == ref_nan
    assert torch.isfinite(adv).all()
    for row, rrow in zip(adv.tolist(), ref):
        for a, r in zip(row, rrow):
            assert close(a, r, 1e-7), (a, r)


@SETTINGS
@given(
    data=st.lists(
        st.tuples(st.integers(0, 3), st.one_of(st.floats(-5, 5), st.just(float("nan")))), min_size=1, max_size=12
    )
)
def test_grpo_flat_group_ids_match_reference(data):
    ids = [g for g, _ in data]
    rewards = [r for _, r in data]
    adv, nan = grpo_advantages(t64(rewards), torch.tensor(ids), norm_std=True)
    for gid in set(ids):
        pos = [k for k, g in enumerate(ids) if g == gid]
        ref, ref_nan = ref_grpo([[rewards[k] for k in pos]], True, 1e-6)
        for k, r, rn in zip(pos, ref[0], ref_nan[0]):
            assert close(adv[k].item(), r, 1e-7)
            assert bool(nan[k]) == rn


def test_grpo_zero_variance_and_broken_groups_are_exact_zeros():
    rewards = torch.tensor(
        [[0.1, 0.1, 0.1], [float("nan")] * 3, [1.0, float("nan"), float("inf")], [1.0, 2.0, float("nan")]]
    )
    adv, nan = grpo_advantages(rewards)
    assert adv[:3].eq(0).all()
    assert nan.tolist() == [[False] * 3, [True] * 3, [False, True, True], [False, False, True]]
    # The NaN in row 3 does not move its group: mean 1.5, unbiased std sqrt(0.5).
    assert torch.allclose(adv[3, :2], torch.tensor([-0.5, 0.5]) / (math.sqrt(0.5) + 1e-6))
    assert adv[3, 2] == 0
    plain, _ = compute_advantages(rewards[3:], AlgorithmConfig(advantage_norm_std=False))
    assert torch.allclose(plain, torch.tensor([[-0.5, 0.5, 0.0]]))


def test_grpo_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="`group_ids`"):
        grpo_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="`group_ids`"):
        grpo_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="`rewards`"):
        grpo_advantages(torch.zeros(2, 2, 2))


# ----------------------------------------------------------------------------------------------
# Loss primitives
# ----------------------------------------------------------------------------------------------


@SETTINGS
@given(d=batches(), mode=st.sampled_from(["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]))
def test_aggregate_loss_matches_reference(d, mode):
    got = aggregate_loss(t64(d["ent"]), torch.tensor(d["mask"]), mode).item()
    assert close(got, ref_agg(d["ent"], d["mask"], mode))


@SETTINGS
@given(
    d=batches(per_token_adv=True),
    cl=st.sampled_from([0.1, 0.2, 0.3]),
    ch=st.sampled_from([0.2, 0.28, 0.5]),
    dc=st.sampled_from([None, 1.5, 3.0]),
)
def test_ppo_clip_token_loss_value_flags_and_grad_match_reference(d, cl, ch, dc):
    b, t = d["b"], d["t"]
    for i in range(b):
        for j in range(t):
            assume(not ppo_near_boundary(d["lp"][i][j], d["old"][i][j], d["adv"][i][j], cl, ch, dc))
    lp = t64(d["lp"]).requires_grad_(True)
    loss, clipped, dual = ppo_clip_token_loss(lp, t64(d["old"]), t64(d["adv"]), clip_low=cl, clip_high=ch, dual_clip=dc)
    loss.sum().backward()
    for i in range(b):
        for j in range(t):
            rl, rc, rd, rg = ref_ppo(d["lp"][i][j], d["old"][i][j], d["adv"][i][j], cl, ch, dc)
            assert close(loss[i, j].item(), rl)
            assert bool(clipped[i, j]) == rc
            assert bool(dual[i, j]) == rd
            assert close(lp.grad[i, j].item(), rg)


@SETTINGS
@given(d=batches())
def test_k3_kl_matches_reference_and_is_nonnegative(d):
    lp = t64(d["lp"]).requires_grad_(True)
    kl = k3_kl(lp, t64(d["ref"]))
    kl.sum().backward()
    for i in range(d["b"]):
        for j in range(d["t"]):
            x = d["ref"][i][j] - d["lp"][i][j]
            assert close(kl[i, j].item(), math.exp(x) - x - 1, 1e-8)
            assert kl[i, j].item() >= 0
            # d/dlp [exp(ref - lp) - (ref - lp) - 1] = 1 - exp(ref - lp)
            assert close(lp.grad[i, j].item(), 1 - math.exp(x), 1e-8)


# ----------------------------------------------------------------------------------------------
# Corrections
# ----------------------------------------------------------------------------------------------


@SETTINGS
@given(
    d=batches(),
    level=st.sampled_from(["token", "sequence"]),
    mode=st.sampled_from(["truncate", "mask"]),
    c=st.sampled_from([1.0, 1.5, 2.0]),
    bounds=st.sampled_from([(0.5, 2.0), (0.8, 1.25), (0.9, 1.1)]),
)
def test_is_correction_weights_match_reference(d, level, mode, c, bounds):
    c_low, c_high = bounds
    w_ref, rhos, changed = ref_is(d["old"], d["ro"], d["mask"], level, mode, c, c_low, c_high)
    for rho in rhos:
        assume(all(abs(rho - x) > NEAR for x in (c, c_low, c_high)))
    w, m = is_correction_weights(
        t64(d["old"]), t64(d["ro"]), torch.tensor(d["mask"]), level=level, mode=mode, c=c, c_low=c_low, c_high=c_high
    )
    assert not w.requires_grad
    for i in range(d["b"]):
        for j in range(d["t"]):
            assert close(w[i, j].item(), w_ref[i][j])
    if rhos:
        assert close(m["train/is_mean"], sum(rhos) / len(rhos))
        assert close(m["train/is_max"], max(rhos))
        assert close(m["train/is_clip_ratio"], sum(changed) / len(changed))
    else:
        assert m == {"train/is_mean": 1.0, "train/is_max": 1.0, "train/is_clip_ratio": 0.0}


@SETTINGS
@given(d=batches(), tau=st.sampled_from([0.0, 0.01, 0.04, 0.2]))
def test_m2po_mask_matches_greedy_reference(d, tau):
    kept_ref, dropped_ref, means = ref_m2po(d["old"], d["ro"], d["mask"], tau)
    assume(all(abs(mu - tau) > NEAR for mu in means))
    keep = m2po_mask(t64(d["old"]), t64(d["ro"]), torch.tensor(d["mask"]), tau=tau)
    kept, dropped = [], []
    for i in range(d["b"]):
        for j in range(d["t"]):
            v = (d["old"][i][j] - d["ro"][i][j]) ** 2
            if not d["mask"][i][j]:
                assert not keep[i, j]  # invalid tokens are never "kept"
            elif keep[i, j]:
                kept.append(v)
            else:
                dropped.append(v)
    assert sorted(kept) == kept_ref
    assert sorted(dropped) == dropped_ref
    if kept:
        assert sum(kept) / len(kept) <= tau + 1e-12


def test_m2po_drops_the_outlier_and_all_when_unsatisfiable():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    ro = torch.tensor([[0.1, -0.1, 1.0, 0.05]], dtype=torch.float64)
    keep = m2po_mask(old, ro, torch.ones(1, 4), tau=0.04)
    assert keep.tolist() == [[True, True, False, True]]
    keep = m2po_mask(old, ro + 1.0, torch.ones(1, 4), tau=0.04)  # every M2 > tau
    assert not keep.any()


@SETTINGS
@given(d=batches(), delta=st.sampled_from([0.0, 1e-4, 0.1]))
def test_opsm_mask_matches_reference(d, delta):
    def adv_at(i, j):
        return adv_tok(d, i, j)

    keep_ref, kls = ref_opsm(d["ro"], d["lp"], adv_at, d["mask"], delta)
    assume(all(abs(kl - delta) > NEAR for kl in kls))
    keep = opsm_mask(t64(d["ro"]), t64(d["lp"]), adv_tensor(d), torch.tensor(d["mask"]), delta=delta)
    assert keep.tolist() == keep_ref


@SETTINGS
@given(
    rows=st.lists(
        st.integers(0, 6).flatmap(
            lambda n: st.tuples(
                st.lists(st.integers(0, 1), min_size=n, max_size=n),
                st.lists(st.integers(0, 3), min_size=n, max_size=n).map(sorted),
            )
        ),
        min_size=1,
        max_size=4,
    ),
    current=st.one_of(st.none(), st.integers(0, 4)),
)
def test_mask_offpolicy_tokens_lists_and_padded_tensors(rows, current):
    def ref(mask, versions, cur):
        if not versions:
            return []
        end = versions[-1] if cur is None else cur
        return [m if v >= end else 0 for m, v in zip(mask, versions)]

    expected = [ref(m, v, current) for m, v in rows]
    for (m, v), e in zip(rows, expected):
        assert mask_offpolicy_tokens(m, v, current) == e
    assert mask_offpolicy_tokens([m for m, _ in rows], [v for _, v in rows], current) == expected
    # Padded tensor: pad masks with 0 and versions with -1 (<= every real version).
    t = max(len(m) for m, _ in rows)
    lm = torch.tensor([m + [0] * (t - len(m)) for m, _ in rows], dtype=torch.long).reshape(len(rows), t)
    wv = torch.tensor([v + [-1] * (t - len(v)) for _, v in rows], dtype=torch.long).reshape(len(rows), t)
    out = mask_offpolicy_tokens(lm, wv, current)
    assert out.dtype == lm.dtype
    assert [row[: len(e)] for row, e in zip(out.tolist(), expected)] == expected
    assert all(x == 0 for row, e in zip(out.tolist(), expected) for x in row[len(e) :])
    bool_out = mask_offpolicy_tokens(lm.bool(), wv, current)
    assert bool_out.dtype == torch.bool and bool_out.tolist() == out.bool().tolist()


def test_mask_offpolicy_tokens_per_row_version_and_errors():
    lm = torch.ones(2, 3)
    wv = torch.tensor([[1, 2, 2], [1, 1, 2]])
    out = mask_offpolicy_tokens(lm, wv, torch.tensor([1, 2]))
    assert out.tolist() == [[1, 1, 1], [0, 0, 1]]
    single = mask_offpolicy_tokens(torch.tensor([1, 0, 1, 1]), torch.tensor([4, 5, 5, 6]))
    assert single.tolist() == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="`weight_versions`"):
        mask_offpolicy_tokens([1, 1], [1])
    with pytest.raises(ValueError, match="`weight_versions`"):
        mask_offpolicy_tokens(torch.ones(2, 3), torch.ones(2, 2))


def test_k3_kl_is_nonnegative_for_tiny_log_ratios():
    # exp(d) - d - 1 rounds to a negative number for ~1 % of |d| < 1e-7; expm1(d) - d does not.
    d = torch.linspace(-1e-7, 1e-7, 200_001, dtype=torch.float64)
    assert bool((k3_kl(torch.zeros_like(d), d) >= 0).all())
