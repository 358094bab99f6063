"""The HTTP front of the embedded engine: SGLang's native API on aiohttp, one replica per process.

Run ``python -m lightning_fasync.engine.server --model tiny --port 30000``. Field names and
response shapes follow SGLang (``srt/managers/io_struct.py``, ``srt/entrypoints/http_server.py``) so
the same client and the real ``sglang-router`` work against this server and against SGLang itself.
Request validation lives in ``lightning_fasync/engine/protocol.py``.
"""

from __future__ import annotations

import asyncio
import glob
import hmac
import ipaddress
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Optional

from aiohttp import web
from jsonargparse import ArgumentParser, Namespace

from lightning_fasync.engine import protocol
from lightning_fasync.engine.protocol import BadRequest
from lightning_fasync.engine.http_common import (ENGINE_KEY, ENGINE_WATCH_S, STATE_KEY, Submitted, apply_update, blocking,
                                                  error_response, json_body)

logger = logging.getLogger("lightning_fasync.engine.server")

HEALTH_GENERATE_TIMEOUT_S = 30.0
LORA_DIR_ENV = "FASYNC_ENGINE_LORA_DIR"
"""The one directory the served engine loads LoRA adapters from (``engine/lora.py``); unset: a private one."""
OPEN_PATHS = ("/health", "/health_generate", "/metrics")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


@web.middleware
async def _errors_and_auth(request: web.Request, handler: Any) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    key = state["api_key"]
    if key and request.path not in state["open_paths"] and not hmac.compare_digest(
            request.headers.get("Authorization", "").encode(), f"Bearer {key}".encode()):
        return error_response(401, "Missing or wrong API key (expected 'Authorization: Bearer <key>').")
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(400, str(exc))


# ------------------------------------------------------------------------------ generation


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    state = request.app[STATE_KEY]
    body = await json_body(request)
    from lightning_fasync.engine.lora import generate_adapter

    generate_adapter(request.app, body)  # SGLang's per-request lora_path: must name the merged adapter
    parsed = protocol.parse_generate(body, state["tokenizer"], engine.vocab_size)
    run = Submitted(request, parsed.items, streaming=parsed.stream)
    failure = run.submit()
    if failure is None and parsed.stream:
        return await _stream(request, run, parsed)
    if failure is None:
        failure = await run.finish()
    if failure is not None:
        return error_response(*failure)
    outs = [protocol.item_response(r, it, state["tokenizer"], engine.weight_version) for r, it in zip(run.reqs, run.items)]
    return web.json_response(outs[0] if parsed.is_single else outs)


