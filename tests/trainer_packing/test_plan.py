"""The forward plan: every sequence scored once where the padded layout has it, positions restarting
per sequence, rows and micro-batches within their bounds; attention kept inside each sequence; the
data-parallel shares balanced by tokens; the refusals."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_fasync.config import ConfigError, load_config, validate
from lightning_fasync.lightning.batch import (PolicyBatch, check_packed_attention, collate_groups, forward_log_probs,
                                              plan_forwards)
from lightning_fasync.lightning.module import RLPolicyModule, token_log_probs
from lightning_fasync.runtime.packing import balanced_equal_count, first_fit_decreasing, padded_cost, split_to
from lightning_fasync.runtime.ranks import dp_share, group_tokens
from tests.helpers.required import MEGATRON, require
from tests.trainer_packing.calls import make_groups

PAD = 0


def _batch(seed: int = 0, **kw) -> PolicyBatch:
    return collate_groups(make_groups(seed, **kw), PAD)


def _unpacked_targets(data: PolicyBatch, plan) -> torch.Tensor:
    """What each micro-batch scores, put where its ``target`` says: the padded layout's next tokens."""
    out = torch.full((data.input_ids.shape[0], plan.width), -1, dtype=torch.long)
    for mb in plan.micro_batches:
        nxt = mb.input_ids.reshape(-1)[mb.source + 1]
        block = torch.full((mb.rows.numel() * plan.width,), -1, dtype=torch.long)
        block[mb.target] = nxt
        out[mb.rows] = block.view(-1, plan.width)
    return out


@pytest.mark.parametrize("pack, layout, budget", [(True, "rows", None), (True, "flat", None), (True, "rows", 40),
                                                  (True, "flat", 30), (False, "rows", 60), (True, "rows", 1)])
def test_every_sequence_is_scored_once_where_the_padded_layout_has_it(pack, layout, budget):
    data = _batch(num_groups=4)
    lengths = data.attention_mask.sum(-1).tolist()
    plan = plan_forwards(data, PAD, pack=pack, max_tokens=budget, layout=layout)
    rows = torch.cat([mb.rows for mb in plan.micro_batches]).tolist()
    assert sorted(rows) == list(range(len(lengths)))  # each sequence in exactly one micro-batch
    # The scores land exactly on the padded layout's positions 0 .. len - 2, predicting the same tokens.
    want = torch.where(data.attention_mask[:, 1:].bool(), data.input_ids[:, 1:], torch.full_like(data.input_ids[:, 1:], -1))
    assert torch.equal(_unpacked_targets(data, plan), want)
    for mb in plan.micro_batches:
        own = [lengths[r] for r in mb.rows.tolist()]
        if budget is not None and len(own) > 1:  # a micro-batch over budget holds one sequence only
            assert (sum(own) if pack else len(own) * max(own)) <= budget
        if not pack:
            assert mb.position_ids is None and mb.attention_mask is not None
            continue
        assert mb.attention_mask is None
        if layout == "flat":
            assert mb.input_ids.shape[0] == 1
        else:
            assert mb.input_ids.shape[1] == max(max(own), 2)  # no row longer than the longest sequence
        # Positions restart at 0 at every sequence start, and count up inside it.
        starts = (mb.source - mb.target % plan.width)[mb.target % plan.width == 0]
        flat_pos = mb.position_ids.reshape(-1)
        assert (flat_pos[starts] == 0).all()
        assert torch.equal(flat_pos[mb.source], mb.target % plan.width)
        assert mb.tokens == sum(own) and int((mb.input_ids != PAD).sum()) <= mb.tokens


def test_a_budget_packs_the_long_tail_apart():
    data = _batch(num_groups=4)
    plan = plan_forwards(data, PAD, pack=True, max_tokens=48)
    assert len(plan.micro_batches) > 1 and sum(mb.tokens for mb in plan.micro_batches) == sum(plan.lengths)
    assert all(mb.tokens <= 48 or mb.rows.numel() == 1 for mb in plan.micro_batches)
    # Packed rows carry far less padding than the padded batch.
    packed = sum(mb.input_ids.numel() for mb in plan_forwards(data, PAD, pack=True).micro_batches)
    assert packed < 0.75 * data.input_ids.numel()


