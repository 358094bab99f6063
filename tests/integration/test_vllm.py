"""A real vLLM server (vLLM's CPU build) beside the embedded engine, loaded with the same weights:
the differential of greedy tokens and log-probs, before and after a weight update through each
one's own protocol (vLLM's RL API over the fasync-gloo transfer engine; SGLang's tensor update),
the sampled distribution's log-probs, aborts that keep their tokens and per-token versions, and
the weight check that catches a server holding other weights."""

import asyncio
import random
import re

import pytest
import torch

from lightning_fasync.config import VLLMArgs
from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.fleet.launch import launch_server
from lightning_fasync.fleet.vllm import VLLMPlan, VLLMPool
from lightning_fasync.pipeline.engine_client import GenerateRequest, SamplingParams
from lightning_fasync.policy import build_policy
from lightning_fasync.weights.sync import TensorWeightSync, WeightSyncError
from lightning_fasync.weights.vllm_sync import VLLMWeightSync
from tests.helpers.vllm import vllm_python, write_tiny_hd32

pytestmark = pytest.mark.slow

PROMPTS = 32
LONG = 480  # tokens of each of the abort test's 64 requests: ~30,000 in all, seconds on an idle core


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """One vLLM server and one embedded engine, both serving the tiny-hd32 directory; the trainer's model."""
    python = vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    model_dir = write_tiny_hd32(str(root / "model"))
    pool = VLLMPool(VLLMPlan(python, model_dir, None, None), VLLMArgs(max_num_seqs=64), cpu_cores=[[1]],
                    context_length=512, log_dir=str(root), startup_timeout=600)
    embedded = launch_server(model_dir, threads=1, cpu_cores=[0], context_length=512, wait=False)
    try:
        pool.start()
        embedded.wait_healthy(300)
        model, _ = build_policy("tiny-hd32")
        yield pool, embedded, model, root
    finally:
        embedded.stop()
        pool.stop()


def prompts(seed):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 99) for _ in range(rng.randrange(3, 20))] for _ in range(PROMPTS)]


def greedy(client, ids, tag):
    async def run():
        try:
            return await asyncio.gather(*(client.generate(GenerateRequest(
                f"{tag}-{i}", p, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)))
                for i, p in enumerate(ids)))
        finally:
            await client.close()

    return asyncio.run(run())


def assert_same(ours, theirs):
    for a, b in zip(ours, theirs):
        assert a.output_ids == b.output_ids, (a.rid, a.output_ids, b.output_ids)
        worst = max(abs(x - y) for x, y in zip(a.output_log_probs, b.output_log_probs))
        assert worst < 1e-4, (a.rid, worst)


def hf_logprobs(model, prompt, output, temperature=1.0):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def perturbed(model, seed):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def test_greedy_tokens_and_logprobs_match_the_embedded_engine_before_and_after_a_weight_update(engines):
    pool, embedded, model, _ = engines
    ids = prompts(0)
    ours = greedy(SGLangClient([embedded.url]), ids, "emb0")
    theirs = greedy(pool.client(), ids, "vllm0")
    assert_same(ours, theirs)
    # Both are the transformers model's own log-probs (float32 on both sides).
    for r, p in zip(theirs[:4], ids):
        assert max(abs(a - b) for a, b in zip(r.output_log_probs, hf_logprobs(model, p, r.output_ids))) < 1e-4
    assert {v for r in theirs for v in r.weight_versions} == {0}
    before = [r.output_ids for r in theirs]

    # New weights through each engine's own update protocol, labelled version 1.
    weights = perturbed(model, 1)

    async def update():
        vsync = VLLMWeightSync(pool.client(), model="tiny-hd32", timeout_s=120)
        esync = TensorWeightSync(SGLangClient([embedded.url]), timeout_s=120)
        try:
            await vsync.push(weights, 1, step=0)
            await esync.push(weights, 1, step=0)
        finally:
            await vsync.close()
            await esync.close()

    asyncio.run(update())
    ids = prompts(1)
    ours = greedy(SGLangClient([embedded.url]), ids, "emb1")
    theirs = greedy(pool.client(), ids, "vllm1")
    assert_same(ours, theirs)
    assert {v for r in theirs for v in r.weight_versions} == {1}
    model.load_state_dict(weights)
    for r, p in zip(theirs[:4], ids):
        assert max(abs(a - b) for a, b in zip(r.output_log_probs, hf_logprobs(model, p, r.output_ids))) < 1e-4
    # The new weights are served: the first prompts' continuations changed.
    assert [r.output_ids for r in greedy(pool.client(), prompts(0), "vllm0b")] != before


