"""Where the embedded server answered otherwise than SGLang 0.5.23 (issue 30), now answering as it does.

Each test names the SGLang source it copies; ``tests/engine/test_sglang_parity.py`` checks the same
answers against SGLang's own code, where the ``sglang`` package is installed. These run in-process
and without it.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from lightning_fasync.engine import protocol
from lightning_fasync.engine.engine import Engine
from lightning_fasync.engine.model_runner import KVCacheTooLargeError, plan_kv_pool
from lightning_fasync.engine.server import parse_args
from lightning_fasync.policy import build_policy
from tests.helpers.engine import call, serve

VOCAB = 99  # the tiny preset's


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


async def wait_running(session, url, n=1):
    for _ in range(2000):
        if (await call(session, "GET", url + "/get_load"))[1][0]["num_reqs"] >= n:
            return
        await asyncio.sleep(0.005)
    raise TimeoutError("the request never started")


LONG = {"max_new_tokens": 400, "ignore_eos": True}


def test_a_rid_twice_in_one_batch_or_already_in_flight_is_refused_with_sglangs_400(policy):
    """``GenerateReqInput._validate_rid_uniqueness`` (io_struct.py) and ``TokenizerManager._init_req_state``
    (tokenizer_manager.py): 400 ``{"error": {"message"}}`` (http_server.py ``_create_error_response``)."""

    async def body(s, url, engine):
        status, out = await call(s, "POST", url + "/generate", {"input_ids": [[5], [6], [7]], "rid": ["a", "b", "a"]})
        assert (status, out["error"]["message"]) == (400, "Duplicate request IDs detected within the request: ['a']")
        # Two concurrent requests with one rid: the second is refused while the first runs.
        first = asyncio.ensure_future(call(s, "POST", url + "/generate",
                                           {"input_ids": [5], "rid": "dup", "sampling_params": LONG}))
        await wait_running(s, url)
        status, out = await call(s, "POST", url + "/generate", {"input_ids": [6], "rid": "dup"})
        assert (status, out["error"]["message"]) == (400, "Duplicate request ID detected: dup")
        # A batch item's rid counts too, and so does a rid taken by the OpenAI routes.
        status, out = await call(s, "POST", url + "/generate", {"input_ids": [[6], [7]], "rid": ["x", "dup"]})
        assert (status, out["error"]["message"]) == (400, "Duplicate request ID detected: dup")
        status, out = await call(s, "POST", url + "/v1/completions", {"prompt": "hi", "max_tokens": 2, "rid": "dup"})
        assert status == 400 and out["error"]["message"] == "Duplicate request ID detected: dup"
        status, out = await call(s, "POST", url + "/v1/completions",
                                 {"prompt": ["a", "b"], "max_tokens": 2, "rid": ["r", "r"]})
        assert status == 400 and "Duplicate request IDs detected within the request: ['r']" in out["error"]["message"]
        # The refused calls ran nothing and held nothing: "x" is free, the first request goes on.
        assert (await call(s, "POST", url + "/generate", {"input_ids": [6], "rid": "x",
                                                          "sampling_params": {"max_new_tokens": 1}}))[0] == 200
        await call(s, "POST", url + "/abort_request", {"rid": "dup"})
        status, out = await first
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        # Finished (aborted included), the rid is free again; n > 1 samples share their prompt's rid.
        status, out = await call(s, "POST", url + "/generate", {"input_ids": [5], "rid": "dup",
                                                                "sampling_params": {"max_new_tokens": 2, "n": 2}})
        assert status == 200 and [o["meta_info"]["id"] for o in out] == ["dup_0", "dup_1"]
        # A call refused by validation releases its rids at once.
        status, _ = await call(s, "POST", url + "/generate", {"input_ids": [[5], [5] * 600], "rid": ["p", "q"]})
        assert status == 400
        assert (await call(s, "POST", url + "/generate", {"input_ids": [[5], [6]], "rid": ["p", "q"],
                                                          "sampling_params": {"max_new_tokens": 1}}))[0] == 200
        # Streaming requests hold their rid too.
        async with s.post(url + "/generate", json={"input_ids": [5], "rid": "s", "stream": True,
                                                   "sampling_params": LONG}) as stream:
            await stream.content.readline()
            status, out = await call(s, "POST", url + "/generate", {"input_ids": [6], "rid": "s"})
            assert (status, out["error"]["message"]) == (400, "Duplicate request ID detected: s")
            await call(s, "POST", url + "/abort_request", {"rid": "s"})
            await stream.read()
        assert engine.loads()["num_running_reqs"] == 0

    serve(policy, body)


def test_update_weights_from_disk_with_a_missing_path_answers_sglangs_update_body(policy, tmp_path):
    """http_server.py ``update_weights_from_disk``: ``{"success", "message", "num_paused_requests"}``,
    400 on failure (the model runner's ``Failed to get weights iterator: ...``); clients read
    ``ret["success"]``."""

    async def body(s, url, engine):
        missing = str(tmp_path / "no-such-checkpoint")
        status, out = await call(s, "POST", url + "/update_weights_from_disk", {"model_path": missing})
        assert status == 400
        assert out == {"success": False, "num_paused_requests": 0,
                       "message": f"Failed to get weights iterator: model_path {missing!r} does not exist."}
        status, out = await call(s, "POST", url + "/update_weights_from_disk", {"model_path": str(tmp_path)})
        assert status == 400 and out["success"] is False and "no safetensors weights" in out["message"]
        assert out["num_paused_requests"] == 0
        # A checkpoint whose tensors do not fit the model: the same body.
        from safetensors.torch import save_file

        save_file({"no.such.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
        status, out = await call(s, "POST", url + "/update_weights_from_disk", {"model_path": str(tmp_path)})
        assert (status, out["success"], out["num_paused_requests"]) == (400, False, 0)
        assert "Unknown parameter name" in out["message"] and engine.weight_version == "default"
        # A malformed request is still a 400 naming the field.
        status, out = await call(s, "POST", url + "/update_weights_from_disk", {})
        assert status == 400 and "model_path" in out["error"]["message"]
        assert (await call(s, "POST", url + "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}))[0] == 200

    serve(policy, body)


def plan(**kw):
    base = dict(layers=3, kv_heads=1, head_dim=24, dtype=torch.float32, weight_bytes=2**30, available_bytes=10 * 2**30,
                max_slots=64, mem_fraction_static=0.4)
    return plan_kv_pool(**{**base, **kw})


def test_a_pool_of_max_total_tokens_equal_to_the_context_length_starts(policy):
    """SGLang's default page size is 1, so ``--max-total-tokens 1000 --context-length 1000`` starts;
    here page 16 (the default, for speed: docs/engine.md) would hold 992 tokens, so the pool takes
    the largest page that holds one request."""
    assert (plan(context_length=1000, max_total_tokens=1000).page_size,
            plan(context_length=1000, max_total_tokens=1000).max_total_tokens) == (8, 1000)
    assert plan(context_length=1001, max_total_tokens=1001).page_size == 1
    assert plan(context_length=512, max_total_tokens=4096).page_size == 16  # the default where it fits
    assert plan(context_length=512).page_size == 16
    with pytest.raises(KVCacheTooLargeError, match="holds 992 tokens"):  # a page size given is kept
        plan(context_length=1000, max_total_tokens=1000, page_size=16)
    assert parse_args(["--model", "tiny"]).page_size is None
    model, _ = policy
    engine = Engine(model, max_running_requests=4, context_length=1000, max_total_tokens=1000)
    try:
        req = engine.generate([5] * 900, max_new_tokens=99, ignore_eos=True)  # the whole context, in one request
        assert len(req.output_ids) == 99
        assert (engine.runner.page_size, engine.runner.max_total_tokens) == (8, 1000)
    finally:
        engine.stop()


@pytest.mark.parametrize("payload,message", [
    ({"token_ids_logprob": [[1, 2]]}, "token_ids_logprob must be a flat list of integers."),
    ({"token_ids_logprob": ["a"]}, "token_ids_logprob must be a flat list of integers."),
    ({"token_ids_logprob": [VOCAB]}, f"token_ids_logprob contains out-of-vocabulary token id {VOCAB}; "
                                     f"valid range is [0, {VOCAB})."),
    ({"token_ids_logprob": [-1], "return_logprob": True}, "token_ids_logprob contains out-of-vocabulary token id -1"),
    ({"input_ids": [[5], [6]], "token_ids_logprob": [[1], [VOCAB]], "return_logprob": True},
     f"token_ids_logprob contains out-of-vocabulary token id {VOCAB}"),
])
def test_token_ids_logprob_is_checked_with_sglangs_wording(payload, message):
    """tokenizer_manager.py ``_validate_token_ids_logprob``: checked with or without return_logprob."""
    with pytest.raises(protocol.BadRequest) as info:
        protocol.parse_generate({"input_ids": [5], **payload}, None, VOCAB)
    assert str(info.value).startswith(message)


def test_server_info_merges_in_sglangs_scheduler_and_startup_fields(policy):
    """http_server.py ``server_info`` merges the scheduler's handshake (``max_total_num_tokens``,
    ``max_req_input_len``: tp_worker.py's ``min(context, pool) - 1 - 5``) and ``startup_time``
    (observability/startup_time.py's phases)."""

    async def body(s, url, engine):
        status, info = await call(s, "GET", url + "/server_info")
        assert status == 200
        assert info["max_total_num_tokens"] == engine.runner.max_total_tokens == info["max_total_tokens"]
        assert info["max_req_input_len"] == min(engine.context_length, engine.runner.max_total_tokens) - 6
        startup = info["startup_time"]
        assert set(startup) == {"load_weight", "kv_cache_allocation", "scheduler_e2e", "cuda_graph", "tokenizer_e2e"}
        assert set(startup["cuda_graph"]) == {"prefill", "decode", "target_verify", "draft_prefill", "draft_decode",
                                              "draft_extend"}
        assert startup["load_weight"] == 1.5 and startup["cuda_graph"]["decode"] == 0.0

    from lightning_fasync.engine.server import startup_time_info

    serve(policy, body, {"startup_time": startup_time_info(load_weight=1.5)})


def test_tokenize_and_detokenize_take_and_answer_sglangs_shapes(policy):
    """serving_tokenize.py and protocol.py's ``TokenizeRequest``/``Response``, ``DetokenizeRequest``/``Response``."""
    _, tok = policy

    async def body(s, url, engine):
        for prefix in ("", "/v1"):
            status, out = await call(s, "POST", url + prefix + "/tokenize", {"prompt": "Hello", "model": "tiny"})
            assert (status, out) == (200, {"tokens": tok.encode("Hello"), "count": 5, "max_model_len": 512})
            status, out = await call(s, "POST", url + prefix + "/detokenize", {"tokens": out["tokens"]})
            assert (status, out) == (200, {"text": "Hello"})
        status, out = await call(s, "POST", url + "/tokenize", {"prompt": ["ab", "c"], "add_special_tokens": False})
        assert out == {"tokens": [tok.encode("ab", add_special_tokens=False), tok.encode("c", add_special_tokens=False)],
                       "count": [2, 1], "max_model_len": 512}
        chat = [{"role": "user", "content": "hi"}]
        status, out = await call(s, "POST", url + "/tokenize", {"messages": chat})
        rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert status == 200 and out["tokens"] == tok.encode(rendered, add_special_tokens=False)
        assert out["count"] == len(out["tokens"])
        # The chat completion's prompt is exactly what /tokenize counts.
        status, done = await call(s, "POST", url + "/v1/chat/completions", {"messages": chat, "max_tokens": 1})
        assert done["usage"]["prompt_tokens"] == out["count"]
        status, out = await call(s, "POST", url + "/tokenize", {"messages": chat, "add_generation_prompt": False})
        assert out["tokens"] == tok.encode(tok.apply_chat_template(chat, add_generation_prompt=False, tokenize=False),
                                           add_special_tokens=False)
        status, out = await call(s, "POST", url + "/detokenize", {"tokens": [[40], [41, 42]]})
        assert (status, out) == (200, {"text": [tok.decode([40]), tok.decode([41, 42])]})
        assert (await call(s, "POST", url + "/detokenize", {"tokens": []}))[1] == {"text": ""}
        for path, payload, message in [
            ("/tokenize", {}, "Exactly one of 'prompt' or 'messages' must be provided."),
            ("/tokenize", {"prompt": "a", "messages": chat}, "Exactly one of 'prompt' or 'messages' must be provided."),
            ("/tokenize", {"prompt": 5}, "Invalid prompt type: <class 'int'>. Expected str or List[str]."),
            ("/detokenize", {"tokens": [40, "x"]}, "Invalid input: 'tokens' must be a list of integers."),
            ("/detokenize", {"tokens": [[40], [41, "x"]]},
             "Invalid input: Sublist in 'tokens' must contain only integers. Found: [41, 'x']"),
            ("/detokenize", {"tokens": ["x"]}, "Invalid tokens type"),
            ("/detokenize", {}, "Missing required field `tokens`."),
        ]:
            status, out = await call(s, "POST", url + path, payload)
            assert status == 400 and out["error"]["message"].startswith(message), (path, payload, out)

    serve(policy, body)


def parse_metrics(text: str) -> tuple[dict[str, str], dict[str, list[tuple[dict[str, str], float]]]]:
    """``(type by family, samples by name)`` of a Prometheus text exposition."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            name, _, labels = head.partition("{")
            pairs = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
            samples.setdefault(name, []).append((pairs, float(value)))
    return types, samples


def value(samples, name, **labels):
    matching = [v for pairs, v in samples[name] if all(pairs.get(k) == str(w) for k, w in labels.items())]
    assert len(matching) == 1, (name, labels, samples.get(name))
    return matching[0]


def test_metrics_are_served_with_enable_metrics_under_sglangs_names(policy):
    """observability/metrics_collector.py: SGLang's names, types and labels, text format; only with
    ``--enable-metrics``."""

    async def without(s, url, engine):
        assert (await call(s, "GET", url + "/metrics"))[0] == 404

    serve(policy, without)
    assert parse_args(["--model", "tiny", "--enable-metrics"]).enable_metrics is True

    async def body(s, url, engine):
        async with s.get(url + "/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            types, before = parse_metrics(await r.text())
        scheduler = {"model_name": "served-tiny", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}
        assert value(before, "sglang:max_total_num_tokens", **scheduler) == engine.runner.max_total_tokens
        assert value(before, "sglang:num_running_reqs", **scheduler) == 0
        assert "sglang:num_requests_total" not in before
        for name, kind in (("sglang:num_running_reqs", "gauge"), ("sglang:token_usage", "gauge"),
                           ("sglang:gen_throughput", "gauge"), ("sglang:num_queue_reqs", "gauge"),
                           ("sglang:prompt_tokens", "counter"), ("sglang:generation_tokens", "counter"),
                           ("sglang:num_requests", "counter"), ("sglang:e2e_request_latency_seconds", "histogram")):
            assert types[name] == kind
        running = asyncio.ensure_future(call(s, "POST", url + "/generate", {"input_ids": [5, 6], "rid": "m",
                                                                            "sampling_params": LONG}))
        await wait_running(s, url)
        # /get_load counts it once queued; the scheduler's gauge once a decode batch holds it.
        for _ in range(2000):
            async with s.get(url + "/metrics") as r:
                _, live = parse_metrics(await r.text())
            if value(live, "sglang:num_running_reqs", **scheduler) or running.done():
                break
            await asyncio.sleep(0.005)
        assert value(live, "sglang:num_running_reqs", **scheduler) == 1
        assert 0 < value(live, "sglang:token_usage", **scheduler) <= 1
        await call(s, "POST", url + "/abort_request", {"rid": "m"})
        status, aborted = await running
        status, out = await call(s, "POST", url + "/generate", {"input_ids": [[5, 6, 7], [8]],
                                                                "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert status == 200
        async with s.post(url + "/generate", json={"input_ids": [5], "stream": True,
                                                   "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}) as r:
            await r.read()
        async with s.get(url + "/metrics") as r:
            _, after = parse_metrics(await r.text())
        tokenizer = {"model_name": "served-tiny", "engine_type": "unified"}
        generated = aborted["meta_info"]["completion_tokens"] + 6
        assert value(after, "sglang:num_requests_total", **tokenizer, is_streaming="false") == 3
        assert value(after, "sglang:num_requests_total", **tokenizer, is_streaming="true") == 1
        assert value(after, "sglang:prompt_tokens_total", **tokenizer, is_streaming="false") == 2 + 3 + 1
        assert value(after, "sglang:generation_tokens_total", **tokenizer, is_streaming="false") == generated
        assert value(after, "sglang:generation_tokens_total", **tokenizer, is_streaming="true") == 2
        assert value(after, "sglang:num_aborted_requests_total", **tokenizer) == 1
        assert value(after, "sglang:e2e_request_latency_seconds_count", **tokenizer, is_streaming="false") == 3
        assert value(after, "sglang:e2e_request_latency_seconds_bucket", **tokenizer, is_streaming="false",
                     le="+Inf") == 3
        assert value(after, "sglang:gen_throughput", **scheduler) > 0  # tokens since the last scrape
        assert value(after, "sglang:num_running_reqs", **scheduler) == 0

    serve(policy, body, {"enable_metrics": True, "served_model_name": "served-tiny"})


UNSUPPORTED = [
    ({"sampling_params": {"json_schema": "{}"}}, "`sampling_params.json_schema`='{}' is not supported: the embedded "
     "engine does not support constrained decoding (only null is accepted)."),
    ({"sampling_params": {"regex": "a+"}}, "does not support constrained decoding"),
    ({"sampling_params": {"ebnf": "root ::= 'a'"}}, "does not support constrained decoding"),
    ({"sampling_params": {"structural_tag": "{}"}}, "does not support constrained decoding"),
    ({"image_data": "a.png"}, "`image_data`='a.png' is not supported: the embedded engine does not support multimodal "
     "inputs"),
    ({"audio_data": "a.wav"}, "does not support multimodal inputs"),
    ({"lora_path": "adapter"}, "does not support LoRA adapters"),
    ({"session_params": {"id": "s"}}, "does not support sessions"),
    ({"return_hidden_states": True}, "does not support returning hidden states"),
]


@pytest.mark.parametrize("payload,message", UNSUPPORTED)
def test_what_the_engine_refuses_by_design_names_the_feature(payload, message):
    with pytest.raises(protocol.BadRequest) as info:
        protocol.parse_generate({"input_ids": [5], **payload}, None, VOCAB)
    assert message in str(info.value)


def test_every_refused_field_has_a_feature_name():
    tables = [protocol._GENERATE_UNSUPPORTED, protocol._SAMPLING_UNSUPPORTED]
    from lightning_fasync.engine import openai_api

    tables += [openai_api._UNSUPPORTED_COMPLETION, openai_api._UNSUPPORTED_CHAT]
    missing = sorted({name for table in tables for name in table} - set(protocol.UNSUPPORTED_FEATURES))
    assert missing == []


def test_openai_refusals_name_the_feature(policy):
    async def body(s, url, engine):
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        for path, payload, message in [
            ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
             "does not support constrained decoding"),
            ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}},
             "does not support constrained decoding"),
            ("/v1/completions", {"prompt": "hi", "json_schema": "{}"}, "does not support constrained decoding"),
            ("/v1/chat/completions", {**chat, "regex": "a+"}, "does not support constrained decoding"),
            ("/v1/chat/completions", {**chat, "modalities": ["audio"]}, "does not support multimodal inputs"),
            ("/v1/chat/completions", {**chat, "lora_path": "a"}, "does not support LoRA adapters"),
            ("/v1/completions", {"prompt": "hi", "best_of": 3}, "does not support best-of sampling"),
        ]:
            status, out = await call(s, "POST", url + path, payload)
            assert status == 400 and message in out["error"]["message"], (path, payload, out)

    serve(policy, body)
