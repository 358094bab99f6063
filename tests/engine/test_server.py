"""The HTTP server: SGLang's fields and shapes, bad requests, auth, and the server process lifecycle."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from lightning_fasync.policy import build_policy
from lightning_fasync.engine.engine import Engine
from lightning_fasync.fleet.launch import ServerStartError, launch_server
from lightning_fasync.engine.server import build_app, parse_args


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


def run_against_app(policy, body, api_key=None, app_kwargs=None, **engine_kwargs):
    """Run ``body(session, base_url)`` against an in-process server on a free port."""
    model, tok = policy
    engine = Engine(model, **{"max_running_requests": 8, **engine_kwargs})

    async def main():
        server = TestServer(build_app(engine, tok, "tiny", api_key=api_key, **(app_kwargs or {})), host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                return await body(session, str(server.make_url("")).rstrip("/"))
        finally:
            await server.close()

    try:
        return asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.stop()


async def call(session, method, url, json=None, data=None, headers=None):
    async with session.request(method, url, json=json, data=data, headers=headers) as r:
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, await r.text()


BAD_GENERATE = [
    ("{not json", "Malformed JSON"),
    ([1, 2], "must be an object"),
    ({"input_ids": [5, 6], "frobnicate": 1}, "Unknown field(s) for /generate: frobnicate"),
    ({"input_ids": "abc"}, "`input_ids` must be a list"),
    ({"input_ids": [5, "6"]}, "integers only"),
    ({"input_ids": [[5, 6], []]}, "Prompt 1 is empty"),
    ({"input_ids": [[5, 6], [7]], "sampling_params": [{}]}, "one object per prompt (2)"),
    ({"input_ids": [[5, 6], [7]], "rid": ["a"]}, "`rid` has 1 entries"),
    ({"input_ids": [[5], [7]], "sampling_params": [{"n": 1}, {"n": 2}]}, "must be the same for every prompt"),
    ({"input_ids": []}, "empty"),
    ({"text": ""}, "empty"),
    ({}, "Either `text` or `input_ids`"),
    ({"text": "a", "input_ids": [5]}, "not both"),
    ({"input_ids": list(range(5, 90)) * 8}, "is longer than the model's context length"),
    ({"input_ids": [5] * 200, "sampling_params": {"max_new_tokens": 400}},
     "Requested token count exceeds the model's maximum context length"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens` must be at least 0"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": "8"}}, "must be an integer"),
    ({"input_ids": [5], "sampling_params": {"temperature": "hot"}}, "`sampling_params.temperature` must be a number"),
    ({"input_ids": [5], "sampling_params": {"ignore_eos": 1}}, "`sampling_params.ignore_eos` must be a boolean"),
    ({"input_ids": [5], "sampling_params": {"warp": 9}}, "Unknown field(s) for sampling_params: warp"),
    ({"input_ids": [5], "sampling_params": {"stop": [1]}}, "`sampling_params.stop` must be a string or a list"),
    ({"input_ids": [5], "sampling_params": {"stop_regex": "(("}}, "not a valid regular expression"),
    ({"input_ids": [5], "sampling_params": {"n": 0}}, "`sampling_params.n` must be in [1, 4096], got 0"),
    ({"input_ids": [5], "sampling_params": {"n": 10**8}}, "`sampling_params.n` must be in [1, 4096], got 100000000"),
    ({"input_ids": [5], "sampling_params": {"min_p": 2.0}}, "min_p` must be in [0, 1]"),
    ({"input_ids": [5], "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 2}}, "min_new_tokens` must be in"),
    ({"input_ids": [5], "sampling_params": {"regex": "a+"}},
     "`sampling_params.regex`='a+' is not supported: the embedded engine does not support constrained decoding"),
    ({"input_ids": [5], "sampling_params": {"json_schema": "{}"}},
     "`sampling_params.json_schema`='{}' is not supported: the embedded engine does not support constrained decoding"),
    ({"input_ids": [5], "sampling_params": {"frequency_penalty": 2.5}}, "`sampling_params.frequency_penalty` must be in [-2, 2]"),
    ({"input_ids": [5], "sampling_params": {"repetition_penalty": 0}}, "`sampling_params.repetition_penalty` must be in (0, 2]"),
    ({"input_ids": [5], "sampling_params": {"logit_bias": {"x": 1.0}}}, "`sampling_params.logit_bias` has the key 'x'"),
    ({"input_ids": [5], "sampling_params": {"logit_bias": {"5": "up"}}}, "`sampling_params.logit_bias[5]` must be a number"),
    ({"input_ids": [5], "sampling_params": {"logit_bias": {"100000": 1}}}, "logit_bias must has keys in [0, 98]"),
    ({"input_ids": [5], "sampling_params": {"ebnf": "root ::= 'a'"}}, "support constrained decoding"),
    ({"input_ids": [5], "lora_path": "adapter"}, "LoRA adapter 'adapter' is not loaded; loaded adapters: []."),
    ({"input_ids": [5], "image_data": "a.png"}, "does not support multimodal inputs"),
    ({"input_ids": [5], "return_hidden_states": True}, "`return_hidden_states`=True is not supported"),
    ({"input_ids": [5], "routed_dp_rank": 1}, "`routed_dp_rank`=1 does not exist"),
    ({"input_ids": [5], "stream": "yes"}, "`stream` must be a boolean"),
    ({"input_ids": [5], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len=3 is higher"),
    ({"input_ids": [5], "return_logprob": True, "token_ids_logprob": [10**6]}, "token_ids_logprob contains out-of-vocabulary token id 1000000; valid range is [0, 99)."),
    ({"input_ids": [5], "return_logprob": True, "top_logprobs_num": "3"}, "`top_logprobs_num` must be an integer"),
    ({"input_ids": [5], "return_logprob": True, "top_logprobs_num": -1}, "`top_logprobs_num` must be >= 0"),
    ({"input_ids": [5], "return_logprob": True, "logprob_start_len": 0.5}, "`logprob_start_len` must be an integer"),
    ({"input_ids": [5], "return_text_in_logprobs": "y"}, "`return_text_in_logprobs` must be a boolean"),
    ({"input_ids": [5], "return_prompt_token_ids": 1}, "`return_prompt_token_ids` must be a boolean"),
    ({"input_ids": [5], "token_ids_logprob": ["a"]}, "token_ids_logprob must be a flat list of integers."),
    ({"input_ids": [5], "sampling_params": {"n": "2"}}, "`sampling_params.n` must be an integer"),
    ({"input_ids": [5], "sampling_params": {"stream_interval": 0}}, "`sampling_params.stream_interval` must be at least 1"),
    ({"input_ids": [5], "sampling_params": {"stop_token_ids": ["x"]}}, "`sampling_params.stop_token_ids` must contain"),
    ({"input_ids": [5], "sampling_params": {"min_p": "low"}}, "`sampling_params.min_p` must be a number"),
    ({"input_ids": [5], "sampling_params": {"no_stop_trim": "no"}}, "`sampling_params.no_stop_trim` must be a boolean"),
    ({"input_ids": [5], "sampling_params": {"top_k": 0}}, "`sampling_params.top_k` must be -1 (disable) or at least 1"),
    ({"input_ids": [5], "sampling_params": {"beam_width": 4}}, "`sampling_params.beam_width`=4 is not supported: the "
     "embedded engine does not support beam search"),
    ({"input_ids": [[5], [6], [7]], "rid": ["a", "b", "a"]}, "Duplicate request IDs detected within the request: ['a']"),
    ({"input_ids": [5], "token_ids_logprob": [[1, 2]]}, "token_ids_logprob must be a flat list of integers."),
    ({"input_ids": [5], "token_ids_logprob": [99]}, "token_ids_logprob contains out-of-vocabulary token id 99"),
    ({"text": ["a", 5]}, "`text` must be a string or a list of strings"),
    ({"input_ids": [5], "rid": 12}, "`rid` must be a string"),
    ({"input_ids": [5], "return_logprob": "yes"}, "`return_logprob` must be a boolean"),
]


def test_generate_fields_and_shapes(policy):
    _, tok = policy

    async def body(s, url):
        status, out = await call(s, "POST", url + "/generate", {
            "text": "Hello", "rid": "abc", "return_logprob": True, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.5, "top_p": 0.9, "top_k": 10,
                                "ignore_eos": True, "sampling_seed": 3, "stop_token_ids": [], "skip_special_tokens": True}})
        assert status == 200, out
        meta = out["meta_info"]
        assert meta["id"] == "abc" and meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 6
        assert meta["finish_reason"] == {"type": "length", "length": 6}
        assert len(out["output_ids"]) == 6 and out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
        assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"]
        assert all(isinstance(e[0], float) and e[0] <= 0 and isinstance(e[2], str) for e in meta["output_token_logprobs"])
        assert meta["weight_version"] == "default"
        assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 6}]
        # Without return_logprob there are no log-probs; a rid is made up when missing.
        status, out = await call(s, "POST", url + "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and "output_token_logprobs" not in out["meta_info"] and out["meta_info"]["id"]
        # Fields a router re-serialises with null values are accepted.
        status, out = await call(s, "POST", url + "/generate", {"input_ids": [5], "lora_path": None, "stream": False,
                                                                "sampling_params": {"max_new_tokens": 1, "stop": None}})
        assert status == 200, out

    run_against_app(policy, body)


def test_bad_requests_get_400_and_the_server_keeps_serving(policy):
    async def body(s, url):
        for payload, message in BAD_GENERATE:
            kwargs = {"data": payload} if isinstance(payload, str) else {"json": payload}
            status, out = await call(s, "POST", url + "/generate", **kwargs)
            assert status == 400, (payload, out)
            assert message in out["error"]["message"], (payload, out)
        for path, payload, message in [
            ("/abort_request", {}, "rid"), ("/abort_request", {"rid": 5}, "must be a string"),
            ("/pause_generation", {"mode": "nap"}, "Unknown pause mode"),
            ("/update_weights_from_disk", {}, "model_path"),
            ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}, "not valid base64"),
            ("/update_weights_from_tensor", {"safetensors_path": "/x.safetensors"}, "Unknown field"),
            ("/update_weight_version", {"new_version": 3}, "must be a string"),
        ]:
            status, out = await call(s, "POST", url + path, payload)
            assert status == 400 and message in out["error"]["message"], (path, out)
        status, _ = await call(s, "GET", url + "/health")
        assert status == 200
        status, out = await call(s, "POST", url + "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 3}})
        assert status == 200 and out["meta_info"]["completion_tokens"] >= 1

    run_against_app(policy, body)


def test_info_health_load_and_version_endpoints(policy, tmp_path):
    model, _ = policy

    async def body(s, url):
        for path in ("/health", "/health_generate"):
            assert (await call(s, "GET", url + path))[0] == 200
        for method in ("GET", "POST"):
            assert (await call(s, method, url + "/flush_cache"))[0] == 200
        status, info = await call(s, "GET", url + "/model_info")
        assert status == 200 and info["weight_version"] == "default" and info["is_generation"] is True
        assert (await call(s, "GET", url + "/get_model_info"))[1] == info
        status, sinfo = await call(s, "GET", url + "/server_info")
        assert sinfo["dp_size"] == 1 and sinfo["max_running_requests"] == 8
        status, loads = await call(s, "GET", url + "/v1/loads")
        assert loads["loads"][0]["num_running_reqs"] == 0
        status, out = await call(s, "POST", url + "/update_weight_version", {"new_version": "5"})
        assert status == 200 and (await call(s, "GET", url + "/get_weight_version"))[1] == {"weight_version": "5"}
        # Weights in SGLang's serialised format (the same-host update_weights_from_tensor path).
        from lightning_fasync.weights import wire as weight_wire

        def update_body():  # one payload per deserialisation (each holds one shared-memory reference)
            return {"serialized_named_tensors": [weight_wire.serialize([("lm_head.weight", model.lm_head.weight.detach().clone())])],
                    "weight_version": "6"}

        update = update_body()
        # SGLang 0.5.23: a tensor update outside begin/end_weight_update fails.
        status, out = await call(s, "POST", url + "/update_weights_from_tensor", update)
        assert status == 400 and out["success"] is False and "begin_weight_update" in out["message"]
        assert (await call(s, "POST", url + "/end_weight_update", {}))[1]["success"] is False  # none open
        assert (await call(s, "POST", url + "/begin_weight_update", {}))[1] == {"success": True, "message": "Success"}
        assert (await call(s, "POST", url + "/begin_weight_update", {}))[1]["success"] is False  # already open
        status, out = await call(s, "POST", url + "/update_weights_from_tensor", {"serialized_named_tensors": []})
        assert status == 400 and "serialized_named_tensors" in out["error"]["message"]
        status, out = await call(s, "POST", url + "/update_weights_from_tensor", update_body())
        assert status == 200 and out["success"], out
        assert (await call(s, "POST", url + "/end_weight_update", {}))[1]["success"] is True
        status, out = await call(s, "POST", url + "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
        assert out["meta_info"]["weight_version"] == "6"
        status, out = await call(s, "POST", url + "/pause_generation", {"mode": "in_place"})
        assert status == 200
        assert (await call(s, "GET", url + "/health_generate"))[0] == 200  # paused on purpose is healthy
        assert (await call(s, "POST", url + "/continue_generation"))[0] == 200

    run_against_app(policy, body)


def test_api_key_is_required_when_set(policy):
    async def body(s, url):
        gen = {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}
        status, out = await call(s, "POST", url + "/generate", gen)
        assert status == 401 and "API key" in out["error"]["message"]
        status, _ = await call(s, "POST", url + "/generate", gen, headers={"Authorization": "Bearer wrong"})
        assert status == 401
        status, _ = await call(s, "POST", url + "/generate", gen, headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        assert (await call(s, "GET", url + "/health"))[0] == 200

    run_against_app(policy, body, api_key="s3cret")


def test_a_server_others_can_reach_needs_the_key_on_every_route(policy, capsys):
    from lightning_fasync.engine.server import is_loopback, main

    assert main(["--model", "tiny", "--host", "192.0.2.7"]) == 2  # refused before it loads or binds anything
    assert "`--host` is 192.0.2.7, which others can reach: set an API key" in capsys.readouterr().err
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")

    async def body(s, url):
        for path in ("/health", "/metrics", "/get_server_info"):
            assert (await call(s, "GET", url + path))[0] == 401, path
        assert (await call(s, "GET", url + "/health", headers={"Authorization": "Bearer s3cret"}))[0] == 200

    run_against_app(policy, body, api_key="s3cret", app_kwargs={"open_paths": (), "enable_metrics": True})


def test_cli_flags():
    args = parse_args(["--model", "tiny", "--port", "123", "--threads", "2", "--max-running-requests", "9"])
    assert (args.model, args.port, args.host, args.threads, args.max_running_requests) == ("tiny", 123, "127.0.0.1", 2, 9)
    with pytest.raises(SystemExit):
        parse_args(["--port", "1"])
    assert parse_args(["--model", "tiny"]).port == 30000  # as `export` and the README print it: SGLang's default


@pytest.mark.slow
def test_launch_failure_reports_the_server_output():
    with pytest.raises(ServerStartError, match="neither a preset") as info:
        launch_server("no-such-model", timeout=60)
    log = str(info.value).split("full log: ")[1].split(")")[0]
    os.unlink(log)  # kept for the user on failure; this failure is the test's own


@pytest.mark.slow
def test_server_and_router_exit_with_their_killed_parent(tmp_path):
    # A throwaway parent (a "trainer") launches a pinned server and a router, reports their pids,
    # then is killed with SIGKILL: neither child may survive it.
    script = textwrap.dedent(
        """
        import sys, time
        from lightning_fasync.fleet.launch import launch_router, launch_server
        h = launch_server("tiny", cpu_cores=[0], threads=1, timeout=120)
        r = launch_router([h.url])
        print(h.pid, h.url, r.pid, r.url, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    pids: list[int] = []
    try:
        line = parent.stdout.readline()
        assert line, "the parent process died before its server was healthy"
        server_pid, url, router_pid, router_url = line.split()
        pids = [int(server_pid), int(router_pid)]
        assert os.sched_getaffinity(pids[0]) == {0}
        import urllib.request

        for u in (url, router_url):
            with urllib.request.urlopen(u + "/health", timeout=5) as r:
                assert r.status == 200
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while any(_pid_alive(p) for p in pids):
            assert time.monotonic() < deadline, "a child outlived its killed parent"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            os.kill(parent.pid, signal.SIGKILL)
            parent.wait(10)
        for pid in pids:  # only if the assertion above failed
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        # The killed parent could not remove its children's logs.
        for u in (url, router_url) if pids else ():
            for path in glob.glob(f"{tempfile.gettempdir()}/fasync-*-{u.rsplit(':', 1)[1]}-*.log"):
                os.unlink(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stopped_engine_answers_503(policy):
    model, tok = policy
    engine = Engine(model)

    async def main():
        server = TestServer(build_app(engine, tok, "tiny"), host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                url = str(server.make_url("")).rstrip("/")
                engine.stop()
                status, out = await call(s, "POST", url + "/generate", {"input_ids": [5]})
                assert status == 503 and "stopped" in out["error"]["message"]
                assert (await call(s, "GET", url + "/health"))[0] == 503
        finally:
            await server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_resumed_request_reports_the_tokens_its_kept_cache_saved_over_http(policy, tmp_path):
    """``--keep-aborted-kv`` over SGLang's protocol: a request aborted through ``/abort_request``
    leaves its cache; the resumed ``/generate`` (prompt + tokens so far) reports them in
    ``meta_info.cached_tokens`` and ``/metrics`` a non-zero ``sglang:cache_hit_rate``; an update with
    ``flush_cache`` (SGLang's default) drops what is kept, one with ``flush_cache: false`` does not."""
    from safetensors.torch import save_file

    from tests.helpers.engine import call, serve

    async def decoding(engine, tokens=3, timeout=30.0):
        """Until the engine's one running request has ``tokens`` output tokens."""
        deadline = time.monotonic() + timeout
        while not engine._running or len(engine._running[0].output_ids) < tokens:
            assert time.monotonic() < deadline, f"no running request reached {tokens} tokens within {timeout} s"
            await asyncio.sleep(0.001)

    async def body(session, url, engine):
        prompt = [1, 5, 6, 7, 8]
        first = asyncio.ensure_future(call(session, "POST", url + "/generate", {
            "rid": "long", "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 500, "ignore_eos": True, "temperature": 0.0}}))
        await decoding(engine)
        assert (await call(session, "POST", url + "/abort_request", {"rid": "long"}))[0] == 200
        status, out = await first
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        done = out["output_ids"]
        assert engine.kept_kv == 1
        status, again = await call(session, "POST", url + "/generate", {
            "input_ids": prompt + done, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        assert status == 200 and again["meta_info"]["cached_tokens"] == len(prompt) + len(done) - 1
        _, metrics = await call(session, "GET", url + "/metrics")
        rate = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("sglang:cache_hit_rate"))
        assert rate > 0
        # What flush_cache does to kept caches, through a weight update.
        names = {n: t.detach().clone() for n, t in engine.model.state_dict().items()}
        for flush in (False, True):
            first = asyncio.ensure_future(call(session, "POST", url + "/generate", {
                "input_ids": prompt, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}))
            await decoding(engine)
            engine.abort("", abort_all=True)
            await first
            kept = engine.kept_kv
            assert kept >= 1
            path = str(tmp_path / f"weights-{flush}")
            os.makedirs(path)
            save_file(names, os.path.join(path, "model.safetensors"))
            status, res = await call(session, "POST", url + "/update_weights_from_disk",
                                     {"model_path": path, "flush_cache": flush})
            assert status == 200 and res["success"], res
            assert engine.kept_kv == (0 if flush else kept), flush

    serve(policy, body, {"enable_metrics": True}, own_model=True, keep_aborted_kv=True)
