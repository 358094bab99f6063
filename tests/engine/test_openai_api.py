"""The OpenAI-compatible endpoints, driven by the official ``openai`` client against an in-process server."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer

from lightning_fasync.policy import build_char_tokenizer, build_policy
from lightning_fasync.engine.engine import Engine
from lightning_fasync.engine.openai_api import _settled, _token_bytes
from lightning_fasync.engine.server import build_app

USER = [{"role": "user", "content": "Hello there"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


def run_openai(policy, body, tokenizer=None):
    """Run ``body(client, session, base_url)`` against an in-process server (``tokenizer`` replaces the model's)."""
    model, tok = policy
    engine = Engine(model, max_running_requests=8)

    async def main():
        server = TestServer(build_app(engine, tokenizer or tok, "tiny"), host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            async with aiohttp.ClientSession() as session:
                return await body(client, session, url)
        finally:
            await client.close()
            await server.close()

    try:
        return asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.stop()


async def native(session, url, input_ids, max_new_tokens, top=0):
    """Greedy ``/generate`` of ``input_ids`` with log-probs (the reference the OpenAI answers must match)."""
    body = {"input_ids": input_ids, "return_logprob": True, "top_logprobs_num": top, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    async with session.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def chat_prompt_ids(tok, messages, tools=None):
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


async def collect(stream):
    return [chunk async for chunk in stream]


def test_models_list_and_retrieve(policy):
    async def body(client, session, url):
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        card = models.data[0]
        assert (card.object, card.owned_by, card.root, card.max_model_len) == ("model", "sglang", "tiny", 512)
        assert (await client.models.retrieve("tiny")).id == "tiny"
        with pytest.raises(openai.NotFoundError, match="The model 'gpt-4' does not exist") as info:
            await client.models.retrieve("gpt-4")
        assert (info.value.code, info.value.param) == ("model_not_found", "model")

    run_openai(policy, body)


def test_completions_prompts_n_and_usage(policy):
    _, tok = policy

    async def body(client, session, url):
        ids = {t: tok(t, add_special_tokens=False)["input_ids"] for t in ("Hello", "abc")}
        for prompt, lengths in (("Hello", [5]), (["Hello", "abc"], [5, 3]), (ids["Hello"], [5]),
                                ([ids["Hello"], ids["abc"]], [5, 3])):
            out = await client.completions.create(model="tiny", prompt=prompt, max_tokens=4, n=2, seed=1,
                                                  extra_body={"return_token_ids": True})
            assert out.object == "text_completion" and out.model == "tiny"
            assert [c.index for c in out.choices] == list(range(2 * len(lengths)))
            for c in out.choices:
                assert c.finish_reason in ("stop", "length")
                assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
            assert out.usage.prompt_tokens == sum(lengths)  # once per prompt, not per sample
            assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)
            assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
            assert out.metadata == {"weight_version": "default", "weight_versions": [
                {"version": "default", "start": 0, "end": len(out.choices[0].token_ids)}]}
        # max_tokens defaults to SGLang's 16; ignore_eos is an SGLang extra field.
        out = await client.completions.create(model="tiny", prompt="Hi", extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"

    run_openai(policy, body)


def test_greedy_completion_and_logprobs_match_native_generate(policy):
    _, tok = policy

    async def body(client, session, url):
        prompt_ids = tok("The quick brown", add_special_tokens=False)["input_ids"]
        ref = await native(session, url, prompt_ids, 10, top=2)
        for prompt in ("The quick brown", prompt_ids):
            out = await client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2)
            choice = out.choices[0]
            assert choice.text == ref["text"]
            want = ref["meta_info"]["output_token_logprobs"]
            assert choice.logprobs.tokens == [text for _, _, text in want]
            assert choice.logprobs.token_logprobs == pytest.approx([lp for lp, _, _ in want], abs=1e-5)
            assert [len(row) for row in choice.logprobs.top_logprobs] == [2] * len(want)
            for row, ref_row in zip(choice.logprobs.top_logprobs, ref["meta_info"]["output_top_logprobs"]):
                assert row == pytest.approx({text: lp for lp, _, text in ref_row}, abs=1e-5)
        # echo prepends the prompt; with logprobs it carries the prompt tokens' log-probs (the first is null).
        out = await client.completions.create(model="tiny", prompt="The quick brown", max_tokens=10, temperature=0,
                                              echo=True, logprobs=1)
        choice = out.choices[0]
        assert choice.text == "The quick brown" + ref["text"]
        assert choice.logprobs.tokens[:len(prompt_ids)] == list("The quick brown")
        assert choice.logprobs.token_logprobs[0] is None
        assert len(choice.logprobs.tokens) == len(prompt_ids) + ref["meta_info"]["completion_tokens"]

    run_openai(policy, body)


def test_chat_greedy_and_logprobs_match_native_generate(policy):
    _, tok = policy

    async def body(client, session, url):
        ref = await native(session, url, chat_prompt_ids(tok, USER), 8, top=2)
        out = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0,
                                                   logprobs=True, top_logprobs=2)
        assert out.object == "chat.completion"
        choice = out.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == ref["text"]
        assert choice.message.tool_calls is None
        assert out.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
        assert out.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
        want = ref["meta_info"]["output_token_logprobs"]
        assert [e.token for e in choice.logprobs.content] == [text for _, _, text in want]
        assert [e.bytes for e in choice.logprobs.content] == [list(text.encode()) for _, _, text in want]
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx([lp for lp, _, _ in want], abs=1e-5)
        for entry, ref_row in zip(choice.logprobs.content, ref["meta_info"]["output_top_logprobs"]):
            assert [t.token for t in entry.top_logprobs] == [text for _, _, text in ref_row]
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for lp, _, _ in ref_row], abs=1e-5)
        assert out.metadata["weight_version"] == "default"
        # max_completion_tokens is max_tokens' newer name.
        again = await client.chat.completions.create(model="tiny", messages=USER, max_completion_tokens=8,
                                                     temperature=0)
        assert again.choices[0].message.content == ref["text"]

    run_openai(policy, body)


