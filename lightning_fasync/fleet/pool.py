"""A pool of embedded engine replicas, with the real sglang-router in front when there are several.

The pool also keeps what a replica needs to come back after a fault (see
:mod:`~lightning_fasync.fleet.supervisor`): the set of serving URLs its clients share, the last
weights the trainer pushed (:class:`~lightning_fasync.weights.sync.KeptWeights`: shared-memory
buckets or a directory, replaced at each sync), and the checksums the replicas had at the start.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlparse

from lightning_fasync.pipeline.engine_client import EngineError
from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.fleet.launch import (SERVE, STARTUP_TIMEOUT_S, ServerHandle, launch_router, launch_server,
                                         server_args, server_env)
from lightning_fasync.fleet.supervisor import EngineSupervisor
from lightning_fasync.fleet.workers import WorkerSet
from lightning_fasync.weights.sync import KeptWeights, push_kept

JOIN_TIMEOUT_S = 120.0
"""Longest a restarted replica may take to load the kept weights and report its checksums."""


class RolloutPool:
    """Start ``num_replicas`` engine processes (+ sglang-router when more than one) and hand out clients.

    Args:
        model: Local HF directory or preset name, served by every replica.
        num_replicas: Engine processes.
        threads_per_replica: torch threads per replica.
        max_running_requests: Engine concurrency limit per replica.
        cpu_cores: Optional per-replica core lists (``cpu_cores[i]`` pins replica ``i``).
        api_key: Bearer token required by the engines.
        context_length: Tokens per request.
        router_policy: sglang-router policy.
        startup_timeout: Seconds each replica has to become healthy.
        server_args: More server flags for every replica (e.g. ``--enable-memory-saver``).
        placement: Where the replicas run: None, this host (each a child process, pinned to
            ``cpu_cores``); or a :class:`~lightning_fasync.fleet.ray_placement.RayPlacement`, other
            nodes of a Ray cluster (``rollout.placement: ray``; its API key guards every replica).
    """

    def __init__(
        self,
        model: str,
        num_replicas: int = 1,
        threads_per_replica: int = 1,
        max_running_requests: Optional[int] = None,
        cpu_cores: Optional[Sequence[Sequence[int]]] = None,
        api_key: Optional[str] = None,
        context_length: Optional[int] = None,
        router_policy: str = "round_robin",
        startup_timeout: float = STARTUP_TIMEOUT_S,
        server_args: Sequence[str] = (),
        placement: Any = None,
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}.")
        if cpu_cores is not None and len(cpu_cores) != num_replicas:
            raise ValueError(f"cpu_cores has {len(cpu_cores)} entries for {num_replicas} replicas.")
        self.model = model
        self.num_replicas = num_replicas
        self.threads_per_replica = threads_per_replica
        self.max_running_requests = max_running_requests
        self.cpu_cores = cpu_cores
        self.api_key = api_key
        self.context_length = context_length
        self.router_policy = router_policy
        self.startup_timeout = startup_timeout
        self.server_args = list(server_args)
        self.placement = placement
        if placement is not None:
            self.api_key = placement.api_key
        # Memory tags the replicas hold released now (colocate offload); a restarted replica joins so.
        self.released_tags: set[str] = set()
        self.servers: list[ServerHandle] = []
        self.router: Optional[ServerHandle] = None
        self.workers = WorkerSet([])
        # Held by a weight sync and by a replica joining, so a joiner never misses a version.
        self.sync_lock = threading.RLock()
        self.weights: Optional[KeptWeights] = None  # the last sync's weights
        self.initial_checksums: Optional[dict[str, str]] = None
        self.supervisor: Optional[EngineSupervisor] = None

    def start(self) -> "RolloutPool":
        """Start the replicas in parallel, wait for them, then the router. Stops everything on failure."""
        try:
            if self.placement is not None:
                self.placement.check_fits(self.num_replicas, self.threads_per_replica, 0)
            for i in range(self.num_replicas):
                self.servers.append(self._relaunch(i, None))
            for server in self.servers:
                server.wait_healthy(self.startup_timeout, self.api_key)
            # Replicas on other nodes require the API key on /health too, which sglang-router's probes do
            # not send: there the client routes each request to the least busy replica itself.
            if self.num_replicas > 1 and self.placement is None:
                self.router = launch_router(self.worker_urls, policy=self.router_policy, api_key=self.api_key)
            self.workers = WorkerSet(self.worker_urls, router=self.router is not None)
        except BaseException:
            self.stop()
            raise
        return self

    def supervise(self, max_attempts: int = 3, backoff_s: float = 2.0, timeout_s: float = 300.0,
                  hang_timeout_s: float = 60.0, poll_s: float = 0.5, emit: Optional[Callable[..., None]] = None,
                  on_fatal: Optional[Callable[[BaseException], None]] = None) -> EngineSupervisor:
        """Start the :class:`EngineSupervisor` (``rollout.engine_restart.*``); records the replicas'
        starting checksums, which a replica restarted before the first weight sync must match."""
        if self.supervisor is not None:
            return self.supervisor
        sums = asyncio.run(self._checksums(self.worker_urls))
        for url, other in zip(self.worker_urls[1:], sums[1:]):
            if other != sums[0]:
                raise EngineError(f"The engine replicas started with different weights ({self.worker_urls[0]} and {url}).")
        self.initial_checksums = sums[0]
        self.workers.wait_timeout_s = timeout_s
        self.supervisor = EngineSupervisor(
            self, max_attempts=max_attempts, backoff_s=backoff_s, timeout_s=timeout_s, hang_timeout_s=hang_timeout_s,
            poll_s=poll_s, emit=emit, on_fatal=on_fatal,
        ).start()
        return self.supervisor

    @property
    def worker_urls(self) -> list[str]:
        """Every replica's URL, serving or not (see ``workers`` for the serving ones)."""
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """Where ``/generate`` goes: the router, or the only replica."""
        if not self.servers:
            raise RuntimeError("The pool is not started.")
        return self.router.url if self.router is not None else self.servers[0].url

    def client(self, **kwargs: Any) -> SGLangClient:
        """A new client for this pool (router for generate, the serving workers for admin calls)."""
        router_url = self.router.url if self.router is not None else None
        return SGLangClient(self.worker_urls, router_url=router_url, api_key=self.api_key, workers=self.workers, **kwargs)

    # ------------------------------------------------------------------ weights kept for restarts

    def keep_weights(self, kept: KeptWeights) -> None:
        """Remember the weights just pushed and release the previous ones. A restarted replica
        loads these before it serves."""
        with self.sync_lock:
            previous, self.weights = self.weights, kept
        if previous is not None and previous is not kept:
            previous.release()

    def expected_checksums(self) -> tuple[dict[str, str], int]:
        """The checksums a replica must report now, and their weight version."""
        from lightning_fasync.weights.checksum import checksums

        if self.weights is None:
            assert self.initial_checksums is not None
            return self.initial_checksums, 0
        return checksums(self.weights.named_tensors()), self.weights.version

    # ------------------------------------------------------------------ faults

    def restart_replica(self, index: int, should_stop: Callable[[], bool] = lambda: False) -> Optional[int]:
        """Start replica ``index`` again on its port, give it the current weights, check them, and
        put it back in ``workers`` and behind the router. Returns its weight version (None when
        ``should_stop`` turned true meanwhile).

        Raises:
            ServerStartError, EngineError: the attempt failed (the new process is stopped).
        """
        old = self.servers[index]
        old.kill_tree()
        old.stop()
        handle = self._relaunch(index, urlparse(old.url).port)
        self.servers[index] = handle
        try:
            handle.wait_healthy(self.startup_timeout, self.api_key, should_stop=should_stop)
            with self.sync_lock:
                if should_stop():
                    handle.stop()
                    return None
                version = asyncio.run(self._join(handle.url))
                if should_stop():  # the run ended while it joined: not put back under a stopping pool
                    handle.stop()
                    return None
                self.router_add(handle.url)
                self.workers.add(handle.url)
            return version
        except BaseException:
            handle.kill_tree()
            handle.stop()
            raise

    def _relaunch(self, index: int, port: Optional[int]) -> ServerHandle:
        """Replica ``index``'s server started (again) on ``port`` (None: a free one), not yet waited for."""
        if self.placement is not None:
            args = server_args(self.model, self.threads_per_replica, self.max_running_requests, None,
                               self.context_length, self.server_args)
            command = [*SERVE, *args, "--host", "{host}", "--port", "{port}", "--parent-pid", "{parent_pid}"]
            return self.placement.launch(index, command, port, cpus=self.threads_per_replica, gpus=0,
                                         env=server_env(self.threads_per_replica))
        return launch_server(
            self.model, port=port, threads=self.threads_per_replica, max_running_requests=self.max_running_requests,
            api_key=self.api_key, cpu_cores=self.cpu_cores[index] if self.cpu_cores else None,
            context_length=self.context_length, extra_args=self.server_args, wait=False,
        )

    async def _join(self, url: str) -> int:
        """Load the kept weights into ``url`` and check them tensor by tensor (caller holds sync_lock)."""
        from lightning_fasync.weights.checksum import compare

        # A replica that hangs while joining must not hold the weight-sync lock for long.
        client = SGLangClient([url], api_key=self.api_key, retries=1, admin_timeout_s=JOIN_TIMEOUT_S)
        try:
            expected, version = self.expected_checksums()
            if self.weights is not None:
                # A replica on another node shares no memory with this process: over the network.
                await push_kept(self.weights, client, timeout_s=JOIN_TIMEOUT_S,
                                path="distributed" if self.placement is not None else None)
            (reported,) = await client.weight_checksums()
            diffs = compare(expected, reported)
            if diffs:
                raise EngineError(
                    f"The restarted engine {url} does not hold the trainer's weights of version {version}: "
                    + "; ".join(diffs[:5]) + (f" (and {len(diffs) - 5} more)" if len(diffs) > 5 else "")
                )
            if self.released_tags:  # the others are offloaded (colocate): so is this one
                await client.release_memory_occupation(sorted(self.released_tags))
            return version
        finally:
            await client.close()

    async def _checksums(self, urls: Sequence[str]) -> list[dict[str, str]]:
        client = SGLangClient(list(urls), api_key=self.api_key)
        try:
            return await client.weight_checksums()
        finally:
            await client.close()

    def restart_router(self) -> None:
        """Start the router again on its port, in front of the serving replicas."""
        assert self.router is not None
        old = self.router
        old.stop()
        with self.sync_lock:
            self.router = launch_router(self.workers.urls, port=urlparse(old.url).port, policy=self.router_policy,
                                        api_key=self.api_key)

    def _router_call(self, method: str, path: str, body: Optional[dict] = None, timeout: float = 10.0) -> Any:
        assert self.router is not None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.router.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read().decode()
            return json.loads(text) if text else None

    def _router_workers(self) -> list[dict[str, Any]]:
        return list((self._router_call("GET", "/workers") or {}).get("workers", []))

    def router_remove(self, url: str) -> None:
        """Take ``url`` out of the router (its ``DELETE /workers/{id}``); best effort: a dead router
        is restarted with the serving replicas only."""
        if self.router is None:
            return
        try:
            for worker in self._router_workers():
                if worker.get("url") == url:
                    self._router_call("DELETE", f"/workers/{worker['id']}")
        except (urllib.error.URLError, OSError, ValueError):
            pass

    def router_add(self, url: str, timeout: float = 30.0) -> None:
        """Put ``url`` behind the router (``POST /workers``) and wait until the router lists it healthy."""
        if self.router is None:
            return
        body: dict[str, Any] = {"url": url}
        if self.api_key:
            body["api_key"] = self.api_key
        deadline = time.monotonic() + timeout
        posted = False
        while True:
            try:
                listed = {w.get("url"): w for w in self._router_workers()}
                if url in listed and listed[url].get("is_healthy", True):
                    return
                if not posted and url not in listed:
                    self._router_call("POST", "/workers", body)
                    posted = True
            except (urllib.error.URLError, OSError, ValueError) as exc:
                if time.monotonic() > deadline:
                    raise EngineError(f"The router at {self.router.url} did not take worker {url}: {exc}") from exc
            if time.monotonic() > deadline:
                raise EngineError(f"The router at {self.router.url} did not list worker {url} within {timeout:g} s.")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the supervisor, the router, then every replica, by pid; remove the kept weights. Idempotent."""
        if self.supervisor is not None:
            self.supervisor.stop()
        errors = []
        for handle in ([self.router] if self.router else []) + self.servers:
            try:
                handle.stop()
            except Exception as exc:  # keep stopping the others, then report
                errors.append(f"{handle}: {exc!r}")
        if self.weights is not None:
            self.weights.release()
            self.weights = None
        if self.placement is not None:
            try:
                self.placement.close()
            except Exception as exc:  # noqa: BLE001 - reported with the others
                errors.append(f"the Ray placement: {exc!r}")
        if errors:
            raise RuntimeError("Some rollout processes did not stop: " + "; ".join(errors))

    def __enter__(self) -> "RolloutPool":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

