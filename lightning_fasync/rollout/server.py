"""The HTTP front of the embedded engine: SGLang's native API on aiohttp, one replica per process.

Run ``python -m lightning_fasync.rollout.server --model tiny --port 30000``. Field names and
response shapes follow SGLang (``srt/managers/io_struct.py``, ``srt/entrypoints/http_server.py``) so
the same client and the real ``sglang-router`` work against this server and against SGLang itself.
Request validation lives in ``rollout/protocol.py``.
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Optional

from aiohttp import web
from jsonargparse import ArgumentParser, Namespace

from lightning_fasync.rollout import protocol
from lightning_fasync.rollout.engine import EngineDeadError
from lightning_fasync.rollout.protocol import BadRequest

logger = logging.getLogger("lightning_fasync.rollout.server")

ENGINE_KEY: web.AppKey = web.AppKey("engine", object)
STATE_KEY: web.AppKey = web.AppKey("state", dict)
HEALTH_GENERATE_TIMEOUT_S = 30.0
OPEN_PATHS = ("/health", "/health_generate", "/metrics")


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


@web.middleware
async def _errors_and_auth(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE_KEY]["api_key"]
    if key and request.path not in OPEN_PATHS and request.headers.get("Authorization") != f"Bearer {key}":
        return _error(401, "Missing or wrong API key (expected 'Authorization: Bearer <key>').")
    try:
        return await handler(request)
    except BadRequest as exc:
        return _error(400, str(exc))


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        data = json.loads(await request.text())
    except ValueError as exc:
        raise BadRequest(f"Malformed JSON body: {exc}.") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BadRequest(f"The JSON body must be an object, got {type(data).__name__}.")
    return data


async def _blocking(fn: Any, *args: Any) -> Any:
    """Run a blocking engine control call off the event loop (it waits for a step boundary)."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# ------------------------------------------------------------------------------ generation


async def generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    state = request.app[STATE_KEY]
    gen = protocol.parse_generate(await _body(request), state["tokenizer"])
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def on_finish(req: Any) -> None:  # engine thread
        loop.call_soon_threadsafe(lambda: done.done() or done.set_result(req))

    req = gen.to_engine_request(on_finish)
    try:
        engine.submit(req)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    except EngineDeadError as exc:
        return _error(503, str(exc))
    # No overall deadline: a paused engine holds requests by design. The loop only wakes to notice
    # a dead engine, which fails its requests anyway.
    while True:
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout=5.0)
            break
        except asyncio.TimeoutError:
            if not engine.alive and not done.done():
                return _error(503, "The engine stopped while the request was waiting.")
    if req.error is not None:
        return _error(503, f"Generation failed: {req.error}")
    return web.json_response(protocol.generate_response(req, gen, state["tokenizer"], engine.weight_version))


async def abort_request(request: web.Request) -> web.Response:
    body = await _body(request)
    protocol.check_fields(body, {"rid", "abort_all", "abort_message"}, "abort_request")
    rid = protocol.opt(body, "rid", str, "")
    abort_all = protocol.opt(body, "abort_all", bool, False)
    try:
        n = await _blocking(request.app[ENGINE_KEY].abort, rid, abort_all)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return web.json_response({"success": True, "num_aborted": n})


async def pause_generation(request: web.Request) -> web.Response:
    body = await _body(request)
    protocol.check_fields(body, {"mode"}, "pause_generation")
    mode = protocol.opt(body, "mode", str, "abort")
    try:
        n = await _blocking(request.app[ENGINE_KEY].pause, mode)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    return web.json_response({"success": True, "message": f"Generation paused ({mode}).", "num_aborted": n})


async def continue_generation(request: web.Request) -> web.Response:
    await _blocking(request.app[ENGINE_KEY].resume)
    return web.json_response({"success": True, "message": "Generation continued."})


# ------------------------------------------------------------------------------ weights