async def _stream(request: web.Request, run: Submitted, parsed: protocol.ParsedGenerate) -> web.StreamResponse:
    """Server-sent events as SGLang sends them: one ``data: {...}`` chunk per update of an item
    (cumulative text, output ids and log-probs so far; ``index`` names the item in a batch), its final
    chunk carrying ``finish_reason``, then ``data: [DONE]``."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    tokenizer = request.app[STATE_KEY]["tokenizer"]
    engine = run.engine
    sent = [0] * len(run.items)
    closed = [False] * len(run.items)

    async def emit(i: int, finished: bool, upto: Optional[int]) -> None:
        out = protocol.item_response(run.reqs[i], run.items[i], tokenizer, engine.weight_version, finished=finished,
                                     upto=upto)
        if not parsed.is_single:
            out["index"] = i
        await response.write(b"data: " + json.dumps(out).encode() + b"\n\n")

    try:
        while not all(closed):
            run.wake.clear()
            for i in range(len(run.items)):
                if closed[i]:
                    continue
                if run.done[i].done():
                    req = run.reqs[i]
                    if req.error is not None:
                        error = {"error": {"message": f"Generation failed: {req.error}", "code": 503}}
                        await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
                    else:
                        await emit(i, True, None)
                    closed[i] = True
                elif run.progress[i] > sent[i]:
                    sent[i] = run.progress[i]
                    await emit(i, False, sent[i])
            if all(closed):
                break
            try:
                await asyncio.wait_for(run.wake.wait(), timeout=ENGINE_WATCH_S)
            except asyncio.TimeoutError:
                if not engine.alive:
                    error = {"error": {"message": "The engine stopped while the request was waiting.", "code": 503}}
                    await response.write(b"data: " + json.dumps(error).encode() + b"\n\n")
                    break
        await response.write(b"data: [DONE]\n\n")
    except (asyncio.CancelledError, ConnectionResetError):
        await asyncio.shield(run.cancel_unfinished())
        raise
    await response.write_eof()
    return response


async def abort_request(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"rid", "abort_all", "abort_message", "finished_reason", "weight_versions",
                                 "http_worker_ipc"}, "abort_request")
    rid = protocol.opt(body, "rid", str, "")
    abort_all = protocol.opt(body, "abort_all", bool, False)
    message = protocol.opt(body, "abort_message", str, None)
    try:
        await blocking(request.app[ENGINE_KEY].abort, rid, abort_all, message)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return web.Response(status=200)  # SGLang answers an empty 200


async def pause_generation(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"mode", "http_worker_ipc", "rid"}, "pause_generation")
    mode = protocol.opt(body, "mode", str, "abort")
    try:
        await blocking(request.app[ENGINE_KEY].pause, mode)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"torch_empty_cache", "http_worker_ipc", "rid"}, "continue_generation")
    await blocking(request.app[ENGINE_KEY].resume)
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


# ------------------------------------------------------------------------------ weights


def _load_safetensors(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    if not os.path.exists(path):
        raise FileNotFoundError(f"model_path {path!r} does not exist")
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no safetensors weights at model_path {path!r} (only safetensors are loaded)")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


async def begin_weight_update(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"selector", "http_worker_ipc", "rid"}, "begin_weight_update")
    selector = protocol.opt(body, "selector", str, "all")
    if selector not in ("target", "draft", "all"):
        raise BadRequest(f"`selector` must be 'target', 'draft' or 'all', got {selector!r}.")
    state = request.app[STATE_KEY]
    if state["weight_update_session"] is not None:
        return web.json_response(
            {"success": False, "message": "a weight-update session is already open; call end_weight_update() first"},
            status=400,
        )
    state["weight_update_session"] = {"selector": selector, "loaded": False}
    return web.json_response({"success": True, "message": "Success"})


async def end_weight_update(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"http_worker_ipc", "rid"}, "end_weight_update")
    state = request.app[STATE_KEY]
    if state["weight_update_session"] is None:
        return web.json_response(
            {"success": False, "message": "no weight-update session is open; call begin_weight_update() first"},
            status=400,
        )
    state["weight_update_session"] = None
    return web.json_response({"success": True, "message": "Success"})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await json_body(request)
    # SGLang 0.5.23's UpdateWeightFromDiskReqInput; the CUDA-graph, pause and step fields change
    # nothing here (no CUDA graphs; an update never ends a pause), a tensor manifest is refused.
    protocol.check_fields(
        body, {"model_path", "load_format", "weight_version", "flush_cache", "abort_all_requests", "is_async",
               "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "manifest", "rid",
               "http_worker_ipc"}, "update_weights_from_disk"
    )
    for name in ("torch_empty_cache", "keep_pause", "recapture_cuda_graph", "is_async"):
        protocol.opt(body, name, bool, False)
    protocol.opt(body, "token_step", int, 0)
    if body.get("manifest") is not None:
        raise protocol.unsupported("manifest", body["manifest"], "null")
    path = protocol.req(body, "model_path", str)
    version = protocol.opt(body, "weight_version", str, None)
    abort = protocol.opt(body, "abort_all_requests", bool, False)
    flush = protocol.opt(body, "flush_cache", bool, True)
    # SGLang answers a load that fails (a missing path included) with its update body and 400:
    # {"success": false, "message", "num_paused_requests": 0}, which clients read as ret["success"].
    try:
        tensors = await blocking(_load_safetensors, path)
    except Exception as exc:  # noqa: BLE001 - the caller is told, as SGLang's model runner does
        return web.json_response({"success": False, "message": f"Failed to get weights iterator: {exc}.",
                                  "num_paused_requests": 0}, status=400)
    response = await apply_update(request, tensors, version, abort, flush=flush,
                                  failure_fields={"num_paused_requests": 0})
    if response.status == 200:
        request.app[STATE_KEY]["model_path"] = path
    return response


async def update_weight_version(request: web.Request) -> web.Response:
    body = await json_body(request)
    protocol.check_fields(body, {"new_version", "abort_all_requests", "http_worker_ipc", "rid"}, "update_weight_version")
    version = protocol.req(body, "new_version", str)
    engine = request.app[ENGINE_KEY]
    if protocol.opt(body, "abort_all_requests", bool, True):  # SGLang's default: abort everything first
        await blocking(engine.abort, "", True)
    await blocking(engine.set_weight_version, version)
    return web.json_response({"success": True, "message": f"Weight version updated to {version}", "new_version": version})


WEIGHTS_CHECKER_ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")  # SGLang 0.5.23's


async def weights_checker(request: web.Request) -> web.Response:
    """SGLang's ``/weights_checker`` with ``action`` ``checksum`` (its default; body optional).

    Answers SGLang's body (``success``, ``message``, ``ranks``, ``per_engine_checksum``; see
    ``lightning_fasync/weights/checksum.py``). The tensors are hashed on an executor thread, so generation
    goes on meanwhile; a weight update waits until the hashing is done, so the checksums are those
    of one set of weights. SGLang's other actions (``snapshot``, ``reset_tensors``, ``compare``)
    are refused with 400. With ``selector`` ``draft`` there is no runner to check (no draft
    model): SGLang then answers success without ``ranks``.
    """
    from lightning_fasync.weights.checksum import engine_checksum_body

    body = await json_body(request)
    protocol.check_fields(
        body, {"action", "allow_quant_error", "skip_tensor_list", "selector", "http_worker_ipc", "rid"}, "weights_checker"
    )
    action = protocol.opt(body, "action", str, "checksum")
    protocol.opt(body, "allow_quant_error", bool, False)  # used by SGLang's compare only
    skip = protocol.opt(body, "skip_tensor_list", list, [])
    if not all(isinstance(s, str) for s in skip):
        raise BadRequest(f"`skip_tensor_list` must be a list of strings, got {skip!r:.80}.")
    selector = protocol.opt(body, "selector", str, "all")
    if selector not in ("target", "draft", "all"):
        raise BadRequest(f"`selector` must be 'target', 'draft' or 'all', got {selector!r}.")
    if action != "checksum":
        message = f"Unsupported action={action!r}: the embedded engine supports only 'checksum'"
        if action not in WEIGHTS_CHECKER_ACTIONS:
            message += f" (SGLang's actions: {', '.join(WEIGHTS_CHECKER_ACTIONS)})"
        return web.json_response({"success": False, "message": message + "."}, status=400)
    if selector == "draft":
        return web.json_response({"success": True, "message": "Success."})
    engine = request.app[ENGINE_KEY]
    if engine.enable_memory_saver and "weights" in engine.released_tags:
        return web.json_response({"success": False, "message": "The weights are released (/release_memory_occupation); "
                                  "there is nothing to check until they are resumed and loaded."}, status=400)
    model = engine.model
    from lightning_fasync.engine.weight_endpoints import weights_writing

    if weights_writing(request.app):
        return web.json_response({"success": False, "message": "A distributed weight update is writing the weights; "
                                  "ask again once it has answered."}, status=400)
    async with request.app[STATE_KEY]["weights_lock"]:
        return web.json_response(await blocking(engine_checksum_body, model, skip))


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's ``/flush_cache``: 400 while requests run or wait (``?timeout=`` waits that long for idle)."""
    try:
        timeout = float(request.query.get("timeout", 0.0))
    except ValueError:
        raise BadRequest(f"`timeout` must be a number, got {request.query.get('timeout')!r}.") from None
    engine = request.app[ENGINE_KEY]
    deadline = time.monotonic() + max(timeout, 0.0)
    while True:
        ok, message = await blocking(engine.flush_cache)
        if ok or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.05)
    if ok:
        message = ("Cache flushed.\nPlease check backend logs for more details. "
                   "(When there are running or waiting requests, the operation will not be performed.)\n")
    return web.Response(text=message, status=200 if ok else 400)


