"""``rollout.weight_sync: adapter`` on a real vLLM server (vLLM's CPU build): the trainer's LoRA
adapter alone goes to vLLM's ``/v1/load_lora_adapter`` (in place, under one name), every rollout
request names it, and what the server then samples is the merged policy's: greedy tokens and
log-probs against transformers on the merged weights, a second push replacing the first (no KV of
the old adapter reused), the same log-probs as a merged push of the same weights through vLLM's RL
API, a restarted server given the kept adapter and checked, and `fit` training with it end to end."""

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from lightning_fasync.config import VLLMArgs
from lightning_fasync.fleet.vllm import VLLMClient, VLLMPlan, VLLMPool
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.pipeline.engine_client import EngineError, GenerateRequest, SamplingParams
from lightning_fasync.policy import build_policy
from lightning_fasync.weights.lora_sync import AdapterWeightSync
from lightning_fasync.weights.sync import WeightSyncError
from lightning_fasync.weights.vllm_sync import VLLMWeightSync
from tests.helpers.paths import REPO
from tests.helpers.vllm import vllm_python, write_tiny_hd32

pytestmark = pytest.mark.slow

LORA = {"r": 8, "alpha": 16.0}  # the default target modules: every attention and MLP projection
PROMPTS = [[1] + [(7 * i + 3 * j) % 90 + 5 for j in range(4 + i % 5)] for i in range(12)]


def test_fit_trains_with_the_adapter_path_on_vllm(tmp_path):
    """First in the module: no other vLLM server runs beside it (the fixture's starts after)."""
    steps = 4
    env = dict(os.environ, FASYNC_VLLM_PYTHON=vllm_python())
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config",
           os.path.join(REPO, "configs", "tiny_cpu_vllm.yaml"), f"--trainer.default_root_dir={tmp_path}",
           "--trainer.enable_progress_bar=false", f"--trainer.rollout_steps={steps}", "--trainer.save_freq=0",
           "--model.lora.r=8", "--model.lora.alpha=16", "--model.lora.sync=adapter", "--rollout.weight_sync=adapter",
           "--rollout.vllm_args.max_lora_rank=8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    from lightning_fasync.pipeline.events import read_jsonl

    run = os.path.join(tmp_path, "lightning_logs", "version_0")
    consumed = [r for r in read_jsonl(os.path.join(run, "ledger.jsonl")) if r["kind"] == "consume"]
    assert len({r["prompt"] for r in consumed}) == len(consumed) == steps * 16
    log = open(os.path.join(run, "vllm", "replica-0.log"), errors="replace").read()
    loads = log.count('"POST /v1/load_lora_adapter HTTP/1.1" 200')
    assert loads == steps + 1, loads  # the first sync and one per step, each under its version's name
    assert log.count('"POST /v1/unload_lora_adapter HTTP/1.1" 200') == steps  # the previous one each time
    assert '"POST /update_weights HTTP/1.1"' not in log  # the base never moved


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-lora")
    model_dir = write_tiny_hd32(str(root / "model"))
    pool = VLLMPool(VLLMPlan(vllm_python(), model_dir, None, None), VLLMArgs(max_num_seqs=32, max_lora_rank=8),
                    cpu_cores=[[1]], context_length=256, log_dir=str(root), startup_timeout=600, lora=True)
    try:
        yield pool.start()
    finally:
        pool.stop()


def trained(seed, sync="adapter", r=8):
    """A ``tiny-hd32`` policy with LoRA adapters set from ``seed`` (peft initialises B to zeros)."""
    module = RLPolicyModule("tiny-hd32", lora={**LORA, "r": r, "sync": sync})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if "lora_B" in name else 0.2))
    return module


