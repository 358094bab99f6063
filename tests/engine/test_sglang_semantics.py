"""The embedded engine's HTTP server behaves as SGLang 0.5.23 does: batches, ``n``, streaming,
log-probs, stops, pause modes, aborts, weight-update brackets and versions.

Shapes and messages are SGLang's (``srt/entrypoints/http_server.py``, ``srt/managers/``);
``tests/integration/test_sglang_compat.py`` checks the same server against SGLang's own classes
and frontend.
"""

from __future__ import annotations

import asyncio
import copy
import json

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer

from lightning_fasync.policy import build_policy
from lightning_fasync.engine.engine import Engine
from lightning_fasync.engine.server import build_app
from tests.helpers.engine import serve as serve_app


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


def serve(policy, body, **engine_kwargs):
    """Run ``body(session, url, engine)`` against an in-process server over its own copy of the model."""
    return serve_app(policy, body, own_model=True, timeout=180, **engine_kwargs)


async def post(session, url, body=None):
    async with session.post(url, json=body) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text and r.content_type == "application/json" else text)


async def wait_tokens(engine, rid, n, timeout=30.0):
    """Until the running request ``rid`` has ``n`` output tokens."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        for r in list(engine._running):
            if r.rid == rid and len(r.output_ids) >= n:
                return
        await asyncio.sleep(0.002)
    raise TimeoutError(f"request {rid} did not reach {n} tokens")


def greedy(max_new_tokens, **extra):
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **extra}


def hf_next_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


# ----------------------------------------------------------------------------- batches and n


def test_batched_prompts_n_samples_and_per_prompt_sampling_params(policy):
    _, tok = policy

    async def body(s, url, engine):
        single = {}
        for text in ("alpha", "beta gamma"):
            status, out = await post(s, url + "/generate", {"text": text, "sampling_params": greedy(5)})
            assert status == 200
            single[text] = out["output_ids"]
        # List in, list out, in order; one sampling_params object per prompt.
        status, outs = await post(s, url + "/generate", {
            "text": ["alpha", "beta gamma"], "rid": ["a", "b"],
            "sampling_params": [greedy(5), greedy(3)]})
        assert status == 200 and isinstance(outs, list) and len(outs) == 2
        assert [o["meta_info"]["id"] for o in outs] == ["a", "b"]
        assert outs[0]["output_ids"] == single["alpha"] and outs[1]["output_ids"] == single["beta gamma"][:3]
        # Batched token ids, one rid string: SGLang names the items rid_0, rid_1.
        prompts = [tok("alpha", add_special_tokens=False)["input_ids"], tok("beta gamma", add_special_tokens=False)["input_ids"]]
        status, outs = await post(s, url + "/generate", {"input_ids": prompts, "rid": "x", "sampling_params": greedy(5)})
        assert [o["meta_info"]["id"] for o in outs] == ["x_0", "x_1"]
        assert [o["output_ids"] for o in outs] == [single["alpha"], single["beta gamma"]]
        # n samples of one prompt come back as a list, each its own sample.
        status, outs = await post(s, url + "/generate", {"text": "alpha", "rid": "n", "sampling_params": {
            "max_new_tokens": 12, "n": 3, "ignore_eos": True}})
        assert status == 200 and len(outs) == 3 and [o["meta_info"]["id"] for o in outs] == ["n_0", "n_1", "n_2"]
        assert len({tuple(o["output_ids"]) for o in outs}) > 1  # sampled, not copies
        # A batch with n: prompt-major order, as SGLang's tokenizer manager expands it.
        status, outs = await post(s, url + "/generate", {"text": ["alpha", "beta gamma"], "sampling_params": greedy(4, n=2)})
        assert [o["output_ids"] for o in outs] == [single["alpha"][:4]] * 2 + [single["beta gamma"][:4]] * 2
        assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(prompts[0])] * 2 + [len(prompts[1])] * 2

    serve(policy, body)


# ----------------------------------------------------------------------------- streaming


async def read_stream(s, url, body):
    chunks = []
    async with s.post(url + "/generate", json={**body, "stream": True}) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        async for raw in r.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            chunks.append(payload if payload == "[DONE]" else json.loads(payload))
    return chunks


def test_streaming_sends_cumulative_chunks_then_done_and_abort_ends_the_stream(policy):
    async def body(s, url, engine):
        # 48 tokens: a reader that falls behind gets the latest cumulative state (below), so on a loaded
        # machine a short stream can arrive as one chunk; over 48 tokens it still arrives in several.
        status, full = await post(s, url + "/generate", {"text": "stream me", "sampling_params": greedy(48),
                                                          "return_logprob": True})
        chunks = await read_stream(s, url, {"text": "stream me", "sampling_params": greedy(48), "return_logprob": True})
        assert chunks[-1] == "[DONE]" and len(chunks) >= 3
        data = chunks[:-1]
        lengths = [len(c["output_ids"]) for c in data]
        assert lengths == sorted(lengths) and lengths[-1] == 48  # cumulative
        assert all(c["meta_info"]["finish_reason"] is None for c in data[:-1])
        last = data[-1]
        assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 48}
        assert last["output_ids"] == full["output_ids"] and last["text"] == full["text"]
        assert last["meta_info"]["output_token_logprobs"] == full["meta_info"]["output_token_logprobs"]
        for c in data:  # every chunk is a consistent prefix
            assert c["output_ids"] == full["output_ids"][: len(c["output_ids"])]
            assert len(c["meta_info"]["output_token_logprobs"]) == len(c["output_ids"])
        # stream_interval: chunks at multiples of k tokens (a reader that falls behind gets the
        # latest cumulative state, not every intermediate one).
        chunks = await read_stream(s, url, {"text": "stream me", "sampling_params": greedy(12, stream_interval=4)})
        sizes = [len(c["output_ids"]) for c in chunks[:-1]]
        assert sizes[-1] == 12 and all(n % 4 == 0 for n in sizes) and sizes == sorted(set(sizes))
        # A batched stream tags every chunk with its item's index.
        chunks = await read_stream(s, url, {"text": ["a", "b"], "sampling_params": greedy(3)})
        assert {c["index"] for c in chunks[:-1]} == {0, 1}
        # Aborting a streaming request ends its stream with finish type abort.
        task = asyncio.ensure_future(read_stream(s, url, {"text": "long", "rid": "st", "sampling_params": greedy(400)}))
        await wait_tokens(engine, "st", 3)
        assert (await post(s, url + "/abort_request", {"rid": "st"}))[0] == 200
        chunks = await asyncio.wait_for(task, 30)
        assert chunks[-1] == "[DONE]" and chunks[-2]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 3 <= len(chunks[-2]["output_ids"]) < 400

    serve(policy, body, context_length=512)


# ----------------------------------------------------------------------------- log-probs


def test_logprobs_input_top_k_token_ids_and_text(policy):
    model, tok = policy
    prompt = tok("log probs please", add_special_tokens=False)["input_ids"]

    async def body(s, url, engine):
        status, out = await post(s, url + "/generate", {
            "input_ids": prompt, "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 3,
            "token_ids_logprob": [5, 9], "return_text_in_logprobs": True, "sampling_params": greedy(4)})
        assert status == 200, out
        meta = out["meta_info"]
        lp = hf_next_logprobs(model, prompt + out["output_ids"])
        # Input tokens from position 1 on: logprob of token i given the tokens before it.
        assert [e[1] for e in meta["input_token_logprobs"]] == prompt[1:]
        for i, (value, token, text) in enumerate(meta["input_token_logprobs"], start=1):
            assert value == pytest.approx(lp[i - 1, token].item(), abs=1e-4) and text == tok.decode([token])
        n_in = len(prompt)
        for j, entry in enumerate(meta["output_top_logprobs"]):
            ref = lp[n_in - 1 + j].topk(3)
            assert [e[1] for e in entry] == ref.indices.tolist()
            assert [e[0] for e in entry] == pytest.approx(ref.values.tolist(), abs=1e-4)
            assert entry[0][1] == out["output_ids"][j]  # greedy picks the top token
        for j, entry in enumerate(meta["output_token_ids_logprobs"]):
            assert [e[1] for e in entry] == [5, 9]
            assert [e[0] for e in entry] == pytest.approx(lp[n_in - 1 + j, [5, 9]].tolist(), abs=1e-4)
        assert len(meta["input_top_logprobs"]) == n_in - 1 and len(meta["input_token_ids_logprobs"]) == n_in - 1
        # The default start (-1): no input log-probs, as SGLang.
        status, out = await post(s, url + "/generate", {"input_ids": prompt, "return_logprob": True,
                                                         "sampling_params": greedy(2)})
        assert out["meta_info"]["input_token_logprobs"] == [] and "output_top_logprobs" not in out["meta_info"]
        # Prefill only (max_new_tokens 0): scores the prompt, generates nothing. Position 0 has no log-prob.
        status, out = await post(s, url + "/generate", {"input_ids": prompt, "return_logprob": True,
                                                         "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
        assert status == 200 and out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["input_token_logprobs"][0][0] is None and len(out["meta_info"]["input_token_logprobs"]) == n_in

    serve(policy, body)


# ----------------------------------------------------------------------------- stops and sampling


def test_stop_strings_regex_trim_min_new_tokens_and_min_p(policy):
    _, tok = policy

    async def body(s, url, engine):
        status, ref = await post(s, url + "/generate", {"text": "stop words", "sampling_params": greedy(24)})
        text = ref["text"]
        stop = text[6:9]
        cut = text.find(stop)
        status, out = await post(s, url + "/generate", {"text": "stop words", "sampling_params": greedy(24, stop=stop)})
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["text"] == text[:cut] and len(out["output_ids"]) < 24
        status, kept = await post(s, url + "/generate", {"text": "stop words",
                                                          "sampling_params": greedy(24, stop=[stop], no_stop_trim=True)})
        assert kept["text"].startswith(text[:cut] + stop) and kept["output_ids"] == out["output_ids"]
        status, rx = await post(s, url + "/generate", {"text": "stop words",
                                                        "sampling_params": greedy(24, stop_regex=[f"{__import__('re').escape(stop)}"])})
        assert rx["meta_info"]["finish_reason"]["type"] == "stop" and rx["text"] == text[:cut]
        # A stop token id trims that token from the text (unless no_stop_trim) but keeps it in output_ids.
        first = ref["output_ids"][2]
        status, out = await post(s, url + "/generate", {"text": "stop words",
                                                         "sampling_params": greedy(24, stop_token_ids=[first])})
        k = ref["output_ids"].index(first)
        assert out["output_ids"] == ref["output_ids"][: k + 1] and out["meta_info"]["finish_reason"]["matched"] == first
        assert out["text"] == tok.decode(ref["output_ids"][:k], skip_special_tokens=True)
        # min_new_tokens holds the stop tokens back: the first k tokens cannot end the request.
        status, out = await post(s, url + "/generate", {"text": "stop words", "sampling_params": greedy(
            24, stop_token_ids=[first], min_new_tokens=k + 2)})
        assert len(out["output_ids"]) >= k + 2 and first not in out["output_ids"][: k + 2]
        # min_p = 1 keeps only the most likely token: greedy even at temperature 1.
        status, out = await post(s, url + "/generate", {"text": "stop words", "sampling_params": {
            "max_new_tokens": 24, "ignore_eos": True, "min_p": 1.0}})
        assert out["output_ids"] == ref["output_ids"]

    serve(policy, body)


def test_penalties_and_logit_bias_change_the_distribution_as_sglangs_penalizers(policy):
    model, tok = policy
    prompt = tok("penalise me", add_special_tokens=False)["input_ids"]
    freq, pres, rep, bias = 0.7, 0.4, 1.6, {7: 2.5, 11: -1.0}

    async def body(s, url, engine):
        status, plain = await post(s, url + "/generate", {"input_ids": prompt, "sampling_params": greedy(24)})
        status, out = await post(s, url + "/generate", {
            "input_ids": prompt, "return_logprob": True, "sampling_params": greedy(
                24, frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep,
                logit_bias={str(k): v for k, v in bias.items()})})
        assert status == 200, out
        assert out["output_ids"] != plain["output_ids"]
        # Reference: the HF logits, the penalties over the output so far, then the bias; greedy
        # picks their argmax and the reported log-prob is their log_softmax (as SGLang's sampler).
        ids = list(prompt)
        for j, token in enumerate(out["output_ids"]):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out["output_ids"][:j], dtype=torch.long), minlength=logits.shape[0]).float()
            seen = counts > 0
            logits = torch.where(seen, torch.where(logits < 0, logits * rep, logits / rep), logits)
            logits = logits - freq * counts - pres * seen.float()
            for k, v in bias.items():
                logits[k] += v
            assert token == int(logits.argmax()), j
            assert out["meta_info"]["output_token_logprobs"][j][0] == pytest.approx(
                torch.log_softmax(logits, -1)[token].item(), abs=1e-4)
            ids.append(token)

    serve(policy, body)


# ----------------------------------------------------------------------------- aborts and versions


def test_abort_prefix_message_and_update_weight_version_defaults(policy):
    async def body(s, url, engine):
        assert engine.weight_version == "default"
        # Prefix match aborts every request whose rid starts with it; each returns what it had.
        tasks = [asyncio.ensure_future(post(s, url + "/generate", {"text": "x", "rid": f"grp-{i}",
                                                                   "sampling_params": greedy(400)})) for i in range(2)]
        for i in range(2):
            await wait_tokens(engine, f"grp-{i}", 2)
        status, text = await post(s, url + "/abort_request", {"rid": "grp-"})
        assert status == 200 and text == ""  # SGLang answers an empty 200
        for status, out in await asyncio.gather(*tasks):
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
            assert 2 <= len(out["output_ids"]) < 400
        # With abort_message the aborted request answers 503 with that message (SGLang's timeout path).
        task = asyncio.ensure_future(post(s, url + "/generate", {"text": "x", "rid": "m", "sampling_params": greedy(400)}))
        await wait_tokens(engine, "m", 1)
        await post(s, url + "/abort_request", {"rid": "m", "abort_message": "Request running timeout reached."})
        status, out = await task
        assert status == 503 and "Request running timeout reached." in out["error"]["message"]
        # /update_weight_version aborts running requests unless told otherwise (SGLang's default).
        task = asyncio.ensure_future(post(s, url + "/generate", {"text": "x", "rid": "v", "sampling_params": greedy(400)}))
        await wait_tokens(engine, "v", 1)
        status, out = await post(s, url + "/update_weight_version", {"new_version": "3"})
        assert status == 200 and out["new_version"] == "3"
        status, out = await task
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        task = asyncio.ensure_future(post(s, url + "/generate", {"text": "x", "rid": "w", "sampling_params": greedy(60)}))
        await wait_tokens(engine, "w", 1)
        await post(s, url + "/update_weight_version", {"new_version": "4", "abort_all_requests": False})
        status, out = await task
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["weight_versions"][-1]["version"] == "4"

    serve(policy, body, context_length=512)


def test_queued_requests_abort_with_what_they_had_and_the_bracket_flag(policy):
    model, tok = policy

    async def body(s, url, engine):
        # One slot: the second request waits in the queue; aborting it returns no tokens.
        first = asyncio.ensure_future(post(s, url + "/generate", {"text": "a", "rid": "run", "sampling_params": greedy(400)}))
        await wait_tokens(engine, "run", 1)
        queued = asyncio.ensure_future(post(s, url + "/generate", {"text": "b", "rid": "wait", "sampling_params": greedy(4)}))
        while engine.loads()["num_waiting_reqs"] < 1:
            await asyncio.sleep(0.002)
        await post(s, url + "/abort_request", {"rid": "wait"})
        status, out = await queued
        assert status == 200 and out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "abort"
        await post(s, url + "/abort_request", {"abort_all": True})
        assert (await first)[1]["meta_info"]["finish_reason"]["type"] == "abort"

    serve(policy, body, max_running_requests=1, context_length=512)

    # --require-weight-update-session false: tensor updates outside the bracket are accepted (0.5.15).
    from lightning_fasync.weights.wire import serialize

    async def outside(s, url, engine):
        payload = serialize([("lm_head.weight", model.lm_head.weight.detach().clone())])
        status, out = await post(s, url + "/update_weights_from_tensor",
                                 {"serialized_named_tensors": [payload], "weight_version": "2"})
        assert status == 200 and out["success"] and engine.weight_version == "2"

    model_copy = copy.deepcopy(model)
    engine = Engine(model_copy, max_running_requests=2)

    async def main():
        server = TestServer(build_app(engine, tok, "tiny", require_weight_update_session=False), host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                await outside(session, str(server.make_url("")).rstrip("/"), engine)
        finally:
            await server.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        engine.stop()


def test_pause_retract_reprefills_under_new_weights_and_flush_rules(policy):
    model, tok = policy
    prompt = tok("retract", add_special_tokens=False)["input_ids"]
    new_model = copy.deepcopy(model)
    with torch.no_grad():
        new_model.lm_head.weight.neg_()

    async def body(s, url, engine):
        task = asyncio.ensure_future(post(s, url + "/generate", {"input_ids": prompt, "rid": "r", "return_logprob": True,
                                                                 "sampling_params": greedy(40)}))
        await wait_tokens(engine, "r", 3)
        # in_place keeps the request running (holding its cache): flush is refused, as in SGLang.
        await post(s, url + "/pause_generation", {"mode": "in_place"})
        status, text = await post(s, url + "/flush_cache")
        assert status == 400 and "running" in text
        # retract sends it back to the queue: the cache is free, flush succeeds.
        await post(s, url + "/pause_generation", {"mode": "retract"})
        assert engine.loads()["num_running_reqs"] == 0 and engine.loads()["num_waiting_reqs"] == 1
        assert (await post(s, url + "/flush_cache"))[0] == 200
        # New weights (inside SGLang 0.5.23's bracket), then continue: the request is prefilled again.
        from lightning_fasync.weights.wire import serialize

        payload = serialize([("lm_head.weight", new_model.lm_head.weight.detach().clone())])
        assert (await post(s, url + "/begin_weight_update", {}))[1]["success"]
        status, out = await post(s, url + "/update_weights_from_tensor",
                                 {"serialized_named_tensors": [payload], "weight_version": "1"})
        assert status == 200, out
        assert (await post(s, url + "/end_weight_update", {}))[1]["success"]
        assert (await post(s, url + "/continue_generation", {}))[1]["status"] == "ok"
        status, out = await task
        spans = out["meta_info"]["weight_versions"]
        assert len(spans) == 2 and spans[0]["version"] == "default" and spans[1] == {"version": "1", "start": spans[0]["end"], "end": 40}
        k = spans[0]["end"]
        assert k >= 3
        # Tokens after the switch are the new model's greedy continuation of prompt + first k tokens.
        ids = prompt + out["output_ids"][:k]
        for j in range(k, 40):
            lp = hf_next_logprobs(new_model, ids)[-1]
            assert out["output_ids"][j] == int(lp.argmax())
            assert out["meta_info"]["output_token_logprobs"][j][0] == pytest.approx(lp.max().item(), abs=1e-4)
            ids.append(out["output_ids"][j])

    serve(policy, body)


def test_info_endpoints_answer_as_sglang(policy):
    async def body(s, url, engine):
        async with s.get(url + "/model_info") as r:
            info = await r.json()
        for key in ("model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
                    "weight_version", "model_type", "architectures"):
            assert key in info, key
        assert info["model_type"] == "qwen2" and info["weight_version"] == "default"
        async with s.get(url + "/get_server_info") as r:
            sinfo = await r.json()
        assert sinfo["version"] == "0.5.23" and sinfo["tp_size"] == 1 and sinfo["dp_size"] == 1
        assert "internal_states" in sinfo and sinfo["context_length"] == engine.context_length
        async with s.get(url + "/v1/loads") as r:
            loads = await r.json()
        assert {"timestamp", "version", "loads"} <= set(loads)
        load = loads["loads"][0]
        for key in ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens",
                    "max_total_num_tokens", "max_running_requests", "token_usage"):
            assert key in load, key
        async with s.get(url + "/get_load") as r:
            assert (await r.json())[0]["dp_rank"] == 0

    serve(policy, body)