# ------------------------------------------------------------------------------ memory (colocate)


def _memory_tags(body: dict[str, Any], endpoint: str) -> Optional[list[str]]:
    """``tags`` of SGLang's ``Release``/``ResumeMemoryOccupationReqInput`` (plus ``BaseReq``'s fields)."""
    protocol.check_fields(body, {"tags", "rid", "http_worker_ipc"}, endpoint)
    tags = body.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise BadRequest(f"`tags` must be a list of strings or null, got {tags!r:.80}.")
    return tags


async def release_memory_occupation(request: web.Request) -> web.Response:
    """SGLang's ``/release_memory_occupation {tags}``: free weights and/or KV cache until resumed
    (see ``Engine.release_memory_occupation``). Answers 200 with a null body, as SGLang does."""
    tags = _memory_tags(await json_body(request), "release_memory_occupation")
    try:
        async with request.app[STATE_KEY]["weights_lock"]:  # never while /weights_checker reads them
            await blocking(request.app[ENGINE_KEY].release_memory_occupation, tags)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return web.json_response(None)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    """SGLang's ``/resume_memory_occupation {tags}``: reallocate what was released; weights come back
    zeroed until a weight update loads them."""
    tags = _memory_tags(await json_body(request), "resume_memory_occupation")
    try:
        await blocking(request.app[ENGINE_KEY].resume_memory_occupation, tags)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return web.json_response(None)


