"""The engine's fast paths: inverse-CDF sampling, folded/fused weights, prefill shortcut, slot gathers."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_fasync.policy import build_policy
from lightning_fasync.engine.engine import Engine
from lightning_fasync.engine.model_runner import ModelRunner, prefill_chunks
from lightning_fasync.engine.sampling import sample


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float()


def test_inverse_cdf_sampling_matches_the_distribution():
    torch.manual_seed(0)
    logits = torch.randn(4, 10) * 2
    g = torch.Generator().manual_seed(1)
    n = 4000
    for temperature in (1.0, 0.5):
        counts = torch.zeros(4, 10)
        for _ in range(n // 4):
            toks, _ = sample(logits.repeat(4, 1), [temperature] * 16, [1.0] * 16, [-1] * 16, [None] * 16, g)
            for row, t in enumerate(toks):
                counts[row % 4, t] += 1
        expected = torch.softmax(logits / temperature, dim=-1)
        # n samples per row: a total-variation gap above 0.05 would be far outside sampling noise.
        tv = 0.5 * (counts / counts.sum(1, keepdim=True) - expected).abs().sum(1)
        assert tv.max() < 0.05, tv
    # Log-probs are of the distribution sampled from (SGLang 0.5.23: logits / T, before filters) on
    # the plain and the tempered path, and of the raw logits with original=True.
    for temperature in (1.0, 0.5):
        for original in (False, True):
            toks, lps = sample(logits, [temperature] * 4, [0.9] * 4, [-1] * 4, [None] * 4, g, original=original)
            ref = torch.log_softmax(logits / (1.0 if original else temperature), -1)
            assert torch.allclose(torch.tensor(lps), ref.gather(1, torch.tensor(toks).unsqueeze(1)).squeeze(1), atol=1e-6)


def test_filtered_rows_never_sample_dropped_tokens_and_greedy_rows_mix():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]] * 4)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        toks, _ = sample(logits, [1.0, 0.0, 2.0, 1.0], [1.0, 1.0, 1.0, 0.5], [2, -1, -1, -1], [None] * 4, g)
        assert toks[0] in (1, 3)  # top-k 2
        assert toks[1] == 1  # greedy row in a sampled batch
        assert toks[3] == 1  # top-p 0.5: only the top token has the mass before it below 0.5


def test_seeded_rows_ignore_the_rest_of_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    first = sample(logits, [1.0] * 6, [1.0] * 6, [-1] * 6, [torch.Generator().manual_seed(3) if i == 2 else None
                                                             for i in range(6)], torch.Generator().manual_seed(0))
    other = sample(logits[2:3], [1.0], [1.0], [-1], [torch.Generator().manual_seed(3)],
                   torch.Generator().manual_seed(9))
    assert first[0][2] == other[0][0]


def test_prefill_logits_and_gathered_slots_match_hf(policy):
    model, _ = policy
    runner = ModelRunner(model, max_slots=8, context_length=64, page_size=4)
    prompts = [[5, 6, 7], list(range(10, 40)), [9], list(range(3, 20))]
    slots = [6, 1, 3, 4]  # not 0..B-1: decode gathers the block-table rows
    runner.allocate(slots, [len(p) for p in prompts])
    logits = runner.prefill(slots, prompts)
    for row, p in enumerate(prompts):
        assert torch.allclose(logits[row], hf_last_logits(model, p), atol=1e-4)
    nxt = [11, 12, 13, 14]
    # Sorted by slot as the engine passes them: slots 1, 3, 4, 6.
    order = sorted(range(4), key=lambda r: slots[r])
    runner.allocate(slots, [len(p) + 1 for p in prompts])  # [5, 6, 7] crosses into its second block
    out = runner.decode([slots[r] for r in order], [nxt[r] for r in order], [len(prompts[r]) for r in order])
    for i, r in enumerate(order):
        assert torch.allclose(out[i], hf_last_logits(model, prompts[r] + [nxt[r]]), atol=1e-4)


def test_a_prefill_batch_runs_sorted_in_forwards_that_pay_for_their_padding():
    """A forward pads its rows to its longest prompt: a long resumed prompt among short ones runs in a
    forward of its own, prompts of one length share one, and each forward stays within its budget."""
    lengths = [30, 400, 31, 29, 30, 5, 400]
    chunks = prefill_chunks(lengths, forward_tokens=64, max_tokens=8192)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    assert [[lengths[i] for i in c] for c in chunks] == [[5, 29, 30, 30, 31], [400, 400]]
    # Padding the 5 to 31 (26 tokens) is cheaper than a forward; padding four prompts to 400 is not.
    assert prefill_chunks([10] * 64, forward_tokens=64) == [list(range(64))]
    capped = prefill_chunks([100] * 10, forward_tokens=64, max_tokens=300)
    assert len(capped) == 4 and max(len(c) for c in capped) == 3  # the fewest forwards of 300 tokens
    assert prefill_chunks([900], max_tokens=100) == [[0]]  # alone, whatever the budget


def _tiny_qwen3(dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=24, max_position_embeddings=64,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(dtype).eval()


@pytest.mark.parametrize("kind", ["tiny", "qwen3-float32", "qwen3-bfloat16"])
def test_weight_update_refreshes_folded_norms_and_fused_matrices(policy, kind):
    """Each way the fused matrices are built (Qwen2 in float32: norms folded, rows permuted for the
    complex RoPE; Qwen3 in float32: q/k norms, norms folded; bfloat16: nothing folded) is rewritten
    in place by an update, twice, and the engine then computes what HF computes."""
    model = copy.deepcopy(policy[0]) if kind == "tiny" else _tiny_qwen3(getattr(torch, kind.split("-")[1]))
    # HF's side is a separate copy that loads each update itself: the engine's in-place rewrite of
    # `model` cannot make the two agree.
    reference = copy.deepcopy(model)
    eng = Engine(model, max_running_requests=4)
    dtype = next(model.parameters()).dtype
    tol = 1e-4 if dtype == torch.float32 else 0.1
    try:
        fused = [t.data_ptr() for t in eng.runner._derived_weights()]
        for round_ in range(2):
            torch.manual_seed(1 + round_)
            update = {k: v.to(dtype) for k, v in _random_update(model).items()}
            eng.update_weights(update, weight_version=str(round_ + 1))
            reference.load_state_dict(update, strict=False)
            prompt = [5, 6, 7, 8, 9]
            out = eng.generate(prompt, max_new_tokens=8, ignore_eos=True)
            with torch.no_grad():
                ref = torch.log_softmax(reference(torch.tensor([prompt + out.output_ids])).logits[0].float(), -1)
            expect = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.output_ids)]
            assert max(abs(a - b) for a, b in zip(expect, out.output_logprobs, strict=True)) <= tol
            assert out.output_versions == [str(round_ + 1)] * 8
        # Rewritten where they were: an update allocates no new fused matrices.
        assert [t.data_ptr() for t in eng.runner._derived_weights()] == fused
    finally:
        eng.stop()


def _random_update(model) -> dict:
    hidden = model.config.hidden_size
    shape = {n: p.shape for n, p in model.named_parameters()}
    return {
        "model.layers.0.input_layernorm.weight": torch.rand(hidden) + 0.5,
        "model.layers.2.post_attention_layernorm.weight": torch.rand(hidden) + 0.5,
        "model.norm.weight": torch.rand(hidden) + 0.5,
        "model.layers.1.self_attn.k_proj.weight": torch.randn(shape["model.layers.1.self_attn.k_proj.weight"]) * 0.1,
        "model.layers.1.self_attn.q_proj.weight": torch.randn(shape["model.layers.1.self_attn.q_proj.weight"]) * 0.1,
        "model.layers.1.mlp.up_proj.weight": torch.randn(shape["model.layers.1.mlp.up_proj.weight"]) * 0.1,
        "model.layers.2.self_attn.o_proj.weight": torch.randn(shape["model.layers.2.self_attn.o_proj.weight"]) * 0.1,
    }
