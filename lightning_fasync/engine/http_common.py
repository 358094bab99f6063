"""What the embedded engine's route modules share: the app's keys, request bodies, running engine
calls off the event loop, a submitted generation and its failure, the weight update's application
and SGLang's weight-update session rule. ``server``, ``openai_api`` and ``weight_endpoints`` import
it; it imports none of them.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any, Optional

from aiohttp import web

from lightning_fasync.engine import protocol
from lightning_fasync.engine.engine import EngineDeadError
from lightning_fasync.engine.protocol import BadRequest

ENGINE_KEY: web.AppKey = web.AppKey("engine", object)
STATE_KEY: web.AppKey = web.AppKey("state", dict)


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


async def json_body(request: web.Request) -> dict[str, Any]:
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


async def blocking(fn: Any, *args: Any) -> Any:
    """Run a blocking engine control call off the event loop (it waits for a step boundary)."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


ENGINE_WATCH_S = 5.0  # how often a waiting handler checks that the engine is still alive


class Submitted:
    """Items of one call submitted to the engine, with their completion futures and stream progress.

    As SGLang's tokenizer manager (``_init_req_state``), the call's rids (one per prompt, before the
    ``n`` samples expand it) are held as in flight from the submission until the last of their items
    finishes; a call that reuses a rid in flight is refused with SGLang's 400. Each item that finishes
    is counted in the server's request metrics (when ``--enable-metrics``).
    """

    def __init__(self, request: web.Request, items: list[protocol.GenItem], streaming: bool = False) -> None:
        self.engine = request.app[ENGINE_KEY]
        state = request.app[STATE_KEY]
        self.tokenizer = state["tokenizer"]
        self.in_flight: dict[str, Submitted] = state.setdefault("rids_in_flight", {})
        self.metrics = state.get("metrics")
        self.streaming = streaming
        self.items = items
        self.left = Counter(item.client_rid for item in items)  # unfinished items per rid
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        self.done: list[asyncio.Future] = [self.loop.create_future() for _ in items]
        self.progress = [0] * len(items)  # tokens at the last stream notification (engine thread writes)
        self.reqs: list[Any] = []
        for i, item in enumerate(items):
            self.reqs.append(protocol.engine_request(
                item, self.tokenizer, self.engine.context_length, self._finisher(i),
                self._streamer(i, item.stream_interval) if streaming else None,
            ))

    def _finisher(self, i: int) -> Any:
        rid = self.items[i].client_rid

        def on_finish(req: Any) -> None:  # engine thread
            def settle() -> None:
                if not self.done[i].done():
                    self.done[i].set_result(req)
                    self._release(rid)
                    if self.metrics is not None:
                        self.metrics.observe(len(req.input_ids), len(req.output_ids),
                                             (req.finished_at or req.created_at) - req.created_at, self.streaming,
                                             (req.finish_reason or {}).get("type") == "abort")
                self.wake.set()

            self.loop.call_soon_threadsafe(settle)

        return on_finish

    def _streamer(self, i: int, interval: int) -> Any:
        def on_token(req: Any) -> None:  # engine thread
            n = len(req.output_ids)
            if n % interval == 0:
                self.progress[i] = n
                self.loop.call_soon_threadsafe(self.wake.set)

        return on_token

    def submit(self) -> Optional[tuple[int, str]]:
        """Submit every item, all or nothing: a bad one, or a rid already in flight, raises
        ``BadRequest`` (none runs); a dead engine gives ``(503, message)``."""
        for rid in self.left:
            if rid in self.in_flight:  # SGLang's message (TokenizerManager._init_req_state)
                raise BadRequest(f"Duplicate request ID detected: {rid}")
        self.in_flight.update(dict.fromkeys(self.left, self))
        submitted = []
        try:
            for req in self.reqs:
                self.engine.submit(req)
                submitted.append(req)
        except (ValueError, EngineDeadError) as exc:
            self.metrics = None  # a refused call is not counted, as in SGLang
            for rid in list(self.left):
                self.left[rid] = 0
                self._release(rid, force=True)
            if submitted and self.engine.alive:
                self.engine.cancel(submitted)
            if isinstance(exc, EngineDeadError):
                return 503, str(exc)
            raise BadRequest(str(exc)) from None
        return None

    def _release(self, rid: str, force: bool = False) -> None:
        """One item of ``rid`` finished: once all have (or ``force``), the rid is free again, if this
        call still holds it."""
        if not force:
            self.left[rid] -= 1
        if self.left[rid] <= 0 and self.in_flight.get(rid) is self:
            del self.in_flight[rid]

    async def finish(self) -> Optional[tuple[int, str]]:
        """Wait for every item; ``(status, message)`` of the first that failed, or None.

        A client that goes away (the handler is cancelled) frees the engine's slots.
        """
        try:
            await self.wait_all()
        except EngineDeadError as exc:
            return 503, str(exc)
        except asyncio.CancelledError:
            await asyncio.shield(self.cancel_unfinished())
            raise
        for req in self.reqs:
            failure = failure_of(req)
            if failure is not None:
                return failure
        return None

    async def wait_all(self) -> None:
        """Until every item finished; a dead engine ends the wait (its requests fail anyway)."""
        while not all(f.done() for f in self.done):
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=ENGINE_WATCH_S)
            except asyncio.TimeoutError:
                if not self.engine.alive:
                    raise EngineDeadError("The engine stopped while the request was waiting.") from None

    async def cancel_unfinished(self) -> None:
        left = [r for r, f in zip(self.reqs, self.done) if not f.done()]
        if left and self.engine.alive:
            await blocking(self.engine.cancel, left)