# ------------------------------------------------------------------------------ info and health


SGLANG_API_VERSION = "0.5.23"  # the SGLang release whose HTTP semantics this server follows


async def model_info(request: web.Request) -> web.Response:
    """SGLang's ``/model_info`` fields (plus the engine's limits, which SGLang reports elsewhere)."""
    engine, state = request.app[ENGINE_KEY], request.app[STATE_KEY]
    config = engine.model.config
    return web.json_response(
        {
            "model_path": state["model_path"],
            "served_model_name": state["served_model_name"],
            "tokenizer_path": state["model_path"],
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "load_format": "safetensors",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            "max_context_length": engine.context_length,
            "vocab_size": engine.vocab_size,
            "eos_token_ids": sorted(engine.eos_token_ids),
        }
    )


async def server_info(request: web.Request) -> web.Response:
    """SGLang's ``/server_info``: the server arguments that apply here, live state, the version."""
    engine, state = request.app[ENGINE_KEY], request.app[STATE_KEY]
    return web.json_response(
        {
            "model_path": state["model_path"],
            "tokenizer_path": state["model_path"],
            "served_model_name": state["served_model_name"],
            "host": state.get("host"),
            "port": state.get("port"),
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "context_length": engine.context_length,
            "max_running_requests": engine.max_running_requests,
            # The KV pool as sized at start (SGLang reports the resolved values of these arguments).
            "mem_fraction_static": engine.runner.plan.mem_fraction_static,
            "max_total_tokens": engine.runner.max_total_tokens,
            "page_size": engine.runner.page_size,
            "allow_auto_truncate": engine.allow_auto_truncate,
            "weight_version": engine.weight_version,
            "skip_tokenizer_init": state["tokenizer"] is None,
            "device": str(engine.runner.device),
            "dtype": str(engine.runner.dtype).replace("torch.", ""),
            "internal_states": [{**engine.loads(), "memory_usage": engine.memory_usage()}],
            # What SGLang merges in from its scheduler's handshake and its tokenizer manager.
            "max_total_num_tokens": engine.runner.max_total_tokens,
            "max_req_input_len": max_req_input_len(engine),
            "startup_time": state["startup_time"],
            "version": SGLANG_API_VERSION,
            "frontend": "python",
            "engine": "lightning-fasync-embedded",
            # SGLang's LoRA arguments as they apply here, and where adapters load from (ours: engine/lora.py).
            "enable_deterministic_inference": engine.deterministic,
            "enable_lora": state["lora"].enabled,
            "max_loras_per_batch": 1,
            "lora_dir": state["lora"].lora_dir,
        }
    )