def test_chat_sampling_defaults_come_from_the_generation_config(policy):
    model, _ = policy

    async def body(client, session, url):
        greedy = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
        # top_k=1 from the model's generation_config makes sampling greedy unless the request says otherwise.
        for seed in (1, 2):
            out = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, seed=seed)
            assert out.choices[0].message.content == greedy.choices[0].message.content
        sampled = [await client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, seed=seed,
                                                        extra_body={"top_k": -1}) for seed in (1, 2)]
        assert len({out.choices[0].message.content for out in sampled + [greedy]}) > 1
        # /v1/completions keeps SGLang's fixed defaults.
        texts = {(await client.completions.create(model="tiny", prompt="Hi", max_tokens=12, seed=seed)).choices[0].text
                 for seed in (1, 2)}
        assert len(texts) == 2

    model.generation_config.top_k = 1
    try:
        run_openai(policy, body)
    finally:
        model.generation_config.top_k = None


def test_stop_strings_trim_and_finish_with_stop(policy):
    async def body(client, session, url):
        full = (await client.completions.create(model="tiny", prompt="Once upon", max_tokens=20, temperature=0,
                                                extra_body={"ignore_eos": True})).choices[0].text
        stop = full[6:8]
        want = full[:full.find(stop)]
        out = await client.completions.create(model="tiny", prompt="Once upon", max_tokens=20, temperature=0,
                                              stop=[stop], extra_body={"ignore_eos": True})
        choice = out.choices[0]
        assert (choice.text, choice.finish_reason, choice.matched_stop) == (want, "stop", stop)
        # Streamed, the text that may start the stop is held back: the deltas add up to the trimmed text.
        chunks = await collect(await client.completions.create(
            model="tiny", prompt="Once upon", max_tokens=20, temperature=0, stop=stop, stream=True,
            extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"
        chat = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, temperature=0,
                                                    extra_body={"ignore_eos": True})
        text = chat.choices[0].message.content
        chat = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, temperature=0,
                                                    stop=text[5:7], extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == text[:text.find(text[5:7])]
        assert chat.choices[0].finish_reason == "stop"

    run_openai(policy, body)


def test_streaming_matches_the_non_streamed_text(policy):
    async def body(client, session, url):
        plain = await client.completions.create(model="tiny", prompt=["Hello", "abc"], max_tokens=12, temperature=0)
        chunks = await collect(await client.completions.create(
            model="tiny", prompt=["Hello", "abc"], max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        texts, finish = ["", ""], [None, None]
        for chunk in chunks[:-1]:
            (choice,) = chunk.choices
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish[choice.index]
        assert texts == [c.text for c in plain.choices]
        assert finish == [c.finish_reason for c in plain.choices] and None not in finish
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == plain.usage.total_tokens

        plain = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
        chunks = await collect(await client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=12, temperature=0, stream=True, logprobs=True,
            stream_options={"include_usage": True}))
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        deltas = [c.choices[0] for c in chunks[:-1]]
        assert "".join(d.delta.content or "" for d in deltas) == plain.choices[0].message.content
        assert deltas[-1].finish_reason == plain.choices[0].finish_reason
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert sum(len(d.logprobs.content) for d in deltas if d.logprobs) == plain.usage.completion_tokens
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
        # Without include_usage there is no usage chunk.
        chunks = await collect(await client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=3, stream=True, n=2))
        assert chunks[-1].choices and all(c.usage is None for c in chunks)
        assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]

    run_openai(policy, body)


