"""A pool of embedded engine replicas, with the real sglang-router in front when there are several."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lightning_fasync.rollout.client import SGLangClient
from lightning_fasync.rollout.launch import STARTUP_TIMEOUT_S, ServerHandle, launch_router, launch_server


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
        self.servers: list[ServerHandle] = []
        self.router: Optional[ServerHandle] = None

    def start(self) -> "RolloutPool":
        """Start the replicas in parallel, wait for them, then the router. Stops everything on failure."""
        try:
            for i in range(self.num_replicas):
                self.servers.append(
                    launch_server(
                        self.model, threads=self.threads_per_replica, max_running_requests=self.max_running_requests,
                        api_key=self.api_key, cpu_cores=self.cpu_cores[i] if self.cpu_cores else None,
                        context_length=self.context_length, wait=False,
                    )
                )
            for server in self.servers:
                server.wait_healthy(self.startup_timeout, self.api_key)
            if self.num_replicas > 1:
                self.router = launch_router(self.worker_urls, policy=self.router_policy, api_key=self.api_key)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def worker_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """Where ``/generate`` goes: the router, or the only replica."""
        if not self.servers:
            raise RuntimeError("The pool is not started.")
        return self.router.url if self.router is not None else self.servers[0].url

    def client(self, **kwargs: Any) -> SGLangClient:
        """A new client for this pool (router for generate, every worker for admin calls)."""
        router_url = self.router.url if self.router is not None else None
        return SGLangClient(self.worker_urls, router_url=router_url, api_key=self.api_key, **kwargs)

    def stop(self) -> None:
        """Stop the router, then every replica, by pid. Idempotent."""
        errors = []
        for handle in ([self.router] if self.router else []) + self.servers:
            try:
                handle.stop()
            except Exception as exc:  # keep stopping the others, then report
                errors.append(f"{handle}: {exc!r}")
        if errors:
            raise RuntimeError("Some rollout processes did not stop: " + "; ".join(errors))

    def __enter__(self) -> "RolloutPool":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
