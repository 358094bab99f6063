"""Weight sync, both sides: the trainer's three paths (``lightning_fasync/weights/sync.py``) against real
engine processes (one replica, and two behind the real sglang-router), the engine's endpoints
(``lightning_fasync/engine/weight_endpoints.py``) and the wire format (``lightning_fasync/weights/wire.py``). Compatibility with
SGLang's own code is in ``tests/integration/test_sglang_weight_sync.py``."""

from __future__ import annotations

import asyncio
import copy
import os
import pickle
import time

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer

from lightning_fasync.config import ConfigError, FasyncConfig, validate
from lightning_fasync.pipeline.engine_client import GenerateRequest, SamplingParams
from lightning_fasync.policy import build_policy
from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.engine.engine import Engine
from lightning_fasync.fleet.launch import launch_server
from lightning_fasync.engine.server import build_app
from lightning_fasync.weights.tensor_stream import TensorStream
from lightning_fasync.weights.checksum import checksums
from lightning_fasync.weights.group import DistributedWeightSync
from lightning_fasync.weights.sync import (
    TensorWeightSync, WeightSyncError, make_weight_sync, resolve_weight_sync, unique_tensors,
)
from lightning_fasync.weights.wire import (
    FlattenedTensorMetadata, UnsafePayload, deserialize, flatten_into, layout, plan_buckets, serialize, serialize_bucket,
    unflatten,
)
from tests.helpers.weights import Tracked


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights moved enough to change its greedy output: what a trainer pushes."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def hf_greedy(model, state: dict[str, torch.Tensor], prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by the HF forward of ``model`` holding ``state`` (the reference)."""
    ref = copy.deepcopy(model)
    ref.load_state_dict(state)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def greedy(rid: str, prompt: list[int], n: int = 12) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=prompt, sampling_params=SamplingParams(temperature=0.0, max_new_tokens=n,
                                                                                     ignore_eos=True))


# ----------------------------------------------------------------------------- wire format and config


def test_buckets_keep_sglangs_layout_their_size_and_alignment():
    named = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(4), "big": torch.randn(64)}
    buckets = plan_buckets(named, max_bytes=100)
    # a (60 B) + b (14 B) fit; c (float32) would start at byte 74, not a multiple of 4: a new
    # bucket (SGLang's receiver refuses an unaligned tensor); big (256 B) goes alone.
    assert [[n for n, _ in b] for b in buckets] == [["a", "b"], ["c"], ["big"]]
    for bucket in buckets:
        flat = torch.empty(sum(t.numel() * t.element_size() for _, t in bucket), dtype=torch.uint8)
        metadata = flatten_into(bucket, flat)
        assert metadata[0].start_idx == 0 and all(m.end_idx == n.start_idx for m, n in zip(metadata, metadata[1:]))
        assert all(torch.equal(t, named[n]) and t.dtype == named[n].dtype for n, t in unflatten(flat, metadata))
    with pytest.raises(ValueError, match="Unaligned received tensor y"):
        layout(["x", "y"], [torch.bfloat16, torch.float32], [[3], [1]])
    with pytest.raises(ValueError, match=r"bytes \[0, 12\) of a 8-byte bucket"):
        unflatten(torch.zeros(8, dtype=torch.uint8), layout(["x"], [torch.float32], [[3]]))
    with pytest.raises(ValueError, match="do not hold"):  # 8 bytes cannot hold three float32
        unflatten(torch.zeros(16, dtype=torch.uint8), [FlattenedTensorMetadata("x", torch.Size([3]), torch.float32, 0, 8, 8)])
    emb = torch.randn(5, 3)  # a tied tensor is sent once, under its first name
    assert list(unique_tensors({"model.embed_tokens.weight": emb, "x": torch.ones(2), "lm_head.weight": emb})) == [
        "model.embed_tokens.weight", "x"]


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_the_unpickler_admits_tensor_payloads_and_refuses_any_other_global():
    ((name, tensor),) = deserialize(serialize([("w", torch.arange(6.0).view(2, 3))]), "f")
    assert name == "w" and torch.equal(tensor, torch.arange(6.0).view(2, 3))
    for bad, needle in ((pickle.dumps(_Exploit()), r"(posix|os)\.system"), (pickle.dumps(print), "builtins.print")):
        with pytest.raises(UnsafePayload, match=f"`serialized_named_tensors` was refused: the payload asks for {needle}"):
            deserialize(bad, "serialized_named_tensors")
    # torch's default CPU sharing (file descriptors) cannot reach an unrelated process: said so.
    from multiprocessing.reduction import ForkingPickler

    with pytest.raises(UnsafePayload, match="file_system"):
        deserialize(bytes(ForkingPickler.dumps([("w", torch.ones(2))])), "serialized_named_tensors")
    with pytest.raises(UnsafePayload, match="not valid base64"):
        deserialize("%%%", "serialized_named_tensors")
    # SGLang's per-TP-rank wrapper (``LocalSerializedTensor``, pickled under SGLang's class name).
    import io

    from lightning_fasync.weights import wire as weight_wire
    from lightning_fasync.engine.weight_endpoints import _named_tensors

    class SGLangNames(weight_wire._Pickler):
        _ALIASES = {**weight_wire._Pickler._ALIASES,
                    weight_wire.LocalSerializedTensor: weight_wire.SGLANG_LOCAL_TENSOR_CLASSES[0]}

    buf = io.BytesIO()
    SGLangNames(buf).dump([("w", weight_wire.LocalSerializedTensor([serialize(torch.ones(3))]))])
    assert b"sglang.srt.model_executor.model_runner" in buf.getvalue()
    named = _named_tensors(deserialize(buf.getvalue(), "serialized_named_tensors"), None)
    assert list(named) == ["w"] and torch.equal(named["w"], torch.ones(3))