def max_req_input_len(engine: Any) -> int:
    """SGLang's ``max_req_input_len``: ``min(context length, KV pool tokens) - 1``, less its 5 reserved."""
    return min(engine.context_length, engine.runner.max_total_tokens) - 1 - 5


def startup_time_info(load_weight: float = 0.0, kv_cache_allocation: float = 0.0, scheduler_e2e: float = 0.0,
                      tokenizer_e2e: float = 0.0) -> dict[str, Any]:
    """``startup_time`` as SGLang 0.5.23 reports it (``srt/observability/startup_time.py``): seconds
    per phase, and its CUDA-graph capture phases (0 here: the engine captures no graphs)."""
    graph_phases = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")
    return {"load_weight": load_weight, "kv_cache_allocation": kv_cache_allocation, "scheduler_e2e": scheduler_e2e,
            "cuda_graph": dict.fromkeys(graph_phases, 0.0), "tokenizer_e2e": tokenizer_e2e}


async def prometheus_metrics(request: web.Request) -> web.Response:
    """SGLang's ``GET /metrics`` (with ``--enable-metrics``): see ``lightning_fasync/engine/metrics.py``."""
    from lightning_fasync.engine import metrics

    state = request.app[STATE_KEY]
    text = metrics.render(request.app[ENGINE_KEY], state["metrics"], state["served_model_name"], state["startup_time"],
                          state["started_at"])
    return web.Response(body=text.encode(), headers={"Content-Type": metrics.CONTENT_TYPE})


async def weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[ENGINE_KEY].weight_version})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.alive:
        return error_response(503, "The engine is not running.")
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.alive:
        return error_response(503, "The engine is not running.")
    if engine.paused or engine.memory_released:  # generation is off on purpose; the process is healthy
        return web.Response(text="")
    try:
        await asyncio.wait_for(
            blocking(lambda: engine.generate([0], timeout=HEALTH_GENERATE_TIMEOUT_S, rid=f"HEALTH_CHECK_{time.time_ns()}",
                                              max_new_tokens=1, temperature=0.0)),
            timeout=HEALTH_GENERATE_TIMEOUT_S + 5,
        )
    except Exception as exc:
        return error_response(503, f"Health generation failed: {exc!r}")
    return web.Response(text="")


def _load_snapshot(engine: Any) -> dict[str, Any]:
    load = engine.loads()
    used = load["num_total_tokens"]
    capacity = load["max_total_num_tokens"]  # the paged KV pool's size in tokens
    return {
        "dp_rank": 0,
        "num_running_reqs": load["num_running_reqs"],
        "num_waiting_reqs": load["num_waiting_reqs"],
        "num_used_tokens": load["kv_used_tokens"],
        "num_total_tokens": used,
        "max_total_num_tokens": capacity,
        "max_running_requests": engine.max_running_requests,
        "token_usage": load["kv_used_tokens"] / capacity if capacity else 0.0,
        "paused": load["paused"],
        "weight_version": load["weight_version"],
    }


async def loads(request: web.Request) -> web.Response:
    """SGLang's ``/v1/loads``: one load snapshot per data-parallel rank (here one)."""
    if request.query.get("dp_rank") not in (None, "0"):
        return web.json_response({"timestamp": _utc_now(), "version": SGLANG_API_VERSION, "loads": []})
    return web.json_response({
        "timestamp": _utc_now(), "version": SGLANG_API_VERSION, "accelerator": None, "num_accelerators": 1,
        "loads": [_load_snapshot(request.app[ENGINE_KEY])],
    })


def _utc_now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat()


