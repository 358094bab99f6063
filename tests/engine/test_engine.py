"""The embedded engine in-process: numerics against the HF forward, scheduling, control, presets."""

from __future__ import annotations

import contextlib
import copy
import time

import pytest
import torch

from lightning_fasync.pipeline.engine_client import GenerateResult, SamplingParams
from lightning_fasync.policy import build_policy, save_policy
from lightning_fasync.engine.engine import Engine, EngineRequest
from lightning_fasync.engine.model_runner import UnsupportedModelError
from lightning_fasync.pipeline.flow import apply_result, resume_request
from lightning_fasync.engine.sampling import sample
from lightning_fasync.types import PromptId, Trajectory, TrajectoryStatus
from tests.helpers.engine import submit, wait_for


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


@pytest.fixture
def engine(policy):
    # A private copy: tests that update weights must not leak into the others.
    eng = Engine(copy.deepcopy(policy[0]), max_running_requests=8)
    yield eng
    eng.stop()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """Trainer-side recomputation: one plain HF forward over prompt+response, log_softmax of logits / T."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


# ----------------------------------------------------------------------------- presets


def test_tiny_preset_saves_and_reloads(policy, tmp_path):
    model, tok = policy
    text = "Hello, world! ~{}"
    assert tok.decode(ids(tok, text)) == text
    assert {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id} == {0, 1, 2}
    assert model.config.vocab_size == len(tok)
    save_policy(model, tok, str(tmp_path))
    model2, tok2 = build_policy(str(tmp_path))
    x = torch.tensor([ids(tok, text)])
    with torch.no_grad():
        assert torch.equal(model(x).logits, model2(x).logits)
    assert ids(tok2, text) == ids(tok, text)
    # Seeded: the preset is the same model every time.
    model3, _ = build_policy("tiny")
    assert torch.equal(model3.lm_head.weight, model.lm_head.weight)


def test_unknown_policy_and_unsupported_architecture():
    with pytest.raises(ValueError, match="neither a preset"):
        build_policy("no-such-model")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        Engine(gpt2)


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, -1), (1.0, 1.0, -1), (0.7, 0.9, 20)])
def test_logprobs_equal_hf_forward(policy, engine, temperature, top_p, top_k):
    model, tok = policy
    prompts = [ids(tok, "Hi"), ids(tok, "The quick brown fox"), ids(tok, "x" * 40)]
    reqs = [submit(engine, f"r{i}", p, max_new_tokens=24, temperature=temperature, top_p=top_p, top_k=top_k,
                   ignore_eos=True) for i, p in enumerate(prompts)]
    for req, done in reqs:
        assert done.wait(60)
        assert len(req.output_ids) == 24
        # SGLang 0.5.23's sampler: the temperature-scaled distribution before top-p/top-k (greedy: T=1).
        ref = hf_logprobs(model, req.input_ids, req.output_ids, temperature if temperature > 0 else 1.0)
        assert max(abs(a - b) for a, b in zip(ref, req.output_logprobs, strict=True)) <= 1e-4


def test_original_logprobs_are_raw_at_any_temperature(policy):
    # SGLANG_RETURN_ORIGINAL_LOGPROB: log-probs of the raw logits, whatever the temperature.
    model, tok = policy
    eng = Engine(model, max_running_requests=4, return_original_logprob=True)
    try:
        prompt = ids(tok, "The quick brown fox")
        req = eng.generate(prompt, max_new_tokens=16, temperature=0.7, top_p=0.9, ignore_eos=True)
        ref = hf_logprobs(model, prompt, req.output_ids)
        assert max(abs(a - b) for a, b in zip(ref, req.output_logprobs, strict=True)) <= 1e-4
        scaled = hf_logprobs(model, prompt, req.output_ids, 0.7)
        assert max(abs(a - b) for a, b in zip(scaled, req.output_logprobs, strict=True)) > 1e-2
    finally:
        eng.stop()


def test_greedy_matches_hf_generate(policy, engine):
    model, tok = policy
    prompt = ids(tok, "Once upon a time")
    out = engine.generate(prompt, max_new_tokens=30, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, min_new_tokens=30,
                             pad_token_id=tok.pad_token_id)
    assert out.output_ids == ref[0, len(prompt):].tolist()


def test_sampling_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        toks, lps = sample(logits, [1.0, 5.0, 1.0], [1.0, 1.0, 1e-6], [1, 2, -1], [None] * 3, g)
        assert toks[0] == 1 and toks[1] in (1, 3) and toks[2] == 1
    assert lps[0] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())


def test_seeded_sampling_is_reproducible_in_any_batch(policy, engine):
    _, tok = policy
    prompt = ids(tok, "seed")
    alone = engine.generate(prompt, max_new_tokens=20, sampling_seed=7, ignore_eos=True).output_ids
    with recorded_decodes(engine) as batches:
        # Longer than the seeded request: still decoding when it is admitted.
        others = [submit(engine, f"o{i}", prompt, max_new_tokens=60, ignore_eos=True) for i in range(3)]
        batched = engine.generate(prompt, max_new_tokens=20, sampling_seed=7, ignore_eos=True).output_ids
        for _, done in others:
            assert done.wait(30)
    assert max(len(b) for b in batches) == 4  # the seeded request decoded in one batch with the three others
    assert alone == batched


@contextlib.contextmanager
def recorded_decodes(engine):
    """The positions of each decode step's batch while in the block."""
    batches: list[list[int]] = []
    real_decode = engine.runner.decode

    def recording_decode(slots, tokens, positions):
        batches.append(list(positions))
        return real_decode(slots, tokens, positions)

    engine.runner.decode = recording_decode
    try:
        yield batches
    finally:
        engine.runner.decode = real_decode


