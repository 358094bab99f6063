"""The rollout producer: a background thread with its own asyncio event loop (docs/contract.md §2).

It asks :class:`PipelineState` how many groups the window strategy allows, takes prompts from the
datasource (recycled first), and runs N agent-flow coroutines per group; each terminal trajectory
goes into TrajQueue. It sleeps on an asyncio event that the state sets whenever capacity may have
grown, so it never polls.

Errors in the thread are stored in the state and re-raised on the main thread (the
``AsyncCheckpointIO`` pattern); ``stop()`` is idempotent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine, Optional

from lightning_fasync.pipeline.engine_client import EngineClient
from lightning_fasync.pipeline.flow import AgentFlow, continuation
from lightning_fasync.pipeline.state import PipelineError, PipelineState
from lightning_fasync.types import PromptSample, Trajectory, TrajectoryStatus


class RolloutProducer:
    """Dispatches prompt groups under the window strategy.

    Arguments:
        state: the shared pipeline state.
        flow: turns (sample, index) into a trajectory.
        client: the engine client, used for ``abort_all`` at a partial step boundary and closed on
            stop. May be None for flows that need no engine (tests).
        max_connections: concurrent flow calls (``agentflow.router.max_connections``).
    """

    def __init__(self, state: PipelineState, flow: AgentFlow, client: Optional[EngineClient], max_connections: int = 512) -> None:
        self.state = state
        self.flow = flow
        self.client = client
        self.max_connections = max_connections
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()
        self._stopping = False
        self._stopped = False
        self._wake: Optional[asyncio.Event] = None
        self._sem: Optional[asyncio.Semaphore] = None
        self._main_task: Optional[asyncio.Task] = None
        self._notify_scheduled = False
        self._waiting = False
        self._cancel_queued = False  # set during a partial pause: queued requests return at once
        state.add_wake_listener(self._wake_threadsafe)

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._thread_main, name="fasync-producer", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise PipelineError(f"The rollout producer thread did not start within {timeout:.0f} s.")

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - everything reaches the main thread
            if not self._stopping:
                self.state.set_error(exc)
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                if self.client is not None:
                    loop.run_until_complete(self.client.close())
            except BaseException as exc:  # noqa: BLE001
                if not self._stopping:
                    self.state.set_error(exc)
            finally:
                loop.close()

    async def _main(self) -> None:
        self._main_task = asyncio.current_task()
        self._wake = asyncio.Event()
        # Groups are dispatched whole, so max_connections is applied as max_connections // N
        # concurrent groups (at least one). The window already bounds groups by C; a semaphore
        # only matters below that.
        groups = max(1, self.max_connections // self.state.N)
        self._sem = asyncio.Semaphore(groups) if groups < self.state.C else None
        self._started.set()
        loop = asyncio.get_running_loop()
        n = self.state.N
        while not self._stopping:
            self._wake.clear()
            # Announce the wait before planning: a wake-up that lands after the plan found
            # nothing must still set the event (see _wake_threadsafe).
            self._waiting = True
            planned = self.state.plan_dispatch()
            if planned:
                self._waiting = False
            # One task per group (the flow batches its N requests). Tasks are not tracked one by
            # one: stop() and _cancel_tasks() use all_tasks().
            for seq, sample in planned:
                loop.create_task(self._run_group(sample, seq))
            if not planned:
                await self._wake.wait()
                self._waiting = False
            else:
                await asyncio.sleep(0)  # let the new requests start before planning again

    async def _run_group(self, sample: PromptSample, seq: int) -> None:
        n = self.state.N
        try:
            if self._sem is None:
                trajs = await self.flow.run_group(sample, seq, n)
            else:
                async with self._sem:
                    if self._cancel_queued:
                        trajs = self._cancelled(sample, seq)  # never reached the engine
                    else:
                        trajs = await self.flow.run_group(sample, seq, n)
            if len(trajs) != n:
                raise PipelineError(f"The agent flow returned {len(trajs)} trajectories for prompt {sample.prompt_id}; N is {n}.")
        except asyncio.CancelledError:
            if self._stopping:
                raise
            trajs = self._cancelled(sample, seq)
        except Exception as exc:  # a flow bug: the group policy drops the group, the error is kept
            trajs = self._cancelled(sample, seq)
            for traj in trajs:
                traj.status = TrajectoryStatus.FAILED
                traj.error = f"{type(exc).__name__}: {exc}"
                traj.metadata["failed_in"] = "agent flow"
        if not self._stopping:
            if self.state.add_trajectories(trajs) and not self._notify_scheduled:
                # One collector wake-up per loop iteration, however many groups completed in it.
                self._notify_scheduled = True
                asyncio.get_running_loop().call_soon(self._notify_collector)

    def _cancelled(self, sample: PromptSample, seq: int) -> list[Trajectory]:
        """The group as it stands, every unfinished trajectory marked cancelled."""
        out = []
        for i in range(self.state.N):
            traj = continuation(sample, i, seq)
            if not traj.status.finished:
                traj.status = TrajectoryStatus.CANCELLED
            out.append(traj)
        return out

    def _notify_collector(self) -> None:
        self._notify_scheduled = False
        self.state.notify_collector()

    def _wake_threadsafe(self) -> None:
        loop, wake = self.loop, self._wake
        if loop is None or wake is None or loop.is_closed() or not self._waiting:
            # A busy producer re-plans before it sleeps again; only a waiting one needs waking.
            return
        try:
            if threading.get_ident() == getattr(self._thread, "ident", None):
                wake.set()
            else:
                loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # loop closed between the check and the call
            pass

    def run_coroutine(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run ``coro`` on the producer's loop from the main thread and wait for its result."""
        if self.loop is None or self._stopped:
            coro.close()
            raise PipelineError("The rollout producer is not running.")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            future.cancel()
            raise PipelineError(f"An engine call on the producer loop did not return within {timeout:g} s.") from None

    # ------------------------------------------------------------------ step boundary

    def cancel_in_flight(self, timeout: float) -> None:
        """Abort every in-flight request and return once none is in flight (a partial pause).

        Requests still queued behind ``agentflow.router.max_connections`` return cancelled without
        reaching the engine; requests that reached the engine after its abort pass are aborted
        again while waiting.
        """
        self._cancel_queued = True
        try:
            self._abort_in_flight(timeout)
            self.state.wait_in_flight(timeout, poll=lambda: self._abort_in_flight(timeout, wait=False))
        finally:
            self._cancel_queued = False

    def pause_engines(self, mode: str, timeout: float) -> None:
        """``pause(mode)`` on every engine, from the main thread (colocate's frozen long tail)."""
        if self.client is None:
            raise PipelineError("Freezing the requests in flight needs an engine client; this producer has none.")
        self.run_coroutine(self.client.pause(mode), timeout)

    def resume_engines(self, timeout: float) -> None:
        """``resume()`` on every engine, from the main thread. Idempotent."""
        if self.client is not None:
            self.run_coroutine(self.client.resume(), timeout)

    def _abort_in_flight(self, timeout: float, wait: bool = True) -> None:
        if self.loop is None:
            return
        if self.client is None:
            self.loop.call_soon_threadsafe(self._cancel_tasks)
            return
        coro = self.client.abort_all()
        if wait:
            self.run_coroutine(coro, timeout)
        else:
            asyncio.run_coroutine_threadsafe(coro, self.loop)

    def _cancel_tasks(self) -> None:
        current = asyncio.current_task()
        main = self._main_task
        for task in asyncio.all_tasks(self.loop):
            if task is not current and task is not main:
                task.cancel()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread: cancel every request task, close the client. Idempotent."""
        if self._stopped:
            return
        self._stopping = True
        loop, thread = self.loop, self._thread
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._cancel_tasks)
                if self._wake is not None:
                    loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:
                pass
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise PipelineError(f"The rollout producer thread did not stop within {timeout:.0f} s.")
        self._stopped = True