async def get_load(request: web.Request) -> web.Response:
    load = request.app[ENGINE_KEY].loads()
    return web.json_response(
        [{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
          "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_total_tokens"]}]
    )


def build_app(
    engine: Any,
    tokenizer: Any,
    model_path: str,
    api_key: Optional[str] = None,
    served_model_name: Optional[str] = None,
    require_weight_update_session: bool = True,
    enable_metrics: bool = False,
    startup_time: Optional[dict[str, Any]] = None,
    enable_lora: bool = True,
    lora_dir: Optional[str] = None,
    open_paths: tuple[str, ...] = OPEN_PATHS,
) -> web.Application:
    """The aiohttp application serving ``engine`` with SGLang's native and OpenAI-compatible routes.

    Args:
        require_weight_update_session: Refuse tensor and distributed weight updates outside
            ``/begin_weight_update`` ... ``/end_weight_update``, as SGLang 0.5.23 does; False
            accepts them as SGLang 0.5.15 does (``lightning_fasync/engine/weight_endpoints.py``).
        enable_metrics: Serve Prometheus metrics at ``/metrics`` (SGLang's ``--enable-metrics``).
        startup_time: ``/server_info``'s ``startup_time`` (:func:`startup_time_info`); zeros if None.
        enable_lora: Serve ``/load_lora_adapter`` and ``/unload_lora_adapter``; False refuses them, as
            SGLang does without ``--enable-lora`` (``lightning_fasync/engine/lora.py``).
        lora_dir: The directory adapters load from (None: a private one made now, removed at exit).
        open_paths: Routes served without the API key (health and metrics, for probes on this host);
            ``()``: the key on every route, as for a server bound to an address others can reach.
    """
    from lightning_fasync.engine import lora, metrics, openai_api, weight_endpoints

    app = web.Application(middlewares=[_errors_and_auth], client_max_size=64 * 1024**2)
    app[ENGINE_KEY] = engine
    app[STATE_KEY] = {
        "tokenizer": tokenizer, "model_path": model_path, "api_key": api_key, "open_paths": open_paths,
        "served_model_name": served_model_name or model_path,
        "require_weight_update_session": require_weight_update_session, "weight_update_session": None,
        "weights_lock": asyncio.Lock(),  # weight updates vs. /weights_checker
        "rids_in_flight": {},  # rid -> the call holding it (http_common.Submitted)
        "metrics": metrics.RequestMetrics() if enable_metrics else None,
        "startup_time": startup_time or startup_time_info(), "started_at": time.monotonic(),
    }
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/begin_weight_update", begin_weight_update)
    r.add_post("/end_weight_update", end_weight_update)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weight_version", update_weight_version)
    for path, handler in (("/release_memory_occupation", release_memory_occupation),
                          ("/resume_memory_occupation", resume_memory_occupation)):
        r.add_get(path, handler, allow_head=False)  # SGLang routes both methods
        r.add_post(path, handler)
    for path, handler in (("/flush_cache", flush_cache), ("/weights_checker", weights_checker)):
        r.add_get(path, handler, allow_head=False)
        r.add_post(path, handler)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/get_weight_version", weight_version)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    r.add_get("/v1/loads", loads)
    r.add_get("/get_load", get_load)
    if enable_metrics:
        r.add_get("/metrics", prometheus_metrics)
    weight_endpoints.add_routes(app)
    lora.add_routes(app, enabled=enable_lora, lora_dir=lora_dir)
    openai_api.add_routes(app)
    return app


# ------------------------------------------------------------------------------ process entry


