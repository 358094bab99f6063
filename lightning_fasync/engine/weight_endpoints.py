"""The embedded engine's side of SGLang's weight-update protocols (SGLang 0.5.23,
``srt/entrypoints/http_server.py``, request fields from ``srt/managers/io_struct.py``):

- ``POST /init_weights_update_group`` and ``/destroy_weights_update_group``: join (leave) the
  trainer's weight-update group, at rank ``rank_offset`` (the engine has one TP rank), created the
  way SGLang's ``init_custom_process_group`` creates it (:mod:`~lightning_fasync.weights.wire`);
  gloo on CPU, NCCL on CUDA.
- ``POST /update_weights_from_distributed``: receive rank 0's broadcasts, one per tensor in order
  or one ``uint8`` flattened bucket (``load_format="flattened_bucket"``), and load them.
- ``POST /update_weights_from_tensor``: ``serialized_named_tensors`` (one payload per TP rank; this
  engine reads index 0) in SGLang's serialised format, a list of ``(name, tensor)`` or, with
  ``load_format="flattened_bucket"``, ``{"flattened_tensor", "metadata"}``; deserialised through
  the restricted unpickler.

As in SGLang 0.5.23, the tensor and distributed updates run only between ``/begin_weight_update``
and ``/end_weight_update`` (outside: ``success: false``, and a distributed update then receives
nothing); the weight version is set with each successful update; with ``flush_cache`` on a paused
engine whose requests still hold the cache (``in_place`` pause) the update fails after loading,
with SGLang's message. A malformed request is a 400 naming the field; a load that fails (unknown
name, shape mismatch, a broken group) answers ``{"success": false, "message"}`` with 400 and the
server goes on serving.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
from typing import Any, Optional

from aiohttp import web

from lightning_fasync.engine import protocol
from lightning_fasync.weights import wire as weight_wire
from lightning_fasync.engine.protocol import BadRequest
from lightning_fasync.engine.http_common import ENGINE_KEY, STATE_KEY, apply_update, blocking, json_body, outside_session

GROUP_TIMEOUT_S = 1800.0  # SGLang's default_pg_timeout: how long a receive or the rendezvous may wait
_COMMON = {"rid", "http_worker_ipc"}  # SGLang's BaseReq fields
_LOAD_FORMATS = (None, "direct", "flattened_bucket")


def _groups(request: web.Request) -> dict[str, Any]:
    return request.app[STATE_KEY].setdefault("weight_groups", {})


def _result(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


def _update_options(body: dict[str, Any]) -> tuple[str, bool, bool, Optional[str]]:
    """The fields every tensor and distributed update shares: ``selector``, ``flush_cache``,
    ``abort_all_requests``, ``weight_version`` (and ``torch_empty_cache``, checked, nothing to empty)."""
    selector = _selector(body)
    flush = protocol.opt(body, "flush_cache", bool, True)
    protocol.opt(body, "torch_empty_cache", bool, False)
    abort = protocol.opt(body, "abort_all_requests", bool, False)
    return selector, flush, abort, protocol.opt(body, "weight_version", str, None)


def _selector(body: dict[str, Any]) -> str:
    selector = protocol.opt(body, "selector", str, "all")
    if selector not in ("target", "draft", "all"):
        raise BadRequest(f"`selector` must be 'target', 'draft' or 'all', got {selector!r}.")
    return selector


def _load_format(body: dict[str, Any]) -> Optional[str]:
    load_format = protocol.opt(body, "load_format", str, None)
    if load_format not in _LOAD_FORMATS:
        raise BadRequest(f"`load_format` {load_format!r} is not supported; use null, 'direct' or 'flattened_bucket'.")
    return load_format


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend",
                                 *_COMMON}, "init_weights_update_group")
    address = protocol.req(body, "master_address", str)
    port = protocol.req(body, "master_port", int)
    rank_offset = protocol.req(body, "rank_offset", int)
    world_size = protocol.req(body, "world_size", int)
    group_name = protocol.opt(body, "group_name", str, "weight_update_group")
    backend = protocol.opt(body, "backend", str, "nccl")
    if not 0 < port < 65536:
        raise BadRequest(f"`master_port` must be a port number, got {port}.")
    if not 0 < rank_offset < world_size:
        raise BadRequest(f"`rank_offset` must be in [1, world_size) (rank 0 is the trainer), got {rank_offset} "
                         f"of {world_size}.")
    if not group_name:
        raise BadRequest("`group_name` must not be empty.")
    if backend not in ("gloo", "nccl"):
        raise BadRequest(f"`backend` must be 'gloo' or 'nccl', got {backend!r}.")
    device = request.app[ENGINE_KEY].runner.device
    if backend == "nccl" and device.type != "cuda":
        return _result(False, "Failed to initialize custom process group: backend nccl needs CUDA, the engine runs "
                              f"on {device}.")
    groups = _groups(request)
    if group_name in groups:
        return _result(False, f"Failed to initialize custom process group: group {group_name!r} already exists.")
    groups[group_name] = None  # reserved while the rendezvous runs
    try:
        pg = await weight_wire.in_daemon_thread(lambda: weight_wire.init_custom_process_group(
            backend, f"tcp://{_host(address)}:{port}", world_size, rank_offset, group_name,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S)))
    except Exception as exc:  # noqa: BLE001 - reported to the caller, as SGLang does
        groups.pop(group_name, None)
        return _result(False, f"Failed to initialize custom process group: {exc}.")
    groups[group_name] = {"pg": pg, "lock": threading.Lock(), "device": device}
    return _result(True, "Succeeded to initialize custom process group.")


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"group_name", *_COMMON}, "destroy_weights_update_group")
    group_name = protocol.opt(body, "group_name", str, "weight_update_group")
    group = _groups(request).get(group_name)
    if group is None:
        return _result(False, "The group to be destroyed does not exist.")
    _groups(request).pop(group_name)
    if group["lock"].acquire(blocking=False):
        try:
            await blocking(weight_wire.destroy_process_group, group["pg"])
        finally:
            group["lock"].release()
    else:  # a receive still waits on this (broken) group: it stays alive until its timeout
        request.app[STATE_KEY].setdefault("weight_groups_abandoned", []).append(group)
    return _result(True, "Succeeded to destroy custom process group.")


def _receive(group: dict[str, Any], names: list[str], dtypes: list[Any], shapes: list[list[int]],
             bucketed: bool, into: Optional[list[Any]] = None) -> list[tuple[str, Any]]:
    """Receive rank 0's broadcasts (off the event loop; one update at a time per group, so the
    collectives stay in the sender's order): a bucket into a reused buffer, single tensors into
    ``into`` (the engine's own parameters, see :func:`_direct_targets`) or new tensors."""
    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    with group["lock"]:
        if bucketed:
            metadata = weight_wire.layout(names, dtypes, shapes)
            flat = _bucket_buffer(group, weight_wire.bucket_bytes(metadata))
            dist.broadcast(flat, src=0, group=group["pg"], async_op=True).wait(timeout)
            return weight_wire.unflatten(flat, metadata)
        if into is None:
            into = [torch.empty(s, dtype=d, device=group["device"]) for d, s in zip(dtypes, shapes)]
        tensors = list(zip(names, into))
        works = [dist.broadcast(t, src=0, group=group["pg"], async_op=True) for _, t in tensors]
        for work in works:
            work.wait(timeout)
        return tensors


def _direct_targets(request: web.Request, names: list[str], dtypes: list[Any], shapes: list[list[int]]) -> Optional[list[Any]]:
    """The engine's own parameters to receive single-tensor broadcasts into, so a distributed update
    copies nothing on this side (the load that follows is then a copy of each onto itself, and the
    fused matrices are rebuilt as after any update). Only while generation is paused (no decode
    step reads the weights meanwhile), and only when every name is a parameter of that shape and
    dtype with its memory in place; otherwise None: new tensors, checked and loaded as usual. A
    group that breaks in the middle leaves the tensors received so far written; the push then
    fails and the engine stays paused until the next one."""
    engine = request.app[ENGINE_KEY]
    if not engine.paused or engine.memory_released or request.app[STATE_KEY]["weights_lock"].locked():
        return None
    params = dict(engine.model.named_parameters(remove_duplicate=False))
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        param = params.get(name)
        if (param is None or param.dtype != dtype or list(param.shape) != list(shape) or not param.is_contiguous()
                or not param.untyped_storage().nbytes()):
            return None
        out.append(param.data)
    return out


def weights_writing(app: web.Application) -> bool:
    """A distributed update of a live group is writing straight into the weights now."""
    return any(g is not None and g.get("writing") for g in (app[STATE_KEY].get("weight_groups") or {}).values())


def _bucket_buffer(group: dict[str, Any], nbytes: int) -> Any:
    """A ``uint8`` buffer of ``nbytes`` to receive a flattened bucket into. On CPU one buffer per
    group is kept between updates and grown as needed (receiving into fresh memory every bucket
    costs a page fault per 4 KiB page, about as much as the transfer); on CUDA the caching allocator
    already reuses memory. The buffer is busy from the receive until the bucket is loaded; a bucket
    that arrives meanwhile gets fresh memory."""
    import torch

    device = group["device"]
    if device.type != "cpu" or group.get("buffer_busy"):  # a sender that does not wait for answers
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    buffer = group.get("buffer")
    if buffer is None or buffer.numel() < nbytes:
        buffer = group["buffer"] = torch.empty(nbytes, dtype=torch.uint8)
    group["buffer_busy"] = True
    return buffer[:nbytes]


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
                                 "weight_version", "load_format", "selector", "torch_empty_cache", *_COMMON},
                          "update_weights_from_distributed")
    names = protocol.req(body, "names", list)
    dtype_names = protocol.req(body, "dtypes", list)
    shapes = protocol.req(body, "shapes", list)
    if not all(isinstance(n, str) for n in names):
        raise BadRequest("`names` must be a list of strings.")
    if not (len(names) == len(dtype_names) == len(shapes)) or not names:
        raise BadRequest(f"`names`, `dtypes` and `shapes` must be non-empty lists of one length, got "
                         f"{len(names)}, {len(dtype_names)} and {len(shapes)}.")
    try:
        dtypes = [weight_wire.parse_dtype(d) for d in dtype_names]
    except ValueError as exc:
        raise BadRequest(f"`dtypes`: {exc}") from None
    if not all(isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s)
               for s in shapes):
        raise BadRequest("`shapes` must be a list of lists of non-negative integers.")
    group_name = protocol.opt(body, "group_name", str, "weight_update_group")
    load_format = _load_format(body)
    selector, flush, abort, version = _update_options(body)
    if load_format == "flattened_bucket":
        try:
            weight_wire.layout(names, dtypes, shapes)
        except ValueError as exc:
            raise BadRequest(f"`shapes`/`dtypes` do not form a flattened bucket: {exc}") from None
    refused = outside_session(request, "update_weights_from_distributed")
    if refused is not None:
        return refused
    group = _groups(request).get(group_name)
    if group is None:
        known = [name for name, g in _groups(request).items() if g is not None]
        return _result(False, f"Group {group_name} not in {known}. Please call `init_weights_update_group` first.")
    bucketed = load_format == "flattened_bucket"
    into = None if bucketed or selector == "draft" else _direct_targets(request, names, dtypes, shapes)
    # While the weights are written as received, /weights_checker refuses (weights_writing); the
    # weights lock is not held meanwhile, since a receive whose sender has gone waits out the
    # group's timeout, and later updates (on a new group, or another path) must not wait for it.
    group["writing"] = into is not None
    try:
        tensors = await weight_wire.in_daemon_thread(_receive, group, names, dtypes, shapes, bucketed, into)
    except Exception as exc:  # noqa: BLE001 - a broken group or a sender gone: the caller is told
        group["buffer_busy"] = False
        return _result(False, f"Failed to receive weights: {exc}")
    finally:
        group["writing"] = False
    try:
        if selector == "draft":  # no draft model here: received, nothing to load (as SGLang without one)
            return _result(True, "Succeeded to update parameter online.")
        return await apply_update(request, dict(tensors), version, abort, flush=flush)
    finally:
        del tensors
        group["buffer_busy"] = False  # loaded: the next bucket may reuse the buffer