# ----------------------------------------------------------------------------- scheduling


def test_continuous_batching_respects_max_running(policy):
    model, tok = policy
    eng = Engine(model, max_running_requests=2)
    try:
        with recorded_decodes(eng) as batches:
            prompt = ids(tok, "abc")
            lengths = [5, 30, 12, 20, 8]
            reqs = [submit(eng, f"r{i}", prompt, max_new_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
            for (req, done), n in zip(reqs, lengths):
                assert done.wait(60)
                assert len(req.output_ids) == n and req.finish_reason == {"type": "length", "length": n}
    finally:
        eng.stop()
    assert max(len(b) for b in batches) == 2
    # Requests joined a batch already in flight: one step held requests at different positions.
    assert any(len(set(b)) > 1 for b in batches)
    assert eng.loads()["num_running_reqs"] == 0


def test_the_prefill_counters_count_each_batch_its_requests_and_its_seconds(policy):
    """``num_prefill_batches``, ``num_prefill_requests`` and ``prefill_busy_s`` (``/get_server_info``'s
    ``internal_states``), which ``lightning-fasync plan`` reads to find a prefill batch's fixed
    cost: one batch per prefill forward pass, each request once, and at least the passes' time."""
    model, tok = policy
    eng = Engine(model, max_running_requests=2)
    passes: list[tuple[int, float]] = []
    real_prefill = eng.runner.prefill

    def recording_prefill(slots, prompts):
        t0 = time.perf_counter()
        out = real_prefill(slots, prompts)
        passes.append((len(slots), time.perf_counter() - t0))
        return out

    eng.runner.prefill = recording_prefill
    try:
        reqs = [submit(eng, f"r{i}", ids(tok, "abc"), max_new_tokens=n, ignore_eos=True) for i, n in enumerate([5, 30, 12, 20, 8])]
        for _, done in reqs:
            assert done.wait(60)
        load = eng.loads()
    finally:
        eng.stop()
    # Two slots for five requests: the waiting ones were admitted as slots freed, in batches of their own.
    assert load["num_prefill_batches"] == len(passes) >= 3
    assert load["num_prefill_requests"] == sum(n for n, _ in passes) == 5
    assert load["prefill_busy_s"] >= sum(dt for _, dt in passes) - 1e-6 > 0  # reported to the microsecond


def test_stop_tokens_eos_and_context_cap(policy):
    model, tok = policy
    eng = Engine(model, context_length=32)
    try:
        prompt = ids(tok, "stop here")
        greedy = eng.generate(prompt, max_new_tokens=10, temperature=0.0, ignore_eos=True).output_ids
        stop_at = greedy[3]
        out = eng.generate(prompt, max_new_tokens=10, temperature=0.0, stop_token_ids=(stop_at,), ignore_eos=True)
        k = greedy.index(stop_at)
        assert out.output_ids == greedy[: k + 1]
        assert out.finish_reason == {"type": "stop", "matched": stop_at}
        # Prompt + max_new_tokens over the context: SGLang's refusal, not a silent cap ...
        with pytest.raises(ValueError, match="exceeds the model's maximum context length of 32 tokens"):
            eng.generate(list(range(4, 34)), max_new_tokens=10, ignore_eos=True)
        # ... unless the server allows auto-truncation (SGLang's --allow-auto-truncate).
        eng.allow_auto_truncate = True
        capped = eng.generate(list(range(4, 34)), max_new_tokens=10, ignore_eos=True)
        assert len(capped.output_ids) == 2 and capped.finish_reason["type"] == "length"
        eng.allow_auto_truncate = False
        # An EOS ends a request unless ignore_eos.
        eng.eos_token_ids = {greedy[0]}
        assert eng.generate(prompt, max_new_tokens=10, temperature=0.0).output_ids == [greedy[0]]
    finally:
        eng.stop()


@pytest.mark.parametrize(
    "kwargs,match",
    [({"input_ids": []}, "empty"), ({"input_ids": list(range(5, 600))}, "context length"),
     ({"max_new_tokens": -1}, "max_new_tokens"), ({"input_ids": [10**6]}, "vocabulary"), ({"top_k": 0}, "top_k"),
     ({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature")],
)
def test_invalid_requests_are_refused(engine, kwargs, match):
    req = EngineRequest(rid="bad", **{"input_ids": [5, 6], **kwargs})
    with pytest.raises(ValueError, match=match):
        engine.submit(req)


# ----------------------------------------------------------------------------- control


def test_abort_returns_partial_output_and_frees_the_slot(policy):
    model, tok = policy
    eng = Engine(model, max_running_requests=1)
    try:
        long_req, long_done = submit(eng, "long-1", ids(tok, "a"), max_new_tokens=450, ignore_eos=True)
        wait_for(lambda: len(long_req.output_ids) >= 5, what="first tokens")
        short_req, short_done = submit(eng, "short", ids(tok, "b"), max_new_tokens=5, ignore_eos=True)
        assert eng.abort("long") == 1  # rid prefix, as in SGLang
        assert long_done.wait(10) and short_done.wait(30)
        assert long_req.finish_reason["type"] == "abort"
        assert 5 <= len(long_req.output_ids) < 450
        assert len(long_req.output_ids) == len(long_req.output_logprobs) == len(long_req.output_versions)
        assert len(short_req.output_ids) == 5
        assert eng.abort(abort_all=True) == 0
    finally:
        eng.stop()


def test_pause_in_place_then_continue(policy, engine):
    _, tok = policy
    req, done = submit(engine, "p1", ids(tok, "pause"), max_new_tokens=400, ignore_eos=True)
    wait_for(lambda: len(req.output_ids) >= 3, what="first tokens")
    assert engine.pause("in_place") == 0
    frozen = len(req.output_ids)
    queued, queued_done = submit(engine, "p2", ids(tok, "q"), max_new_tokens=4, ignore_eos=True)
    time.sleep(0.2)
    assert len(req.output_ids) == frozen and not done.is_set() and not queued_done.is_set()
    engine.resume()
    assert done.wait(60) and queued_done.wait(60)
    assert len(req.output_ids) == 400 and len(queued.output_ids) == 4


def test_pause_abort_mode_aborts_in_flight(policy, engine):
    _, tok = policy
    req, done = submit(engine, "pa", ids(tok, "pause"), max_new_tokens=450, ignore_eos=True)
    wait_for(lambda: len(req.output_ids) >= 1, what="first token")
    assert engine.pause("abort") == 1
    assert done.wait(10) and req.finish_reason["type"] == "abort"
    with pytest.raises(ValueError, match="mode"):
        engine.pause("sideways")
    engine.resume()
    assert len(engine.generate(ids(tok, "ok"), max_new_tokens=3, ignore_eos=True).output_ids) == 3


def negated_head(model) -> dict[str, torch.Tensor]:
    """A weight change that surely changes greedy output: flip the LM head."""
    return {"lm_head.weight": -model.lm_head.weight.detach().clone()}


def test_weight_update_changes_greedy_output_and_version(policy, engine):
    model, tok = policy
    prompt = ids(tok, "weights")
    before = engine.generate(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True)
    assert set(before.output_versions) == {"default"}  # SGLang's initial label
    update = negated_head(model)
    engine.update_weights(update, weight_version="1")
    after = engine.generate(prompt, max_new_tokens=16, temperature=0.0, ignore_eos=True)
    assert after.output_ids != before.output_ids
    assert set(after.output_versions) == {"1"} and after.version_spans() == [{"version": "1", "start": 0, "end": 16}]
    new_model = copy.deepcopy(model)
    new_model.load_state_dict(update, strict=False)
    ref = hf_logprobs(new_model, prompt, after.output_ids)
    assert max(abs(a - b) for a, b in zip(ref, after.output_logprobs, strict=True)) <= 1e-4
    engine.set_weight_version("7")
    assert set(engine.generate(prompt, max_new_tokens=2).output_versions) == {"7"}
    with pytest.raises(ValueError, match="Unknown parameter"):
        engine.update_weights({"nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="Shape mismatch"):
        engine.update_weights({"lm_head.weight": torch.zeros(1)})


def test_in_flight_update_splits_versions(policy, engine):
    model, tok = policy
    req, done = submit(engine, "v", ids(tok, "span"), max_new_tokens=300, ignore_eos=True)
    wait_for(lambda: len(req.output_ids) >= 3, what="first tokens")
    engine.pause("in_place")
    k = len(req.output_ids)
    engine.update_weights(negated_head(model), weight_version="1")
    engine.resume()
    assert done.wait(60)
    assert req.version_spans() == [{"version": "default", "start": 0, "end": k}, {"version": "1", "start": k, "end": 300}]


# ----------------------------------------------------------------------------- resume


def test_resume_request_continues_a_partial_trajectory(policy, engine):
    _, tok = policy
    prompt = ids(tok, "resume me")
    full = engine.generate(prompt, max_new_tokens=20, temperature=0.0, ignore_eos=True)
    traj = Trajectory(prompt_id=PromptId(0, 3), sample_index=1, prompt_ids=prompt)
    traj.extend(full.output_ids[:8], full.output_logprobs[:8], [0] * 8)
    sp = SamplingParams(temperature=0.0, ignore_eos=True)
    req = resume_request(traj, sp, 20, rid="r-1")
    assert req.input_ids == prompt + full.output_ids[:8]
    assert req.sampling_params.max_new_tokens == 12 and sp.max_new_tokens == 128  # the template is untouched
    engine.set_weight_version("1")
    rest = engine.generate(req.input_ids, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert rest.output_ids == full.output_ids[8:]  # greedy continuation is seamless
    apply_result(traj, GenerateResult(rid=req.rid, output_ids=rest.output_ids, output_log_probs=rest.output_logprobs,
                                      weight_versions=[int(v) for v in rest.output_versions], finish_reason="length"), 20)
    assert traj.response_ids == full.output_ids and traj.weight_versions == [0] * 8 + [1] * 12
    assert traj.status is TrajectoryStatus.TRUNCATED and traj.is_partial
    assert resume_request(traj, sp, 20, rid="r-2") is None  # no budget left


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_other_architectures_match_hf_forward(family):
    """The lean forward also covers Llama (no qkv bias) and Qwen3 (per-head q/k norms), GQA group 2."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = LlamaConfig if family == "llama" else Qwen3Config
    config = cls(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, initializer_range=0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    eng = Engine(model, max_running_requests=4)
    try:
        prompts = [[3, 4, 5], list(range(2, 30)), [7]]
        reqs = [submit(eng, f"a{i}", p, max_new_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)]
        for req, done in reqs:
            assert done.wait(60)
            ref = hf_logprobs(model, req.input_ids, req.output_ids)
            assert max(abs(a - b) for a, b in zip(ref, req.output_logprobs, strict=True)) <= 1e-4
    finally:
        eng.stop()


def test_a_kv_cache_that_cannot_fit_is_refused_with_the_numbers(policy, monkeypatch):
    from lightning_fasync.engine import model_runner

    model, _ = policy
    # tiny: 3 layers x 1 kv head x 24 dims x fp32 x (K, V) = 576 bytes per token.
    with pytest.raises(model_runner.KVCacheTooLargeError,
                       match=r"holds 992 tokens \(--max-total-tokens 1000\), fewer than the 4096 tokens one request "
                             r"of --context-length 4096 takes in pages of --page-size 16"):
        Engine(model, max_running_requests=64, context_length=4096, max_total_tokens=1000, page_size=16)
    # Without --page-size, the smallest page is tried last: even that does not hold one request.
    with pytest.raises(model_runner.KVCacheTooLargeError,
                       match=r"holds 1000 tokens \(--max-total-tokens 1000\), fewer than the 4096 tokens one request "
                             r"of --context-length 4096 takes in pages of --page-size 1;"):
        Engine(model, max_running_requests=64, context_length=4096, max_total_tokens=1000)
    monkeypatch.setattr(model_runner, "_available_bytes", lambda device: 100 * 2**20)  # 100 MiB free
    # The budget, not 64 x 4096 tokens, sizes the pool: weights + pool within 40 % of 100 MiB + weights.
    eng = Engine(model, max_running_requests=64, context_length=4096)
    try:
        usage = eng.memory_usage()
        assert 4096 <= usage["token_capacity"] < 64 * 4096
        assert usage["weight_bytes"] + usage["kvcache_bytes"] <= 0.4 * (100 * 2**20 + usage["weight_bytes"])
    finally:
        eng.stop()


def test_a_control_operation_whose_caller_timed_out_never_runs(engine):
    ran = []
    with engine._cond:  # the engine thread cannot take its operations meanwhile
        with pytest.raises(TimeoutError, match=r"did not run a control operation within 0.2 s .*; it will not run\."):
            engine._call(lambda: ran.append("late"), timeout=0.2)
    assert engine._call(lambda: "next") == "next"  # the thread has been through its queue since
    assert ran == []
