"""Packed and micro-batched training calls give the plain padded call's loss, metrics and gradients.

The reference is ``RLPolicyModule`` with ``pack_sequences: false`` and no token budget: one padded
forward over the call, the path that existed before packing. Each case runs both calls of a rollout
step (the second one's old log-probs come from the step-start snapshot or the loglinear
interpolation, so the loss depends on the live log-probs), on calls with long-tailed lengths,
tokens of two weight versions and loss-mask zeros inside responses."""

from __future__ import annotations

import types

import pytest
import torch

from lightning_fasync.lightning.module import RLPolicyModule
from tests.trainer_packing.calls import Qwen3Module, assert_same_calls, module, two_calls

# M2PO's tau and OPSM's default delta drop some of these calls' tokens, not all (asserted below).
ALGORITHMS = {
    "grpo": {},
    "ppo-is-token": {"is_correction": {"enable": True}},
    "ppo-is-sequence-mask": {"is_correction": {"enable": True, "level": "sequence", "mode": "mask", "c_low": 0.2,
                                               "c_high": 5.0}},
    "m2po": {"m2po": {"enable": True, "tau": 10.0}, "is_correction": {"enable": True}},
    "opsm": {"opsm": {"enable": True}},
    "loglinear-m2po": {"prox_logp_method": "loglinear", "m2po": {"enable": True, "tau": 1.0}},
    "entropy-bonus-metrics": {"entropy_coef": 0.01, "prox_logp_method": "metrics"},
    "kl-reference": {"kl_coef": 0.05, "reference": {"model": "policy"}},  # the reference's forwards packed too
}
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
# Packed in one forward, packed in micro-batches of 40 tokens (most sequences share a micro-batch,
# the longest are alone), and padded micro-batches of the same budget.
VARIANTS = {"packed": {"pack_sequences": True}, "packed-micro": {"pack_sequences": True, "max_tokens_per_micro_batch": 40},
            "padded-micro": {"pack_sequences": False, "max_tokens_per_micro_batch": 40}}


CASES = [(name, "token-mean") for name in sorted(ALGORITHMS)] + [(name, mode) for name in ("grpo", "m2po", "opsm")
                                                                    for mode in MODES[1:]]


@pytest.mark.parametrize("name, mode", CASES)
def test_packed_and_micro_batched_calls_match_the_padded_call(name, mode):
    algorithm = {**ALGORITHMS[name], "loss_agg_mode": mode}
    want = two_calls(module(algorithm, pack_sequences=False))
    assert want[0]["plan"] is None  # the reference is the plain padded forward
    for key in ("train/m2po_mask_ratio", "train/opsm_mask_ratio"):
        if key.split("/")[1].split("_")[0] in name:  # the correction masks part of each call
            assert all(0.05 < call["metrics"][key] < 0.95 for call in want), key
    for variant, overrides in VARIANTS.items():
        got = two_calls(module(algorithm, **overrides), like=want)
        plan = got[0]["plan"]
        assert plan.packed == overrides["pack_sequences"]
        if "max_tokens_per_micro_batch" in overrides:
            assert len(plan.micro_batches) >= 3, variant  # the budget really cut the call
        # Token sums (seq-mean-token-sum) weigh each token up to a response's length more, and float32
        # rounds the embedding gradient's scatter-add in another order when packed: up to ~1.5e-6 there.
        assert_same_calls(got, want, tol=3e-6 if mode == "seq-mean-token-sum" else 1e-6)


def test_partial_rollout_masks_match_the_padded_call():
    """``rollout.mask_offpolicy_in_partial_rollout``: only the newest version's tokens are trained."""
    rollout = {"partial": True, "mask_offpolicy_in_partial_rollout": True}
    # M2PO's tau as in ALGORITHMS: at its default it masks every token these calls keep (loss 0).
    algorithm = {"is_correction": {"enable": True}, "m2po": {"enable": True, "tau": 10.0}}
    want = two_calls(module(algorithm, rollout, pack_sequences=False))
    # Tokens are left to train on, and the older version's are taken out: without the mask the loss differs.
    assert all(w["loss"] != 0 and any(g.abs().max() > 0 for g in w["grads"].values()) for w in want)
    unmasked = two_calls(module(algorithm, {"partial": True}, pack_sequences=False))
    assert all(abs(u["loss"] - w["loss"]) > 1e-3 for u, w in zip(unmasked, want, strict=True))
    for overrides in VARIANTS.values():
        assert_same_calls(two_calls(module(algorithm, rollout, **overrides), like=want), want)