def _named_tensors(obj: Any, load_format: Optional[str]) -> dict[str, Any]:
    """The ``(name, tensor)`` pairs of a deserialised ``update_weights_from_tensor`` payload."""
    import torch

    field = "serialized_named_tensors"
    if load_format == "flattened_bucket":
        if not (isinstance(obj, dict) and set(obj) == {"flattened_tensor", "metadata"}
                and isinstance(obj["metadata"], list)):
            raise BadRequest(f"`{field}` with load_format flattened_bucket must hold "
                             "{'flattened_tensor': uint8 tensor, 'metadata': [FlattenedTensorMetadata, ...]}.")
        try:
            return dict(weight_wire.unflatten(obj["flattened_tensor"], obj["metadata"]))
        except (ValueError, AttributeError, TypeError) as exc:
            raise BadRequest(f"`{field}`: a malformed flattened bucket: {exc}") from None
    if not isinstance(obj, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
                                                     for p in obj):
        raise BadRequest(f"`{field}` must hold a list of (name, tensor) pairs.")
    out = {}
    for name, value in obj:
        if isinstance(value, weight_wire.LocalSerializedTensor):  # one payload per TP rank: ours is 0
            try:
                value = value.get(0)
            except (weight_wire.UnsafePayload, IndexError, TypeError) as exc:
                raise BadRequest(f"`{field}`: {name!r}: {exc}") from None
        if not isinstance(value, torch.Tensor):
            raise BadRequest(f"`{field}`: {name!r} is a {type(value).__name__}, not a tensor.")
        out[name] = value
    return out


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                                 "weight_version", "selector", "torch_empty_cache", *_COMMON}, "update_weights_from_tensor")
    payloads = protocol.req(body, "serialized_named_tensors", list)
    if not payloads:
        raise BadRequest("`serialized_named_tensors` must hold one payload per TP rank (this engine has one), got none.")
    load_format = _load_format(body)
    selector, flush, abort, version = _update_options(body)
    try:  # decoded first: a malformed field is a 400 whatever the session (SGLang's schema decodes it)
        data = [weight_wire.decode(p, "serialized_named_tensors") for p in payloads][0]
    except weight_wire.UnsafePayload as exc:
        raise BadRequest(str(exc)) from None
    refused = outside_session(request, "update_weights_from_tensor")
    if refused is not None:
        return refused
    try:
        obj = await blocking(weight_wire.deserialize, data, "serialized_named_tensors")
    except weight_wire.UnsafePayload as exc:
        raise BadRequest(str(exc)) from None
    tensors = _named_tensors(obj, load_format)
    del obj
    if selector == "draft":
        return _result(True, "Success")
    return await apply_update(request, tensors, version, abort, flush=flush)


def add_routes(app: web.Application) -> None:
    """Register the weight-update group and the tensor and distributed update endpoints."""
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
    app.router.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    app.on_cleanup.append(_close_groups)


async def _close_groups(app: web.Application) -> None:
    """At shutdown, destroy the groups no receive is waiting on (a live gloo group left behind
    holds the process at exit); bounded, so a stuck one cannot hold the shutdown."""
    groups = app[STATE_KEY].get("weight_groups") or {}
    for name, group in list(groups.items()):
        if group is not None and group["lock"].acquire(blocking=False):
            try:
                await asyncio.wait_for(weight_wire.in_daemon_thread(weight_wire.destroy_process_group, group["pg"]), 5)
                del groups[name]
            except asyncio.TimeoutError:
                pass  # left in place: the server then exits without waiting for it (server.main)

