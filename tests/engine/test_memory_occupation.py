"""SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` on the embedded engine.

The memory really goes (tensor storages drop to 0 bytes; in a server process its RSS drops) and
comes back (weights zeroed until a weight update loads them, as SGLang's resumed memory keeps no
contents); requests wait while memory is released; bad requests answer 400 naming the field. The
request bodies are built with SGLang 0.5.23's own request classes and ``msgspec_to_builtins``,
compiled from the installed package's source (importing ``io_struct`` pulls in SGLang's GPU
runtime), and our client's bodies are parsed by SGLang's own pydantic schema for those classes.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import os
import time
import typing
import urllib.request

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer

from lightning_fasync.pipeline.engine_client import EngineError
from lightning_fasync.policy import build_policy
from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.engine.engine import MEMORY_TAGS, Engine
from lightning_fasync.fleet.launch import launch_server
from lightning_fasync.engine.server import build_app
from tests.helpers.engine import call
from tests.helpers.required import SGLANG, located

SGLANG_DIR = located(*SGLANG)  # found without importing it; missing, a failure under LFA_REQUIRE_SGLANG=1
needs_sglang = pytest.mark.skipif(SGLANG_DIR is None, reason="sglang is not installed (tests/requirements-sglang.txt)")
PROMPT = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


def serve(policy, body, *servers_kwargs):
    """Run ``body(session, urls, engines)`` against in-process servers (one per kwargs dict) on free ports."""
    model, tok = policy
    engines = []
    for kwargs in servers_kwargs or ({},):
        fresh, _ = build_policy("tiny")  # each engine owns its weights (they are freed and rebuilt)
        engines.append(Engine(fresh, **{"max_running_requests": 8, **kwargs}))

    async def main():
        servers = [TestServer(build_app(e, tok, "tiny"), host="127.0.0.1") for e in engines]
        for server in servers:
            await server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                urls = [str(server.make_url("")).rstrip("/") for server in servers]
                return await body(session, urls, engines)
        finally:
            for server in servers:
                await server.close()

    try:
        return asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        for e in engines:
            e.stop()


async def until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached within the test's bound"
        await asyncio.sleep(0.02)


def storage_bytes(tensors):
    return [t.untyped_storage().nbytes() for t in tensors]


def test_release_frees_memory_and_resume_brings_it_back(policy, tmp_path):
    from safetensors.torch import save_file

    model, _ = policy
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))

    async def body(s, urls, engines):
        (url,), (engine,) = urls, engines
        params = list(engine.model.parameters())
        shapes = [tuple(p.shape) for p in params]
        caches = engine.runner.k_cache + engine.runner.v_cache
        status, out = await call(s, "POST", url + "/generate", PROMPT)
        assert status == 200, out
        greedy = out["output_ids"]

        # KV cache first, as a caller may release one tag at a time: its storage goes to 0 bytes.
        status, out = await call(s, "POST", url + "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert (status, out) == (200, None)  # SGLang answers 200 with a null body
        assert storage_bytes(caches) == [0] * len(caches) and all(c.numel() > 0 for c in caches)
        status, info = await call(s, "GET", url + "/server_info")
        usage = info["internal_states"][0]["memory_usage"]
        assert usage["kvcache_bytes"] == 0 and usage["weight_bytes"] > 0 and usage["released_tags"] == ["kv_cache"]

        status, out = await call(s, "POST", url + "/release_memory_occupation", {"tags": ["weights"]})
        assert (status, out) == (200, None)
        assert storage_bytes(params) == [0] * len(params)
        assert [tuple(p.shape) for p in params] == shapes  # names and shapes stay for the next load
        status, info = await call(s, "GET", url + "/server_info")
        assert info["internal_states"][0]["memory_usage"]["weight_bytes"] == 0

        # The server keeps answering; generation waits; nothing reads or writes the freed weights.
        for path in ("/health", "/health_generate", "/model_info"):
            status, _ = await call(s, "GET", url + path)
            assert status == 200, path
        status, out = await call(s, "POST", url + "/weights_checker", {})
        assert status == 400 and out["success"] is False and "released" in out["message"]
        status, out = await call(s, "POST", url + "/update_weights_from_disk", {"model_path": str(tmp_path)})
        assert status == 400 and out["success"] is False and "released" in out["message"]
        waiting = asyncio.ensure_future(call(s, "POST", url + "/generate", PROMPT))

        async def queued():
            _, loads = await call(s, "GET", url + "/v1/loads")
            return loads["loads"][0]["num_waiting_reqs"] == 1

        await until(queued)

        # Weights come back zeroed, with their memory; a weight update then loads them.
        status, out = await call(s, "POST", url + "/resume_memory_occupation", {"tags": ["weights"]})
        assert (status, out) == (200, None)
        assert storage_bytes(params) == [p.numel() * p.element_size() for p in params]
        assert all(torch.count_nonzero(p) == 0 for p in params)
        status, out = await call(s, "POST", url + "/update_weights_from_disk",
                                 {"model_path": str(tmp_path), "weight_version": "1"})
        assert status == 200 and out["success"] is True, out
        assert not waiting.done()  # the KV cache is still released
        status, out = await call(s, "POST", url + "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
        assert status == 400 and "`tags` holds 'cuda_graph', which is not released" in out["error"]["message"]
        status, out = await call(s, "POST", url + "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert (status, out) == (200, None)
        pool = engine.runner.kv_pool  # the per-layer caches are views of one pool
        assert storage_bytes(caches) == [pool.numel() * pool.element_size()] * len(caches)

        status, out = await waiting  # the queued request ran on the reloaded weights
        assert status == 200 and out["output_ids"] == greedy and out["meta_info"]["weight_version"] == "1"
        status, out = await call(s, "POST", url + "/generate", PROMPT)
        assert status == 200 and out["output_ids"] == greedy

        # No tags means every tag, as in SGLang; both methods are routed, as in SGLang.
        status, _ = await call(s, "GET", url + "/release_memory_occupation")
        assert status == 200 and engine.released_tags == set(MEMORY_TAGS)
        status, _ = await call(s, "POST", url + "/resume_memory_occupation", {"tags": None})
        assert status == 200 and engine.released_tags == set()

    serve(policy, body, {"enable_memory_saver": True})


def test_bad_memory_requests_answer_400_naming_the_field(policy):
    async def body(s, urls, engines):
        (url,), (engine,) = urls, engines
        for path, payload, words in (
            ("/release_memory_occupation", {"tags": ["weights", "gpu"]}, "`tags` holds 'gpu'; SGLang's memory tags are"),
            ("/release_memory_occupation", {"tags": "weights"}, "`tags` must be a list of strings or null"),
            ("/resume_memory_occupation", {"tags": [1]}, "`tags` must be a list of strings or null"),
            ("/release_memory_occupation", {"tagz": ["weights"]}, "Unknown field(s) for release_memory_occupation: tagz"),
            ("/resume_memory_occupation", {"tags": ["weights"]}, "`tags` holds 'weights', which is not released"),
        ):
            status, out = await call(s, "POST", url + path, payload)
            assert status == 400 and words in out["error"]["message"], (path, payload, out)
        status, _ = await call(s, "POST", url + "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert status == 200
        status, out = await call(s, "POST", url + "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert status == 400 and "`tags` holds 'kv_cache', which is released already" in out["error"]["message"]
        status, _ = await call(s, "POST", url + "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert status == 200

        # As in SGLang, only an idle engine releases: a request kept running (paused in place) refuses it.
        long = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
        running = asyncio.ensure_future(call(s, "POST", url + "/generate", long))

        async def one_running():
            _, loads = await call(s, "GET", url + "/v1/loads")
            return loads["loads"][0]["num_running_reqs"] == 1

        await until(one_running)
        status, _ = await call(s, "POST", url + "/pause_generation", {"mode": "in_place"})
        assert status == 200
        status, out = await call(s, "POST", url + "/release_memory_occupation", {})
        assert status == 400 and "needs an idle engine" in out["error"]["message"]
        assert engine.released_tags == set()
        await call(s, "POST", url + "/continue_generation", {})
        await call(s, "POST", url + "/abort_request", {"abort_all": True})
        status, _ = await running
        assert status == 200

    serve(policy, body, {"enable_memory_saver": True})


def test_without_the_memory_saver_nothing_is_freed(policy):
    """SGLang without --enable-memory-saver: the calls succeed and free nothing."""

    async def body(s, urls, engines):
        (url,), (engine,) = urls, engines
        before = engine.runner.memory_bytes()
        status, out = await call(s, "POST", url + "/generate", PROMPT)
        greedy = out["output_ids"]
        status, _ = await call(s, "POST", url + "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
        assert status == 200 and engine.released_tags == {"weights", "kv_cache"}
        assert engine.runner.memory_bytes() == before and not engine.memory_released
        status, out = await call(s, "POST", url + "/generate", PROMPT)  # nothing was freed: it runs
        assert status == 200 and out["output_ids"] == greedy
        status, _ = await call(s, "POST", url + "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
        assert status == 200 and engine.released_tags == set()
        status, out = await call(s, "POST", url + "/generate", PROMPT)
        assert out["output_ids"] == greedy  # the weights kept their values

    serve(policy, body, {})


def test_client_fans_the_calls_out_to_every_worker(policy):
    async def body(s, urls, engines):
        client = SGLangClient(urls, admin_timeout_s=30)
        try:
            await client.release_memory_occupation(["weights", "kv_cache", "cuda_graph"])
            assert [e.released_tags for e in engines] == [set(MEMORY_TAGS)] * 2
            assert all(e.runner.memory_bytes() == {"weights": 0, "kv_cache": 0} for e in engines)
            await client.resume_memory_occupation(["weights"])
            assert [e.released_tags for e in engines] == [{"kv_cache", "cuda_graph"}] * 2
            with pytest.raises(EngineError, match="`tags` holds 'weights', which is not released"):
                await client.resume_memory_occupation(None)  # None is every tag, and the weights are back
            await client.resume_memory_occupation(["kv_cache", "cuda_graph"])
            assert [e.released_tags for e in engines] == [set(), set()]
        finally:
            await client.close()

    serve(policy, body, {"enable_memory_saver": True}, {"enable_memory_saver": True})


# ------------------------------------------------------------------------------ against SGLang's code


def _sglang_source(relpath: str) -> ast.Module:
    with open(os.path.join(SGLANG_DIR, *relpath.split("/"))) as f:
        return ast.parse(f.read())


@pytest.fixture(scope="module")
def sglang():
    """SGLang 0.5.23's request classes for the two endpoints, its ``msgspec_to_builtins``, its memory
    tags and the HTTP methods it routes, from the installed package's source files."""
    if SGLANG_DIR is None:
        pytest.skip("sglang is not installed")
    import msgspec

    spec = importlib.util.spec_from_file_location("_sglang_msgspec_utils", os.path.join(SGLANG_DIR, "srt", "utils", "msgspec_utils.py"))
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)  # msgspec and pydantic_core only, no SGLang runtime
    names = {"BaseReq", "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput"}
    classes = [n for n in _sglang_source("srt/managers/io_struct.py").body if isinstance(n, ast.ClassDef) and n.name in names]
    assert {c.name for c in classes} == names
    ns = {"__name__": "_sglang_io_struct", "msgspec": msgspec, "Optional": typing.Optional, "List": typing.List,
          "msgspec_struct_pydantic_core_schema": utils.msgspec_struct_pydantic_core_schema}
    # dont_inherit: this file's `from __future__ import annotations` would leave the annotations unresolved.
    exec(compile(ast.Module(body=classes, type_ignores=[]), "sglang/srt/managers/io_struct.py", "exec", dont_inherit=True), ns)
    constants: dict = {}
    exec(compile(_sglang_source("srt/constants.py"), "sglang/srt/constants.py", "exec"), constants)
    methods = {}
    for node in ast.walk(_sglang_source("srt/entrypoints/http_server.py")):
        if isinstance(node, ast.AsyncFunctionDef) and node.name in ("release_memory_occupation", "resume_memory_occupation"):
            for deco in node.decorator_list:
                if isinstance(deco, ast.Call) and getattr(deco.func, "attr", None) == "api_route":
                    methods[deco.args[0].value] = {m.value for m in next(k.value for k in deco.keywords if k.arg == "methods").elts}
    return {"release": ns["ReleaseMemoryOccupationReqInput"], "resume": ns["ResumeMemoryOccupationReqInput"],
            "to_builtins": utils.msgspec_to_builtins, "tags": constants["GPU_MEMORY_ALL_TYPES"], "methods": methods}


