"""PipelineState: the pipeline's shared state and every transition on it, behind one lock.

This is the one home of the spec's scheduling rules: capacity, the window questions, TrajQueue →
collector → PipelineBuffer, consumption, and the step-boundary cleanup (recycle complete groups,
drop incomplete ones, clear TrajQueue, reset the strategy). The live producer/collector threads
and the simulator drive these same methods; neither keeps scheduling state of its own.

Group policy for trajectories that did not finish (collector side):

- all N finished (completed or truncated): the group goes to the strategy's collection check, then
  through ``rollout.filter``; a filtered group is dropped and counted in ``rollout/filter_drop``.
- any trajectory failed (engine error after retries): the group is dropped; its prompt is
  regenerated from scratch once (ledger ``recycle`` with ``reason: failed``), and on a second
  failure it is dropped for good (ledger ``drop``, counted in ``rollout/failed_drop``). Too many
  failed groups in a row raise an error on the main thread instead of starving the trainer.
- every failed trajectory failed because the engine did not serve it (``EngineFault``: the
  request timed out, or its replica or router went away): the prompt is regenerated from scratch
  (ledger ``recycle`` with ``reason: engine_fault``, counted in ``rollout/engine_fault_recycled``)
  without spending its failure budget or counting toward the limit above; the engine supervisor
  owns that case. After ``ENGINE_FAULT_RETRIES`` such tries it is dropped (``drop``, same reason).
- any trajectory cancelled (aborted at a step boundary, or by the engine itself): the group is put
  back into the datasource's recycle buffer with its partial tokens and resumed later.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from lightning_fasync.pipeline.buffer import PipelineBuffer
from lightning_fasync.pipeline.datasource import DataSource
from lightning_fasync.pipeline.events import EventLog, Ledger
from lightning_fasync.pipeline.traj_queue import PendingGroup, TrajQueue
from lightning_fasync.config.schema import pipeline_capacity
from lightning_fasync.pipeline.window import WindowStrategy, WindowView
from lightning_fasync.errors import PipelineError
from lightning_fasync.types import PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus

GroupFilter = Callable[[TrajectoryGroup], bool]

ENGINE_FAULT_RETRIES = 3
"""Times a prompt is regenerated after engine faults (timeouts, lost replicas) before it is dropped."""


@dataclass
class _StepStats:
    filter_drop: int = 0
    failed_drop: int = 0
    engine_fault_recycled: int = 0
    partial_restored_count: int = 0
    partial_dropped_incomplete_count: int = 0
    aborted_restored_count: int = 0
    recycled_any: bool = False
    consumed_trajectories: int = 0
    consumed_groups: int = 0
    consumed_partial: int = 0
    partial_span_max: int = 0
    reward_sum: float = 0.0
    reward_count: int = 0
    length_sum: int = 0
    length_max: int = 0


class PipelineState:
    """Shared pipeline state. Every public method takes the lock itself.

    Arguments:
        num_prompts_per_step: B.
        num_trajectories_per_prompt: N.
        stale_steps: ``fully_async.stale_steps``; capacity ``C = int(B * (1 + stale_steps))``.
        capacity: C given directly instead (colocate: B plus the synchronous over-dispatch).
        strategy: the sliding-window strategy.
        datasource: prompt supply and recycle buffer.
        event_log, ledger: optional observability sinks.
        group_filter: ``rollout.filter``; returns False to drop a group.
        max_consecutive_failed_groups: raise after this many failed groups in a row.
    """

    def __init__(
        self,
        *,
        num_prompts_per_step: int,
        num_trajectories_per_prompt: int,
        stale_steps: float = 0.0,
        strategy: WindowStrategy,
        datasource: DataSource,
        event_log: Optional[EventLog] = None,
        ledger: Optional[Ledger] = None,
        group_filter: Optional[GroupFilter] = None,
        max_consecutive_failed_groups: int = 16,
        capacity: Optional[int] = None,
    ) -> None:
        self.B = num_prompts_per_step
        self.N = num_trajectories_per_prompt
        self.C = pipeline_capacity(num_prompts_per_step, stale_steps) if capacity is None else capacity
        if self.C < 1:
            raise ValueError(f"Pipeline capacity int(B * (1 + stale_steps)) is {self.C}; it must be >= 1.")
        self.strategy = strategy
        self.datasource = datasource
        self.events = event_log or EventLog(None, time.monotonic)
        self.ledger = ledger or Ledger(None)
        self.group_filter = group_filter
        self.max_consecutive_failed_groups = max_consecutive_failed_groups

        self.cond = threading.Condition(threading.Lock())
        # The trainer waits on its own condition (same lock) and is woken only when the buffer
        # can satisfy it, not on every completion.
        self._fetch_cv = threading.Condition(self.cond._lock)  # type: ignore[attr-defined]
        self._fetch_want = 1 << 62
        self.queue = TrajQueue(self.N)
        self.buffer = PipelineBuffer()
        self.next_seq = 0
        self.in_flight = 0  # trajectories dispatched and not yet returned
        self._collecting = 0  # groups taken from TrajQueue, not yet in the buffer or dropped
        self.paused = False
        self.exhausted = False
        self.rollout_step = 0
        self.weight_version = 0
        self.consumed_this_step = 0  # groups the trainer took since the step began (WindowView.consumed)
        self._consecutive_failed = 0
        self._error: Optional[BaseException] = None
        # Called at each poll of the main thread's waits (fetch, pause); may raise to abandon them.
        self.interrupt: Optional[Callable[[], None]] = None
        # The engines are lost for good (set by the engine supervisor): nothing more is dispatched;
        # the trainer uses what the buffer holds, saves at the next boundary and stops there, or
        # stops at once with this error when it would have to wait for more.
        self.fault: Optional[BaseException] = None
        self._error_seen = False
        self._stats = _StepStats()
        self._wake_listeners: list[Callable[[], None]] = []
        # Bumped whenever a collection decision could change (a group completed, Q moved, the
        # step resumed); the collector thread waits on it instead of polling.
        self.change_count = 0

    # ------------------------------------------------------------------ views and errors

    @property
    def R(self) -> int:  # noqa: N802 - the spec's symbol
        """Groups dispatched but not yet collected (docs/contract.md §3)."""
        return len(self.queue) + self._collecting

    @property
    def Q(self) -> int:  # noqa: N802
        """Completed groups in the PipelineBuffer not yet consumed."""
        return len(self.buffer)

    def view(self) -> WindowView:
        return WindowView(
            B=self.B,
            C=self.C,
            R=self.R,
            Q=self.Q,
            next_seq=self.next_seq,
            oldest_uncollected_seq=self.queue.oldest_uncollected_seq(self.next_seq),
            min_uncompleted_seq=self.queue.min_uncompleted_seq(self.next_seq),
            consumed=self.consumed_this_step,
        )

    def add_wake_listener(self, fn: Callable[[], None]) -> None:
        """``fn`` is called (outside the lock) whenever dispatch capacity may have grown."""
        self._wake_listeners.append(fn)

    def _wake_producer(self) -> None:
        for fn in self._wake_listeners:
            fn()

    def set_error(self, exc: BaseException) -> None:
        """Record a background thread's exception; the main thread re-raises it at its next call."""
        self._record("_error", exc)
        self._wake_producer()

    def set_fault(self, exc: BaseException) -> None:
        """The engines are lost for good (see ``fault``); any thread."""
        self._record("fault", exc)

    def _record(self, attr: str, exc: BaseException) -> None:
        """Keep the first ``exc`` in ``attr`` and wake every main-thread wait."""
        with self.cond:
            if getattr(self, attr) is None:
                setattr(self, attr, exc)
            self.cond.notify_all()
            self._fetch_cv.notify_all()

    def check_interrupt(self) -> None:
        """Run the main thread's interrupt check (``interrupt``, set by the driver: a preemption
        that must abandon the step raises from here), at each poll of a main-thread wait."""
        if self.interrupt is not None:
            self.interrupt()

    def raise_if_error(self, unseen_only: bool = False) -> None:
        """Re-raise a background thread's error on the calling (main) thread.

        With ``unseen_only`` only an error the main thread has not been given yet is raised (what
        ``shutdown`` reports: an error already raised once is not raised again at teardown).
        """
        err = self._error
        if err is None or (unseen_only and self._error_seen):
            return
        self._error_seen = True
        raise PipelineError(f"A rollout thread failed: {type(err).__name__}: {err}") from err

    # ------------------------------------------------------------------ producer side

    def plan_dispatch(self, limit: Optional[int] = None) -> list[tuple[int, PromptSample]]:
        """Take as many groups as the strategy allows now; each gets the next sequence number."""
        out: list[tuple[int, PromptSample]] = []
        with self.cond:
            if self.paused or self.exhausted or self._error is not None or self.fault is not None:
                return out
            count = int(self.strategy.dispatch_count(self.view()))
            if limit is not None:
                count = min(count, limit)
            for _ in range(count):
                sample = self.datasource.next_sample()
                if sample is None:
                    self.exhausted = True
                    self.cond.notify_all()
                    self._fetch_cv.notify_all()
                    break
                seq = self.next_seq
                self.next_seq += 1
                self.queue.register(sample, seq)
                self.in_flight += self.N
                out.append((seq, sample))
                if self.events.enabled:
                    self.events.emit("dispatch", seq=seq, prompt=sample.prompt_id, R=self.R, Q=self.Q, step=self.rollout_step)
        return out

    def add_trajectory(self, traj: Trajectory) -> bool:
        """A terminal trajectory arrives in TrajQueue. Returns True when it completed its group."""
        with self.cond:
            completed, recycled = self._add_locked(traj)
            if completed:
                self.cond.notify_all()
        if recycled:
            self._wake_producer()
        return completed

    def _add_locked(self, traj: Trajectory) -> tuple[bool, bool]:
        group = self.queue.add(traj)
        self.in_flight -= 1
        if self.in_flight == 0:
            self.cond.notify_all()
        if group is None:
            return False, False
        if group.has_cancelled and not group.has_failed and not self.paused:
            # Aborted by the engine outside a step boundary: resume it later.
            self.queue.pop(group.seq)
            self._recycle_locked(group, reason="aborted")
            self._stats.aborted_restored_count += self.N
            return True, True
        if self.events.enabled:
            self.events.emit("complete", seq=group.seq, prompt=group.sample.prompt_id, R=self.R, Q=self.Q, step=self.rollout_step)
        self.change_count += 1
        return True, False

    def add_trajectories(self, trajs: Sequence[Trajectory]) -> bool:
        """Add several terminal trajectories under one lock; True when a group completed.

        The caller wakes the collector (:meth:`notify_collector`); the producer does that once per
        event-loop iteration.
        """
        completed = False
        recycled = False
        with self.cond:
            for traj in trajs:
                c, r = self._add_locked(traj)
                completed |= c
                recycled |= r
        if recycled:
            self._wake_producer()
        return completed

    def notify_collector(self) -> None:
        with self.cond:
            self.cond.notify_all()

    # ------------------------------------------------------------------ collector side

    def collect_once(self) -> int:
        """Move every group the strategy lets go from TrajQueue into the buffer (or drop it).

        Returns the number of groups taken from TrajQueue. The user filter runs outside the lock.
        """
        with self.cond:
            taken = self._take_ready_locked()
        if not taken:
            return 0
        verdicts = []
        for group in taken:
            if group.has_failed:
                verdicts.append("failed")
                continue
            tg = group.to_group()
            keep = True
            if self.group_filter is not None:
                try:
                    keep = bool(self.group_filter(tg))
                except Exception as exc:  # a user callable: name it in the error
                    self.set_error(PipelineError(f"`rollout.filter` raised on prompt {tg.prompt_id}: {exc!r}"))
                    keep = False
            verdicts.append("keep" if keep else "filter")
        self._finish_collect(taken, verdicts)
        return len(taken)

    def drain_collect(self, timeout: float) -> None:
        """Collect until nothing collectable is left and no other pass is mid-way (``pause()``)."""
        deadline = time.monotonic() + timeout
        while True:
            self.collect_once()
            with self.cond:
                if self._collecting == 0 and not any(
                    g.has_failed or self.strategy.can_collect(g.seq, self.view()) for g in self.queue.ready()
                ):
                    return
                if time.monotonic() > deadline:
                    raise PipelineError(f"The collector did not settle within {timeout:.0f} s during pause().")
                if self._collecting:
                    self.cond.wait(0.05)

    def _take_ready_locked(self) -> list[PendingGroup]:
        taken: list[PendingGroup] = []
        if not self.queue.num_ready:
            return taken
        # Taking a group moves it from TrajQueue to "collecting": R, Q and min_uncompleted_seq do
        # not change during the pass (only oldest_uncollected_seq may move forward), so the view
        # taken at the start of the pass serves every decision in it.
        view = self.view()
        can_collect = self.strategy.can_collect
        horizon_fn = getattr(self.strategy, "collect_horizon", None)
        horizon = horizon_fn(view) if horizon_fn is not None else None
        for group in self.queue.ready(horizon):
            if group.has_failed or can_collect(group.seq, view):
                self.queue.pop(group.seq)
                self._collecting += 1
                taken.append(group)
        return taken

    @staticmethod
    def _engine_fault(group: PendingGroup) -> bool:
        """Every failed trajectory of ``group`` failed because the engine did not serve it."""
        failed = [t for t in group.trajectories.values() if t.status is TrajectoryStatus.FAILED]
        return bool(failed) and all(t.metadata.get("engine_fault") for t in failed)

    def _finish_collect(self, groups: Sequence[PendingGroup], verdicts: Sequence[str]) -> None:
        # The producer is always woken: a collection moves the oldest uncollected seq
        # (window-gated) and a drop frees capacity.
        failed_too_often = None
        with self.cond:
            for group, verdict in zip(groups, verdicts):
                self._collecting -= 1
                pid = group.sample.prompt_id
                if verdict == "keep":
                    self.buffer.put(group.to_group())
                    self._consecutive_failed = 0
                    if self.events.enabled:
                        self.events.emit("collect", seq=group.seq, prompt=pid, R=self.R, Q=self.Q, step=self.rollout_step)
                    if len(self.buffer) >= self._fetch_want:
                        self._fetch_cv.notify()
                elif verdict == "filter":
                    self._consecutive_failed = 0
                    self._stats.filter_drop += 1
                    self.ledger.record("drop", prompt=str(pid), seq=group.seq, step=self.rollout_step, reason="filter")
                elif self._engine_fault(group):
                    # The engine did not serve (timeout, lost replica): regenerate the prompt from
                    # scratch without spending its failure budget, up to ENGINE_FAULT_RETRIES times.
                    errors = [t.error for t in group.trajectories.values() if t.error]
                    faults = int(group.sample.metadata.get("_engine_fault_retries", 0))
                    self._stats.engine_fault_recycled += 1
                    if faults < ENGINE_FAULT_RETRIES:
                        self.datasource.recycle([PromptSample(
                            prompt_id=pid, input_ids=group.sample.input_ids,
                            metadata={**group.sample.metadata, "_engine_fault_retries": faults + 1},
                        )])
                        self.ledger.record("recycle", prompt=str(pid), seq=group.seq, step=self.rollout_step, reason="engine_fault", error=errors[:1])
                    else:
                        self._stats.failed_drop += 1
                        self.ledger.record("drop", prompt=str(pid), seq=group.seq, step=self.rollout_step, reason="engine_fault", error=errors[:1])
                else:
                    self._consecutive_failed += 1
                    erred = [t for t in group.trajectories.values() if t.error]
                    errors = [t.error for t in erred]
                    retries = int(group.sample.metadata.get("_failed_retries", 0))
                    if retries < 1:
                        fresh = PromptSample(
                            prompt_id=pid,
                            input_ids=group.sample.input_ids,
                            metadata={**group.sample.metadata, "_failed_retries": retries + 1},
                        )
                        self.datasource.recycle([fresh])
                        self.ledger.record("recycle", prompt=str(pid), seq=group.seq, step=self.rollout_step, reason="failed", error=errors[:1])
                    else:
                        self._stats.failed_drop += 1
                        self.ledger.record("drop", prompt=str(pid), seq=group.seq, step=self.rollout_step, reason="failed", error=errors[:1])
                    if self._consecutive_failed >= self.max_consecutive_failed_groups:
                        where = erred[0].metadata.get("failed_in") if erred else None
                        cause = {"reward": "the reward failed", "engine": "the rollout engine failed",
                                 "agent flow": "the agent flow failed"}.get(where, "last error")
                        failed_too_often = PipelineError(
                            f"{self._consecutive_failed} prompt groups in a row had a failed trajectory "
                            f"(`rollout.max_consecutive_failed_groups` is {self.max_consecutive_failed_groups}); "
                            f"{cause}: {errors[0] if errors else 'unknown'}"
                            + (". Is the rollout engine up?" if where == "engine" else "")
                        )
            self.cond.notify_all()
        if failed_too_often is not None:
            self.set_error(failed_too_often)
        self._wake_producer()

    # ------------------------------------------------------------------ trainer side

    def try_fetch(self, k: int) -> Optional[list[TrajectoryGroup]]:
        """Pop ``k`` groups if the buffer has them, else None (no waiting)."""
        with self.cond:
            if len(self.buffer) < k:
                return None
            groups = self._pop_locked(k)
        self._wake_producer()
        return groups

    def fetch_wait(self, k: int, timeout: float) -> None:
        """Wait until the buffer holds ``k`` groups, without taking them (colocate's rollout phase)."""
        with self.cond:
            self._wait_locked(k, timeout)

    def fetch(self, k: int, timeout: float) -> list[TrajectoryGroup]:
        """Wait until the buffer holds ``k`` groups and pop them (main thread).

        Raises:
            PipelineError: after ``timeout`` seconds, when a rollout thread failed, or when the
                datasource ran out before ``k`` groups could be produced.
        """
        with self.cond:
            self._wait_locked(k, timeout)
            groups = self._pop_locked(k)
        self._wake_producer()
        return groups

    def _wait_locked(self, k: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._fetch_want = k
        try:
            while len(self.buffer) < k:
                self.raise_if_error()
                self.check_interrupt()
                if self.fault is not None:
                    raise self.fault
                if self.exhausted and self.R == 0 and self.in_flight == 0:
                    raise PipelineError(
                        f"The datasource is exhausted: {len(self.buffer)} groups are left in the PipelineBuffer "
                        f"and the trainer needs {k}."
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PipelineError(
                        f"No mini-batch after {timeout:.0f} s (`fully_async.fetch_timeout`): the trainer needs {k} "
                        f"groups, the PipelineBuffer holds {len(self.buffer)}, {self.R} are dispatched and "
                        f"{self.in_flight} trajectories in flight. Is the rollout engine generating?"
                    )
                self._fetch_cv.wait(min(remaining, 0.25))
        finally:
            self._fetch_want = 1 << 62
        self.raise_if_error()

    def _pop_locked(self, k: int) -> list[TrajectoryGroup]:
        groups = self.buffer.pop(k)
        self.change_count += 1
        self.consumed_this_step += len(groups)
        s = self._stats
        for g in groups:
            s.consumed_groups += 1
            vmin, vmax = None, None
            lengths = []
            for t in g.trajectories:
                s.consumed_trajectories += 1
                span = t.version_span
                if span != 0:
                    s.consumed_partial += 1
                if span > s.partial_span_max:
                    s.partial_span_max = span
                if t.reward is not None and t.reward == t.reward:  # NaN rewards are the trainer's to count
                    s.reward_sum += t.reward
                    s.reward_count += 1
                n = len(t.response_ids)
                lengths.append(n)
                s.length_sum += n
                if n > s.length_max:
                    s.length_max = n
                if t.start_version is not None:
                    vmin = t.start_version if vmin is None else min(vmin, t.start_version)
                    vmax = t.end_version if vmax is None else max(vmax, t.end_version)
            self.ledger.record(
                "consume", prompt=str(g.prompt_id), seq=g.seq, step=self.rollout_step, start_version=vmin, end_version=vmax,
                response_lengths=lengths,
            )
            if self.events.enabled:
                self.events.emit("consume", seq=g.seq, prompt=g.prompt_id, R=self.R, Q=self.Q, step=self.rollout_step)
        return groups

    # ------------------------------------------------------------------ step boundary

    def begin_pause(self) -> None:
        """Stop dispatching (docs/contract.md §2, step 2)."""
        with self.cond:
            self.paused = True
            if self.events.enabled:
                self.events.emit("pause", R=self.R, Q=self.Q, step=self.rollout_step, in_flight=self.in_flight)

    def wait_in_flight(self, timeout: float, poll: Optional[Callable[[], None]] = None) -> None:
        """Wait until no trajectory is in flight; ``poll`` runs about every 0.5 s while waiting."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.in_flight > 0:
                self.raise_if_error()
                self.check_interrupt()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PipelineError(
                        f"pause() waited {timeout:.0f} s (`fully_async.pause_timeout`) and {self.in_flight} "
                        "trajectories are still in flight; the engine did not finish or honour the abort."
                    )
                self.cond.wait(min(remaining, 0.5))
                if poll is not None and self.in_flight > 0:
                    self.cond.release()
                    try:
                        poll()
                    finally:
                        self.cond.acquire()

    def cleanup_after_pause(self) -> None:
        """Recycle complete groups, drop incomplete ones, clear TrajQueue, reset the strategy.

        Must run once nothing is in flight and after a last collection pass. "Complete" means N
        trajectories assembled, finished or not (docs/contract.md §4, ``partial_restored_count``). An
        incomplete group loses its partial tokens (counted in
        ``partial_dropped_incomplete_count``) but not its prompt: the prompt is regenerated from
        scratch, so nothing is lost.
        """
        with self.cond:
            if self.in_flight != 0:
                raise PipelineError(f"cleanup_after_pause() called with {self.in_flight} trajectories in flight.")
            recycled: list[PromptSample] = []
            for group in self.queue.drain():
                self._stats.recycled_any = True
                if group.assembled:
                    self._stats.partial_restored_count += self.N
                    recycled.append(self._resumable(group))
                    self.ledger.record("recycle", prompt=str(group.sample.prompt_id), seq=group.seq, step=self.rollout_step, reason="partial")
                else:
                    self._stats.partial_dropped_incomplete_count += len(group.trajectories)
                    recycled.append(PromptSample(prompt_id=group.sample.prompt_id, input_ids=group.sample.input_ids, metadata=group.sample.metadata))
                    self.ledger.record("recycle", prompt=str(group.sample.prompt_id), seq=group.seq, step=self.rollout_step, reason="incomplete")
            self.datasource.recycle(recycled)
            self.strategy.reset()

    @staticmethod
    def _resumable(group: PendingGroup) -> PromptSample:
        return PromptSample(
            prompt_id=group.sample.prompt_id,
            input_ids=group.sample.input_ids,
            metadata=group.sample.metadata,
            resume=[group.trajectories[i] for i in sorted(group.trajectories)],
        )

    def _recycle_locked(self, group: PendingGroup, reason: str) -> None:
        sample = self._resumable(group)
        self.datasource.recycle([sample])
        self.ledger.record("recycle", prompt=str(sample.prompt_id), seq=group.seq, step=self.rollout_step, reason=reason)

    def resume(self) -> None:
        """Rollout step + 1, weight version + 1, dispatch again (docs/contract.md §2, step 4)."""
        with self.cond:
            self.rollout_step += 1
            self.weight_version += 1
            self.consumed_this_step = 0
            self.paused = False
            self.change_count += 1
            self.cond.notify_all()
            if self.events.enabled:
                self.events.emit("resume", R=self.R, Q=self.Q, step=self.rollout_step, weight_version=self.weight_version)
        self._wake_producer()

    def step_metrics(self) -> dict[str, float]:
        """The rollout metrics of docs/contract.md §4 for the step that just paused, then reset them.

        ``partial_restored_count`` and ``partial_dropped_incomplete_count`` are reported only when
        there was data to recycle, as the spec says.
        """
        with self.cond:
            s = self._stats
            self._stats = _StepStats()
            q = self.Q
        m: dict[str, float] = {
            "rollout/pipeline_buf_size": float(q),
            "rollout/filter_drop": float(s.filter_drop),
            "rollout/partial_ratio": s.consumed_partial / s.consumed_trajectories if s.consumed_trajectories else 0.0,
            "rollout/partial_span_max": float(s.partial_span_max),
            "rollout/consumed_groups": float(s.consumed_groups),
        }
        if s.recycled_any:
            m["rollout/partial_restored_count"] = float(s.partial_restored_count)
            m["rollout/partial_dropped_incomplete_count"] = float(s.partial_dropped_incomplete_count)
        if s.failed_drop:
            m["rollout/failed_drop"] = float(s.failed_drop)
        if s.engine_fault_recycled:
            m["rollout/engine_fault_recycled"] = float(s.engine_fault_recycled)
        if s.aborted_restored_count:
            m["rollout/aborted_restored_count"] = float(s.aborted_restored_count)
        if s.reward_count:
            m["rollout/reward_mean"] = s.reward_sum / s.reward_count
        if s.consumed_trajectories:
            m["rollout/response_length_mean"] = s.length_sum / s.consumed_trajectories
            m["rollout/response_length_max"] = float(s.length_max)
        return m

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint state; taken at a step boundary (nothing in flight, TrajQueue empty).

        The buffer's unconsumed prompts are saved beside the datasource's recycle queue; on restore
        both are served before new prompts, oldest prompt id first (docs/contract.md §2, step 3).
        """
        with self.cond:
            if self.in_flight or len(self.queue):
                raise PipelineError("PipelineState.state_dict() must be taken at a step boundary, with nothing in flight.")
            ds = self.datasource.state_dict()
            unconsumed = self.buffer.state_dict()["unconsumed_prompts"]
            return {
                "datasource": ds,
                "unconsumed_prompts": unconsumed,
                "rollout_step": self.rollout_step,
                "weight_version": self.weight_version,
                "next_seq": self.next_seq,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.cond:
            self.datasource.load_state_dict(state["datasource"])
            self.datasource.recycle([PromptSample.from_dict(d) for d in state["unconsumed_prompts"]])
            self.rollout_step = int(state["rollout_step"])
            self.weight_version = int(state["weight_version"])
            self.next_seq = int(state["next_seq"])
            self.buffer.clear()
