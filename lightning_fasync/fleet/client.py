"""An aiohttp client for SGLang's native API: the ``EngineClient`` the rollout producer uses.

``/generate`` goes to one URL (the router when there is one, else the single engine). Admin calls
(abort, pause, continue, weight updates, flush, health) fan out to every worker, because the
router does not proxy them. Works the same against the embedded engine and a real SGLang server.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Mapping, Optional, Sequence

import aiohttp

from lightning_fasync.pipeline.engine_client import SKIPPED, EngineClient, EngineError, EngineFault, GenerateRequest, GenerateResult
from lightning_fasync.fleet.workers import EngineLostError, WorkerSet

RETRYABLE_STATUS = (502, 503, 504)  # router without a healthy worker, worker restarting
# Statuses with which the router reports a worker that went away mid-request.
LOST_WORKER_STATUS = (500, *RETRYABLE_STATUS)


class EngineUnavailable(EngineFault):
    """The engine (or router) did not answer: connection refused or reset, or 502/503/504 after retries."""


def parse_version(label: Any) -> int:
    """An SGLang weight-version label as the pipeline's integer version.

    SGLang's initial label is ``"default"``, read as version 0; every other label must be an integer
    (the trainer sets them, see ``update_weights_*``).
    """
    if label is None or label == "default":
        return 0
    try:
        return int(label)
    except (TypeError, ValueError):
        raise EngineError(f"Weight version label {label!r} is not an integer; set integer versions on weight updates.") from None


def _span(entry: Any) -> tuple[int, int, Any]:
    """``(start, end, label)`` of one span: SGLang 0.5.23's ``{"version", "start", "end"}``."""
    if isinstance(entry, Mapping):
        try:
            return int(entry["start"]), int(entry["end"]), entry["version"]
        except (KeyError, TypeError, ValueError):
            raise EngineError(f"Malformed weight-version span {entry!r}.") from None
    raise EngineError(f"Malformed weight-version span {entry!r} (expected an object with version, start, end).")


def expand_versions(meta_info: Mapping[str, Any], num_tokens: int) -> list[int]:
    """One version per output token from ``meta_info``.

    Reads SGLang 0.5.23's ``weight_versions`` spans ``[{"version", "start", "end"}, ...]`` (end
    exclusive); from a server that reports no spans (SGLang 0.5.15), the single ``weight_version``
    for every token.
    """
    spans = meta_info.get("weight_versions")
    if spans is None:
        return [parse_version(meta_info.get("weight_version"))] * num_tokens
    if num_tokens == 0:
        return []
    versions = [0] * num_tokens
    covered = 0
    for start, end, label in map(_span, spans):
        if not 0 <= start <= end <= num_tokens:
            raise EngineError(f"Weight-version span [{start}, {end}) is outside the {num_tokens} output tokens.")
        versions[start:end] = [parse_version(label)] * (end - start)
        covered += end - start
    if covered != num_tokens:
        raise EngineError(f"Weight-version spans cover {covered} of {num_tokens} output tokens.")
    return versions


def parse_generate_response(rid: str, data: Mapping[str, Any]) -> GenerateResult:
    """Turn SGLang's ``/generate`` JSON into a ``GenerateResult``."""
    meta = data.get("meta_info") or {}
    output_ids = list(data.get("output_ids") or [])
    logprobs = meta.get("output_token_logprobs") or []
    if len(logprobs) != len(output_ids):
        raise EngineError(f"Request {rid}: {len(output_ids)} output tokens but {len(logprobs)} log-probs.")
    finish = meta.get("finish_reason") or {}
    reason = finish.get("type") if isinstance(finish, dict) else finish
    if reason not in ("stop", "length", "abort"):
        raise EngineError(f"Request {rid}: unexpected finish_reason {finish!r}.")
    return GenerateResult(
        rid=rid,
        output_ids=output_ids,
        output_log_probs=[float(entry[0]) for entry in logprobs],
        weight_versions=expand_versions(meta, len(output_ids)),
        finish_reason=reason,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        meta_info=dict(meta),
    )


SGLANG_PROTOCOLS = ("0.5.15", "0.5.23")
"""The SGLang HTTP API versions this client speaks."""