def test_a_qwen3_policy_packs_as_it_pads():
    """Qwen3 (per-head q/k norms, grouped-query attention, tied embeddings): the same equality."""
    algorithm = {"is_correction": {"enable": True}, "loss_agg_mode": "seq-mean-token-sum"}
    want = two_calls(module(algorithm, cls=Qwen3Module, pack_sequences=False))
    for overrides in VARIANTS.values():
        assert_same_calls(two_calls(module(algorithm, cls=Qwen3Module, **overrides), like=want), want, tol=3e-6)


class EagerModule(Qwen3Module):
    """The small Qwen3 with transformers' ``eager`` attention (its own mask from the positions)."""

    def _build_policy(self, model):
        policy, tokenizer = super()._build_policy(model)
        policy.config._attn_implementation = "eager"
        return policy, tokenizer


def test_eager_attention_packs_as_it_pads():
    algorithm = {"is_correction": {"enable": True}}
    want = two_calls(module(algorithm, cls=EagerModule, pack_sequences=False))
    packed = module(algorithm, cls=EagerModule, pack_sequences=True, max_tokens_per_micro_batch=40)
    assert packed._packing == "rows" and packed.policy.config._attn_implementation == "eager"
    assert_same_calls(two_calls(packed, like=want), want, tol=3e-6)


BAD = 95  # a token id the calls' random tokens (< 90) never use


class NaNAfterBad(torch.nn.Module):
    """The ``tiny`` policy, except that the logits at a position holding token :data:`BAD` are NaN: a
    row whose own log-probs are non-finite, which the loss drops (and its count with it)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, **kwargs):
        out = self.inner(input_ids=input_ids, **kwargs)
        logits = torch.where((input_ids == BAD).unsqueeze(-1), torch.full_like(out.logits, float("nan")), out.logits)
        return types.SimpleNamespace(logits=logits)


class BrokenRowModule(RLPolicyModule):
    def _build_policy(self, model):
        policy, tokenizer = super()._build_policy(model)
        return NaNAfterBad(policy), tokenizer


@pytest.mark.parametrize("mode", MODES)
def test_a_row_with_non_finite_log_probs_is_dropped_as_in_one_forward(mode, monkeypatch):
    """The denominators are fixed before the forwards; a row found non-finite in a micro-batch
    leaves them, and the micro-batches' gradients already accumulated are rescaled to the new count."""
    import tests.trainer_packing.calls as calls

    make = calls.make_groups

    def with_bad(seed, **kw):
        groups = make(seed, **kw)
        t = max((t for g in groups for t in g.trajectories), key=lambda t: len(t.response_ids))
        t.response_ids[len(t.response_ids) // 2] = BAD  # mid-response: the position after it is scored
        t.loss_mask[:] = [1] * len(t.loss_mask)
        return groups

    monkeypatch.setattr(calls, "make_groups", with_bad)
    algorithm = {"is_correction": {"enable": True}, "loss_agg_mode": mode}
    want = two_calls(module(algorithm, cls=BrokenRowModule, pack_sequences=False))
    assert all(call["metrics"]["train/nan_ratio"] > 0 for call in want)  # the row was dropped
    got = two_calls(module(algorithm, cls=BrokenRowModule, pack_sequences=True, max_tokens_per_micro_batch=40),
                    like=want)
    assert len(got[0]["plan"].micro_batches) >= 3
    assert_same_calls(got, want, tol=3e-6 if mode == "seq-mean-token-sum" else 1e-6)