def greedy(client, tag):
    async def run():
        try:
            return await asyncio.gather(*(client.generate(GenerateRequest(
                f"{tag}-{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)))
                for i, p in enumerate(PROMPTS)))
        finally:
            await client.close()

    return asyncio.run(run())


def hf_check(merged, results, tol=1e-4):
    """Greedy tokens and log-probs of ``results`` against transformers holding the ``merged`` weights."""
    model = build_policy("tiny-hd32")[0]
    model.load_state_dict(merged)
    for prompt, r in zip(PROMPTS, results):
        ids = torch.tensor([prompt + r.output_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        want = [logp[len(prompt) - 1 + i].argmax().item() for i in range(len(r.output_ids))]
        assert r.output_ids == want, (r.rid, r.output_ids, want)
        ref = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(r.output_ids)]
        assert max(abs(a - b) for a, b in zip(r.output_log_probs, ref)) < tol, r.rid


def push(pool, weights, version, cls=AdapterWeightSync, **kwargs):
    async def run():
        sync = cls(pool.client(), timeout_s=120, **kwargs)
        try:
            return await sync.push(weights, version)
        finally:
            await sync.close()

    return asyncio.run(run())


def test_the_adapter_push_serves_the_merged_policy_and_a_second_push_replaces_it(pool):
    assert pool.client().lora_name is None  # no adapter before the first push
    first, second = trained(1), trained(2)
    push(pool, first.engine_state_dict(), 3, keep=True)
    assert pool.client().lora_name == "policy-v3"  # every client of the pool names it now
    served = greedy(pool.client(), "a")
    assert {v for r in served for v in r.weight_versions} == {3}
    merged_first = trained(1, sync="merged").engine_state_dict()
    hf_check(merged_first, served)

    # The same prompts again after a second adapter: the new adapter's tokens, nothing of the
    # first's prefix cache (another adapter id; the push resets the cache too).
    push(pool, second.engine_state_dict(), 4)
    again = greedy(pool.client(), "b")
    assert {v for r in again for v in r.weight_versions} == {4}
    hf_check(trained(2, sync="merged").engine_state_dict(), again)
    assert [r.output_ids for r in again] != [r.output_ids for r in served]

    # The merged push of the first adapter's weights through vLLM's RL API serves what its adapter
    # push served (requests that name no adapter read the base, which now holds the merged weights).
    push(pool, merged_first, 5, cls=VLLMWeightSync, model="tiny-hd32")
    base = greedy(VLLMClient(pool.worker_urls), "c")  # a client of its own, naming no adapter
    assert [r.output_ids for r in base] == [r.output_ids for r in served]
    worst = max(abs(a - b) for r, s in zip(base, served) for a, b in zip(r.output_log_probs, s.output_log_probs))
    assert worst < 1e-4
    push(pool, build_policy("tiny-hd32")[0].state_dict(), 6, cls=VLLMWeightSync, model="tiny-hd32")  # the base back


def test_an_adapter_above_the_servers_rank_is_refused_naming_the_key(pool):
    with pytest.raises(WeightSyncError, match=r"rank 16 .*`rollout\.vllm_args\.max_lora_rank` to at least 16"):
        push(pool, trained(3, r=16).engine_state_dict(), 7)


def test_a_restarted_server_gets_the_kept_adapter_and_is_checked(pool):
    module = trained(4)
    kept = push(pool, module.engine_state_dict(), 8, keep=True)
    assert kept is not None and kept.kind == "adapter"
    pool.keep_weights(kept)
    url = pool.worker_urls[0]
    # The join is what a restart runs (on a server that holds no adapter, as a restarted one):
    # the kept adapter loaded under its version's name, then its probe checked.
    forget(url, "policy-v8")
    assert asyncio.run(pool._join(url)) == 8
    hf_check(trained(4, sync="merged").engine_state_dict(), greedy(pool.client(), "d"))
    # A kept adapter the server does not serve is caught: the probe of other weights.
    forget(url, "policy-v8")
    kept.base = {k: v + 0.05 for k, v in kept.base.items()}
    with pytest.raises(EngineError, match="does not serve the trainer's adapter"):
        asyncio.run(pool._join(url))


def forget(url, name):
    """Unload ``name`` from the server at ``url`` (vLLM's ``/v1/unload_lora_adapter``)."""
    async def run():
        client = VLLMClient([url])
        try:
            await client._request("POST", url + "/v1/unload_lora_adapter", {"lora_name": name}, timeout=30)
        finally:
            await client.close()

    asyncio.run(run())