@dataclass(frozen=True)
class ServerProtocol:
    """What one server says of its SGLang API (:func:`server_protocol`)."""

    protocol: str
    """``0.5.15`` or ``0.5.23``: the API the server speaks."""
    version: Optional[str] = None
    """The version ``/get_server_info`` reports; None when only ``/model_info`` answered."""
    update_bracket: Optional[bool] = None
    """Whether it has ``/begin_weight_update`` ... ``/end_weight_update``; None: not known from the
    version (probed at the first weight update)."""


def server_protocol(server_info: Optional[Mapping[str, Any]], model_info: Optional[Mapping[str, Any]] = None) -> ServerProtocol:
    """The API a server speaks, from its ``/get_server_info`` (its ``version``) or, failing that,
    its ``/model_info`` (0.5.23 added ``served_model_name``, ``load_format`` and the parsers to it).

    SGLang 0.5.23 has the weight-update bracket and 0.5.15 does not; a release in between (or an
    answer that only ``/model_info`` gives) leaves it unknown.
    """
    from packaging.version import InvalidVersion, Version

    reported = (server_info or {}).get("version")
    if reported:
        try:
            version = Version(str(reported))
        except InvalidVersion:
            version = None
        if version is not None:
            if version.release[:3] >= (0, 5, 23):
                return ServerProtocol("0.5.23", str(reported), True)
            if version.release[:3] <= (0, 5, 15):
                return ServerProtocol("0.5.15", str(reported), False)
            return ServerProtocol("0.5.15", str(reported), None)
    newer = model_info is not None and "served_model_name" in model_info and "load_format" in model_info
    return ServerProtocol("0.5.23" if newer else "0.5.15", str(reported) if reported else None, None)