def test_weight_sync_config_auto_override_and_refusals():
    from lightning_fasync.lightning.strategy import FullyAsyncStrategy

    cfg = FasyncConfig()
    assert cfg.rollout.weight_sync == "auto" and cfg.rollout.weight_sync_bucket_mb == 512
    assert resolve_weight_sync(cfg) == "tensor"  # the embedded engines run on this host
    cfg.rollout.backend = "external"
    assert resolve_weight_sync(cfg) == "distributed"
    assert resolve_weight_sync(cfg, "disk") == "disk"  # FullyAsyncStrategy(weight_sync=...) wins
    cfg.rollout.backend = "embedded"
    for key, value, needle in (("weight_sync", "nccl", "`rollout.weight_sync` is 'nccl'; it must be one of auto, "),
                               ("weight_sync_bucket_mb", 0, "`rollout.weight_sync_bucket_mb` is 0; it must be a positive")):
        bad = copy.deepcopy(cfg)
        setattr(bad.rollout, key, value)
        with pytest.raises(ConfigError, match=needle):
            validate(bad)
    with pytest.raises(ConfigError, match="`weight_sync` is 'shm'"):
        FullyAsyncStrategy(device="cpu", weight_sync="shm")


def test_an_update_rebuilds_only_the_layers_it_touches(policy):
    model, _ = policy
    engine = Engine(copy.deepcopy(model), max_running_requests=1, context_length=32)
    try:
        runner = engine.runner
        before = [f[0].clone() for f in runner._fused]
        name = "model.layers.1.self_attn.q_proj.weight"
        engine.update_weights({name: torch.randn_like(dict(model.named_parameters())[name])})
        assert torch.equal(runner._fused[0][0], before[0]) and not torch.equal(runner._fused[1][0], before[1])
        partial = [tuple(x.clone() if x is not None else None for x in f) for f in runner._fused]
        runner.refresh_weights()  # everything from the parameters: the same matrices
        assert all(torch.equal(a, b) for p, f in zip(partial, runner._fused) for a, b in zip(p, f) if a is not None)
    finally:
        engine.stop()


# ----------------------------------------------------------------------------- engine endpoints


