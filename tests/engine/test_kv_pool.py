"""The paged KV pool: sizing from the memory budget, refusals at start, block accounting, retraction."""

from __future__ import annotations

import pytest
import torch
from lightning_fasync.policy import build_policy
from lightning_fasync.engine.engine import Engine
from lightning_fasync.engine.model_runner import KVCacheTooLargeError, plan_kv_pool
from tests.helpers.engine import submit, wait_for

GIB = 2**30


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def plan(**kw):
    # The tiny preset's cache: 3 layers x 2 (K, V) x 1 kv head x 24 x 4 bytes = 576 bytes per token.
    base = dict(layers=3, kv_heads=1, head_dim=24, dtype=torch.float32, weight_bytes=1 * GIB,
                available_bytes=10 * GIB, max_slots=64, context_length=512, page_size=16, mem_fraction_static=0.4)
    return plan_kv_pool(**{**base, **kw})


def test_the_pool_is_sized_from_the_memory_budget_and_the_flags():
    big = plan()  # budget 4 GiB: far more than 64 requests of 512 tokens need, so that is the size
    assert (big.bytes_per_token, big.budget_bytes, big.max_total_tokens) == (576, 4 * GIB, 64 * 512)
    # 20 % of 10 GiB, of which the weights take 1.99 GiB: the rest, in whole requests of 512 tokens,
    # sizes the pool.
    small = plan(mem_fraction_static=0.2, weight_bytes=int(1.99 * GIB))
    room = int(0.2 * 10 * GIB) - int(1.99 * GIB)
    assert small.max_total_tokens == room // 576 // 512 * 512 < 64 * 512
    assert small.num_blocks * 16 == small.max_total_tokens and small.pool_bytes <= room
    # --max-total-tokens sets the size (whole requests), past the 64 x 512 cap too, within the budget.
    assert plan(max_total_tokens=100_005).max_total_tokens == 100_005 // 512 * 512
    assert plan(available_bytes=None).max_total_tokens == 64 * 512  # memory unknown: the cap
    assert plan(layers=28, kv_heads=8, head_dim=128, dtype=torch.bfloat16).bytes_per_token == 28 * 2 * 8 * 128 * 2


@pytest.mark.parametrize("kw,match", [
    ({"max_total_tokens": 500},
     r"^The KV pool holds 496 tokens \(--max-total-tokens 500\), fewer than the 512 tokens one request of "
     r"--context-length 512 takes in pages of --page-size 16; raise --mem-fraction-static or --max-total-tokens, "
     r"or lower --context-length\.$"),
    ({"mem_fraction_static": 0.1, "weight_bytes": int(0.9999 * GIB)},
     r"^The KV pool holds \d+ tokens \(the 0\.00 GiB that the weights' 1\.00 GiB leave of the memory budget of "
     r"1\.00 GiB \(--mem-fraction-static 0\.1 x 10\.00 GiB of cpu memory available to weights and cache\), at 576 "
     r"bytes per token: 3 layers x 2 \(K, V\) x 1 kv heads x 24 x float32\), fewer than the 512 tokens"),
    ({"mem_fraction_static": 0.05},
     r"^The weights take 1\.00 GiB, which leaves nothing of the memory budget of 0\.50 GiB \(--mem-fraction-static "
     r"0\.05 x 10\.00 GiB of cpu memory available to weights and cache\) for the KV cache; raise "
     r"--mem-fraction-static or free memory\.$"),
    ({"max_total_tokens": 10_000_000},
     r"^A KV pool of --max-total-tokens 10000000 takes 5\.36 GiB \(576 bytes per token: .*\), which with the "
     r"weights' 1\.00 GiB exceeds the memory budget of 4\.00 GiB \(--mem-fraction-static 0\.4 x 10\.00 GiB .*\); "
     r"lower --max-total-tokens or raise --mem-fraction-static\.$"),
])
def test_a_configuration_that_cannot_fit_is_refused_in_one_sentence_with_the_numbers(kw, match):
    with pytest.raises(KVCacheTooLargeError, match=match):
        plan(**kw)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match=r"--page-size is 0; it must be at least 1\."):
        plan(page_size=0)
    with pytest.raises(ValueError, match=r"--mem-fraction-static is 1\.5; it must be in \(0, 1\]\."):
        plan(mem_fraction_static=1.5)