def test_chat_with_tools_renders_them_through_the_template(policy):
    _, tok = policy

    async def body(client, session, url):
        bare = await client.chat.completions.create(model="tiny", messages=TOOL_TURNS[:2], max_tokens=4)
        with_tools = await client.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=TOOLS, max_tokens=4)
        assert with_tools.usage.prompt_tokens > bare.usage.prompt_tokens
        assert with_tools.usage.prompt_tokens == len(chat_prompt_ids(tok, TOOL_TURNS, TOOLS))
        choice = with_tools.choices[0]
        assert isinstance(choice.message.content, str) and choice.message.tool_calls is None
        assert choice.finish_reason in ("stop", "length")
        # tool_choice "none" (or no tools) leaves the tools out of the prompt, as SGLang does.
        none = await client.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=TOOLS, tool_choice="none",
                                                    max_tokens=4)
        assert none.usage.prompt_tokens == len(chat_prompt_ids(tok, TOOL_TURNS))
        auto = await client.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=TOOLS, tool_choice="auto",
                                                    max_tokens=4)
        assert auto.usage.prompt_tokens == with_tools.usage.prompt_tokens
        for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            with pytest.raises(openai.BadRequestError, match="tool_choice.*tool-call parsing is not supported"):
                await client.chat.completions.create(model="tiny", messages=TOOL_TURNS, tools=TOOLS,
                                                     tool_choice=tool_choice)

    run_openai(policy, body)