def test_the_engine_refuses_bad_updates_with_400_naming_the_field_and_keeps_serving(policy):
    model, tok = policy
    engine = Engine(copy.deepcopy(model), max_running_requests=2, context_length=300)
    head = model.lm_head.weight.detach()

    def tensor(**extra):  # an update_weights_from_tensor body (a new payload each time: each is read once)
        return {"serialized_named_tensors": [serialize([("lm_head.weight", head)])], **extra}

    def init(**extra):
        return {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, **extra}

    def distributed(**extra):
        return {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[99, 96]], **extra}

    async def post(s, url, body):
        async with s.post(url, json=body) as r:
            return r.status, await r.json()

    async def body(s, url):
        # SGLang 0.5.23: tensor and distributed updates only between begin and end_weight_update.
        for path, request in (("/update_weights_from_tensor", tensor()), ("/update_weights_from_distributed", distributed())):
            status, out = await post(s, url + path, request)
            assert status == 400 and out["success"] is False and "begin_weight_update" in out["message"]
        assert (await post(s, url + "/begin_weight_update", {}))[1]["success"]
        bad_fields = (
            ("/update_weights_from_tensor", {"serialized_named_tensors": [serialize(_Exploit())]},
             "`serialized_named_tensors` was refused"),
            ("/update_weights_from_tensor", tensor(load_format="auto"), "`load_format`"),
            ("/update_weights_from_tensor", tensor(load_format="flattened_bucket"), "flattened_bucket must hold"),
            ("/update_weights_from_distributed", distributed(dtypes=["float33"]), "`dtypes`"),
            ("/update_weights_from_distributed", distributed(names=["a", "b"]), "`names`, `dtypes` and `shapes`"),
            ("/update_weights_from_distributed", distributed(shapes=[[-1]]), "`shapes`"),
            ("/init_weights_update_group", init(rank_offset=0), "`rank_offset`"),
            ("/init_weights_update_group", init(backend="mpi"), "`backend`"),
        )
        for path, request, needle in bad_fields:
            status, out = await post(s, url + path, request)
            assert status == 400 and needle in out["error"]["message"], (path, out)
        # Loads that fail: success false with the reason; nothing is half-loaded.
        bucket = [("lm_head.weight", -head), ("nope.weight", torch.zeros(2))]
        flat = torch.empty(sum(t.numel() * 4 for _, t in bucket), dtype=torch.uint8)
        status, out = await post(s, url + "/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize_bucket(flat, flatten_into(bucket, flat))], "load_format": "flattened_bucket"})
        assert status == 400 and out["success"] is False and "Unknown parameter name" in out["message"]
        assert torch.equal(engine.model.lm_head.weight, head)
        failed_loads = (
            ("/update_weights_from_distributed", distributed(group_name="g"), "init_weights_update_group"),
            ("/init_weights_update_group", init(backend="nccl"), "nccl needs CUDA"),
            ("/destroy_weights_update_group", {"group_name": "g"}, "does not exist"),
        )
        for path, request, needle in failed_loads:
            status, out = await post(s, url + path, request)
            assert status == 400 and out["success"] is False and needle in out["message"], (path, out)
        # SGLang's flush rule: paused in place, a request still holds the cache, the update reports it.
        gen = asyncio.ensure_future(post(s, url + "/generate", {"input_ids": [5, 6], "sampling_params": {
            "max_new_tokens": 250, "temperature": 0, "ignore_eos": True}}))
        while engine.loads()["num_running_reqs"] == 0:
            await asyncio.sleep(0.01)
        await post(s, url + "/pause_generation", {"mode": "in_place"})
        status, out = await post(s, url + "/update_weights_from_tensor", tensor())
        assert status == 400 and "cache was not flushed" in out["message"]
        status, out = await post(s, url + "/update_weights_from_tensor", tensor(flush_cache=False, weight_version="3"))
        assert status == 200 and out["success"], out
        await post(s, url + "/continue_generation", {})
        assert (await post(s, url + "/end_weight_update", {}))[1]["success"]
        status, out = await gen
        assert status == 200 and out["meta_info"]["completion_tokens"] == 250

    async def main():
        server = TestServer(build_app(engine, tok, "tiny"), host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as s:
                await body(s, str(server.make_url("")).rstrip("/"))
        finally:
            await server.close()

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        engine.stop()


# ----------------------------------------------------------------------------- the paths, end to end


@pytest.fixture(scope="module")
def pool():
    """Two replicas behind the router, supervised (``rollout.engine_restart``); ``pool.events``
    collects the supervisor's events."""
    from lightning_fasync.fleet.pool import RolloutPool

    p = RolloutPool("tiny", num_replicas=2, max_running_requests=4, context_length=512).start()
    p.events = []
    p.supervise(max_attempts=2, backoff_s=0.1, timeout_s=120, poll_s=0.2, emit=lambda event, **f: p.events.append(event))
    yield p
    p.stop()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["distributed", "distributed-flattened", "tensor", "tensor-flattened", "tensor-stream",
                                  "disk"])
def test_each_path_serves_the_new_weights_behind_the_router_and_on_one_replica(pool, policy, kind, tmp_path):
    """Each path and wire format: ``distributed`` broadcasts each tensor (the engine receives into
    its parameters) or flattened buckets; ``tensor`` sends handles to the trainer's own tensors
    (moved to shared memory in place) or flattened buckets in staging memory, also taken from a
    ``TensorStream`` (a sharded trainer's; ``tests/weights/test_tensor_stream.py``)."""
    kind, _, variant = kind.partition("-")
    options = {"flatten": True} if variant and kind == "distributed" else (
        {"zero_copy": False} if variant == "flattened" else {})
    streamed = TensorStream.from_mapping if variant == "stream" else (lambda tensors: tensors)
    model, tok = policy
    prompt = tok("weights", add_special_tokens=False)["input_ids"]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = perturbed(model, seed=7)
    ref_new, ref_original = hf_greedy(model, new, prompt, 12), hf_greedy(model, original, prompt, 12)
    assert ref_new != ref_original

    async def main():
        both = pool.client()  # generate through the router; updates to each replica
        one = SGLangClient([pool.worker_urls[0]])  # a single replica on its own
        # Small buckets: several per push, so the bucket boundaries are exercised too.
        sync = make_weight_sync(kind, both, bucket_bytes=256 * 1024, timeout_s=120, work_dir=str(tmp_path), **options)
        solo = make_weight_sync(kind, one, bucket_bytes=256 * 1024, timeout_s=120, work_dir=str(tmp_path), **options)
        try:
            await sync.push(streamed(new), 7, step=6)
            # The zero-copy tensor path sent the tensors themselves: they now live in shared memory.
            assert all(t.is_shared() for t in new.values()) == (kind == "tensor" and not variant)
            for i in range(2):  # round robin: one request per replica
                res = await both.generate(greedy(f"{kind}-new-{i}", prompt))
                assert res.output_ids == ref_new and res.weight_versions == [7] * 12
            assert [i["weight_version"] for i in await both.model_info()] == ["7", "7"]
            expected = checksums(new)
            for reported in await both.weight_checksums():
                assert {k: expected[k] for k in reported} == reported
            await solo.push(streamed(original), 8, step=7)
            res = await one.generate(greedy(f"{kind}-solo", prompt))
            assert res.output_ids == ref_original and res.weight_versions == [8] * 12
            assert [i["weight_version"] for i in await both.model_info()] == ["8", "7"]
            await sync.push(original, 0, step=8)  # as the module found them
        finally:
            await sync.close()
            await solo.close()
            await one.close()
        assert os.listdir(tmp_path) == [], "a pushed directory was left behind"

    asyncio.run(asyncio.wait_for(main(), 300))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tensor", "disk", "distributed"])
def test_a_stream_loads_what_the_mapping_loads_one_bucket_and_one_tensor_at_a_time(pool, policy, kind, tmp_path):
    """A ``TensorStream`` (a sharded trainer's tensors, gathered one at a time) on each path, to one
    replica: the same greedy output, per-token versions and checksums as the mapping; at most one
    bucket and one tensor of it held; a stream failing mid-push fails the push, the next succeeds."""
    bucket = 128 * 1024  # the tiny policy (~1.2 MiB): about ten buckets
    model, tok = policy
    prompt = tok("stream", add_special_tokens=False)["input_ids"]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    new = perturbed(model, seed=13)

    async def main():
        client = SGLangClient([pool.worker_urls[0]])
        sync = make_weight_sync(kind, client, bucket_bytes=bucket, timeout_s=60, work_dir=str(tmp_path))

        async def served(rid):
            res = await client.generate(greedy(rid, prompt))
            return res.output_ids, res.weight_versions, (await client.weight_checksums())[0]

        try:
            await sync.push(new, 7, step=6)
            as_mapping = await served(f"{kind}-mapping")
            await sync.push(original, 0, step=7)
            at_start = await served(f"{kind}-original")
            assert at_start[0] != as_mapping[0]  # the next push has something to change
            tracked = Tracked(new)
            await sync.push(tracked.stream, 7, step=8)
            assert await served(f"{kind}-stream") == as_mapping  # output, per-token versions, checksums
            assert tracked.stream.consumed == len(new)
            # Peak: one bucket and one tensor. The flattening paths drop each tensor once it is in
            # the bucket; disk holds a shard's tensors (one bucket) until the shard is written.
            if kind == "disk":
                assert max(nbytes for _, nbytes in tracked.held) < bucket and tracked.held[0] == (0, 0)
            else:
                assert tracked.held == [(0, 0)] * len(new)
            # Failing mid-push: the push fails naming the tensor and leaves the rest of the stream to
            # the caller (who drains it, so the ranks' collectives match); the next push succeeds.
            failing = Tracked(original, fail_at=len(original) // 2)
            name = failing.items[failing.fail_at][0]
            with pytest.raises(WeightSyncError, match=f"step 9 failed taking {name}"):
                await sync.push(failing.stream, 0, step=9)
            assert failing.stream.consumed == failing.fail_at + 1
            failing.stream.drain()
            await sync.push(Tracked(original).stream, 0, step=10)  # as the module found them
            assert await served(f"{kind}-restored") == at_start
        finally:
            await sync.close()
            await client.close()
        assert os.listdir(tmp_path) == [], "a pushed directory was left behind"

    asyncio.run(asyncio.wait_for(main(), 240))


@pytest.mark.slow
def test_a_request_in_flight_across_the_update_continues_under_the_new_weights(pool, policy):
    """A partial rollout across the update: paused by ``retract``, the request is prefilled again
    under the new weights after the push and goes on; its per-token versions show the switch."""
    model, tok = policy
    prompt = tok("partial", add_special_tokens=False)["input_ids"]
    new = perturbed(model, seed=11)
    url = pool.worker_urls[1]

    async def main():
        client = SGLangClient([url])
        sync = TensorWeightSync(client, pause_mode="retract", timeout_s=120)
        try:
            task = asyncio.ensure_future(client.generate(greedy("across", prompt, 300)))
            while True:  # until the request has tokens of the old weights
                (load,) = (await client.loads())[0]["loads"]
                if load["num_used_tokens"] > len(prompt) + 3:
                    break
                assert not task.done(), "the request finished before the update"
                await asyncio.sleep(0.01)
            await sync.push(new, 9, step=8)
            res = await task
            await sync.push({k: v.clone() for k, v in model.state_dict().items()}, 0)
            return res
        finally:
            await sync.close()

    res = asyncio.run(asyncio.wait_for(main(), 300))
    k = res.weight_versions.index(9)
    assert 3 <= k < 300 and res.weight_versions == [0] * k + [9] * (300 - k)
    # After the switch: the new weights' greedy continuation of prompt + the tokens so far.
    assert res.output_ids[k:k + 4] == hf_greedy(model, new, prompt + res.output_ids[:k], 4)


class _KillAfterFirstBucket(DistributedWeightSync):
    victim = None

    async def _collect(self, calls, work, where, what):
        skipped = await super()._collect(calls, work, where, what)
        if what.startswith("bucket 1 ") and self.victim is not None:
            self.victim.kill_tree()
        return skipped


@pytest.mark.slow
def test_an_engine_killed_during_a_distributed_update_gives_an_error_naming_it_not_a_hang(pool, policy):
    model, _ = policy
    victim = launch_server("tiny", max_running_requests=2, context_length=64)
    try:
        async def main():
            # The group: one replica of the pool and the victim, killed after the first bucket.
            client = SGLangClient([pool.worker_urls[0], victim.url], retries=0, admin_timeout_s=60)
            sync = _KillAfterFirstBucket(client, bucket_bytes=128 * 1024, timeout_s=60)
            sync.victim = victim
            t0 = time.monotonic()
            try:
                with pytest.raises(WeightSyncError) as err:
                    await sync.push(perturbed(model, seed=3), 5, step=4)
                return str(err.value), time.monotonic() - t0
            finally:
                await sync.close()
                # The replica that stayed may hold part of the update (and is paused): as the module found it.
                restore = SGLangClient([pool.worker_urls[0]])
                try:
                    await make_weight_sync("tensor", restore).push({k: v.clone() for k, v in model.state_dict().items()}, 0)
                finally:
                    await restore.close()

        message, took = asyncio.run(asyncio.wait_for(main(), 120))
        assert "step 4" in message and victim.url in message, message
        assert took < 60, "the error came from the timeout, not from the lost engine"
    finally:
        victim.stop()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["mapping", "stream"])
def test_a_replica_lost_mid_push_is_skipped_and_restarts_with_the_pushed_weights(pool, policy, source):
    """With the supervisor (``rollout.engine_restart``), a replica killed during a ``distributed``
    push leaves the serving set: the group is formed again with the other and the push completes
    (a mapping from its first bucket; a ``TensorStream``, which cannot be taken twice, from the
    bucket that was being broadcast); the restarted replica gets the kept weights and its checksums
    match them."""
    model, _ = policy
    new = perturbed(model, seed=5)
    restarts = pool.events.count("engine_restarted")

    async def push(tensors, version, victim=None):
        client = pool.client(admin_timeout_s=60)
        sync = _KillAfterFirstBucket(client, bucket_bytes=128 * 1024, timeout_s=60, keep=True)
        sync.victim = victim
        try:
            kept = await sync.push(tensors, version, step=version - 1)
            return kept, sync.members, [group for group, _ in sync._leaked]
        finally:
            await sync.close()

    with pool.sync_lock:  # as the runtime: a replica restarting meanwhile joins after this version
        pushed = TensorStream.from_mapping(new) if source == "stream" else new
        kept, members, left = asyncio.run(asyncio.wait_for(push(pushed, 4, victim=pool.servers[1]), 120))
        pool.keep_weights(kept)
    assert members == [pool.worker_urls[0]]  # formed again without the lost one
    # The broken group is kept as it is, out of torch.distributed's registry (tests/weights/test_group.py).
    from torch.distributed import distributed_c10d as c10d

    assert left and not any(group in c10d._world.pg_map for group in left)
    deadline = time.monotonic() + 120
    while pool.events.count("engine_restarted") == restarts or len(pool.workers.urls) < 2:
        assert time.monotonic() < deadline, pool.events
        time.sleep(0.1)

    async def report():
        client = pool.client()
        try:
            return await client.weight_checksums(), [i["weight_version"] for i in await client.model_info()]
        finally:
            await client.close()

    reported, versions = asyncio.run(report())
    expected = checksums(new)
    assert len(reported) == 2 and all({k: expected[k] for k in r} == r for r in reported)
    assert versions == ["4", "4"]
    with pool.sync_lock:  # as the module found them
        original, _, _ = asyncio.run(push({k: v.clone() for k, v in model.state_dict().items()}, 0))
        pool.keep_weights(original)
