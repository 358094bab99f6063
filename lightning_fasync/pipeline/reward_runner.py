"""Run a reward function off the producer's event loop, with a timeout and failure counters.

The producer thread runs one asyncio event loop for every in-flight group; a reward that blocks
it (a math verifier chewing on SymPy, a sandbox call) stalls all generation. :class:`RewardRunner`
wraps a ``reward(sample, trajectory) -> float`` so that :class:`~lightning_fasync.pipeline.flow.SingleTurnFlow`
can await it:

- an ``async def`` reward is awaited on the loop, bounded by ``timeout_s``;
- a plain function runs in a pool of daemon threads (``processes == 0``) or in ``processes``
  worker processes (CPU-heavy verifiers: the GIL would serialise them in threads), bounded by
  ``timeout_s`` counted from when it starts running (a burst of calls queued for a free worker
  does not time out while waiting). ``processes=None`` (``data_source.reward_processes: null``,
  the default) chooses: worker processes for a function marked ``cpu_bound = True`` (as
  :func:`~lightning_fasync.data.rewards.math_reward` is), ``min(4, cpu_count)`` of them, and
  threads for any other.

A reward that times out or raises becomes a :class:`RewardError`; the flow marks the trajectory
failed and the group policy (``pipeline/state.py``) drops the group and regenerates its prompt.
Both are counted for ``rollout/reward_failed`` and ``rollout/reward_timeout`` (:meth:`RewardRunner.metrics`,
a controller metric source).

Hung rewards. A worker process that overruns its timeout is killed and replaced; the other calls
in flight run in their own processes and are not affected. A thread cannot be killed: the call
still fails at its timeout and the pipeline goes on, but the thread is abandoned, running until
the reward returns, and the pool starts a replacement so later calls are not starved. The pool's
threads are daemon threads, so a reward that never returns does not block interpreter exit
(``concurrent.futures.ThreadPoolExecutor`` joins its threads at exit, which is why it is not used).
Worse, a reward stuck in C code that holds the GIL (SymPy's big-integer arithmetic) stalls the
event loop itself, so even its timeout fires late: rewards that can hang in C code, math
verifiers first, belong in processes.

Processes use the ``spawn`` start method (the parent has threads, so ``fork`` is unsafe): the reward
must be picklable (a module-level function, checked at construction), each worker imports its
module on start, and, as with any spawn, a script that builds the runner must keep its top-level
work under ``if __name__ == "__main__":``. Workers start on first use. The reward receives
pickled copies of the sample and the trajectory, so only its return value comes back.

Layering: no Lightning, HTTP, model or torch imports; nothing here logs from a thread.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time
from typing import Any, Awaitable, Callable, Optional, Union

from lightning_fasync.types import PromptSample, Trajectory

__all__ = ["RewardError", "RewardRunner", "auto_processes"]

RewardCallable = Callable[[PromptSample, Trajectory], Union[float, Awaitable[float]]]

# A worker process gets this long to start (spawn + import of the reward's module) before the
# call fails; its timeout_s starts only when the task is handed to a ready worker.
_STARTUP_TIMEOUT_S = 120.0
# How long a killed worker may take to be reaped.
_KILL_JOIN_S = 5.0
# Slack on the event-loop side's safety bound in process mode, where the driver thread enforces
# the timeout itself.
_PROCESS_GRACE_S = 10.0
# Idle pool threads exit after this long; the pool starts threads again on demand.
_THREAD_IDLE_S = 30.0
# Poll interval of waits that also watch for shutdown.
_POLL_S = 1.0
# Worker processes of a reward marked cpu_bound when the count is left to the runner (processes=None).
_AUTO_PROCESSES = 4


def auto_processes(fn: Any) -> int:
    """The worker processes ``processes=None`` gives ``fn``: ``min(4, cpu_count)`` for a plain,
    picklable function marked ``cpu_bound = True`` (a math verifier: in threads it would hold the
    GIL and its timeout could not stop it), else 0 (threads)."""
    if getattr(fn, "cpu_bound", False) is not True or _is_async(fn):
        return 0
    try:
        pickle.dumps(fn)
    except Exception:  # a closure or a local function: threads, as for any unmarked reward
        return 0
    return min(_AUTO_PROCESSES, os.cpu_count() or 1)


class RewardError(RuntimeError):
    """A reward call timed out (``data_source.reward_timeout``) or raised."""


def _describe(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module}:{name}" if module else str(name)


def _source_file(fn: Any) -> Optional[str]:
    """The file that defines ``fn`` (a function, or a callable object's ``__call__``), if known."""
    target = inspect.unwrap(fn) if inspect.isroutine(fn) else getattr(type(fn), "__call__", fn)
    try:
        return inspect.getsourcefile(target)
    except (TypeError, OSError):
        return None


def where_raised(exc: BaseException, fn: Any) -> str:
    """`` at FILE:LINE in NAME: SOURCE`` for the reward's own frame in ``exc``'s traceback (the last
    one in the file that defines ``fn``; else the innermost frame), or ``""`` without a traceback."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    source = _source_file(fn)
    own = [f for f in frames if source is not None and os.path.abspath(f.filename) == os.path.abspath(source)]
    frame = (own or frames)[-1]
    line = f": {frame.line.strip()}" if frame.line else ""
    return f" at {frame.filename}:{frame.lineno} in {frame.name}{line}"


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


# ---------------------------------------------------------------------------- the thread pool


class _Task:
    """One call handed to the thread pool; its outcome is delivered to ``future`` on ``loop``."""

    __slots__ = ("call", "loop", "future", "started", "started_at", "finished", "cancelled", "abandoned")

    def __init__(self, call: Callable[["_Task"], Any], loop: asyncio.AbstractEventLoop) -> None:
        self.call = call
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.started: asyncio.Future = loop.create_future()  # set when a thread picks it up
        self.started_at: Optional[float] = None  # time.monotonic() when a thread picked it up
        self.finished = False
        self.cancelled = False
        self.abandoned = False


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class _ThreadPool:
    """Daemon threads, started on demand up to ``max_workers`` healthy ones.

    A thread whose task was abandoned (timed out while running) does not count against
    ``max_workers``; it exits when its task returns.
    """

    def __init__(self, max_workers: int, name: str) -> None:
        self.max_workers = max_workers
        self.name = name
        self._queue: "queue.SimpleQueue[Optional[_Task]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._idle = 0  # threads waiting on the queue
        self._pending = 0  # tasks queued and not yet taken
        self._abandoned = 0  # threads still running an abandoned task
        self._closed = False
        self._counter = 0

    @property
    def stuck(self) -> int:
        """Threads still running a call that timed out."""
        with self._lock:
            return self._abandoned

    def submit(self, task: _Task) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward runner is closed")
            self._pending += 1
            self._queue.put(task)
            self._grow()

    def abandon(self, task: _Task) -> None:
        """Stop counting the thread running ``task`` (timed out) and start a spare if needed."""
        with self._lock:
            if task.started_at is None or task.finished or task.abandoned:
                return
            task.abandoned = True
            self._abandoned += 1
            self._grow()

    def shutdown(self) -> None:
        """Refuse new tasks and let idle threads exit; running threads are not waited for."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            n = len(self._threads)
        for _ in range(n):
            self._queue.put(None)

    def _grow(self) -> None:  # under self._lock
        healthy = len(self._threads) - self._abandoned
        if self._pending > self._idle and healthy < self.max_workers and not self._closed:
            self._counter += 1
            thread = threading.Thread(target=self._work, name=f"{self.name}-{self._counter}", daemon=True)
            self._threads.add(thread)
            thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            with self._lock:
                self._idle += 1
            try:
                task = self._queue.get(timeout=_THREAD_IDLE_S)
            except queue.Empty:
                with self._lock:
                    self._idle -= 1
                    # A submit that counted on this thread being idle must still be served.
                    if self._pending > self._idle and not self._closed:
                        continue
                    self._threads.discard(me)
                    return
            with self._lock:
                self._idle -= 1
                if task is None:
                    self._threads.discard(me)
                    return
                self._pending -= 1
                if task.cancelled:
                    continue
                task.started_at = time.monotonic()
            try:
                task.loop.call_soon_threadsafe(_settle, task.started, True, None)
            except RuntimeError:  # the event loop is closed
                pass
            try:
                ok, value = True, task.call(task)
            except BaseException as exc:  # delivered to the caller, which converts it
                ok, value = False, exc
            try:
                task.loop.call_soon_threadsafe(_settle, task.future, ok, value)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                pass
            with self._lock:
                task.finished = True
                if task.abandoned:  # a replacement was started when it timed out
                    self._abandoned -= 1
                    self._threads.discard(me)
                    return


# ---------------------------------------------------------------------------- worker processes


class _WorkerTimeout(Exception):
    """The worker overran ``timeout_s`` and was killed."""


def _worker_main(conn: Any, fn: Callable[[Any, Any], Any]) -> None:
    """A worker process: answer pickled ``(sample, trajectory)`` requests until orphaned or killed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills us
    conn.send(("ready", os.getpid()))
    parent = multiprocessing.parent_process()
    while True:
        try:
            if not conn.poll(_POLL_S):
                if parent is not None and not parent.is_alive():
                    return
                continue
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            sample, trajectory = pickle.loads(payload)
            reply: tuple = ("ok", float(fn(sample, trajectory)))
        except BaseException as exc:  # the exception itself may not pickle: send its name, text and frame
            reply = ("raised", type(exc).__name__, str(exc), where_raised(exc, fn))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


class _Worker:
    """One worker process and the parent's end of its pipe; started on first use.

    Only the driver thread that borrowed it calls :meth:`ensure_started` and :meth:`call`;
    :meth:`kill` may come from any thread (:meth:`RewardRunner.close`).
    """

    def __init__(self, ctx: Any, fn: Callable, name: str) -> None:
        self.ctx = ctx
        self.fn = fn
        self.name = name
        self.proc: Any = None
        self.conn: Any = None
        self.pid: Optional[int] = None
        self._lock = threading.Lock()
        self._killed = False

    def ensure_started(self) -> None:
        """Start the process and wait until it has imported the reward.

        Raises:
            RuntimeError: It was killed, exited, or did not get ready within the startup timeout.
        """
        with self._lock:  # so that kill() either sees the started process or prevents its start
            if self._killed:
                raise RuntimeError("the reward runner is closed")
            if self.proc is not None:
                return
            parent_conn, child_conn = self.ctx.Pipe(duplex=True)
            proc = self.ctx.Process(target=_worker_main, args=(child_conn, self.fn), name=self.name, daemon=True)
            proc.start()
            child_conn.close()
            self.proc, self.conn, self.pid = proc, parent_conn, proc.pid
        try:
            msg = parent_conn.recv() if parent_conn.poll(_STARTUP_TIMEOUT_S) else None
        except (EOFError, OSError):
            msg = None
        if not msg or msg[0] != "ready":
            closed = self._was_killed()
            if not closed:
                proc.join(_KILL_JOIN_S)  # let a failing child print its traceback and exit
            self.kill()
            if closed:
                raise RuntimeError("the reward runner is closed")
            raise RuntimeError(
                f"reward worker process {self.name} did not start (exit code {proc.exitcode}); it must be "
                f"able to import the reward function (see its stderr)"
            )

    def call(self, payload: bytes, timeout_s: float) -> tuple:
        """Send one pickled request and wait ``timeout_s`` for the reply.

        Raises:
            _WorkerTimeout: No reply in time; the process has been killed.
            RuntimeError: The process died (killed from outside, out of memory, closed runner).
        """
        try:
            self.conn.send_bytes(payload)
            if not self.conn.poll(timeout_s):
                self.kill()
                raise _WorkerTimeout()
            return self.conn.recv()
        except (EOFError, OSError) as exc:
            closed = self._was_killed()
            self.kill()
            if closed:
                raise RuntimeError("the reward runner is closed") from exc
            raise RuntimeError(f"reward worker process {self.name} died (exit code {self.proc.exitcode})") from exc

    def _was_killed(self) -> bool:
        with self._lock:
            return self._killed

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def kill(self) -> None:
        """Kill and reap the process without waiting on its work; idempotent. The pipe is left to
        its owner (closing it under a driver thread blocked on it is unsafe)."""
        with self._lock:
            self._killed = True
            proc = self.proc
        if proc is None:
            return
        if proc.is_alive():
            proc.kill()
        proc.join(_KILL_JOIN_S)

    def discard(self) -> None:
        """Kill the process and close the pipe (by the thread that owns the worker)."""
        self.kill()
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass


# ---------------------------------------------------------------------------- the runner


class RewardRunner:
    """Awaitable wrapper of a reward function: off the event loop, with a timeout and counters.

    ``await runner(sample, trajectory)`` returns the reward as a float, or raises
    :class:`RewardError`. It is meant to be called from one event loop (the producer's);
    :meth:`metrics` and :meth:`close` may be called from any thread.

    Args:
        fn: ``(sample, trajectory) -> float``, a plain function or an ``async def`` one.
        timeout_s: ``data_source.reward_timeout``: seconds one call may run.
        processes: ``data_source.reward_processes``: 0 runs a plain ``fn`` in threads; N > 0 in
            N worker processes (``fn`` must then be a picklable, plain function); None lets the
            runner choose (:func:`auto_processes`: processes for a ``cpu_bound`` function).
        tokenizer: If given, each call first sets ``trajectory.metadata["response_text"]`` to
            ``tokenizer.decode(response_ids, skip_special_tokens=True)`` for text-level rewards.
        name: How messages name the reward (its config key).
        threads: Thread-pool size in thread mode (default ``min(32, cpu_count + 4)``, as
            ``ThreadPoolExecutor``); in process mode there is one thread per worker process.

    Attributes:
        timeouts: Calls that timed out, since construction.
        errors: Calls that raised, since construction.

    Raises:
        ValueError: ``timeout_s`` is not positive, ``processes`` is negative, or ``processes > 0``
            with an async or non-picklable ``fn``.
    """

    def __init__(
        self,
        fn: RewardCallable,
        timeout_s: float = 30.0,
        processes: Optional[int] = 0,
        tokenizer: Any = None,
        name: str = "data_source.reward",
        threads: Optional[int] = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"data_source.reward_timeout is {timeout_s}; it must be > 0 seconds.")
        if processes is None:
            processes = auto_processes(fn)
        if processes < 0:
            raise ValueError(f"data_source.reward_processes is {processes}; it must be >= 0 (0: threads, null: auto).")
        self.fn = fn
        self.timeout_s = float(timeout_s)
        self.processes = int(processes)
        self.tokenizer = tokenizer
        self.name = name
        self.label = f"{name} ({_describe(fn)})"
        self.is_async = _is_async(fn)
        self.timeouts = 0
        self.errors = 0
        self._reported = (0, 0)  # (errors, timeouts) at the last metrics() call
        self._lock = threading.Lock()
        self._closed = False
        self._pool: Optional[_ThreadPool] = None
        self._workers: list[_Worker] = []  # every worker process, busy or idle
        self._idle_workers: list[_Worker] = []
        self._ctx: Any = None
        self._worker_serial = 0
        if self.processes > 0:
            if self.is_async:
                raise ValueError(
                    f"data_source.reward_processes is {processes}, but {self.label} is async: worker "
                    f"processes run plain functions; set data_source.reward_processes: 0 for an async reward."
                )
            try:
                pickle.dumps(fn)
            except Exception as exc:
                raise ValueError(
                    f"data_source.reward_processes is {processes}, so {self.label} runs in worker processes "
                    f"and must be picklable (a module-level function), but it is not "
                    f"({type(exc).__name__}: {exc}). Move it to a module, or set data_source.reward_processes: 0."
                ) from exc
            self._ctx = multiprocessing.get_context("spawn")
            self._pool = _ThreadPool(self.processes, "reward-driver")
        elif not self.is_async:
            size = threads if threads is not None else min(32, (os.cpu_count() or 1) + 4)
            if size < 1:
                raise ValueError(f"threads is {size}; it must be >= 1.")
            self._pool = _ThreadPool(size, "reward")

    # -------------------------------------------------------------- calls

    async def __call__(self, sample: PromptSample, trajectory: Trajectory) -> float:
        """Score one trajectory.

        Raises:
            RewardError: The reward timed out (message names ``data_source.reward_timeout``) or
                raised (message names the exception type and text), the tokenizer failed, or
                the runner is closed.
        """
        if self.tokenizer is not None:
            try:
                trajectory.metadata["response_text"] = self.tokenizer.decode(
                    trajectory.response_ids, skip_special_tokens=True
                )
            except Exception as exc:
                self._count(timeout=False)
                raise RewardError(f"decoding the response for {self.label} raised {type(exc).__name__}: {exc}") from exc
        if self.is_async:
            return await self._call_async(sample, trajectory)
        return await self._call_in_pool(sample, trajectory)

    async def _call_async(self, sample: PromptSample, trajectory: Trajectory) -> float:
        # asyncio.wait rather than wait_for: a TimeoutError raised by the reward itself (an HTTP
        # client's) must count as an error, not as our timeout.
        try:
            task = asyncio.ensure_future(self.fn(sample, trajectory))  # type: ignore[arg-type]
        except Exception as exc:
            raise self._raised_error(type(exc).__name__, str(exc), where_raised(exc, self.fn)) from exc
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            task.cancel()
            task.add_done_callback(_consume)
            raise self._timeout_error()
        try:
            return float(task.result())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise self._raised_error(type(exc).__name__, str(exc), where_raised(exc, self.fn)) from exc

    async def _call_in_pool(self, sample: PromptSample, trajectory: Trajectory) -> float:
        assert self._pool is not None
        loop = asyncio.get_running_loop()
        if self.processes > 0:
            call: Callable[[_Task], Any] = lambda task: self._call_in_worker(sample, trajectory)
            # The driver thread enforces timeout_s itself; this bound is a safety net.
            limit = _STARTUP_TIMEOUT_S + self.timeout_s + _PROCESS_GRACE_S
        else:
            call = lambda task: self.fn(sample, trajectory)
            limit = self.timeout_s
        task = _Task(call, loop)
        try:
            self._pool.submit(task)
        except RuntimeError as exc:
            self._count(timeout=False)
            raise RewardError(f"{self.label} was called after the reward runner was closed") from exc
        try:
            # Queued behind busy workers: wait for the start (polling, so the wait is bounded);
            # the budget counts from there.
            while not (task.started.done() or task.future.done()):
                await asyncio.wait({task.started, task.future}, timeout=_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            assert task.started_at is not None
            while not task.future.done():
                wait = task.started_at + limit - time.monotonic()
                if wait <= 0:
                    break
                await asyncio.wait({task.future}, timeout=wait)
        except asyncio.CancelledError:
            task.cancelled = True  # skipped if still queued; a running call's outcome is dropped
            task.future.cancel()
            raise
        if not task.future.done():
            task.cancelled = True
            task.future.cancel()
            self._pool.abandon(task)
            raise self._timeout_error()
        exc = task.future.exception()
        if exc is None:
            value = task.future.result()
            if inspect.isawaitable(value):
                if inspect.iscoroutine(value):
                    value.close()
                self._count(timeout=False)
                raise RewardError(f"{self.label} returned an awaitable from a plain function; declare it `async def`.")
            try:
                return float(value)
            except (TypeError, ValueError) as err:
                self._count(timeout=False)
                raise RewardError(
                    f"{self.label} returned {type(value).__name__} {repr(value)[:80]}, which is not a number") from err
        if isinstance(exc, _WorkerTimeout):
            raise self._timeout_error()
        if isinstance(exc, RewardError):  # from the worker driver: already counted
            raise exc
        raise self._raised_error(type(exc).__name__, str(exc), where_raised(exc, self.fn)) from exc

    def _call_in_worker(self, sample: PromptSample, trajectory: Trajectory) -> float:
        """Driver-thread side of a process-mode call: borrow a worker, run, give it back.

        A worker that timed out or died is replaced by a fresh one, started on its next use.
        """
        payload = pickle.dumps((sample, trajectory), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._closed:
                raise RuntimeError("the reward runner is closed")
            # At most `processes` driver threads, so at most `processes` workers.
            worker = self._idle_workers.pop() if self._idle_workers else self._new_worker()
        healthy = False
        try:
            worker.ensure_started()
            reply = worker.call(payload, self.timeout_s)
            healthy = True
        finally:
            if not healthy:
                worker.discard()
            with self._lock:
                if not healthy:
                    self._workers.remove(worker)
                    worker = self._new_worker()
                if self._closed:
                    worker.kill()
                else:
                    self._idle_workers.append(worker)
        if reply[0] == "ok":
            return reply[1]
        raise self._raised_error(reply[1], reply[2], reply[3])

    def _new_worker(self) -> _Worker:  # under self._lock
        self._worker_serial += 1
        worker = _Worker(self._ctx, self.fn, f"reward-worker-{self._worker_serial}")
        self._workers.append(worker)
        return worker

    # -------------------------------------------------------------- errors and metrics

    def _count(self, timeout: bool) -> None:
        with self._lock:
            if timeout:
                self.timeouts += 1
            else:
                self.errors += 1

    def _timeout_error(self) -> RewardError:
        self._count(timeout=True)
        return RewardError(
            f"{self.label} did not return within {self.timeout_s:g} s (data_source.reward_timeout); "
            f"the trajectory is failed."
        )

    def _raised_error(self, type_name: str, message: str, where: str = "") -> RewardError:
        self._count(timeout=False)
        return RewardError(f"{self.label} raised {type_name}: {message}{where}")

    def metrics(self) -> dict[str, float]:
        """Failures since the last call, for the controller's step metrics.

        Both keys are always present (0.0 when nothing failed), so the series has no gaps.

        Returns:
            ``{"rollout/reward_failed": errors + timeouts, "rollout/reward_timeout": timeouts}``,
            counted since the previous call.
        """
        with self._lock:
            errors, timeouts = self.errors - self._reported[0], self.timeouts - self._reported[1]
            self._reported = (self.errors, self.timeouts)
        return {"rollout/reward_failed": float(errors + timeouts), "rollout/reward_timeout": float(timeouts)}

    @property
    def stuck_threads(self) -> int:
        """Threads still running a call that timed out (thread mode)."""
        return self._pool.stuck if self._pool is not None and self.processes == 0 else 0

    def worker_pids(self) -> list[int]:
        """Process ids of the started worker processes (process mode)."""
        with self._lock:
            return [w.pid for w in self._workers if w.pid is not None and w.alive]

    # -------------------------------------------------------------- shutdown

    def close(self) -> None:
        """Stop the pools without waiting on hung work: worker processes are killed, idle threads
        exit, threads still running a reward are left to finish (daemon threads). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
            self._idle_workers.clear()
        if self._pool is not None:
            self._pool.shutdown()
        for worker in workers:
            worker.kill()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _consume(task: asyncio.Future) -> None:
    """Retrieve a cancelled reward task's outcome so asyncio does not report it as never retrieved."""
    if not task.cancelled():
        task.exception()