def test_requests_the_engine_cannot_honour_get_400(policy):
    async def body(client, session, url):
        chat, hi = {"model": "tiny", "messages": USER}, {"model": "tiny", "prompt": "Hi"}
        for create, kwargs, message in [
            (client.completions.create, {**hi, "extra_body": {"regex": "a+"}}, "`request.regex`='a+' is not supported"),
            (client.chat.completions.create, {**chat, "frequency_penalty": 2.5},
             "`request.frequency_penalty` must be in [-2, 2]"),
            (client.chat.completions.create, {**chat, "response_format": {"type": "json_object"}}, "`response_format`"),
            (client.completions.create, {**hi, "suffix": "end"}, "`suffix`='end' is not supported"),
            (client.chat.completions.create, {**chat, "extra_body": {"lora_path": "a"}}, "`lora_path`='a'"),
            (client.chat.completions.create, {**chat, "top_p": 1.5}, "`request.top_p` must be in (0, 1]"),
            (client.completions.create, {**hi, "prompt": ""}, "Prompt cannot be empty"),
            (client.completions.create, {**hi, "max_tokens": 0}, "`max_tokens` must be positive"),
            (client.chat.completions.create, {**chat, "messages": []}, "Messages cannot be empty"),
            (client.chat.completions.create, {**chat, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]}, "only supports text input"),
            (client.completions.create, {"model": "tiny", "prompt": "x" * 300, "max_tokens": 300},
             "exceeds the model's maximum context length"),
            (client.chat.completions.create, {**chat, "messages": [{"role": "user", "content": "x" * 300}],
                                              "max_tokens": 300}, "exceeds the model's maximum context length"),
            (client.chat.completions.create, {**chat, "max_tokens": 600}, "max_completion_tokens is too large: 600"),
            (client.chat.completions.create, {**chat, "stream": True, "extra_body": {"return_token_ids": True}},
             "return_token_ids is not supported with streaming"),
        ]:
            with pytest.raises(openai.BadRequestError) as info:
                await create(**kwargs)
            assert message in info.value.message, (kwargs, info.value.message)
            # The error body's code is 400 (the client hands it on as an int or, from openai 3, a string).
            assert info.value.status_code == 400 and info.value.type == "BadRequestError" and str(info.value.code) == "400"
        # Fields SGLang does not define are ignored, as its pydantic models do; defaults are accepted.
        out = await client.chat.completions.create(**chat, max_tokens=2, frequency_penalty=0.0, store=False,
                                                   extra_body={"some_future_field": 1, "lora_path": None})
        assert out.choices[0].finish_reason in ("stop", "length")
        # The server keeps serving after the refusals.
        assert (await client.completions.create(model="tiny", prompt="Hi", max_tokens=2)).usage.completion_tokens >= 1

    run_openai(policy, body)


def test_an_abort_finishes_with_abort_or_with_an_error_event(policy):
    async def body(client, session, url):
        async def abort_after_two_chunks(stream, abort):
            seen = []
            async for chunk in stream:
                seen.append(chunk)
                if len(seen) == 2:
                    async with session.post(url + "/abort_request", json=abort) as r:
                        assert r.status == 200
            return seen

        long = {"max_tokens": 400, "stream": True}
        chunks = await abort_after_two_chunks(await client.chat.completions.create(
            model="tiny", messages=USER, **long, extra_body={"ignore_eos": True, "rid": "chat-a"}), {"rid": "chat-a"})
        assert chunks[-1].choices[0].finish_reason == "abort" and len(chunks) < 100
        # SGLang: an abort with a message is an error (503), sent as the stream's last event.
        with pytest.raises(openai.APIError, match="draining"):
            await abort_after_two_chunks(await client.completions.create(
                model="tiny", prompt="Hi", **long, extra_body={"ignore_eos": True, "rid": "cmpl-a"}),
                {"rid": "cmpl-a", "abort_message": "draining"})

    run_openai(policy, body)


def test_chat_needs_a_chat_template(policy):
    async def body(client, session, url):
        with pytest.raises(openai.BadRequestError, match="`messages` cannot be rendered.*no chat template"):
            await client.chat.completions.create(model="tiny", messages=USER)
        # Prompt ids given as SGLang's input_ids need no template.
        out = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=3,
                                                   extra_body={"input_ids": [40, 41, 42]})
        assert out.usage.prompt_tokens == 3

    run_openai(policy, body, tokenizer=build_char_tokenizer())


def test_stream_text_is_held_back_while_it_may_still_change():
    assert _settled("abc", []) == "abc"
    assert _settled("ab\ufffd", []) == "ab"
    assert _settled("hello wo", ["world"]) == "hello "
    assert _settled("hello w", ["xyz", "wx"]) == "hello "
    assert _settled("hello", ["lo!"]) == "hel"
    assert _settled("hello", ["xy"]) == "hello"


def test_logprob_bytes_of_byte_level_fragments():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core)
    ids = tok("é", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids] == ["\ufffd", "\ufffd"]  # each token is half of the character
    assert [b for i in ids for b in _token_bytes(tok, i, tok.decode([i]))] == list("é".encode())
    assert _token_bytes(build_char_tokenizer(), 40, "e") == [101]