def test_sampled_logprobs_are_the_sampling_distributions(engines):
    """At temperature 0.7 the log-prob vLLM reports for each sampled token is log softmax(logits / 0.7)
    of the weights it holds: what the importance weights divide by."""
    pool, _, model, _ = engines

    async def sample():
        client = pool.client()
        try:
            return await asyncio.gather(*(client.generate(GenerateRequest(
                f"t-{i}", p, SamplingParams(max_new_tokens=16, temperature=0.7, ignore_eos=True, sampling_seed=i)))
                for i, p in enumerate(prompts(2)[:8])))
        finally:
            await client.close()

    weights = asyncio.run(_served_weights(pool, model))
    results = asyncio.run(sample())
    model.load_state_dict(weights)
    for r, p in zip(results, prompts(2)[:8]):
        ref = hf_logprobs(model, p, r.output_ids, temperature=0.7)
        raw = hf_logprobs(model, p, r.output_ids, temperature=1.0)
        assert max(abs(a - b) for a, b in zip(r.output_log_probs, ref)) < 1e-4
        assert max(abs(a - b) for a, b in zip(r.output_log_probs, raw)) > 1e-2  # not the raw distribution's


async def _served_weights(pool, model):
    """The weights the server holds now: pushed here (version 5), so the test does not depend on order."""
    weights = perturbed(model, 5)
    sync = VLLMWeightSync(pool.client(), model="tiny-hd32", timeout_s=120)
    try:
        await sync.push(weights, 5)
    finally:
        await sync.close()
    return weights


async def running(client, url):
    """vLLM's ``vllm:num_requests_running`` gauge, from its Prometheus ``/metrics``."""
    text = await client._request("GET", url + "/metrics")
    found = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def generated(client, url):
    """vLLM's ``vllm:generation_tokens`` counter (tokens decoded so far), from its ``/metrics``."""
    text = await client._request("GET", url + "/metrics")
    return sum(float(v) for v in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.MULTILINE))


async def decoding(client, url, since, tokens, what):
    """Until vLLM has decoded ``tokens`` more than ``since`` (within 120 s)."""
    deadline = asyncio.get_running_loop().time() + 120
    while await generated(client, url) < since + tokens:
        assert asyncio.get_running_loop().time() < deadline, f"vLLM did not decode {what}"
        await asyncio.sleep(0.005)


