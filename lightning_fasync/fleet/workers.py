"""The engine replicas that serve now (:class:`WorkerSet`), shared by the client that sends to them
and the supervisor that takes them out and puts them back; and :class:`EngineLostError`, when
none serves for good. Its own module so that the client, the pool and the supervisor import it
and not each other.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Optional

from lightning_fasync.pipeline.engine_client import EngineFault

__all__ = ["EngineLostError", "WorkerSet"]


class EngineLostError(EngineFault):
    """No engine replica serves, and none came back within the configured limits."""


class WorkerSet:
    """The engine URLs that serve now, and whether the router in front of them is up. Thread-safe.

    Args:
        urls: The replicas serving at the start.
        router: Whether ``/generate`` goes through a router (then the router must be up too).
        wait_timeout_s: How long :meth:`wait_available` waits (``rollout.engine_restart.timeout_s``).
    """

    POLL_S = 0.05

    def __init__(self, urls: list[str], router: bool = False, wait_timeout_s: float = 300.0) -> None:
        self._lock = threading.Lock()
        self._urls = list(urls)
        self._has_router = router
        self._router_up = True
        self.wait_timeout_s = wait_timeout_s
        self.abort_epoch = 0  # bumped by abort_all: requests waiting for a replica return aborted
        self.changes = 0  # bumped whenever a replica leaves or joins (a restarted one keeps its URL)
        self.fatal: Optional[BaseException] = None  # set when the supervisor gives up: waiters stop waiting

    @property
    def urls(self) -> list[str]:
        with self._lock:
            return list(self._urls)

    def is_live(self, url: str) -> bool:
        with self._lock:
            return url in self._urls

    def available(self) -> bool:
        with self._lock:
            return bool(self._urls) and (self._router_up or not self._has_router)

    def remove(self, url: str) -> None:
        with self._lock:
            if url in self._urls:
                self._urls.remove(url)
                self.changes += 1

    def add(self, url: str) -> None:
        with self._lock:
            if url not in self._urls:
                self._urls.append(url)
                self.changes += 1

    def set_router_up(self, up: bool) -> None:
        with self._lock:
            self._router_up = up

    def bump_abort(self) -> None:
        with self._lock:
            self.abort_epoch += 1

    async def wait_available(self, epoch: int) -> bool:
        """Wait until a replica (and the router) serves: True; False when ``abort_all`` ran meanwhile.

        Raises:
            EngineLostError: none served within ``wait_timeout_s``.
        """
        deadline = time.monotonic() + self.wait_timeout_s
        while not self.available():
            if self.abort_epoch != epoch:
                return False
            if self.fatal is not None:
                raise EngineLostError(str(self.fatal))
            if time.monotonic() > deadline:
                raise EngineLostError(
                    f"No rollout engine served for {self.wait_timeout_s:g} s (`rollout.engine_restart.timeout_s`)."
                )
            await asyncio.sleep(self.POLL_S)
        return self.abort_epoch == epoch
