"""Weight sync from shards: a policy sharded over 2 CPU processes (FSDP2, then tensor parallel)
pushes, bucket by bucket, exactly the weights a single-process trainer pushes: the engine's weight
checksums and greedy output are the same either way."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from lightning_fasync.pipeline.engine_client import GenerateRequest, SamplingParams
from lightning_fasync.policy import build_policy
from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.fleet.launch import free_port
from lightning_fasync.weights.checksum import checksums
from lightning_fasync.weights.sync import make_weight_sync

SEED = 11


def trained(seed: int = SEED) -> torch.nn.Module:
    """The tiny policy with weights moved far enough from the engine's to change its greedy output."""
    model, _ = build_policy("tiny")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


PROMPT = [5, 9, 17, 33, 2, 8]


def greedy(rid: str) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=PROMPT, sampling_params=SamplingParams(temperature=0.0, max_new_tokens=12,
                                                                                     ignore_eos=True))


async def observe(url: str, rid: str):
    """The engine's greedy output and its weight checksums."""
    client = SGLangClient([url])
    try:
        out = await client.generate(greedy(rid))
        (reported,) = await client.weight_checksums()
        return out.output_ids, out.weight_versions, reported
    finally:
        await client.close()


def _rank_main(rank: int, world: int, port: int, url: str, results, errors) -> None:
    """Both layouts in turn on the same 2 processes: FSDP2 (2, 1) pushes version 2, then tensor
    parallel (1, 2) version 3; rank 0 pushes each stream and reports what the engine then serves."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_fasync.weights.shard_gather import full_tensor_stream
    from lightning_fasync.trainers.fsdp.sharding import shard_policy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for version, layout, dims in ((2, "fsdp", (world, 1)), (3, "tp", (1, world))):
            mesh = init_device_mesh("cpu", dims, mesh_dim_names=("data_parallel", "tensor_parallel"))
            stream = full_tensor_stream(shard_policy(trained(), mesh))
            if rank == 0:
                sync = make_weight_sync("tensor", SGLangClient([url]), bucket_bytes=256 * 1024, timeout_s=120)

                async def push() -> None:
                    try:
                        await sync.push(stream, version, step=version - 1)
                    finally:
                        await sync.close()

                try:
                    asyncio.run(push())
                finally:
                    stream.drain()  # the other rank's gathers need this rank's part whatever happened
                results.put((layout, version, asyncio.run(observe(url, layout))))
            else:
                stream.drain()
            dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback

        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise SystemExit(1) from exc
    finally:
        dist.destroy_process_group()


def _push_from_shards(url: str) -> list:
    """Rank 0 pushes the streams, rank 1 drains its own: 2 spawned processes on gloo."""
    ctx = mp.get_context("spawn")
    errors, results = ctx.SimpleQueue(), ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, url, results, errors)) for r in range(2)]
    for p in procs:
        p.start()
    # Polled, not joined: rank 0's shared-memory buckets start torch's shm manager, which keeps a
    # copy of the process sentinel that join() waits on open after rank 0 has exited.
    deadline = time.monotonic() + 240
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not messages and all(p.exitcode == 0 for p in procs), "\n".join(messages) or [p.exitcode for p in procs]
    out = []
    while not results.empty():
        out.append(results.get())
    return out


@pytest.mark.slow
def test_weights_pushed_from_fsdp2_and_tensor_parallel_shards_are_the_single_process_ones():
    from lightning_fasync.fleet.pool import RolloutPool

    model = trained()
    single = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected = checksums(single)
    pool = RolloutPool("tiny", num_replicas=1, max_running_requests=4, context_length=256).start()
    try:
        url = pool.worker_urls[0]

        async def push_single(version: int) -> None:
            sync = make_weight_sync("tensor", SGLangClient([url]), bucket_bytes=256 * 1024, timeout_s=120)
            try:
                await sync.push(single, version, step=version - 1)
            finally:
                await sync.close()

        before, _, _ = asyncio.run(observe(url, "before"))
        asyncio.run(push_single(1))
        reference, versions, reported = asyncio.run(observe(url, "single"))
        assert reference != before and versions == [1] * 12  # the pushed weights are not the engine's own
        assert {k: expected[k] for k in reported} == reported
        seen = _push_from_shards(url)
        assert [(layout, version) for layout, version, _ in seen] == [("fsdp", 2), ("tp", 3)]
        for layout, version, (out, versions, reported) in seen:
            assert {k: expected[k] for k in reported} == reported, layout
            assert out == reference and versions == [version] * 12, layout
    finally:
        pool.stop()
