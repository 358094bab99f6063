"""SGLang's own weight-sync code on either side of ours. Run in a child process by
``tests/integration/test_sglang_weight_sync.py`` (it installs the Triton stand-ins of ``sglang_driver.py``).

- ``python tests/helpers/sglang_weight_driver.py send URL MODEL_DIR``: SGLang as the **trainer**, our engine at
  URL receiving. Every weight-update request with every field of SGLang's request class; payloads made by SGLang's ``FlattenedTensorBucket`` and ``MultiprocessingSerializer``
  go to ``/update_weights_from_tensor``; SGLang's ``init_custom_process_group`` creates rank 0 of
  a weight-update group that our engine joins through ``/init_weights_update_group``, then
  broadcasts buckets (and single tensors) for ``/update_weights_from_distributed``. Prints what
  the engine's ``/weights_checker`` reports against the checksums of what was sent.
- ``python tests/helpers/sglang_weight_driver.py serve``: SGLang as the **engine**, for our trainer side. A
  stand-in server whose weight endpoints are SGLang's receiving code: ``init_custom_process_group``
  (joining our rank 0), ``FlattenedTensorBucket.empty`` + broadcast (SGLang's
  ``_receive_bucketed_weights_from_distributed``), and ``MultiprocessingSerializer.deserialize``
  (SGLang's restricted unpickler) + ``FlattenedTensorBucket.reconstruct_tensors`` (SGLang's
  ``_update_weights_from_flattened_bucket``). Prints its URL, serves until killed;
  ``GET /received`` gives the checksums of what it loaded and the versions it was given.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from sglang_driver import dataclass_fields, install_sglang_triton_stubs, post  # noqa: E402

# SGLang's request classes of the weight-update endpoints (``srt/managers/io_struct.py``).
WEIGHT_REQUESTS = {
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}


def every_field(url: str, model_dir: str) -> dict[str, Any]:
    """Each weight-update request with every field of SGLang's class at its default (read from
    SGLang's source, BaseReq's fields included), the required ones given: what the engine answered.
    Sent outside a bracket, so the updates that need one are refused after their fields are read."""
    import importlib.util

    from sglang.srt.utils.common import MultiprocessingSerializer

    spec = importlib.util.find_spec("sglang")
    io_struct = os.path.join(os.path.dirname(spec.origin), "srt", "managers", "io_struct.py")
    base = dataclass_fields(io_struct, "BaseReq")
    required = {
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2,  # rank 0: refused
        "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[99, 96]], "model_path": model_dir,
        "serialized_named_tensors": [MultiprocessingSerializer.serialize([], output_str=True)],
        "group_name": "nope",
    }
    out = {}
    for path, cls in WEIGHT_REQUESTS.items():
        fields = {**base, **dataclass_fields(io_struct, cls)}
        body = {name: required.get(name, default) for name, default in fields.items()}
        out[path] = {"fields": sorted(body), "answer": post(url + path, body)}
    return out


def perturbed(seed: int) -> dict[str, Any]:
    import torch

    from lightning_fasync.policy import build_policy

    model, _ = build_policy("tiny")
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def engine_checksums(url: str) -> dict[str, str]:
    status, out = post(url + "/weights_checker", {"action": "checksum"})
    assert status == 200, out
    return out["ranks"][0]["checksums"]


def differences(expected: dict[str, str], reported: dict[str, str]) -> list[str]:
    from lightning_fasync.weights.checksum import compare

    return compare(expected, reported)


def send(url: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from sglang.srt.utils.common import MultiprocessingSerializer, init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from lightning_fasync.weights.checksum import checksums

    # CPU tensors reach another process as named shared-memory files only (see weight_wire).
    torch.multiprocessing.set_sharing_strategy("file_system")
    out: dict[str, Any] = {}
    out["fields"] = every_field(url, sys.argv[3])

    # update_weights_from_tensor: a flattened bucket, then the rest as (name, tensor) pairs.
    named = list(perturbed(1).items())
    half = len(named) // 2
    bucket = FlattenedTensorBucket(named_tensors=named[:half])
    flat = MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}, output_str=True)
    pairs = MultiprocessingSerializer.serialize(named[half:], output_str=True)
    out["begin"] = post(url + "/begin_weight_update", {})[0]
    out["tensor_bucket"] = post(url + "/update_weights_from_tensor", {
        "serialized_named_tensors": [flat], "load_format": "flattened_bucket", "weight_version": "5"})
    out["tensor_pairs"] = post(url + "/update_weights_from_tensor", {"serialized_named_tensors": [pairs], "weight_version": "5"})
    out["end"] = post(url + "/end_weight_update", {})[0]
    out["tensor_diffs"] = differences(checksums(dict(named)), engine_checksums(url))

    # update_weights_from_distributed: SGLang's group function as rank 0, our engine as rank 1.
    named = list(perturbed(2).items())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    replies: dict[str, Any] = {}

    def call(key: str, path: str, body: dict[str, Any]) -> threading.Thread:
        thread = threading.Thread(target=lambda: replies.__setitem__(key, post(url + path, body)))
        thread.start()
        return thread

    joining = call("init", "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                          "rank_offset": 1, "world_size": 2, "group_name": "sglang-side",
                                                          "backend": "gloo"})
    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0,
                                      group_name="sglang-side")
    joining.join()
    out["init"] = replies["init"]
    out["begin2"] = post(url + "/begin_weight_update", {})[0]
    bucket = FlattenedTensorBucket(named_tensors=named[:half])
    meta = bucket.get_metadata()
    thread = call("bucket", "/update_weights_from_distributed", {
        "names": [m.name for m in meta], "dtypes": [str(m.dtype).replace("torch.", "") for m in meta],
        "shapes": [list(m.shape) for m in meta], "group_name": "sglang-side", "load_format": "flattened_bucket",
        "weight_version": "6"})
    dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
    thread.join()
    rest = named[half:]
    thread = call("single", "/update_weights_from_distributed", {
        "names": [n for n, _ in rest], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in rest],
        "shapes": [list(t.shape) for _, t in rest], "group_name": "sglang-side", "weight_version": "6"})
    for _, tensor in rest:  # one broadcast per tensor, in order
        dist.broadcast(tensor.contiguous(), src=0, group=group)
    thread.join()
    out["bucket"], out["single"] = replies["bucket"], replies["single"]
    out["end2"] = post(url + "/end_weight_update", {})[0]
    out["destroy"] = post(url + "/destroy_weights_update_group", {"group_name": "sglang-side"})
    dist.destroy_process_group(group)
    out["distributed_diffs"] = differences(checksums(dict(named)), engine_checksums(url))
    out["weight_version"] = post(url + "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}})[1][
        "meta_info"]["weight_version"]
    return out


def serve() -> None:
    """The stand-in engine (module docstring); runs until killed."""
    import torch
    import torch.distributed as dist
    from aiohttp import web
    from sglang.srt.utils.common import MultiprocessingSerializer, init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from lightning_fasync.weights.checksum import tensor_checksum

    groups: dict[str, Any] = {}
    received: dict[str, str] = {}
    versions: list[Any] = []
    ok = {"success": True, "message": "Success"}

    async def blocking(fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def succeed(request: web.Request) -> web.Response:
        return web.json_response(ok)

    async def flush(request: web.Request) -> web.Response:
        return web.Response(text="Cache flushed.\n")

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.5.23", "tp_size": 1})

    async def init_group(request: web.Request) -> web.Response:
        b = await request.json()
        groups[b["group_name"]] = await blocking(lambda: init_custom_process_group(
            backend=b["backend"], init_method=f"tcp://{b['master_address']}:{b['master_port']}",
            world_size=b["world_size"], rank=b["rank_offset"], group_name=b["group_name"]))
        return web.json_response(ok)

    async def destroy_group(request: web.Request) -> web.Response:
        dist.destroy_process_group(groups.pop((await request.json())["group_name"]))
        return web.json_response(ok)

    def receive(b: dict[str, Any]) -> list[tuple[str, Any]]:
        group = groups[b["group_name"]]
        if b.get("load_format") == "flattened_bucket":  # SGLang's _receive_bucketed_weights_from_distributed
            bucket = FlattenedTensorBucket.empty(b["names"], b["dtypes"], b["shapes"], "cpu")
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            return bucket.reconstruct_tensors()
        out = []
        for name, dtype, shape in zip(b["names"], b["dtypes"], b["shapes"]):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0, group=group)
            out.append((name, tensor))
        return out

    def load(named: list[tuple[str, Any]], version: Any) -> web.Response:
        received.update((name, tensor_checksum(tensor)) for name, tensor in named)
        versions.append(version)
        return web.json_response(ok)

    async def from_distributed(request: web.Request) -> web.Response:
        b = await request.json()
        return load(await blocking(receive, b), b.get("weight_version"))

    async def from_tensor(request: web.Request) -> web.Response:
        b = await request.json()
        data = MultiprocessingSerializer.deserialize(b["serialized_named_tensors"][0])  # SGLang's SafeUnpickler
        if b.get("load_format") == "flattened_bucket":  # SGLang's _update_weights_from_flattened_bucket
            named = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]).reconstruct_tensors()
        else:
            named = list(data)
        return load(named, b.get("weight_version"))

    async def report(request: web.Request) -> web.Response:
        return web.json_response({"checksums": received, "versions": versions})

    app = web.Application(client_max_size=64 * 1024**2)
    for path in ("/pause_generation", "/continue_generation", "/begin_weight_update", "/end_weight_update"):
        app.router.add_post(path, succeed)
    app.router.add_post("/flush_cache", flush)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_post("/init_weights_update_group", init_group)
    app.router.add_post("/destroy_weights_update_group", destroy_group)
    app.router.add_post("/update_weights_from_distributed", from_distributed)
    app.router.add_post("/update_weights_from_tensor", from_tensor)
    app.router.add_get("/received", report)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(json.dumps({"url": f"http://127.0.0.1:{port}"}), flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    install_sglang_triton_stubs()
    if sys.argv[1] == "send":  # send URL MODEL_DIR (a safetensors directory the engine may load)
        print(json.dumps(send(sys.argv[2].rstrip("/")), default=str))
    else:
        serve()
