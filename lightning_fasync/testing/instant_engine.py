"""An in-process engine with no model, for the control-plane benchmark and pipeline tests.

It answers ``generate`` at once with deterministic tokens (or, with ``hold=True``, keeps every
request open until it is aborted), so the pipeline's own overhead can be measured and its
step-boundary behaviour exercised without a model. Not a stand-in for a real engine in training.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Callable, Optional

from lightning_fasync.pipeline.engine_client import EngineClient, GenerateRequest, GenerateResult


class InstantEngine(EngineClient):
    """Replies immediately; ``length_fn(rid) -> int`` sets the response length.

    Arguments:
        length_fn: response length per request id (default: 1–16 tokens from a hash of the rid).
        hold: keep requests open until ``abort``/``abort_all`` (then return 1 token, finish abort).
        version_fn: the weight version to stamp on tokens.
        fail_fn: ``rid -> bool``; True makes that request raise (engine error).
    """

    def __init__(
        self,
        length_fn: Optional[Callable[[str], int]] = None,
        hold: bool = False,
        version_fn: Callable[[], int] = lambda: 0,
        fail_fn: Optional[Callable[[str], bool]] = None,
    ) -> None:
        self.length_fn = length_fn or (lambda rid: 1 + zlib.crc32(rid.encode()) % 16)
        self.hold = hold
        self.version_fn = version_fn
        self.fail_fn = fail_fn
        self._held: dict[str, asyncio.Future] = {}
        self.requests = 0
        self.aborts = 0

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests += 1
        if self.fail_fn is not None and self.fail_fn(request.rid):
            raise ConnectionError(f"instant engine: request {request.rid} failed")
        version = self.version_fn()
        if self.hold:
            fut = asyncio.get_running_loop().create_future()
            self._held[request.rid] = fut
            try:
                await fut
            finally:
                self._held.pop(request.rid, None)
            return GenerateResult(request.rid, [7], [-0.5], [version], "abort", len(request.input_ids))
        n = min(self.length_fn(request.rid), request.sampling_params.max_new_tokens)
        reason = "stop" if n < request.sampling_params.max_new_tokens else "length"
        return GenerateResult(request.rid, [5] * n, [-1.0] * n, [version] * n, reason, len(request.input_ids))

    async def generate_batch(self, requests):
        if self.fail_fn is not None:
            return await super().generate_batch(requests)
        if self.hold:
            # One future per request, awaited together: a batching engine (SGLang takes a list of
            # prompts in one /generate) keeps no task per request.
            loop = asyncio.get_running_loop()
            futs = []
            for request in requests:
                self.requests += 1
                fut = loop.create_future()
                self._held[request.rid] = fut
                futs.append(fut)
            version = self.version_fn()
            try:
                await asyncio.gather(*futs)
            finally:
                for request in requests:
                    self._held.pop(request.rid, None)
            return [GenerateResult(r.rid, [7], [-0.5], [version], "abort", len(r.input_ids)) for r in requests]
        # The fast path: no task per request, so the benchmark measures the pipeline.
        out = []
        version = self.version_fn()
        for request in requests:
            self.requests += 1
            n = min(self.length_fn(request.rid), request.sampling_params.max_new_tokens)
            reason = "stop" if n < request.sampling_params.max_new_tokens else "length"
            out.append(GenerateResult(request.rid, [5] * n, [-1.0] * n, [version] * n, reason, len(request.input_ids)))
        return out

    async def abort(self, rid: str) -> None:
        for key in [k for k in self._held if k.startswith(rid)]:
            fut = self._held.get(key)
            if fut is not None and not fut.done():
                fut.set_result(None)
                self.aborts += 1

    async def abort_all(self) -> None:
        await self.abort("")