@needs_sglang
def test_sglangs_own_request_bodies_and_ours_agree(policy, sglang):
    import pydantic

    assert list(MEMORY_TAGS) == sglang["tags"]  # the same tag names, in SGLang's order
    release, resume = sglang["release"], sglang["resume"]
    assert set(release.__struct_fields__) == set(resume.__struct_fields__) == {"rid", "http_worker_ipc", "tags"}
    assert sglang["methods"] == {"/release_memory_occupation": {"GET", "POST"}, "/resume_memory_occupation": {"GET", "POST"}}

    # What our client sends, parsed by SGLang's own schema for these classes (what its FastAPI route does).
    sent = []
    client = SGLangClient(["http://127.0.0.1:9"])

    async def record(method, path, body=None, missing_ok=False):
        sent.append((method, path, body))
        return [None]

    client._all_workers = record
    asyncio.run(client.release_memory_occupation(["weights", "kv_cache"]))
    asyncio.run(client.resume_memory_occupation(None))
    (_, path1, body1), (_, path2, body2) = sent
    assert (path1, path2) == ("/release_memory_occupation", "/resume_memory_occupation")
    assert pydantic.TypeAdapter(release).validate_python(body1).tags == ["weights", "kv_cache"]
    assert pydantic.TypeAdapter(resume).validate_python(body2).tags is None

    # SGLang's objects, as builtins (every field, nulls included), accepted by our endpoints.
    async def body(s, urls, engines):
        (url,), (engine,) = urls, engines
        for tags in (["kv_cache", "weights"], None):
            payload = sglang["to_builtins"](release(tags=tags, rid="r1"))
            assert set(payload) == set(release.__struct_fields__)
            status, out = await call(s, "POST", url + "/release_memory_occupation", payload)
            assert status == 200, out
            assert engine.released_tags == set(tags or MEMORY_TAGS)
            payload = sglang["to_builtins"](resume(tags=tags))
            status, out = await call(s, "POST", url + "/resume_memory_occupation", payload)
            assert status == 200 and engine.released_tags == set(), out

    serve(policy, body, {"enable_memory_saver": True})


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise LookupError("VmRSS")


def _post(url: str, body) -> int:
    import json

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.status


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's RSS from /proc")
def test_a_server_process_gives_the_memory_back_to_the_system():
    """``--enable-memory-saver`` (SGLang's flag) on a server whose KV cache is large (1024 slots):
    its resident memory drops by the KV cache's size on release and grows back on resume."""
    import json

    handle = launch_server("tiny", max_running_requests=1024, extra_args=["--enable-memory-saver"], timeout=120)
    try:
        with urllib.request.urlopen(handle.url + "/server_info", timeout=30) as r:
            kv = json.loads(r.read())["internal_states"][0]["memory_usage"]["kvcache_bytes"]
        assert kv >= 256 * 2**20
        before = _rss_bytes(handle.pid)
        assert _post(handle.url + "/release_memory_occupation", {"tags": ["kv_cache"]}) == 200
        released = _rss_bytes(handle.pid)
        assert before - released > 0.9 * kv, (before, released, kv)
        assert _post(handle.url + "/resume_memory_occupation", {"tags": ["kv_cache"]}) == 200
        assert _rss_bytes(handle.pid) - released > 0.9 * kv
        with urllib.request.urlopen(handle.url + "/health_generate", timeout=60) as r:
            assert r.status == 200
    finally:
        handle.stop()