def test_an_aborted_request_keeps_its_tokens_and_versions_and_resumes_from_them_after_an_update(engines):
    """What rollout.partial does on vLLM: the pause before a sync aborts a long request, which comes
    back with the tokens it has (labelled with the version that sampled them); after the update it
    goes on from prompt + those tokens, and the new tokens carry the new version."""
    pool, _, model, _ = engines
    weights = perturbed(model, 7)

    async def run():
        client = pool.client()
        sync = VLLMWeightSync(pool.client(), model="tiny-hd32", timeout_s=120)
        try:
            await sync.push(perturbed(model, 6), 6)
            # 64 long requests decode together; once vLLM has decoded a few tokens of each (a
            # request sent while the server is paused would wait for the resume, whole), they are
            # frozen where they stand with vLLM's own /pause?mode=keep: a fast server decodes the
            # whole batch in a fraction of a second, sooner than the push reaches its pause. The
            # sync's /pause?mode=abort then aborts them, frozen or running alike (vLLM's scheduler
            # finishes every request it holds), and its /resume lifts both pauses.
            url = pool.worker_urls[0]
            since = await generated(client, url)
            batch = prompts(3) + prompts(5)
            longs = [asyncio.ensure_future(client.generate(GenerateRequest(
                f"long-{i}", p, SamplingParams(max_new_tokens=LONG, temperature=1.0, ignore_eos=True))))
                for i, p in enumerate(batch)]
            await decoding(client, url, since, 4 * len(batch), "the requests")
            await client._request("POST", url + "/pause?mode=keep")
            t0 = asyncio.get_running_loop().time()
            finished_before = sum(f.done() for f in longs)
            await sync.push(weights, 7)
            done = await asyncio.gather(*longs)
            aborted = [(p, r) for p, r in zip(batch, done) if r.finish_reason == "abort" and r.output_ids]
            assert aborted, ([(r.finish_reason, len(r.output_ids), r.weight_versions[-1:]) for r in done],
                             finished_before, asyncio.get_running_loop().time() - t0)
            prompt, first = aborted[0]
            rest = await client.generate(GenerateRequest(
                "long-rest", prompt + first.output_ids, SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)))
            return prompt, first, rest
        finally:
            await client._request("POST", pool.worker_urls[0] + "/resume")  # the module's other tests need it serving
            await sync.close()
            await client.close()

    prompt, first, rest = asyncio.run(run())
    assert 0 < len(first.output_ids) < LONG
    assert first.weight_versions == [6] * len(first.output_ids)
    assert len(first.output_log_probs) == len(first.output_ids)
    assert rest.weight_versions == [7] * 8
    model.load_state_dict(weights)
    ref = hf_logprobs(model, prompt + first.output_ids, rest.output_ids)
    assert max(abs(a - b) for a, b in zip(rest.output_log_probs, ref)) < 1e-4


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_an_inflight_update_freezes_the_requests_and_keeps_or_recomputes_their_kv(engines, kv):
    """``rollout.weight_update_mode: inflight`` on vLLM: the sync pauses with ``/pause?mode=keep``, so
    the running requests are frozen, not aborted, and go on under the new weights after ``/resume``.
    Every request ends with all its tokens; the ones that crossed the swap carry both versions. Their
    log-probs after it are, with ``keep`` (``clear_cache=false``), the new weights reading the cache the
    old weights filled (HF's own KV cache as the reference); with ``recompute`` (``clear_cache=true``,
    which preempts them), the new weights over the whole sequence. Each differs from the other's."""
    pool, _, model, _ = engines
    old_w, new_w = perturbed(model, 8), perturbed(model, 9)
    n = 8

    async def run():
        client = pool.client()
        sync = VLLMWeightSync(pool.client(), model="tiny-hd32", timeout_s=120, check_weights=False,
                              pause_mode={"keep": "in_place", "recompute": "retract"}[kv])
        try:
            await sync.push(old_w, 8)
            url = pool.worker_urls[0]
            since = await generated(client, url)
            batch = prompts(11)[:n]
            longs = [asyncio.ensure_future(client.generate(GenerateRequest(
                f"{kv}-{i}", p, SamplingParams(max_new_tokens=LONG, temperature=1.0, ignore_eos=True))))
                for i, p in enumerate(batch)]
            # Every request running and a few tokens of each decoded, then frozen where they stand
            # with vLLM's own /pause?mode=keep&clear_cache=false (an 8 x 480-token batch decodes in
            # a fraction of a second, sooner than the push reaches its pause). The sync's pause then
            # applies its own mode to them (clear_cache=true preempts them) and its /resume lifts both.
            deadline = asyncio.get_running_loop().time() + 120
            while await running(client, url) < n:
                assert asyncio.get_running_loop().time() < deadline, "vLLM did not run the requests"
                await asyncio.sleep(0.005)
            await decoding(client, url, since, 4 * n, "the requests")
            await client._request("POST", url + "/pause?mode=keep&clear_cache=false")
            await sync.push(new_w, 9)
            return batch, await asyncio.gather(*longs)
        finally:
            await client._request("POST", pool.worker_urls[0] + "/resume")  # the module's other tests need it serving
            await sync.close()
            await client.close()

    batch, done = asyncio.run(run())
    assert [r.finish_reason for r in done] == ["length"] * n and all(len(r.output_ids) == LONG for r in done)
    crossed = [(p, r) for p, r in zip(batch, done) if r.weight_versions[0] == 8 and r.weight_versions[-1] == 9]
    assert crossed, [sorted(set(r.weight_versions)) for r in done]
    old_m, new_m = build_policy("tiny-hd32")[0], build_policy("tiny-hd32")[0]
    old_m.load_state_dict(old_w)
    new_m.load_state_dict(new_w)
    for prompt, r in crossed[:3]:
        v = r.weight_versions
        assert v == sorted(v)
        k = v.index(9)
        seq = torch.tensor([prompt + r.output_ids])
        p = len(prompt)
        with torch.no_grad():
            cut = p + k - 1  # the last old token is fed, under the new weights, at the first step after the swap
            cache = old_m(seq[:, :cut], use_cache=True).past_key_values
            after = torch.log_softmax(new_m(seq[:, cut: p - 1 + LONG], past_key_values=cache).logits[0].float(), -1)
        kept = [after[i, t].item() for i, t in enumerate(r.output_ids[k:])]
        recomputed = hf_logprobs(new_m, prompt, r.output_ids)[k:]
        want, other = (kept, recomputed) if kv == "keep" else (recomputed, kept)
        assert max(abs(a - b) for a, b in zip(r.output_log_probs[k:], want)) < 1e-3
        assert max(abs(a - b) for a, b in zip(r.output_log_probs[k:], other)) > 1e-2
        before = hf_logprobs(old_m, prompt, r.output_ids[:k])
        assert max(abs(a - b) for a, b in zip(r.output_log_probs[:k], before)) < 1e-3


