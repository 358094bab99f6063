"""The HTTP client against real server processes, behind the real sglang-router for two replicas."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch

from lightning_fasync.pipeline.engine_client import EngineError, GenerateRequest, SamplingParams
from lightning_fasync.policy import build_policy, save_policy
from lightning_fasync.fleet.client import SGLangClient, expand_versions, parse_generate_response, parse_version
from lightning_fasync.fleet.pool import RolloutPool


# ----------------------------------------------------------------------------- parsing (no processes)


def test_version_spans_expand_to_one_version_per_token():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]  # SGLang 0.5.23
    assert expand_versions({"weight_versions": spans}, 5) == [3, 3, 4, 4, 4]
    assert expand_versions({"weight_version": "default"}, 3) == [0, 0, 0]  # SGLang 0.5.15: no spans
    assert expand_versions({"weight_versions": [{"version": "default", "start": 0, "end": 0}]}, 0) == []
    with pytest.raises(EngineError, match="cover"):
        expand_versions({"weight_versions": spans[:1]}, 3)
    with pytest.raises(EngineError, match="Malformed"):
        expand_versions({"weight_versions": [[0, 2, "3"]]}, 2)
    with pytest.raises(EngineError, match="not an integer"):
        parse_version("v1.2")


def test_a_call_after_a_timed_out_one_reads_its_own_answer():
    """A call that timed out leaves its answer unread on its connection; the next call must not get it
    (aiohttp 3.9.0 put that connection back in the pool, and the next call read the late answer)."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def slow(request):
        await asyncio.sleep(1.5)
        return web.json_response({"answer": "slow"})

    async def fast(request):
        return web.json_response({"answer": "fast"})

    async def main():
        app = web.Application()
        app.router.add_get("/slow", slow)
        app.router.add_get("/fast", fast)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        client = SGLangClient([url], retries=0, admin_timeout_s=0.3)
        try:
            with pytest.raises(EngineError, match="did not answer within"):
                await client._request("GET", url + "/slow", timeout_key="rollout.admin_timeout")
            assert await client._request("GET", url + "/fast", timeout=5.0) == {"answer": "fast"}
        finally:
            await client.close()
            await server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_supervised_generate_waits_for_its_replica_to_be_put_back_not_for_its_port():
    """A replica taken out of service restarts on its URL and answers there before it holds the
    trainer's weights; a supervised ``/generate`` that found it gone must not reach it until the
    supervisor puts it back (the client's own connection retries reached it 0.5 s later)."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from lightning_fasync.fleet.launch import free_port
    from lightning_fasync.fleet.workers import WorkerSet

    served: list[float] = []

    async def generate(request):
        served.append(time.monotonic())
        return web.json_response({"text": "", "output_ids": [5], "meta_info": {
            "id": "r", "finish_reason": {"type": "length"}, "prompt_tokens": 1, "completion_tokens": 1,
            "output_token_logprobs": [[-0.1, 5, None]], "weight_version": "3"}})

    async def main():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        workers = WorkerSet([url], wait_timeout_s=30)
        client = SGLangClient([url], workers=workers, retry_backoff_s=0.2)
        app = web.Application()
        app.router.add_post("/generate", generate)
        restarted = TestServer(app, host="127.0.0.1", port=port)
        try:
            # The replica is dead (nothing listens) but not yet noticed: the request goes out and is refused.
            task = asyncio.ensure_future(client.generate(GenerateRequest("r", [1], SamplingParams(max_new_tokens=1))))
            await asyncio.sleep(0.1)
            assert not task.done()
            workers.remove(url)  # the supervisor noticed, and restarts it on its port
            await restarted.start_server()
            await asyncio.sleep(1.5)  # loading the trainer's weights, checking them
            put_back = time.monotonic()
            workers.add(url)
            result = await asyncio.wait_for(task, 30)
            assert result.output_ids == [5] and result.weight_versions == [3]
            assert served and served[0] >= put_back, "the restarted replica served before it was put back"
        finally:
            await client.close()
            await restarted.close()

    asyncio.run(main())


def test_parse_generate_response():
    data = {"text": "ab", "output_ids": [7, 8], "meta_info": {
        "id": "r", "finish_reason": {"type": "abort", "message": "x"}, "prompt_tokens": 3,
        "output_token_logprobs": [[-0.5, 7, None], [-1.5, 8, None]], "weight_versions": [{"version": "1", "start": 0, "end": 1}, {"version": "2", "start": 1, "end": 2}]}}
    res = parse_generate_response("r", data)
    assert (res.output_ids, res.output_log_probs, res.weight_versions, res.finish_reason, res.prompt_tokens) == (
        [7, 8], [-0.5, -1.5], [1, 2], "abort", 3)
    with pytest.raises(EngineError, match="log-probs"):
        parse_generate_response("r", {**data, "output_ids": [7]})


# ----------------------------------------------------------------------------- live processes


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


@pytest.fixture(scope="module")
def pool():
    p = RolloutPool("tiny", num_replicas=2, max_running_requests=16)
    p.start()
    yield p
    p.stop()
    assert not any(s.alive() for s in p.servers) and not p.router.alive()
    p.stop()  # idempotent


def run(coro_fn, pool, timeout=120):
    async def main():
        client = pool.client(retries=2, retry_backoff_s=0.2)
        try:
            return await asyncio.wait_for(coro_fn(client), timeout)
        finally:
            await client.close()

    return asyncio.run(main())


def greedy(rid, input_ids, n=16):
    return GenerateRequest(rid, input_ids, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))


async def wait_until_running(client, rid_count=1, timeout=30.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        loads = await client.loads()
        if sum(l["loads"][0]["num_total_tokens"] > 0 for l in loads) >= rid_count:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("No request started running in time.")
        await asyncio.sleep(0.005)


@pytest.mark.slow
def test_concurrent_generates_through_the_router(pool, policy):
    model, tok = policy
    assert pool.router is not None and pool.url == pool.router.url and len(pool.worker_urls) == 2
    prompts = [tok(f"prompt {i}:", add_special_tokens=False)["input_ids"] for i in range(24)]

    async def body(client):
        sp = SamplingParams(max_new_tokens=20, temperature=1.0, ignore_eos=True)
        return await asyncio.gather(*(client.generate(GenerateRequest(f"c{i}", p, sp)) for i, p in enumerate(prompts)))

    results = run(body, pool)
    for p, res in zip(prompts, results):
        assert res.finish_reason == "length" and len(res.output_ids) == 20 and res.prompt_tokens == len(p)
        assert len(res.output_log_probs) == len(res.weight_versions) == 20
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([p + res.output_ids])).logits[0], -1)
        ref = [lp[len(p) - 1 + i, t].item() for i, t in enumerate(res.output_ids)]
        assert max(abs(a - b) for a, b in zip(ref, res.output_log_probs, strict=True)) <= 1e-4


@pytest.mark.slow
def test_abort_mid_generation_returns_partial_tokens(pool):
    async def body(client):
        req = GenerateRequest("abort-me-1", [5, 6, 7], SamplingParams(max_new_tokens=450, ignore_eos=True))
        task = asyncio.create_task(client.generate(req))
        await wait_until_running(client)
        await client.pause("in_place")  # freeze it mid-generation so the abort lands deterministically
        await client.abort("abort-me")  # rid prefix, sent to every worker
        await client.resume()
        res = await asyncio.wait_for(task, 30)
        assert res.finish_reason == "abort" and 0 < len(res.output_ids) < 450
        assert len(res.output_log_probs) == len(res.weight_versions) == len(res.output_ids)
        # abort_all on a busy pool.
        tasks = [asyncio.create_task(client.generate(GenerateRequest(f"all{i}", [5], SamplingParams(max_new_tokens=450, ignore_eos=True))))
                 for i in range(4)]
        await wait_until_running(client, 2)
        await client.abort_all()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert all(r.finish_reason == "abort" and len(r.output_ids) < 450 for r in results)

    run(body, pool)


@pytest.mark.slow
def test_generate_waits_during_pause(pool):
    async def body(client):
        await client.pause("abort")
        task = asyncio.create_task(client.generate(greedy("paused", [9, 10], 4)))
        await asyncio.sleep(0.5)
        assert not task.done()  # waiting, not failing
        await client.resume()
        res = await asyncio.wait_for(task, 30)
        assert res.finish_reason == "length" and len(res.output_ids) == 4

    run(body, pool)


@pytest.mark.slow
def test_weight_updates_change_output_and_version(pool, policy, tmp_path):
    model, tok = policy
    prompt = tok("update", add_special_tokens=False)["input_ids"]
    flipped = copy.deepcopy(model)
    with torch.no_grad():
        flipped.lm_head.weight.neg_()
    save_policy(flipped, tok, str(tmp_path / "flipped"))

    async def body(client):
        before = await client.generate(greedy("u0", prompt))
        await client.update_weights_from_disk(str(tmp_path / "flipped"), weight_version=1)
        assert [i["weight_version"] for i in await client.model_info()] == ["1", "1"]
        # Two generates so round robin visits both replicas.
        after = [await client.generate(greedy(f"u1-{i}", prompt)) for i in range(2)]
        for res in after:
            assert res.output_ids != before.output_ids and res.weight_versions == [1] * 16
        with torch.no_grad():
            lp = torch.log_softmax(flipped(torch.tensor([prompt + after[0].output_ids])).logits[0], -1)
        ref = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(after[0].output_ids)]
        assert max(abs(a - b) for a, b in zip(ref, after[0].output_log_probs, strict=True)) <= 1e-4
        # Back to the original weights through shared memory, as a trainer on the same host would.
        await client.update_weights_from_tensor({"lm_head.weight": model.lm_head.weight}, weight_version=2)
        restored = await client.generate(greedy("u2", prompt))
        assert restored.output_ids == before.output_ids and restored.weight_versions == [2] * 16
        await client.update_weight_version(3)
        assert (await client.generate(greedy("u3", prompt, 2))).weight_versions == [3, 3]
        with pytest.raises(EngineError, match="Shape mismatch"):
            await client.update_weights_from_tensor({"lm_head.weight": torch.zeros(2, 2)})
        await client.update_weight_version(0)

    run(body, pool)


@pytest.mark.slow
def test_bad_request_through_router_then_healthy(pool):
    async def body(client):
        with pytest.raises(EngineError, match="400"):
            await client.generate(GenerateRequest("bad", [], SamplingParams(max_new_tokens=4)))
        with pytest.raises(EngineError, match="max_new_tokens"):
            await client.generate(GenerateRequest("bad2", [5], SamplingParams(max_new_tokens=-1)))
        assert await client.health()
        res = await client.generate(greedy("fine", [5, 6], 3))
        assert len(res.output_ids) == 3

    run(body, pool)


@pytest.mark.slow
def test_single_replica_pool_is_used_directly_and_unreachable_engine_fails_cleanly():
    with RolloutPool("tiny", num_replicas=1) as single:
        assert single.router is None and single.url == single.worker_urls[0]

        async def body(client):
            assert client.generate_url == single.url
            res = await client.generate(greedy("one", [5, 6], 3))
            assert len(res.output_ids) == 3

        run(body, single)
    assert not single.servers[0].alive()

    async def dead():
        client = SGLangClient([single.url], retries=1, retry_backoff_s=0.05)
        try:
            with pytest.raises(EngineError, match="failed after 2 attempts"):
                await client.generate(greedy("x", [5], 2))
            assert not await client.health()
        finally:
            await client.close()

    asyncio.run(dead())


@pytest.mark.slow
def test_a_hung_engine_fails_the_request_after_request_timeout_not_never():
    import os
    import signal
    import time

    from lightning_fasync.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match="`rollout.request_timeout` is 0"):
        validate(load_config({"rollout": {"request_timeout": 0}}))
    with RolloutPool("tiny", num_replicas=1) as single:
        pid = single.servers[0].pid

        async def body(_):
            client = single.client(generate_timeout_s=2.0)
            try:
                assert len((await client.generate(greedy("before", [5, 6], 3))).output_ids) == 3
                os.kill(pid, signal.SIGSTOP)  # hung: the process lives, nothing answers
                t0 = time.monotonic()
                with pytest.raises(EngineError, match=r"did not answer within 2 s \(`rollout.request_timeout`\)"):
                    await client.generate(greedy("hung", [5, 6], 3))
                assert time.monotonic() - t0 < 8  # one attempt, not retried into the minutes
                os.kill(pid, signal.SIGCONT)
                assert len((await client.generate(greedy("after", [5, 6], 3))).output_ids) == 3
            finally:
                os.kill(pid, signal.SIGCONT)
                await client.close()

        run(body, single)


def test_every_engine_call_ends_at_its_timeout_against_an_engine_that_never_answers(tmp_path):
    """A listening socket that never answers (a hung server): every call the client makes, generate
    and each admin call, ends in an EngineError at its deadline, none waits forever."""
    import socket
    import time

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)  # the kernel completes the connections; nobody reads or answers
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    calls = {
        "generate": lambda c: c.generate(greedy("r", [1, 2], 2)),
        "abort": lambda c: c.abort("r"),
        "abort_all": lambda c: c.abort_all(),
        "pause": lambda c: c.pause(),
        "resume": lambda c: c.resume(),
        "begin_weight_update": lambda c: c.begin_weight_update(),
        "update_weights_from_disk": lambda c: c.update_weights_from_disk(str(tmp_path)),
        "update_weights_from_tensor": lambda c: c.update_weights_from_tensor({"w": torch.zeros(2)}),
        "update_weight_version": lambda c: c.update_weight_version(1),
        "flush_cache": lambda c: c.flush_cache(),
        "model_info": lambda c: c.model_info(),
        "loads": lambda c: c.loads(),
        "weight_checksums": lambda c: c.weight_checksums(),
    }

    async def body():
        client = SGLangClient([url], retries=0, admin_timeout_s=0.2, generate_timeout_s=0.2)
        try:
            for name, call in calls.items():
                t0 = time.monotonic()
                with pytest.raises(EngineError):
                    await call(client)
                assert time.monotonic() - t0 < 5, name
            assert await client.health() is False
        finally:
            await client.close()

    try:
        asyncio.run(body())
    finally:
        hung.close()
    assert list(tmp_path.iterdir()) == [], "a weight file was left behind"