def test_first_fit_decreasing_split_to_and_balanced_shares():
    lengths = [7, 1, 5, 5, 2, 9, 3]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins) and bins[0][0] == 5  # the longest goes first
    assert first_fit_decreasing([12, 3], 10) == [[0], [1]]  # too long for the budget: a bin of its own
    assert first_fit_decreasing(lengths, None) == [sorted(range(7), key=lambda i: (-lengths[i], i))]
    assert all(padded_cost([lengths[i] for i in b]) <= 12 for b in first_fit_decreasing(lengths, 12, padded_cost)
               if len(b) > 1)
    more = split_to(bins, len(bins) + 2, lengths)
    assert len(more) == len(bins) + 2 and sorted(i for b in more for i in b) == list(range(7))
    assert max(sum(lengths[i] for i in b) for b in more) <= max(sum(lengths[i] for i in b) for b in bins)
    assert split_to([[0], [1]], 4, [3, 4]) == [[0], [1], [], []]  # single items: empty micro-batches make up the rest
    parts = balanced_equal_count([10, 1, 1, 1, 9, 1, 1, 8], 2)
    assert [len(p) for p in parts] == [4, 4] and sorted(parts[0] + parts[1]) == list(range(8))
    loads = [sum([10, 1, 1, 1, 9, 1, 1, 8][i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 8  # strided: indices 0,2,4,6 weigh 21 against 11


def test_data_parallel_shares_are_whole_groups_balanced_by_tokens():
    rng = random.Random(3)
    groups = make_groups(7, num_groups=8, lengths=(1, 2, 64))  # a long tail: some groups far heavier
    for size in (2, 4):
        shares = [dp_share(groups, r, size, tokens=group_tokens) for r in range(size)]
        assert [len(s) for s in shares] == [len(groups) // size] * size
        seen = [g.sample.prompt_id for s in shares for g in s]
        assert sorted(seen) == sorted(g.sample.prompt_id for g in groups)  # disjoint, covering: each once
        balanced = [sum(group_tokens(g) for g in s) for s in shares]
        strided = [sum(group_tokens(g) for g in dp_share(groups, r, size)) for r in range(size)]
        assert max(balanced) - min(balanced) <= max(strided) - min(strided)
        assert max(balanced) - min(balanced) <= max(group_tokens(g) for g in groups)
        assert shares == [dp_share(list(groups), r, size, tokens=group_tokens) for r in range(size)]  # deterministic
    rng.shuffle(groups)
    with pytest.raises(ValueError, match="cannot be shared evenly"):
        dp_share(groups[:3], 0, 2, tokens=group_tokens)


# ------------------------------------------------------------------------------ attention stays inside a sequence


def _logprobs_by_sequence(policy, data, **plan_args):
    data.forwards = plan_forwards(data, PAD, **plan_args)
    with torch.no_grad():
        lp, _ = token_log_probs(policy, data)
    return lp


def test_changing_one_sequence_leaves_every_other_sequences_log_probs():
    policy = RLPolicyModule("tiny").policy.eval()
    data = _batch(seed=2, num_groups=3)
    plan = plan_forwards(data, PAD, pack=True)
    assert any(len(set(mb.position_ids[r].eq(0).nonzero().flatten().tolist())) > 2 for mb in plan.micro_batches
               for r in range(mb.input_ids.shape[0]))  # a row holds several sequences (the test needs it)
    valid = data.attention_mask[:, 1:].bool()
    for kwargs in ({"pack": True, "layout": "rows"}, {"pack": True, "layout": "flat"}):
        before = _logprobs_by_sequence(policy, data, **kwargs)
        # The padded forward of the same tokens: positions and attention are each sequence's own.
        with torch.no_grad():
            padded, _ = token_log_probs(policy, PolicyBatch(**{**vars(data), "forwards": None}))
        torch.testing.assert_close(before[valid], padded[valid], rtol=0, atol=2e-5)
        changed = PolicyBatch(**{**vars(data), "input_ids": data.input_ids.clone(), "forwards": None})
        row = 3
        n = int(data.attention_mask[row].sum())
        changed.input_ids[row, :n] = (changed.input_ids[row, :n] + 7) % 80 + 4
        after = _logprobs_by_sequence(policy, changed, **kwargs)
        others = valid.clone()
        others[row] = False
        assert torch.equal(after[others], before[others]), kwargs
        assert not torch.equal(after[row, : n - 1], before[row, : n - 1])


def test_a_packing_that_let_sequences_see_each_other_would_be_caught():
    """The negative control of the test above: the same packed rows with a plain causal mask over
    each whole row (what a model that ignored the positions would do) change the later sequences."""
    policy = RLPolicyModule("tiny").policy.eval()
    data = _batch(seed=2, num_groups=3)
    plan = plan_forwards(data, PAD, pack=True)
    mb = plan.micro_batches[0]
    with torch.no_grad():
        right, _, _ = forward_log_probs(policy, mb, plan.width)
        leaky = type(mb)(**{**vars(mb), "position_ids": None, "attention_mask": torch.ones_like(mb.input_ids)})
        wrong, _, _ = forward_log_probs(policy, leaky, plan.width)
    assert (right - wrong).abs().max() > 1e-2


def test_a_model_whose_attention_ignores_the_positions_is_refused():
    policy = RLPolicyModule("tiny").policy

    class CausalOverRows(torch.nn.Module):
        """Drops ``position_ids``: one causal sequence per row, as attention without packing support."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.config = inner.config

        def forward(self, input_ids, position_ids=None, **kw):
            return self.inner(input_ids=input_ids, **kw)

    with pytest.raises(ConfigError, match="lets packed sequences attend to each other"):
        check_packed_attention(CausalOverRows(policy))
    check_packed_attention(policy)  # the real one keeps them apart


def test_the_probe_runs_without_dropout_and_leaves_the_mode_and_the_random_state_alone():
    """A policy with dropout, in training mode (where the probe meets it at the first packed call):
    its two forwards would differ by the dropout masks alone, whatever the attention does."""
    policy = RLPolicyModule("tiny").policy
    for layer in policy.model.layers:
        layer.self_attn.attention_dropout = 0.5
    policy.train()
    state = torch.random.get_rng_state()
    check_packed_attention(policy)
    assert policy.training
    assert torch.equal(torch.random.get_rng_state(), state)


# ------------------------------------------------------------------------------ config


def test_the_keys_are_checked_and_reach_the_module():
    with pytest.raises(ConfigError, match=r"`trainer.max_tokens_per_micro_batch` is 0; it must be >= 1"):
        validate(load_config({"trainer": {"max_tokens_per_micro_batch": 0}}))
    cfg = load_config({"trainer": {"pack_sequences": False, "max_tokens_per_micro_batch": 256}})
    args = RLPolicyModule.algorithm_args(cfg)
    assert (args["pack_sequences"], args["max_tokens_per_micro_batch"]) == (False, 256)
    module = RLPolicyModule("tiny", **args)
    module.check_fasync_config(cfg)
    with pytest.raises(ConfigError, match=r"`trainer.pack_sequences` in the plugin config is None"):
        module.check_fasync_config(load_config({"trainer": {"max_tokens_per_micro_batch": 256}}))
    with pytest.raises(ConfigError, match=r"`trainer.max_tokens_per_micro_batch` is -3"):
        RLPolicyModule("tiny", max_tokens_per_micro_batch=-3)
    # null packs where the policy's attention keeps packed sequences apart (tiny: sdpa).
    assert RLPolicyModule("tiny")._packing == "rows" and RLPolicyModule("tiny", pack_sequences=False)._packing is None


def test_packing_an_attention_transformers_does_not_keep_apart_is_refused():
    class OtherAttention(RLPolicyModule):
        def _build_policy(self, model):
            policy, tokenizer = super()._build_policy(model)
            policy.config._attn_implementation = "my_kernel"
            return policy, tokenizer

    with pytest.raises(ConfigError, match=r"`trainer.pack_sequences` is true, but the policy's attention .*'my_kernel'"):
        OtherAttention("tiny", pack_sequences=True)
    assert OtherAttention("tiny")._packing is None  # null: padded forwards for it


def test_megatron_refuses_packing_and_a_token_budget():
    require(*MEGATRON)
    from lightning_fasync.trainers.megatron.module import MegatronPolicyModule

    with pytest.raises(ConfigError, match=r"`trainer.pack_sequences` is true under MegatronStrategy"):
        MegatronPolicyModule("tiny", pack_sequences=True)
    with pytest.raises(ConfigError, match=r"`trainer.max_tokens_per_micro_batch` is 512 under MegatronStrategy"):
        MegatronPolicyModule("tiny", max_tokens_per_micro_batch=512)
    assert MegatronPolicyModule.packs_sequences is False  # null: padded under its schedule