def test_the_weight_check_refuses_a_server_holding_other_weights(engines):
    pool, _, model, _ = engines

    async def run():
        sync = VLLMWeightSync(pool.client(), model="tiny-hd32", timeout_s=120)
        try:
            await sync.push(perturbed(model, 8), 8)  # passes its own check
            sync._pushed = perturbed(model, 9)  # what the trainer believes it pushed, but did not
            with pytest.raises(WeightSyncError, match="does not hold the trainer's weights"):
                await sync.check_served("step 8")
        finally:
            sync._pushed = None
            await sync.close()

    asyncio.run(run())


def test_external_takes_vllm_servers_someone_else_runs(engines):
    """`rollout.backend: external` with `rollout.weight_sync: vllm`: the run's client and weight
    sync speak vLLM's API to servers it did not start (the pool's, here), through the registry."""
    from lightning_fasync.config import load_config, validate
    from lightning_fasync.registry import ENGINE_BACKENDS, WEIGHT_PATHS, EngineStart
    from lightning_fasync.weights.sync import resolve_weight_sync

    pool, _, model, _ = engines
    cfg = validate(load_config({"rollout": {"backend": "external", "weight_sync": "vllm",
                                            "engine_urls": pool.worker_urls}}))
    external = ENGINE_BACKENDS.get("external").start(EngineStart(
        cfg=cfg, engine_model=None, plan=None, prepared=None, context_length=512, log_dir=None, startup_timeout=60))
    weights = perturbed(model, 10)
    path = WEIGHT_PATHS.get(resolve_weight_sync(cfg))

    async def run():
        client = external.client()
        sync = path.make(external.client(), **path.options(cfg, "tiny-hd32"), timeout_s=120)
        try:
            await sync.push(weights, 10)
            return await client.generate(GenerateRequest(
                "ext", prompts(4)[0], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)))
        finally:
            await sync.close()
            await client.close()

    result = asyncio.run(run())
    external.stop()
    assert result.weight_versions == [10] * 8
    model.load_state_dict(weights)
    ref = hf_logprobs(model, prompts(4)[0], result.output_ids)
    assert max(abs(a - b) for a, b in zip(result.output_log_probs, ref)) < 1e-4