def test_serve_refuses_at_start_a_pool_that_cannot_hold_one_request(capsys):
    from lightning_fasync.engine.server import main

    threads = torch.get_num_threads()
    try:
        rc = main(["--model", "tiny", "--port", "1", "--context-length", "512", "--max-total-tokens", "100"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 2
    err = capsys.readouterr().err
    assert "The KV pool holds 100 tokens (--max-total-tokens 100), fewer than the 512 tokens one request of " \
           "--context-length 512 takes in pages of --page-size 1" in err


def test_block_accounting_survives_many_random_grants_and_frees(policy):
    """Thousands of random grows and frees over a pool smaller than the slots' regions: every block
    is held by one slot or free, each slot's block-table row names its blocks' pages, homes are
    used while free, and everything comes back (no leak, the free-list heap stays bounded)."""
    import random

    from lightning_fasync.engine.model_runner import ModelRunner

    runner = ModelRunner(policy[0], max_slots=8, context_length=32, page_size=4, max_total_tokens=3 * 32)
    assert (runner.regions, runner.num_blocks, runner.max_blocks_per_request) == (3, 24, 8)
    rng = random.Random(0)
    tokens = [0] * 8
    for _ in range(3000):
        slot = rng.randrange(8)
        if tokens[slot] and rng.random() < 0.3:
            runner.free(slot)
            tokens[slot] = 0
        elif tokens[slot] < 32:
            grown = min(32, tokens[slot] + rng.randint(1, 9))
            if runner.blocks_for(grown) - len(runner.slot_blocks(slot)) <= runner.free_blocks:
                runner.allocate([slot], [grown])
                tokens[slot] = grown
        held = [runner.slot_blocks(s) for s in range(8)]
        flat = [b for blocks in held for b in blocks]
        assert len(flat) == len(set(flat)) == runner.used_blocks and runner.free_blocks + len(flat) == 24
        for s, blocks in enumerate(held):
            assert len(blocks) == runner.blocks_for(tokens[s])
            if blocks:
                row = runner.block_table[s].tolist()
                pages = [runner._page_row(b) for b in blocks]
                assert row[: len(blocks)] == pages and set(row[len(blocks):]) <= {pages[0]}
        # A slot off its home (any block not at its place in the slot's region) makes decode gather.
        assert runner._strays == sum(blocks != list(range(s * 8, s * 8 + len(blocks))) for s, blocks in enumerate(held))
    for s in range(8):
        runner.free(s)
    assert runner.free_blocks == 24 and runner._strays == 0 and len(runner._free_heap) <= 2 * 24 + 64
    runner.allocate([0], [32])  # a lone slot 0 gets its whole home region, in order
    assert runner.slot_blocks(0) == list(range(8))


def test_blocks_follow_each_request_and_all_come_back(policy):
    """Blocks are handed out as a request grows (prefill: its prompt's pages; decode: one at each page
    boundary) and all return on finish, abort (running and queued), pause-abort and pause-retract."""
    model, tok = policy
    page = 4
    eng = Engine(model, max_running_requests=6, context_length=128, page_size=page, max_total_tokens=6 * 128)
    held: list[tuple[int, int]] = []

    def on_token(req):  # engine thread: cached tokens (all but the last sampled) vs blocks held
        held.append((len(req.input_ids) + len(req.output_ids) - 1, len(eng.runner.slot_blocks(req.slot))))

    def free_blocks():
        return eng.memory_usage()["kv_pool"]["free_blocks"]

    try:
        usage = eng.memory_usage()
        pool = usage["kv_pool"]
        assert usage["token_capacity"] == 6 * 128 == pool["total_blocks"] * page
        assert usage["kvcache_bytes"] == pool["total_blocks"] * page * 576 == pool["pool_bytes"]
        total = pool["total_blocks"]
        reqs = [submit(eng, f"r{i}", ids(tok, "x" * (1 + 7 * i % 23)), max_new_tokens=3 + 11 * i % 37,
                       ignore_eos=i % 3 != 0, on_token=on_token) for i in range(30)]
        for req, done in reqs:
            assert done.wait(60), req.rid
        assert len(held) > 300 and all(blocks == -(-cached // page) for cached, blocks in held)
        assert free_blocks() == total and eng.memory_usage()["kv_pool"]["used_blocks"] == 0

        long, long_done = submit(eng, "long", ids(tok, "abc"), max_new_tokens=100, ignore_eos=True)
        wait_for(lambda: len(long.output_ids) >= 10, what="10 tokens")
        assert free_blocks() < total
        assert eng.abort("long") == 1 and long_done.wait(10)
        assert free_blocks() == total

        long, long_done = submit(eng, "retract-me", ids(tok, "abc"), max_new_tokens=100, ignore_eos=True)
        wait_for(lambda: len(long.output_ids) >= 10, what="10 tokens")
        assert eng.pause("retract") == 1
        assert free_blocks() == total and long.slot is None
        eng.resume()
        assert long_done.wait(30) and len(long.output_ids) == 100 and long.retractions == 1
        assert free_blocks() == total

        running = [submit(eng, f"p{i}", ids(tok, "hello"), max_new_tokens=100, ignore_eos=True) for i in range(8)]
        wait_for(lambda: len(running[0][0].output_ids) >= 5, what="5 tokens")
        assert eng.pause("abort") == 8  # 6 running, 2 queued
        assert all(done.wait(10) for _, done in running) and free_blocks() == total
        eng.resume()
    finally:
        eng.stop()


def test_a_pool_too_small_for_the_batch_retracts_and_resumes_token_for_token(policy):
    """With room for ~1.5 of 4 requests' sequences, decode runs out of blocks: the requests with the
    fewest tokens go back to the queue and are prefilled again later with their tokens so far. Their
    tokens (greedy and seeded sampling), log-probs and version spans equal an unretracted run's, and
    the greedy ones HF's (argmax of a plain forward, token by token)."""
    model, tok = policy
    prompts = [ids(tok, f"Request {i}: tell me a story") for i in range(4)]
    kw = [{"temperature": 0.0}, {"temperature": 1.0, "sampling_seed": 7}, {"temperature": 0.0},
          {"temperature": 1.0, "sampling_seed": 11}]

    def run(**pool):
        eng = Engine(model, max_running_requests=4, context_length=96, page_size=4, **pool)
        try:
            reqs = [submit(eng, f"q{i}", p, max_new_tokens=40, ignore_eos=True, **kw[i]) for i, p in enumerate(prompts)]
            for req, done in reqs:
                assert done.wait(120), req.rid
                assert req.finish_reason["type"] == "length", req.finish_reason
            assert eng.memory_usage()["kv_pool"]["used_blocks"] == 0
            return [r for r, _ in reqs], eng.decode_retractions
        finally:
            eng.stop()

    ref, ref_retractions = run()
    small, retractions = run(max_total_tokens=96)  # 24 blocks; one request grows to 16
    assert ref_retractions == 0 and retractions >= 2 and sum(r.retractions for r in small) == retractions
    for a, b in zip(ref, small):
        assert b.output_ids == a.output_ids, b.rid
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) < 1e-5, b.rid
        assert b.version_spans() == a.version_spans() == [{"version": "default", "start": 0, "end": 40}]
    for i in (0, 2):  # greedy with EOS allowed (HF generate's min_new_tokens would hold EOS back)
        seq = list(prompts[i])
        with torch.no_grad():
            for _ in range(40):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert small[i].output_ids == seq[len(prompts[i]):]


def test_qwen3_30m_shape_preset_is_a_qwen3_of_tens_of_millions_the_engine_serves():
    model, tok = build_policy("qwen3-30m-shape")
    config = model.config
    assert config.model_type == "qwen3" and config.tie_word_embeddings
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert 20e6 < sum(p.numel() for p in model.parameters()) < 60e6
    prompt = ids(tok, "Once upon a time")
    eng = Engine(model, max_running_requests=2, context_length=64)
    try:
        out = eng.generate(prompt, max_new_tokens=20, temperature=0.0, ignore_eos=True).output_ids
    finally:
        eng.stop()
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, min_new_tokens=20,
                            pad_token_id=tok.pad_token_id)
    assert out == hf[0, len(prompt):].tolist()