def failure_of(req: Any) -> Optional[tuple[int, str]]:
    """``(status, message)`` of a request that failed, or was aborted with an error status (SGLang:
    an ``abort_message`` makes it 503); None for one that finished (an abort included)."""
    if req.error is not None:
        return 503, f"Generation failed: {req.error}"
    reason = req.finish_reason or {}
    status = reason.get("status_code")
    if reason.get("type") == "abort" and isinstance(status, int) and 400 <= status < 600:
        return status, reason.get("message") or "Aborted"
    return None


async def apply_update(request: web.Request, tensors: dict[str, Any], version: Optional[str], abort: bool,
                        flush: bool = False, failure_fields: Optional[dict[str, Any]] = None) -> web.Response:
    """Load ``tensors`` between two decode steps. With ``flush`` on a paused engine whose requests
    still hold the cache (an ``in_place`` pause) the update fails after loading, as SGLang 0.5.23's
    ``flush_cache_after_weight_update`` does (unpaused, SGLang waits for running requests first;
    this engine loads in place and they go on). ``failure_fields`` join a failure's body (the
    endpoint's own fields in SGLang's answer)."""
    extra = failure_fields or {}
    engine = request.app[ENGINE_KEY]
    if abort:
        await blocking(engine.abort, "", True)
    from lightning_fasync.engine.lora import on_weight_update

    try:
        async with request.app[STATE_KEY]["weights_lock"]:  # never while /weights_checker reads them
            # A loaded LoRA adapter stays merged onto the new weights; they become its base only
            # once the engine has loaded them (a refused update leaves the base as it is).
            commit_lora = on_weight_update(request.app, tensors)
            n = await blocking(engine.update_weights, tensors, version)
            commit_lora()
    except ValueError as exc:
        return web.json_response({"success": False, "message": str(exc), **extra}, status=400)
    finally:
        tensors.clear()  # drop shared-memory and IPC mappings now, not at the next collection
    state = request.app[STATE_KEY]
    if state["weight_update_session"] is not None:
        state["weight_update_session"]["loaded"] = True
    if flush:  # the caches aborted requests left were computed under the old weights
        await blocking(engine.drop_kept_kv)
    if flush and engine.paused and not (await blocking(engine.flush_cache))[0]:
        return web.json_response({"success": False, "message": (
            "Weights were updated, but the cache was not flushed because requests are still running or queued. "
            "Retract or finish them, then call /flush_cache."), **extra}, status=400)
    return web.json_response(
        {"success": True, "message": f"Updated {n} tensors; weight_version={engine.weight_version}.", "num_paused_requests": 0}
    )


def outside_session(request: web.Request, endpoint: str) -> Optional[web.Response]:
    """SGLang 0.5.23 refuses tensor (and distributed) updates outside begin/end_weight_update."""
    state = request.app[STATE_KEY]
    if state["require_weight_update_session"] and state["weight_update_session"] is None:
        return web.json_response(
            {"success": False,
             "message": f"{endpoint} must run between begin_weight_update() and end_weight_update()"},
            status=400,
        )
    return None