class SGLangClient(EngineClient):
    """``EngineClient`` over HTTP for SGLang-compatible servers (embedded engine or real SGLang).

    Args:
        worker_urls: Every engine replica (admin calls go to all of them).
        router_url: The sglang-router in front of them; ``/generate`` goes there. None: this client
            routes each ``/generate`` to the least busy serving worker itself (the client-side
            balancing verl's and TRL's clients do; one worker: that one).
        api_key: Sent as ``Authorization: Bearer``.
        max_connections: Concurrent HTTP connections.
        retries: Retries of a call after connection errors (and 502/503/504).
        retry_backoff_s: First retry delay; doubles each time.
        generate_timeout_s: Deadline of one ``/generate``, pauses included (``rollout.request_timeout``);
            past it the request fails with an ``EngineError`` and is not retried.
        admin_timeout_s: Deadline of one admin call.
        workers: The serving replicas, shared with an
            :class:`~lightning_fasync.fleet.supervisor.EngineSupervisor` (``RolloutPool.client``
            passes it). With it, admin calls go to serving replicas only (a call to a replica that
            leaves the set is abandoned), and a ``/generate`` whose replica or router went away is
            sent again once one serves, within ``rollout.engine_restart.timeout_s``. Without it,
            ``worker_urls`` is fixed and such a request fails.
        lora_name: The LoRA adapter every ``/generate`` names (SGLang's ``lora_path`` field, the
            name given to ``/load_lora_adapter``); None: none named.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        router_url: Optional[str] = None,
        api_key: Optional[str] = None,
        max_connections: int = 512,
        retries: int = 3,
        retry_backoff_s: float = 0.5,
        generate_timeout_s: float = 3600.0,
        admin_timeout_s: float = 300.0,
        workers: Optional[WorkerSet] = None,
        lora_name: Optional[str] = None,
    ) -> None:
        if not worker_urls:
            raise ValueError("SGLangClient needs at least one worker URL.")
        self.supervised = workers is not None
        self.workers = workers if workers is not None else WorkerSet([u.rstrip("/") for u in worker_urls])
        self.generate_url = (router_url or worker_urls[0]).rstrip("/")
        self.routed = router_url is not None
        self._busy: dict[str, int] = {}  # worker URL -> generation requests this client has there
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_connections = max_connections
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.generate_timeout_s = generate_timeout_s
        self.admin_timeout_s = admin_timeout_s
        self._session: Optional[aiohttp.ClientSession] = None
        self._has_update_bracket: Optional[bool] = None  # probed once: SGLang >= 0.5.23 has it
        self.protocols: Optional[list[ServerProtocol]] = None  # per worker, from detect_protocol()
        self.lora_name = lora_name
        self.max_lora_rank: Optional[int] = None  # the servers' largest LoRA rank, where they have one
        self.max_lora_rank_key = "rollout.sglang_args.max_lora_rank"  # the key that sets it

    @property
    def worker_urls(self) -> list[str]:
        """The replicas admin calls go to (the serving ones, when supervised)."""
        return self.workers.urls

    def clone(self) -> "SGLangClient":
        """A client of the same servers with connections of its own, for another event loop (an
        aiohttp session belongs to the loop that opened it); the serving set stays shared."""
        other = copy.copy(self)
        other._session, other._busy = None, {}
        return other

    async def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections), headers=self.headers
            )
        return self._session

    async def _request(self, method: str, url: str, body: Optional[dict] = None, timeout: Optional[float] = None,
                       missing_ok: bool = False, timeout_key: Optional[str] = None, retries: Optional[int] = None) -> Any:
        """One call with retries on connection errors; returns the parsed JSON (or text).

        ``missing_ok``: a 404 (an endpoint this server version lacks) returns None instead of raising.
        ``timeout_key``: a call that runs past ``timeout`` is not retried (a hung engine would hang
        every retry too) but fails at once, naming this config key.
        ``retries``: instead of the client's own.
        """
        session = await self._http()
        client_timeout = aiohttp.ClientTimeout(total=timeout or self.admin_timeout_s, sock_connect=10)
        last: Optional[BaseException] = None
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                async with session.request(method, url, json=body, timeout=client_timeout) as resp:
                    text = await resp.text()
                    if resp.status in RETRYABLE_STATUS:
                        last = EngineError(f"{method} {url} answered {resp.status}: {text[:500]}", status=resp.status)
                        continue
                    if resp.status == 404 and missing_ok:
                        return None
                    if resp.status != 200:
                        raise EngineError(f"{method} {url} answered {resp.status}: {text[:500]}", status=resp.status)
                    if resp.content_type == "application/json":
                        return await resp.json()
                    return text
            except asyncio.TimeoutError as exc:
                if timeout_key is not None:
                    raise EngineFault(
                        f"{method} {url} did not answer within {client_timeout.total:g} s (`{timeout_key}`); "
                        "the engine is hung or overloaded."
                    ) from exc
                last = exc
            except aiohttp.ClientConnectionError as exc:
                last = exc
        raise EngineUnavailable(f"{method} {url} failed after {retries + 1} attempts: {last!r}") from last

    async def _all_workers(self, method: str, path: str, body: Optional[dict] = None, missing_ok: bool = False) -> list[Any]:
        """One call per serving worker; workers that left the serving set meanwhile are left out."""
        results = await asyncio.gather(*(self._on_worker(u, self._request(method, u + path, body, missing_ok=missing_ok))
                                         for u in self.worker_urls))
        return [r for r in results if r is not SKIPPED]

    async def _on_worker(self, url: str, call: Awaitable[Any]) -> Any:
        """Await ``call`` to ``url``; abandon it (``SKIPPED``) if the supervisor takes ``url`` out of
        service meanwhile, so a dead or hung replica never holds up a pause or a weight sync."""
        if not self.supervised:
            return await call
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if done:
                    try:
                        return task.result()
                    except EngineError:
                        # Give the supervisor a poll interval to notice a dead replica.
                        for _ in range(8):
                            if not self.workers.is_live(url):
                                return SKIPPED
                            await asyncio.sleep(0.25)
                        raise
                if not self.workers.is_live(url):
                    task.cancel()
                    return SKIPPED
        finally:
            if not task.done():
                task.cancel()

    async def detect_protocol(self) -> list[ServerProtocol]:
        """Ask every worker which SGLang API it speaks (``/get_server_info``'s ``version``, else
        ``/model_info``); when that settles whether they have the weight-update bracket, it is used
        instead of probing ``/begin_weight_update``."""

        async def one(url: str) -> ServerProtocol:
            info = await self._request("GET", url + "/get_server_info", missing_ok=True)
            info = info if isinstance(info, Mapping) else None
            model = None
            if not (info and info.get("version")):
                model = await self._request("GET", url + "/model_info", missing_ok=True)
            return server_protocol(info, model if isinstance(model, Mapping) else None)

        found = [p for p in await asyncio.gather(*(self._on_worker(u, one(u)) for u in self.worker_urls))
                 if p is not SKIPPED]
        self.protocols = found
        brackets = {p.update_bracket for p in found}
        if self._has_update_bracket is None and len(brackets) == 1 and None not in brackets:
            self._has_update_bracket = brackets.pop()
        return found

    @property
    def protocol(self) -> Optional[str]:
        """The oldest API among the workers (``0.5.15`` or ``0.5.23``), once detected; else None."""
        return min((p.protocol for p in self.protocols), key=SGLANG_PROTOCOLS.index) if self.protocols else None

    async def begin_weight_update(self) -> bool:
        """Open SGLang 0.5.23's weight-update bracket on every worker; False where servers lack it (0.5.15)."""
        if self._has_update_bracket is None and self.protocols is None:
            await self.detect_protocol()  # the version decides; a probe only where it cannot
        if self._has_update_bracket is False:
            return False
        results = await self._all_workers("POST", "/begin_weight_update", {}, missing_ok=self._has_update_bracket is None)
        if self._has_update_bracket is None:
            self._has_update_bracket = all(r is not None for r in results)
        if self._has_update_bracket:
            self._check_success(results, "begin_weight_update")
        return self._has_update_bracket

    async def end_weight_update(self) -> None:
        """Close the bracket ``begin_weight_update`` opened."""
        if self._has_update_bracket:
            self._check_success(await self._all_workers("POST", "/end_weight_update", {}), "end_weight_update")

    # -------------------------------------------------------------- EngineClient

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        body = {
            "rid": request.rid,
            "input_ids": list(request.input_ids),
            "sampling_params": request.sampling_params.to_dict(),
            "return_logprob": True,
        }
        if self.lora_name is not None:
            body["lora_path"] = self.lora_name
        data = await self._generate(request, body)
        if data is None:
            return GenerateResult(rid=request.rid, output_ids=[], output_log_probs=[], weight_versions=[],
                                  finish_reason="abort", prompt_tokens=len(request.input_ids))
        if not isinstance(data, dict):
            raise EngineError(f"Request {request.rid}: /generate returned non-JSON: {str(data)[:300]}")
        return parse_generate_response(request.rid, data)

    async def _generate(self, request: GenerateRequest, body: dict) -> Any:
        """POST ``/generate``; when supervised, wait for a serving replica first and send again after
        the replica (or router) went away mid-request. None: ``abort_all`` ran while it waited.

        Supervised, a request goes only to a serving replica (or the router, which has only those)
        and is not retried on its own: a replica taken out of service restarts on its URL and must
        not serve before it holds the trainer's weights and is put back (``RolloutPool.restart_replica``);
        the retry waits for the supervisor instead."""
        if not self.supervised:
            return await self._post_generate(self._generate_url(), request, body)
        epoch = self.workers.abort_epoch
        deadline = time.monotonic() + self.workers.wait_timeout_s
        while True:
            if not await self.workers.wait_available(epoch):
                return None
            serving = self.workers.urls
            url = self._generate_url()
            if not self.routed and url not in serving:
                continue  # the replica left between the wait and now: wait again
            try:
                return await self._post_generate(url, request, body, retries=0)
            except EngineError as exc:
                if not isinstance(exc, EngineUnavailable):
                    # A router answers 500 for a request whose worker died under it; any other
                    # error, or a 500 while the serving set stays as it was, is the request's own.
                    if exc.status not in LOST_WORKER_STATUS or not await self._set_changed(serving):
                        raise
                if self.workers.abort_epoch != epoch:
                    return None
                if time.monotonic() > deadline:
                    raise EngineLostError(
                        f"Request {request.rid}: no engine served it within {self.workers.wait_timeout_s:g} s "
                        f"(`rollout.engine_restart.timeout_s`); last error: {exc}"
                    ) from exc
                await asyncio.sleep(0.25)  # the supervisor notices the lost replica meanwhile

    generate_path = "/generate"
    """Where a generation request goes on ``_generate_url()``."""

    def _generate_url(self) -> str:
        """The router, or the least busy serving worker: where the next generation request goes."""
        if self.routed:
            return self.generate_url
        live = self.worker_urls or [self.generate_url]
        return min(live, key=lambda u: self._busy.get(u, 0))

    async def _post_generate(self, url: str, request: GenerateRequest, body: dict, retries: Optional[int] = None) -> Any:
        """One generation call to ``url``, counted while it runs (:meth:`_generate_url`)."""
        self._busy[url] = self._busy.get(url, 0) + 1
        try:
            return await self._request("POST", url + self.generate_path, body, timeout=self.generate_timeout_s,
                                       timeout_key="rollout.request_timeout", retries=retries)
        finally:
            self._busy[url] -= 1

    async def _set_changed(self, before: list[str], wait_s: float = 2.0) -> bool:
        """True once the serving set differs from ``before`` (a replica lost), within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            if self.workers.urls != before or not self.workers.available():
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)

    async def abort(self, rid: str) -> None:
        await self._all_workers("POST", "/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        self.workers.bump_abort()  # requests waiting for a serving replica return aborted
        await self._all_workers("POST", "/abort_request", {"abort_all": True})

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    # -------------------------------------------------------------- admin, every worker

    async def pause(self, mode: str = "abort") -> None:
        """``/pause_generation`` on every worker (``abort`` or ``in_place``)."""
        await self._all_workers("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """``/continue_generation`` on every worker."""
        await self._all_workers("POST", "/continue_generation", {})

    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """SGLang's ``/release_memory_occupation`` on every worker: free the memory of ``tags``
        (``weights``, ``kv_cache``, ``cuda_graph``; None: all) until :meth:`resume_memory_occupation`.
        The workers must be idle; they free memory only when started with ``--enable-memory-saver``.
        Each call is bounded by ``admin_timeout_s``."""
        await self._all_workers("POST", "/release_memory_occupation", {"tags": None if tags is None else list(tags)})

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        """SGLang's ``/resume_memory_occupation`` on every worker: reallocate what ``tags`` released.
        Resumed weights hold no trained values until the next weight update."""
        await self._all_workers("POST", "/resume_memory_occupation", {"tags": None if tags is None else list(tags)})

    async def update_weights_from_disk(self, model_path: str, weight_version: Optional[int] = None, flush_cache: bool = True) -> None:
        """Every worker loads safetensors weights from ``model_path`` (a directory or file)."""
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        self._check_success(await self._all_workers("POST", "/update_weights_from_disk", body))

    async def update_weights_from_tensor(self, named_tensors: Mapping[str, Any], weight_version: Optional[int] = None,
                                         bucket_bytes: int = 512 * 2**20) -> None:
        """Same-host update in SGLang's own format: ``/update_weights_from_tensor`` with flattened
        buckets serialised as SGLang's ``MultiprocessingSerializer`` does (shared memory on CPU, CUDA
        IPC on GPU), inside the weight-update bracket where the servers have it. It does not pause
        generation; a trainer's sync goes through :mod:`~lightning_fasync.weights.sync`, which does.

        Raises:
            WeightSyncError: an ``EngineError`` naming the engine that failed.
        """
        from lightning_fasync.weights.sync import TensorWeightSync

        sync = TensorWeightSync(self, bucket_bytes=bucket_bytes, timeout_s=self.admin_timeout_s, pause_mode=None)
        await sync.push(named_tensors, weight_version)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> None:
        """SGLang's ``/load_lora_adapter`` on every worker: load the adapter directory ``lora_path``
        (peft's saved format) under ``lora_name``. Sent once to each (:meth:`_lora_call`).

        Raises:
            EngineError: a worker refused (its ``error_message``) or did not answer.
        """
        body = {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        await self._lora_all("/load_lora_adapter", body)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """SGLang's ``/unload_lora_adapter`` on every worker. Sent once to each (:meth:`_lora_call`).

        Raises:
            EngineError: a worker refused (the adapter is not loaded there, say) or did not answer.
        """
        await self._lora_all("/unload_lora_adapter", {"lora_name": lora_name})

    async def _lora_all(self, path: str, body: dict[str, Any]) -> None:
        async def one(url: str) -> None:
            self._check_lora(url, path, await self._lora_call(url, path, body))

        await asyncio.gather(*(self._on_worker(u, one(u)) for u in self.worker_urls))

    async def _lora_call(self, url: str, path: str, body: dict[str, Any], timeout: Optional[float] = None,
                         timeout_key: str = "admin_timeout_s") -> dict[str, Any]:
        """One ``path`` (``/load_lora_adapter`` or ``/unload_lora_adapter``) call to the worker ``url``,
        sent once whatever happens: neither is idempotent (a load repeated after a timeout finds the
        adapter loaded, or loads it twice), so unlike :meth:`_request` there is no retry on a timeout,
        a lost connection or a 5xx. The one implementation of these calls: ``rollout.weight_sync:
        adapter`` (:class:`~lightning_fasync.weights.lora_sync.AdapterWeightSync`) uses it too.

        Returns:
            SGLang's answer (``LoRAUpdateOutput``: ``success``, ``error_message``, ``loaded_adapters``),
            a refusal (400) included.

        Raises:
            EngineFault: no answer within ``timeout`` (default ``admin_timeout_s``), named as ``timeout_key``.
            EngineUnavailable: the connection failed.
            EngineError: any other status, or an answer that is not such an object.
        """
        status, text = await self._post_once(url, path, body, timeout, timeout_key)
        try:
            answer = json.loads(text) if text else None
        except ValueError:
            answer = None
        if status not in (200, 400) or not isinstance(answer, dict):
            raise EngineError(f"POST {url}{path} answered {status}: {text[:500]}", status=status)
        return answer

    async def _post_once(self, url: str, path: str, body: dict[str, Any], timeout: Optional[float] = None,
                         timeout_key: str = "admin_timeout_s") -> tuple[int, str]:
        """``POST url + path`` sent once, never again (an adapter load or unload is not idempotent):
        the status and the answer's text.

        Raises:
            EngineFault: no answer within ``timeout`` (default ``admin_timeout_s``), named as ``timeout_key``.
            EngineUnavailable: the connection failed.
        """
        session = await self._http()
        total = timeout or self.admin_timeout_s
        try:
            async with session.post(url + path, json=body,
                                    timeout=aiohttp.ClientTimeout(total=total, sock_connect=10)) as resp:
                return resp.status, await resp.text()
        except asyncio.TimeoutError as exc:
            raise EngineFault(f"POST {url}{path} did not answer within {total:g} s (`{timeout_key}`); it was not "
                              "sent again, as adapter loads and unloads are not idempotent.") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"POST {url}{path} failed and was not sent again, as adapter loads and unloads "
                                    f"are not idempotent: {exc!r}") from exc

    @staticmethod
    def _check_lora(url: str, path: str, answer: dict[str, Any]) -> None:
        """Raise ``EngineError`` unless ``answer`` (of :meth:`_lora_call`) says the call succeeded."""
        if answer.get("success") is not True:
            message = answer.get("error_message") or str(answer)
            raise EngineError(f"{url} refused {path}: {str(message)[:500]}", status=400)

    async def swap_lora_adapter(self, url: str, name: str, directory: str, version: Optional[int],
                                timeout: float, timeout_key: str) -> None:
        """Replace the adapter ``name`` on the worker ``url`` with the one in ``directory`` (peft's
        saved format), with SGLang 0.5.23's API: ``/unload_lora_adapter`` of the previous one (one
        that was not loaded, as after a restart, is no error), ``/load_lora_adapter`` under the same
        name, ``/update_weight_version``. The LoRA calls are sent once each (:meth:`_lora_call`).

        Raises:
            EngineError: the worker refused a call or did not answer within ``timeout``.
        """
        path = "/unload_lora_adapter"
        answer = await self._lora_call(url, path, {"lora_name": name}, timeout, timeout_key)
        if name in (answer.get("loaded_adapters") or {}):
            self._check_lora(url, path, answer)
        path = "/load_lora_adapter"
        self._check_lora(url, path, await self._lora_call(url, path, {"lora_name": name, "lora_path": directory},
                                                          timeout, timeout_key))
        if version is not None:
            await self._request("POST", url + "/update_weight_version",
                                {"new_version": str(version), "abort_all_requests": False},
                                timeout=timeout, timeout_key=timeout_key)

    async def commit_lora_adapter(self, name: str, version: Optional[int], urls: Sequence[str], timeout: float,
                                  timeout_key: str) -> None:
        """Every worker in ``urls`` loaded the adapter of ``version`` (:meth:`swap_lora_adapter`):
        nothing more to do on SGLang's API, whose adapter keeps its name across loads."""

    async def update_lora_adapter(self, adapter: Mapping[str, Any], weight_version: Optional[int] = None) -> None:
        """Replace the trainer's adapter on every worker (``rollout.weight_sync: adapter``'s client
        method): ``adapter`` is an :class:`~lightning_fasync.lora.AdapterWeights`, written into each
        worker's LoRA directory and loaded there (:class:`~lightning_fasync.weights.lora_sync.AdapterWeightSync`;
        no pause: a trainer's sync goes through the weight sync, which pauses).

        Raises:
            WeightSyncError: an ``EngineError`` naming the engine that failed.
        """
        from lightning_fasync.weights.lora_sync import AdapterWeightSync

        sync = AdapterWeightSync(self, timeout_s=self.admin_timeout_s, pause_mode=None)
        try:
            await sync.push(adapter, weight_version)
        finally:
            await sync.rpc.close()

    async def update_weight_version(self, weight_version: int) -> None:
        """Relabel the current weights on every worker."""
        # SGLang aborts every request first unless told otherwise; a relabel must not.
        await self._all_workers("POST", "/update_weight_version",
                                {"new_version": str(weight_version), "abort_all_requests": False})

    async def flush_cache(self) -> None:
        await self._all_workers("POST", "/flush_cache")

    async def health(self) -> bool:
        """True when every worker answers ``/health`` with 200."""
        try:
            await self._all_workers("GET", "/health")
        except EngineError:
            return False
        return True

    async def model_info(self) -> list[dict[str, Any]]:
        """``/model_info`` of every worker (includes ``weight_version``)."""
        return await self._all_workers("GET", "/model_info")

    async def loads(self) -> list[dict[str, Any]]:
        """``/v1/loads`` of every worker."""
        return await self._all_workers("GET", "/v1/loads")

    @staticmethod
    def _check_success(results: list[Any], what: str = "Weight update") -> None:
        for r in results:
            if isinstance(r, dict) and r.get("success") is False:
                raise EngineError(f"{what} failed: {r.get('message')}")

    async def weight_checksums(self) -> list[dict[str, str]]:
        """SGLang's ``/weights_checker`` (action ``checksum``) on every worker.

        Returns:
            Per worker, in ``worker_urls`` order (less any that left the serving set meanwhile),
            the tensor name -> checksum map of its rank 0 (``ranks[0]["checksums"]``);
            ``weights.checksum.compare`` checks one against the trainer's ``checksums``.

        Raises:
            EngineError: A worker refused (the message names it), or answered without checksums.
        """
        urls = list(self.worker_urls)
        results = await self._all_workers("POST", "/weights_checker", {"action": "checksum"})
        # Workers that left the serving set meanwhile are missing from ``results``.
        names = urls if len(results) == len(urls) else ["one of " + ", ".join(urls)] * len(results)
        out: list[dict[str, str]] = []
        for url, r in zip(names, results):
            ranks = r.get("ranks") if isinstance(r, dict) else None
            rank0 = ranks[0] if isinstance(ranks, list) and ranks else None
            sums = rank0.get("checksums") if isinstance(rank0, dict) else None
            if not isinstance(r, dict) or r.get("success") is not True or not isinstance(sums, dict):
                message = r.get("message") if isinstance(r, dict) else None
                raise EngineError(f"/weights_checker on {url} gave no checksums: {message or str(r)[:300]}")
            out.append(dict(sums))
        return out