def parse_args(argv: Optional[list[str]] = None) -> Namespace:
    p = ArgumentParser(prog="lightning-fasync serve", default_env=False,
                       description="Serve one embedded rollout engine replica. LoRA adapters (/load_lora_adapter) load "
                                   f"only from ${LORA_DIR_ENV} (default: a private directory made at start).")
    p.add_argument("--model", required=True, help="Local Hugging Face model directory or a preset (tiny, qwen3-30m-shape, qwen3-0.6b-shape).")
    p.add_argument("--port", type=int, default=30000, help="Port to listen on (default 30000, as SGLang's).")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1). Any other address needs an API key, then required on every route, /health included.")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    p.add_argument("--max-running-requests", type=int, default=None, help="Requests decoded together at most.")
    p.add_argument("--context-length", type=int, default=None, help="Prompt + response tokens per request.")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="Share of the memory available at start (CUDA: free device memory; CPU: MemAvailable) "
                        "that weights + KV pool may take (SGLang's flag; default 0.4 on CPU, SGLang's rule on CUDA).")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="The KV pool's size in tokens (SGLang's flag); default: from --mem-fraction-static, at most "
                        "--max-running-requests x --context-length.")
    p.add_argument("--page-size", type=int, default=None,
                   help="Tokens per KV block (SGLang's flag); default 16, or the largest of 8, 4, 2, 1 with which the "
                        "KV pool holds one request of --context-length (SGLang's default is 1).")
    p.add_argument("--api-key", default=os.environ.get("FASYNC_ENGINE_API_KEY"), help="Require 'Authorization: Bearer KEY'.")
    p.add_argument("--weight-version", default="default", help="Version label of the initial weights (SGLang's default).")
    p.add_argument("--served-model-name", default=None, help="Model name in /v1/models and OpenAI responses (default: --model).")
    p.add_argument("--allow-auto-truncate", type=bool, default=False,
                   help="Cap max_new_tokens at what the context leaves instead of answering 400 (SGLang's flag).")
    p.add_argument("--return-original-logprob", type=bool,
                   default=os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true"),
                   help="Log-probs of the raw logits at temperature 1 instead of the sampled (temperature-scaled) "
                        "distribution; default from SGLang's SGLANG_RETURN_ORIGINAL_LOGPROB.")
    p.add_argument("--require-weight-update-session", type=bool, default=True,
                   help="Refuse tensor and distributed weight updates outside /begin_weight_update ... /end_weight_update "
                        "(SGLang 0.5.23); false accepts them as SGLang 0.5.15 does.")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="Free the memory /release_memory_occupation releases (SGLang's flag); without it the call "
                        "frees nothing, as in SGLang.")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="SGLang's flag; this engine keeps no prefix cache across requests (but --keep-aborted-kv's), "
                        "so it always holds.")
    p.add_argument("--keep-aborted-kv", action="store_true",
                   help="Keep an aborted request's KV cache; a request whose prompt is its prompt and tokens so far plus "
                        "one more goes on from it with no prefill, until the memory is needed, /flush_cache or an update "
                        "with flush_cache (this engine's; rollout.resume_kv: keep).")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="SGLang's flag: a request's tokens and log-probs do not depend on the requests batched with it "
                        "(here each request runs on its own: slower).")
    p.add_argument("--enable-metrics", action="store_true",
                   help="Serve Prometheus metrics at /metrics, under SGLang's metric names (SGLang's flag).")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda).")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="Parameter and KV-cache dtype.")
    p.add_argument("--cpu-cores", default=None, help="Comma-separated CPU cores to pin this process to.")
    p.add_argument("--parent-pid", type=int, default=None, help="Exit when this process dies.")
    return p.parse_args(argv)


