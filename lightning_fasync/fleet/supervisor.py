"""Engine and router faults: notice a dead or hung replica, keep serving with the others, restart it.

:class:`WorkerSet` is the set of engine URLs that serve right now, shared by every client of a
pool: ``/generate`` waits on it while no replica (or no router) is up, admin calls fan out to the
replicas in it only. :class:`EngineSupervisor` is a thread that watches the pool's processes:

- a replica whose process exited (SIGKILL of its tree, a crash) or whose ``/health`` has not
  answered for ``rollout.engine_restart.hang_timeout_s`` (SIGSTOP, a wedged server) is taken out of
  the set and out of the router (its worker API), within one poll interval;
- it is started again on the same port (``rollout.engine_restart.max_attempts`` attempts, backoff
  doubling from ``backoff_s``), given the weights the trainer pushed last (the pool keeps that one
  file), checked tensor by tensor against them with SGLang's ``/weights_checker`` checksums, and
  only then put back into the set and behind the router;
- a router whose process exited is started again on its port with the replicas in the set.

While no replica serves, requests wait for one (the client's gate) for at most
``rollout.engine_restart.timeout_s``; past it, or once a replica's restart attempts are spent with
none left, the supervisor reports a fatal :class:`EngineLostError`, which the pipeline re-raises on
the main thread. Requests in flight on a dead replica are sent again to a live one by the client.

The thread logs nothing and runs no collectives: it writes run events (``engine_dead``,
``engine_restarted``, ...) to the run's event log, which is thread-safe.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lightning_fasync.fleet.workers import EngineLostError


@dataclass
class ReplicaRecord:
    """What the supervisor knows about one replica slot."""

    index: int
    url: str
    lost_at: Optional[float] = None  # monotonic time the loss was noticed
    unhealthy_since: Optional[float] = None
    restarts: int = 0
    gave_up: bool = False
    restarting: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)


class EngineSupervisor:
    """Watch a :class:`~lightning_fasync.fleet.pool.RolloutPool`'s processes and heal them.

    Args:
        pool: The pool (its handles, router, weight file and locks).
        max_attempts: Restarts tried per loss (``rollout.engine_restart.max_attempts``); 0 disables
            restarts (a lost replica stays out).
        backoff_s: Delay before the second attempt; doubles after each failed one.
        timeout_s: Longest time without any serving replica before the run stops.
        hang_timeout_s: A replica whose ``/health`` has not answered for this long is killed and
            restarted.
        poll_s: Seconds between two looks at the processes.
        health_every_s: Seconds between two ``/health`` probes of each replica.
        emit: ``emit(event, **fields)`` for run events (thread-safe).
        on_fatal: Called once with the :class:`EngineLostError` that ends the run.
    """

    def __init__(
        self,
        pool: Any,
        max_attempts: int = 3,
        backoff_s: float = 2.0,
        timeout_s: float = 300.0,
        hang_timeout_s: float = 60.0,
        poll_s: float = 0.5,
        health_every_s: float = 2.0,
        emit: Optional[Callable[..., None]] = None,
        on_fatal: Optional[Callable[[BaseException], None]] = None,
    ) -> None:
        self.pool = pool
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.poll_s = poll_s
        self.health_every_s = health_every_s
        self.emit = emit or (lambda event, **fields: None)
        self.on_fatal = on_fatal
        self.replicas = [ReplicaRecord(i, h.url) for i, h in enumerate(pool.servers)]
        self.router_restarts = 0
        self.fatal: Optional[BaseException] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._outage_since: Optional[float] = None
        self._last_health = 0.0
        self._router_restarting = False
        self._workers: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "EngineSupervisor":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fasync-engine-supervisor", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop watching (before the pool stops its processes, so no stop looks like a death). Idempotent."""
        self._stop.set()
        thread, self._thread = self._thread, None
        deadline = time.monotonic() + timeout
        for t in [thread, *self._workers]:
            if t is not None and t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in [thread, *self._workers] if t is not None and t.is_alive()
                 and t is not threading.current_thread()]
        if alive:  # a restart still joining (its weight push is bounded by its own timeouts)
            warnings.warn(f"The engine supervisor's threads {', '.join(alive)} did not stop within {timeout:g} s; the "
                          "pool stops its processes under them, and a replica they were restarting is not put back.",
                          stacklevel=2)

    def metrics(self) -> dict[str, float]:
        """``rollout/engines_live`` and the restart counts so far (read on the main thread)."""
        return {
            "rollout/engines_live": float(len(self.pool.workers.urls)),
            "rollout/engine_restarts": float(sum(r.restarts for r in self.replicas)),
            "rollout/router_restarts": float(self.router_restarts),
        }

    # ------------------------------------------------------------------ the watch

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._tick()
            except BaseException as exc:  # noqa: BLE001 - a supervisor bug must stop the run, not vanish
                self._fail(EngineLostError(f"The engine supervisor failed: {type(exc).__name__}: {exc}"))
                return

    def _tick(self) -> None:
        now = time.monotonic()
        pool = self.pool
        probe = now - self._last_health >= self.health_every_s
        if probe:
            self._last_health = now
        for rec in self.replicas:
            if rec.lost_at is not None or self._stop.is_set():
                continue
            handle = pool.servers[rec.index]
            if not handle.alive():
                self._lose(rec, f"its process exited with status {handle.exit_status()}")
            elif probe and self.hang_timeout_s > 0:
                if _healthy(handle.url, pool.api_key, timeout=min(5.0, self.hang_timeout_s)):
                    rec.unhealthy_since = None
                else:
                    rec.unhealthy_since = rec.unhealthy_since or now
                    if now - rec.unhealthy_since >= self.hang_timeout_s:
                        handle.kill_tree()
                        self._lose(rec, f"its /health did not answer for {self.hang_timeout_s:g} s "
                                        "(`rollout.engine_restart.hang_timeout_s`); killed")
        if pool.router is not None and not self._router_restarting and not pool.router.alive() and not self._stop.is_set():
            self._router_restarting = True
            self._spawn(self._restart_router, "router")
        for rec in self.replicas:
            if rec.lost_at is not None and not rec.gave_up and not rec.restarting and not self._stop.is_set():
                rec.restarting = True
                self._spawn(self._restart, f"replica-{rec.index}", rec)
        if pool.workers.available():
            self._outage_since = None
        else:
            self._outage_since = self._outage_since or now
            if now - self._outage_since > self.timeout_s:
                self._fail(EngineLostError(
                    f"No rollout engine served for {self.timeout_s:g} s (`rollout.engine_restart.timeout_s`); "
                    + self._summary()
                ))
            elif all(r.gave_up for r in self.replicas):
                self._fail(EngineLostError(
                    "Every rollout engine replica is lost and its restarts are spent "
                    f"(`rollout.engine_restart.max_attempts` is {self.max_attempts}); " + self._summary()
                ))

    def _spawn(self, fn: Callable[..., None], name: str, *args: Any) -> None:
        """Run a restart on its own thread, so the watch goes on (another replica may die meanwhile)."""

        def body() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - reaches the main thread through on_fatal
                self._fail(EngineLostError(f"Restarting {name} failed unexpectedly: {type(exc).__name__}: {exc}"))

        thread = threading.Thread(target=body, name=f"fasync-restart-{name}", daemon=True)
        self._workers = [t for t in self._workers if t.is_alive()] + [thread]
        thread.start()

    def _lose(self, rec: ReplicaRecord, why: str) -> None:
        rec.lost_at = time.monotonic()
        rec.unhealthy_since = None
        self.pool.workers.remove(rec.url)
        self.pool.router_remove(rec.url)
        rec.history.append({"lost": why})
        self.emit("engine_dead", replica=rec.index, url=rec.url, reason=why, wall=time.time(),
                  live=len(self.pool.workers.urls))

    def _restart(self, rec: ReplicaRecord) -> None:
        """Attempts with backoff; each one: start, weights, checksum, router (a restart thread)."""
        try:
            self._restart_attempts(rec)
        finally:
            rec.restarting = False

    def _restart_attempts(self, rec: ReplicaRecord) -> None:
        last_error = ""
        for attempt in range(1, self.max_attempts + 1):
            if attempt > 1 and self._stop.wait(self.backoff_s * 2 ** (attempt - 2)):
                return
            if self._stop.is_set():
                return
            t0 = time.monotonic()
            try:
                version = self.pool.restart_replica(rec.index, should_stop=self._stop.is_set)
            except Exception as exc:  # noqa: BLE001 - reported in the event and the final error
                last_error = f"{type(exc).__name__}: {exc}"
                rec.history.append({"attempt": attempt, "error": last_error})
                self.emit("engine_restart_failed", replica=rec.index, attempt=attempt, error=last_error[:2000], wall=time.time())
                continue
            if version is None:  # stopped meanwhile
                return
            rec.restarts += 1
            down_s = time.monotonic() - (rec.lost_at or t0)
            rec.lost_at = None
            rec.history.append({"attempt": attempt, "restart_s": round(time.monotonic() - t0, 3)})
            self.emit("engine_restarted", replica=rec.index, url=rec.url, attempt=attempt, weight_version=version,
                      restart_s=round(time.monotonic() - t0, 3), down_s=round(down_s, 3), wall=time.time(),
                      live=len(self.pool.workers.urls))
            return
        rec.gave_up = True
        self.emit("engine_gave_up", replica=rec.index, url=rec.url, attempts=self.max_attempts, error=last_error[:2000],
                  wall=time.time())

    def _restart_router(self) -> None:
        try:
            self._restart_router_attempts()
        finally:
            self._router_restarting = False

    def _restart_router_attempts(self) -> None:
        pool = self.pool
        pool.workers.set_router_up(False)
        self.emit("router_dead", url=pool.router.url if pool.router else None, wall=time.time())
        t0 = time.monotonic()
        last_error = ""
        for attempt in range(1, max(1, self.max_attempts) + 1):
            if attempt > 1 and self._stop.wait(self.backoff_s * 2 ** (attempt - 2)):
                return
            try:
                pool.restart_router()
            except Exception as exc:  # noqa: BLE001
                last_error = f"{type(exc).__name__}: {exc}"
                self.emit("router_restart_failed", attempt=attempt, error=last_error[:2000], wall=time.time())
                continue
            self.router_restarts += 1
            pool.workers.set_router_up(True)
            self.emit("router_restarted", attempt=attempt, restart_s=round(time.monotonic() - t0, 3), wall=time.time())
            return
        self._fail(EngineLostError(
            f"The sglang-router died and did not restart in {self.max_attempts} attempts "
            f"(`rollout.engine_restart.max_attempts`): {last_error}"
        ))

    def _fail(self, exc: BaseException) -> None:
        if self.fatal is not None:
            return
        self.fatal = exc
        self.pool.workers.fatal = exc
        self.emit("engine_fatal", error=str(exc)[:2000], wall=time.time())
        self._stop.set()
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def _summary(self) -> str:
        parts = []
        for rec in self.replicas:
            last = rec.history[-1] if rec.history else {}
            parts.append(f"replica {rec.index} ({rec.url}): " + (json.dumps(last) if last else "serving"))
        return "; ".join(parts) + ". The run stops; resume it from its last checkpoint."


def _healthy(url: str, api_key: Optional[str], timeout: float) -> bool:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=headers), timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError, TimeoutError):
        return False
