"""Plain-Python float64 references for the algorithms and the hypothesis inputs they are checked on,
shared by tests/algorithms/ (advantages, losses and corrections; the composed policy loss).

Every reference is written from the formula with Python floats and loops (``math`` only),
independently of the implementation.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
NEAR = 1e-9


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def close(a: float, b: float, tol: float = 1e-9) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


logp = st.floats(min_value=-4.0, max_value=0.0, allow_nan=False, allow_infinity=False)
offset = st.floats(min_value=-1.0, max_value=1.0, allow_nan=False, allow_infinity=False)
advf = st.floats(min_value=-2.0, max_value=2.0, allow_nan=False, allow_infinity=False)


@st.composite
def batches(draw, per_token_adv=None):
    """A padded batch: log-probs, old/rollout/ref log-probs, advantages, mask, entropy."""
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))

    def grid(elem):
        return [[draw(elem) for _ in range(t)] for _ in range(b)]

    lp = grid(logp)
    old = [[lp[i][j] + d for j, d in enumerate(row)] for i, row in enumerate(grid(offset))]
    ro = [[old[i][j] + d for j, d in enumerate(row)] for i, row in enumerate(grid(offset))]
    ref = grid(logp)
    ent = grid(st.floats(0.0, 3.0))
    mask = grid(st.booleans())
    per_token = draw(st.booleans()) if per_token_adv is None else per_token_adv
    adv = grid(advf) if per_token else [draw(advf) for _ in range(b)]
    return dict(lp=lp, old=old, ro=ro, ref=ref, ent=ent, mask=mask, adv=adv, per_token=per_token, b=b, t=t)


def adv_tok(d, i, j):
    return d["adv"][i][j] if d["per_token"] else d["adv"][i]


def adv_tensor(d):
    return t64(d["adv"])


# ----------------------------------------------------------------------------------------------
# Plain-Python references
# ----------------------------------------------------------------------------------------------


def ref_grpo(groups, norm_std, eps):
    out, nan = [], []
    for g in groups:
        vals = [r for r in g if math.isfinite(r)]
        n = len(vals)
        mean = sum(vals) / n if n else 0.0
        std = math.sqrt(sum((r - mean) ** 2 for r in vals) / (n - 1)) if n > 1 else 0.0
        constant = n == 0 or max(vals) == min(vals)
        row, nrow = [], []
        for r in g:
            if not math.isfinite(r) or constant:
                row.append(0.0)
            else:
                row.append((r - mean) / (std + eps) if norm_std else r - mean)
            nrow.append(not math.isfinite(r))
        out.append(row)
        nan.append(nrow)
    return out, nan


def ref_agg(loss, mask, mode):
    if mode == "token-mean":
        n = sum(1 for row in mask for m in row if m)
        return sum(x for lrow, mrow in zip(loss, mask) for x, m in zip(lrow, mrow) if m) / max(n, 1)
    seqs = []
    for lrow, mrow in zip(loss, mask):
        n = sum(1 for m in mrow if m)
        if n == 0:
            continue
        s = sum(x for x, m in zip(lrow, mrow) if m)
        seqs.append(s if mode == "seq-mean-token-sum" else s / n)
    return sum(seqs) / max(len(seqs), 1)


def ref_ppo(lp, old, a, cl, ch, dc):
    """(loss, clipped, dual, dloss/dlp) of one token."""
    r = math.exp(lp - old)
    pg1 = -a * r
    pg2 = -a * min(max(r, 1 - cl), 1 + ch)
    loss, clipped = max(pg1, pg2), pg2 > pg1
    grad = 0.0 if clipped else -a * r
    dual = False
    if dc is not None and a < 0:
        pg3 = -a * dc
        if pg3 < loss:
            loss, dual, grad = pg3, True, 0.0
    return loss, clipped, dual, grad


def ppo_near_boundary(lp, old, a, cl, ch, dc):
    r = math.exp(lp - old)
    if abs(r - (1 - cl)) < NEAR or abs(r - (1 + ch)) < NEAR:
        return True
    if dc is not None and a < 0:
        clipped_loss = max(-a * r, -a * min(max(r, 1 - cl), 1 + ch))
        return abs(clipped_loss - (-a * dc)) < NEAR
    return False


def ref_is(old, ro, mask, level, mode, c, c_low, c_high):
    """(weights, rhos used for stats, changed flags for stats)."""
    b, t = len(mask), len(mask[0])
    w = [[0.0] * t for _ in range(b)]
    rhos, changed = [], []

    def weight(rho):
        if mode == "truncate":
            return min(rho, c), rho > c
        inside = c_low <= rho <= c_high
        return (rho if inside else 0.0), not inside

    for i in range(b):
        if level == "sequence":
            if not any(mask[i]):
                continue
            rho = math.exp(sum(old[i][j] - ro[i][j] for j in range(t) if mask[i][j]))
            wi, ch = weight(rho)
            rhos.append(rho)
            changed.append(ch)
            for j in range(t):
                if mask[i][j]:
                    w[i][j] = wi
        else:
            for j in range(t):
                if mask[i][j]:
                    rho = math.exp(old[i][j] - ro[i][j])
                    w[i][j], ch = weight(rho)
                    rhos.append(rho)
                    changed.append(ch)
    return w, rhos, changed


def ref_m2po(old, ro, mask, tau):
    """Literal greedy loop: (kept values sorted, dropped values sorted, means seen)."""
    vals = [(old[i][j] - ro[i][j]) ** 2 for i in range(len(mask)) for j in range(len(mask[0])) if mask[i][j]]
    kept = sorted(vals)
    dropped, means = [], []
    while kept:
        mean = 0.0
        for v in kept:  # sequential sum in ascending order
            mean += v
        mean /= len(kept)
        means.append(mean)
        if mean <= tau:
            break
        dropped.append(kept.pop())  # the largest
    return kept, sorted(dropped), means


def ref_opsm(beh, cur, adv_at, mask, delta):
    """keep[i][j] and the per-sequence KL values."""
    keep, kls = [], []
    for i, mrow in enumerate(mask):
        n = sum(1 for m in mrow if m)
        kl = sum(beh[i][j] - cur[i][j] for j in range(len(mrow)) if mrow[j]) / max(n, 1)
        kls.append(kl)
        keep.append([bool(m) and not (adv_at(i, j) < 0 and kl > delta) for j, m in enumerate(mrow)])
    return keep, kls