class _DropHttp2Probe(logging.Filter):
    """Drop the error aiohttp logs when sglang-router probes a worker for gRPC (an HTTP/2 preface).

    The probe is expected (the router then uses HTTP/1.1); logging it as an error with a traceback
    at every router start would bury real errors.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and type(exc).__name__ == "BadHttpMessage" and "PRI" in str(exc))


async def _watch_parent(pid: int) -> None:
    """Exit (via SIGTERM to self, a graceful shutdown) once the parent process is gone."""
    while True:
        await asyncio.sleep(0.5)
        try:
            os.kill(pid, 0)
            alive = os.getppid() == pid or os.getppid() != 1
        except ProcessLookupError:
            alive = False
        except PermissionError:  # exists, owned by someone else: a reused pid would be odd but alive
            alive = True
        if not alive:
            logger.warning("Parent process %d is gone; shutting down.", pid)
            os.kill(os.getpid(), signal.SIGTERM)
            return


def main(argv: Optional[list[str]] = None) -> int:
    """Serve one replica until SIGTERM/SIGINT or the parent's death. Returns the exit status."""
    started = time.perf_counter()
    args = parse_args(argv)
    if not is_loopback(args.host) and not args.api_key:
        print(f"lightning-fasync serve: `--host` is {args.host}, which others can reach: set an API key "
              "($FASYNC_ENGINE_API_KEY or --api-key), required then on every route.", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_DropHttp2Probe())
    if args.cpu_cores:
        os.sched_setaffinity(0, {int(c) for c in args.cpu_cores.split(",")})
    import torch

    from lightning_fasync.policy import build_policy
    from lightning_fasync.engine.engine import Engine

    torch.set_num_threads(args.threads)
    loading = time.perf_counter()
    model, tokenizer = build_policy(args.model, dtype=getattr(torch, args.dtype))
    model.to(args.device)
    loaded = time.perf_counter()
    from lightning_fasync.engine.model_runner import KVCacheTooLargeError, UnsupportedModelError

    try:
        engine = Engine(model, max_running_requests=args.max_running_requests, context_length=args.context_length,
                        weight_version=args.weight_version, allow_auto_truncate=args.allow_auto_truncate,
                        return_original_logprob=args.return_original_logprob,
                        enable_memory_saver=args.enable_memory_saver, page_size=args.page_size,
                        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
                        deterministic=args.enable_deterministic_inference,
                        keep_aborted_kv=args.keep_aborted_kv and not args.disable_radix_cache)
    except (KVCacheTooLargeError, UnsupportedModelError, ValueError) as exc:  # a configuration to fix, not a crash
        print(f"lightning-fasync serve: {exc}", file=sys.stderr)
        return 2
    ready = time.perf_counter()
    startup_time = startup_time_info(load_weight=loaded - loading, kv_cache_allocation=engine.runner.kv_pool_init_s,
                                     scheduler_e2e=ready - loading, tokenizer_e2e=ready - started)
    app = build_app(engine, tokenizer, args.model, args.api_key, served_model_name=args.served_model_name,
                    require_weight_update_session=args.require_weight_update_session,
                    enable_metrics=args.enable_metrics, startup_time=startup_time,
                    lora_dir=os.environ.get(LORA_DIR_ENV) or None,
                    open_paths=OPEN_PATHS if is_loopback(args.host) else ())
    app[STATE_KEY].update(host=args.host, port=args.port)

    async def on_startup(app: web.Application) -> None:
        if args.parent_pid:
            app["parent_watch"] = asyncio.get_running_loop().create_task(_watch_parent(args.parent_pid))

    async def on_cleanup(app: web.Application) -> None:
        engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    logger.info("Serving %s on http://%s:%d (threads=%d, max_running_requests=%d)", args.model, args.host, args.port,
                args.threads, engine.max_running_requests)
    usage = engine.memory_usage()
    logger.info("KV pool: %d tokens (%d blocks of %d) in %.3f GB, weights %.3f GB, budget %.3f GB "
                "(--mem-fraction-static %s of %.3f GB available)", usage["token_capacity"],
                usage["kv_pool"]["total_blocks"], usage["kv_pool"]["page_size"], usage["kvcache"], usage["weight"],
                (usage["kv_pool"]["budget_bytes"] or 0) / 2**30, usage["kv_pool"]["mem_fraction_static"],
                usage["startup_available"])
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=5.0)
    if app[STATE_KEY].get("weight_groups") or app[STATE_KEY].get("weight_groups_abandoned"):
        # A weight-update group whose sender went away mid-broadcast cannot be destroyed, and its
        # threads would hold the interpreter's exit until the group times out: exit now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    # Run the package module's main: under ``python -m`` this file is also imported by its package
    # name (openai_api imports it), and the app must use that copy's AppKeys.
    from lightning_fasync.engine.server import main as package_main

    sys.exit(package_main())