def _load_safetensors(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise BadRequest(f"No safetensors weights at {path!r} (only safetensors are loaded).")
    tensors: dict[str, Any] = {}
    for f in files:
        tensors.update(load_file(f))
    return tensors


async def _apply_update(request: web.Request, tensors: dict[str, Any], version: Optional[str], abort: bool) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if abort:
        await _blocking(engine.abort, "", True)
    try:
        n = await _blocking(engine.update_weights, tensors, version)
    except ValueError as exc:
        return web.json_response({"success": False, "message": str(exc)}, status=400)
    return web.json_response(
        {"success": True, "message": f"Updated {n} tensors; weight_version={engine.weight_version}.", "num_paused_requests": 0}
    )


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await _body(request)
    protocol.check_fields(
        body, {"model_path", "load_format", "weight_version", "flush_cache", "abort_all_requests", "is_async"}, "update_weights_from_disk"
    )
    path = protocol.req(body, "model_path", str)
    if not os.path.exists(path):
        raise BadRequest(f"model_path {path!r} does not exist.")
    tensors = await _blocking(_load_safetensors, path)
    version = protocol.opt(body, "weight_version", str, None)
    response = await _apply_update(request, tensors, version, protocol.opt(body, "abort_all_requests", bool, False))
    if response.status == 200:
        request.app[STATE_KEY]["model_path"] = path
    return response


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """Same-host update: the trainer writes a safetensors file to /dev/shm and posts its path."""
    body = await _body(request)
    if "serialized_named_tensors" in body:
        raise BadRequest(
            "serialized_named_tensors (pickled tensors) is not accepted by the embedded engine; "
            "write a safetensors file (e.g. under /dev/shm) and send its path as safetensors_path."
        )
    protocol.check_fields(
        body, {"safetensors_path", "load_format", "weight_version", "flush_cache", "abort_all_requests"}, "update_weights_from_tensor"
    )
    path = protocol.req(body, "safetensors_path", str)
    if not os.path.isfile(path):
        raise BadRequest(f"safetensors_path {path!r} is not a file.")
    tensors = await _blocking(_load_safetensors, path)
    version = protocol.opt(body, "weight_version", str, None)
    return await _apply_update(request, tensors, version, protocol.opt(body, "abort_all_requests", bool, False))


async def update_weight_version(request: web.Request) -> web.Response:
    body = await _body(request)
    protocol.check_fields(body, {"new_version", "abort_all_requests"}, "update_weight_version")
    version = protocol.req(body, "new_version", str)
    engine = request.app[ENGINE_KEY]
    if protocol.opt(body, "abort_all_requests", bool, False):
        await _blocking(engine.abort, "", True)
    await _blocking(engine.set_weight_version, version)
    return web.json_response({"success": True, "message": f"weight_version={version}.", "new_version": version})


async def flush_cache(request: web.Request) -> web.Response:
    # KV caches are per request and die with it; there is no shared prefix cache to flush.
    return web.Response(text="Cache flushed.\n")


# ------------------------------------------------------------------------------ info and health


async def model_info(request: web.Request) -> web.Response:
    engine, state = request.app[ENGINE_KEY], request.app[STATE_KEY]
    return web.json_response(
        {
            "model_path": state["model_path"],
            "tokenizer_path": state["model_path"],
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "max_context_length": engine.context_length,
            "vocab_size": engine.vocab_size,
            "eos_token_ids": sorted(engine.eos_token_ids),
        }
    )


async def server_info(request: web.Request) -> web.Response:
    engine, state = request.app[ENGINE_KEY], request.app[STATE_KEY]
    return web.json_response(
        {
            "model_path": state["model_path"],
            "tp_size": 1,
            "dp_size": 1,
            "context_length": engine.context_length,
            "max_running_requests": engine.max_running_requests,
            "weight_version": engine.weight_version,
            "version": "lightning-fasync-embedded",
            "internal_states": [engine.loads()],
        }
    )


async def weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[ENGINE_KEY].weight_version})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.alive:
        return _error(503, "The engine is not running.")
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.alive:
        return _error(503, "The engine is not running.")
    if engine.paused:  # generation is paused on purpose; the process is healthy
        return web.Response(text="")
    try:
        await asyncio.wait_for(
            _blocking(lambda: engine.generate([0], timeout=HEALTH_GENERATE_TIMEOUT_S, rid=f"HEALTH_CHECK_{time.time_ns()}",
                                              max_new_tokens=1, temperature=0.0)),
            timeout=HEALTH_GENERATE_TIMEOUT_S + 5,
        )
    except Exception as exc:
        return _error(503, f"Health generation failed: {exc!r}")
    return web.Response(text="")


async def loads(request: web.Request) -> web.Response:
    load = request.app[ENGINE_KEY].loads()
    return web.json_response({"timestamp": time.time(), "dp_rank_count": 1, "loads": [{"dp_rank": 0, **load}]})


async def get_load(request: web.Request) -> web.Response:
    load = request.app[ENGINE_KEY].loads()
    return web.json_response(
        [{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
          "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_total_tokens"]}]
    )


def build_app(engine: Any, tokenizer: Any, model_path: str, api_key: Optional[str] = None) -> web.Application:
    """The aiohttp application serving ``engine`` with SGLang's native routes."""
    app = web.Application(middlewares=[_errors_and_auth], client_max_size=64 * 1024**2)
    app[ENGINE_KEY] = engine
    app[STATE_KEY] = {"tokenizer": tokenizer, "model_path": model_path, "api_key": api_key}
    r = app.router
    r.add_post("/generate", generate)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_post("/update_weight_version", update_weight_version)
    for path, handler in (("/flush_cache", flush_cache),):
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
    return app


# ------------------------------------------------------------------------------ process entry


def parse_args(argv: Optional[list[str]] = None) -> Namespace:
    p = ArgumentParser(prog="lightning-fasync serve", default_env=False, description="Serve one embedded rollout engine replica.")
    p.add_argument("--model", required=True, help="Local Hugging Face model directory or a preset (tiny, qwen3-0.6b-shape).")
    p.add_argument("--port", type=int, required=True, help="Port to listen on.")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1).")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads.")
    p.add_argument("--max-running-requests", type=int, default=None, help="Requests decoded together at most.")
    p.add_argument("--context-length", type=int, default=None, help="Prompt + response tokens per request.")
    p.add_argument("--api-key", default=os.environ.get("FASYNC_ENGINE_API_KEY"), help="Require 'Authorization: Bearer KEY'.")
    p.add_argument("--weight-version", default="0", help="Version label of the initial weights.")
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
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_DropHttp2Probe())
    if args.cpu_cores:
        os.sched_setaffinity(0, {int(c) for c in args.cpu_cores.split(",")})
    import torch

    from lightning_fasync.policy import build_policy
    from lightning_fasync.rollout.engine import Engine

    torch.set_num_threads(args.threads)
    model, tokenizer = build_policy(args.model, dtype=getattr(torch, args.dtype))
    model.to(args.device)
    engine = Engine(model, max_running_requests=args.max_running_requests, context_length=args.context_length,
                    weight_version=args.weight_version)
    app = build_app(engine, tokenizer, args.model, args.api_key)

    async def on_startup(app: web.Application) -> None:
        if args.parent_pid:
            app["parent_watch"] = asyncio.get_running_loop().create_task(_watch_parent(args.parent_pid))

    async def on_cleanup(app: web.Application) -> None:
        engine.stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    logger.info("Serving %s on http://%s:%d (threads=%d, max_running_requests=%d)", args.model, args.host, args.port,
                args.threads, engine.max_running_requests)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, shutdown_timeout=5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
