"""Driving the embedded engine in-process, for tests/engine/ (the engine, its KV pool)."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from typing import Any, Optional

from lightning_fasync.engine.engine import Engine, EngineRequest


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Timed out after {timeout} s waiting for {what}.")
        time.sleep(0.001)


def submit(engine, rid, input_ids, **sampling) -> tuple[EngineRequest, threading.Event]:
    done = threading.Event()
    req = EngineRequest(rid=rid, input_ids=input_ids, on_finish=lambda r: done.set(), **sampling)
    engine.submit(req)
    return req, done


def serve(policy, body, app_kwargs: Optional[dict[str, Any]] = None, own_model: bool = False, timeout: float = 120,
          **engine_kwargs):
    """Run ``body(session, base_url, engine)`` against an in-process server (``build_app``) on a
    free port of 127.0.0.1, within ``timeout`` seconds. ``own_model``: over a copy of the model, so
    weight updates do not leak into other tests."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    from lightning_fasync.engine.server import build_app

    model, tok = policy
    if own_model:
        model = copy.deepcopy(model)
    engine = Engine(model, **{"max_running_requests": 8, **engine_kwargs})

    async def main():
        server = TestServer(build_app(engine, tok, "tiny", **(app_kwargs or {})), host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                return await body(session, str(server.make_url("")).rstrip("/"), engine)
        finally:
            await server.close()

    try:
        return asyncio.run(asyncio.wait_for(main(), timeout))
    finally:
        engine.stop()


async def call(session, method, url, json=None):
    """One HTTP call: ``(status, parsed JSON or text)``."""
    async with session.request(method, url, json=json) as r:
        if r.content_type == "application/json":
            return r.status, await r.json()
        return r.status, await r.text()

