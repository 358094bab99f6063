"""The step protocol, written once (docs/contract.md §2; ``docs/contract.md``, "The step").

One outer step reads like the spec:

1. the producer and collector run in the background; the trainer fetches M // N groups per
   training call, (B × N) // M times;
2. :meth:`FullyAsyncController.pause`: stop dispatch, cancel (``rollout.partial: true``) or await
   in-flight requests, let the collector settle, recycle complete groups and drop incomplete ones,
   clear TrajQueue, reset the strategy; groups already in the PipelineBuffer stay. With
   ``rollout.weight_update_mode: inflight`` only dispatch stops: the requests stay in flight (and
   their groups in TrajQueue), the engines freeze them during the sync and they go on decoding
   under the new weights (:attr:`FullyAsyncController.sync_pause_mode`);
3. aggregate the step's metrics; save a checkpoint when ``trainer.save_freq`` says so (the
   PipelineBuffer's unconsumed prompts are recorded in it); sync the new weights to every engine
   (which flushes its cache); when ``eval.*`` says so, evaluate those weights on the engines
   (:class:`~lightning_fasync.pipeline.evaluator.Evaluator`, outside the pipeline's accounting);
4. ``resume()``: rollout step + 1, weight version + 1, production continues.

:class:`StepSchedule` is the one place that decides when a boundary, a save and an evaluation are due;
:meth:`FullyAsyncController.pause` is the one pause-and-cleanup. The Lightning callback, the
Fabric loop, the simulator and the control-plane benchmark all drive this controller; the live
run and the simulator differ only in the :class:`Rollout` they plug in (threads and engines, or
engines modelled on a virtual clock).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol

from lightning_fasync.config import FasyncConfig, check_offload
from lightning_fasync.components import load_object
from lightning_fasync.pipeline.collector import Collector
from lightning_fasync.pipeline.datasource import DataSource
from lightning_fasync.pipeline.engine_client import EngineClient
from lightning_fasync.pipeline.evaluator import Evaluator
from lightning_fasync.pipeline.events import EventLog, Ledger
from lightning_fasync.pipeline.flow import AgentFlow
from lightning_fasync.pipeline.metrics import StepTimer, aggregate_metrics
from lightning_fasync.pipeline.producer import RolloutProducer
from lightning_fasync.pipeline.state import GroupFilter, PipelineError, PipelineState
from lightning_fasync.pipeline.window import make_window_strategy
from lightning_fasync.types import TrajectoryGroup


class StepHooks(Protocol):
    """What the training side provides at a step boundary."""

    def save_checkpoint(self, step: int) -> None:
        """Write a checkpoint (model, optimizer, and ``controller.state_dict()``)."""

    def sync_weights(self, version: int) -> None:
        """Push the trainer's weights to every engine as ``version``; engines flush their cache."""


class ColocateHooks(StepHooks, Protocol):
    """What colocate mode with ``colocate_offload`` also needs: the five stages (their names are
    the spec's ``timing/*``) in which the engines and the trainer hand the shared devices over.
    The order is slime's (``train.py``): rollout → offload_rollout → onload_train → train →
    checkpoint → offload_train → onload_rollout_weights → weight sync → onload_rollout_kv."""

    def offload_rollout(self) -> None:
        """The engines release their weights and KV cache (they are idle: the step has paused)."""

    def onload_train(self) -> None:
        """The trainer moves model and optimizer state onto its device."""

    def offload_train(self) -> None:
        """The trainer moves model and optimizer state off its device."""

    def onload_rollout_weights(self) -> None:
        """The engines take back the memory of their weights (contents follow in the weight sync)."""

    def onload_rollout_kv(self) -> None:
        """The engines take back their KV cache; after this they can generate."""


class Rollout(Protocol):
    """The engine side of the pipeline, as the step protocol sees it.

    The live run plugs in :class:`ThreadedRollout` (producer and collector threads in front of
    real engines); the simulator plugs in engines modelled on a virtual clock. Everything else
    (capacity, windows, collection, the group policy, pause cleanup, metrics) is the same
    :class:`PipelineState` and the same controller.
    """

    def start(self) -> None:
        """Begin producing (after any checkpoint restore)."""

    def stop(self) -> None:
        """Stop producing and release everything. Idempotent."""

    def wait_for_groups(self, k: int, timeout: float) -> None:
        """Return once the PipelineBuffer holds ``k`` groups; a clear error after ``timeout``."""

    def cancel_in_flight(self, timeout: float) -> None:
        """Abort every in-flight request; return once none is in flight (``rollout.partial``)."""

    def await_in_flight(self, timeout: float) -> None:
        """Return once every in-flight request has finished (``rollout.partial: false``)."""

    def freeze_in_flight(self, timeout: float) -> None:
        """Hold every in-flight request where it is, its KV cache kept, until :meth:`thaw` (colocate
        with ``rollout.weight_update_mode: inflight``: the engines stop decoding while the trainer
        runs)."""

    def thaw(self, timeout: float) -> None:
        """Let the requests :meth:`freeze_in_flight` held go on decoding. Idempotent."""


class ThreadedRollout:
    """The live engine side: the producer thread (window strategy → agent flow → engines) and the
    collector thread (TrajQueue → filter → PipelineBuffer)."""

    def __init__(self, state: PipelineState, flow: AgentFlow, client: Optional[EngineClient], max_connections: int) -> None:
        self.state = state
        self.producer = RolloutProducer(state, flow, client, max_connections=max_connections)
        self.collector = Collector(state)

    def start(self) -> None:
        self.producer.start()
        self.collector.start()

    def stop(self) -> None:
        errors: list[BaseException] = []
        for stop in (self.producer.stop, self.collector.stop):
            try:
                stop()
            except BaseException as exc:  # noqa: BLE001 - stop the rest first
                errors.append(exc)
        if errors:
            raise errors[0]

    def wait_for_groups(self, k: int, timeout: float) -> None:
        self.state.fetch_wait(k, timeout)

    def cancel_in_flight(self, timeout: float) -> None:
        self.producer.cancel_in_flight(timeout)

    def await_in_flight(self, timeout: float) -> None:
        self.state.wait_in_flight(timeout)

    def freeze_in_flight(self, timeout: float) -> None:
        self.producer.pause_engines("in_place", timeout)

    def thaw(self, timeout: float) -> None:
        self.producer.resume_engines(timeout)


@dataclass
class StepSchedule:
    """When a step boundary and a checkpoint are due (docs/contract.md §2). The one place that decides.

    Every data-parallel rank holds one, so the boundary falls on the same training call on every
    rank whether or not that rank runs the pipeline.
    """

    calls_per_step: int
    """(B × N) // M training calls per outer step."""
    save_freq: int
    """``trainer.save_freq``: save after every this many rollout steps; 0 never."""
    calls: int = 0
    """Training calls finished in the current step."""
    force_save: bool = False
    """Save at the next boundary whatever ``save_freq`` says (a preempted run's last checkpoint)."""
    eval_every: int = 0
    """``eval.every_n_steps``: evaluate after every this many rollout steps; 0 never."""
    eval_at_end: bool = False
    """``eval.at_end``: also evaluate at the boundary that ends ``final_step``."""
    final_step: Optional[int] = None
    """The run's last rollout step, when the driver knows it (for ``eval.at_end``)."""

    @classmethod
    def from_config(cls, cfg: FasyncConfig) -> "StepSchedule":
        return cls(
            calls_per_step=cfg.minibatches_per_step, save_freq=cfg.trainer.save_freq,
            eval_every=cfg.eval.every_n_steps, eval_at_end=cfg.eval.at_end,
        )

    def call_done(self) -> bool:
        """Count a finished training call; True (and a new count) when the step boundary is due."""
        self.calls += 1
        if self.calls < self.calls_per_step:
            return False
        self.calls = 0
        return True

    def save_due(self, step: int) -> bool:
        """Whether the boundary that ends rollout step ``step`` saves a checkpoint."""
        return self.force_save or (self.save_freq > 0 and (step + 1) % self.save_freq == 0)

    def eval_due(self, step: int) -> bool:
        """Whether the boundary that ends rollout step ``step`` evaluates (``eval.*``): counted from
        the global rollout step, so a resumed run keeps the schedule. A boundary that ends the run
        on a signal or on lost engines (``force_save``) does not evaluate."""
        if self.force_save:
            return False
        every = self.eval_every > 0 and (step + 1) % self.eval_every == 0
        return every or (self.eval_at_end and self.final_step is not None and step == self.final_step)


def build_state(
    cfg: FasyncConfig,
    datasource: DataSource,
    events: Optional[EventLog] = None,
    ledger: Optional[Ledger] = None,
    group_filter: Optional[GroupFilter] = None,
) -> PipelineState:
    """The :class:`PipelineState` for ``cfg``: fully-async capacity and window, or colocate's.

    Colocate (the spec's baseline) rolls out the batch, pauses, then trains on the same resources:
    capacity is B plus the synchronous over-dispatch, and no window strategy applies.
    """
    if group_filter is None and cfg.rollout.filter:
        group_filter = load_object(cfg.rollout.filter, "rollout.filter")
    colocate = not cfg.fully_async.enable
    return PipelineState(
        num_prompts_per_step=cfg.B,
        num_trajectories_per_prompt=cfg.N,
        stale_steps=cfg.fully_async.stale_steps,
        capacity=cfg.B + cfg.rollout.sampler.num_oversample if colocate else None,
        strategy=make_window_strategy("no-window" if colocate else cfg.fully_async.sliding_window),
        datasource=datasource,
        event_log=events,
        ledger=ledger,
        group_filter=group_filter,
        max_consecutive_failed_groups=cfg.rollout.max_consecutive_failed_groups,
    )


class FullyAsyncController:
    """Owns the rollout side and runs the step protocol.

    Arguments:
        cfg: the validated configuration.
        datasource: the prompt supply.
        flow: the agent flow the producer runs (live runs).
        client: the engine client (abort at partial step boundaries; closed on stop).
        log_dir: where ``events.jsonl`` and ``ledger.jsonl`` go (None: not written).
        group_filter: overrides ``rollout.filter``.
        clock: the clock of timings and event times (the simulator passes its virtual clock).
        rollout: ``state -> Rollout``; default: :class:`ThreadedRollout` over ``flow`` and ``client``.
        events_path: write the event log here instead of ``log_dir/events.jsonl``.
        evaluator: evaluates the engines' weights at the boundaries ``eval.*`` names (closed on
            shutdown); None: no evaluation.
        colocate_offload: colocate mode hands the devices over between rollout and training
            (:class:`ColocateHooks`; the driver resolves ``colocate_offload`` for its device with
            :func:`~lightning_fasync.config.colocate_offload_enabled`). Ignored in fully-async mode.
    """

    def __init__(
        self,
        cfg: FasyncConfig,
        datasource: DataSource,
        flow: Optional[AgentFlow] = None,
        client: Optional[EngineClient] = None,
        log_dir: Optional[str] = None,
        group_filter: Optional[GroupFilter] = None,
        clock: Callable[[], float] = time.perf_counter,
        rollout: Optional[Callable[[PipelineState], Rollout]] = None,
        events_path: Optional[str] = None,
        evaluator: Optional[Evaluator] = None,
        colocate_offload: bool = False,
    ) -> None:
        self.cfg = cfg
        self.evaluator = evaluator
        self.clock = clock
        t0 = clock()
        if events_path is None and log_dir and cfg.fully_async.event_log:
            events_path = os.path.join(log_dir, "events.jsonl")
        events = EventLog(events_path, clock=lambda: clock() - t0)
        ledger = Ledger(os.path.join(log_dir, "ledger.jsonl") if log_dir else None)
        self.state = build_state(cfg, datasource, events, ledger, group_filter)
        self.colocate = not cfg.fully_async.enable
        if rollout is None:
            if flow is None:
                raise PipelineError("FullyAsyncController needs an agent flow (or a `rollout` of its own).")
            self.rollout: Rollout = ThreadedRollout(self.state, flow, client, cfg.agentflow.router.max_connections)
        else:
            self.rollout = rollout(self.state)
        self.schedule = StepSchedule.from_config(cfg)
        self.timer = StepTimer(clock)
        self._train_records: list[Mapping[str, float]] = []
        # More step metrics, read at each boundary on the main thread (e.g. the engine supervisor's).
        self.metric_sources: list[Callable[[], Mapping[str, float]]] = []
        self._rollout_done = False  # colocate: the current step's rollout phase has ended
        self._frozen = False  # colocate in-flight: the engines hold the long tail until the sync
        # Colocate with offload: the spec's five stages (ColocateHooks); fully-async runs none of them.
        self.offload = colocate_offload and self.colocate
        self._handed_to_train = False  # offload_rollout + onload_train ran this step
        check_offload(cfg, self.offload)
        self._train_t0: Optional[float] = None
        self._in_boundary = False
        self._saved_step: Optional[int] = None
        self._started = False
        self._closed = False
        self.sync_pause_mode = "abort"
        """The engines' ``/pause_generation`` mode for the coming weight sync, set at each boundary:
        ``abort`` (nothing is in flight by then), or at an in-flight boundary ``in_place``
        (``rollout.inflight_kv: keep``) or ``retract`` (``recompute``). The runtime's sync reads it."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def rollout_step(self) -> int:
        return self.state.rollout_step

    @property
    def weight_version(self) -> int:
        return self.state.weight_version

    @property
    def producer(self) -> RolloutProducer:
        """The live producer (only with :class:`ThreadedRollout`)."""
        return self.rollout.producer  # type: ignore[attr-defined]

    def start(self, hooks: Optional[ColocateHooks] = None) -> None:
        """Start producing (after any checkpoint restore and the first weight sync).

        With colocate offload the trainer first moves its state off the devices (``hooks``, not
        timed: set-up, as the first weight sync), so the engines have them for step 0's rollout.
        """
        if self._closed:
            raise PipelineError("This FullyAsyncController was shut down; build a new one.")
        if self._started:
            return
        if self.offload:
            self._require_colocate_hooks(hooks).offload_train()
        self.rollout.start()
        self.timer.restart()
        self._started = True

    def shutdown(self, raise_errors: bool = True) -> None:
        """Stop the rollout side and close the logs. Idempotent.

        With ``raise_errors`` a background error not yet seen by the main thread is raised here.
        """
        if self._closed:
            return
        self._closed = True
        error: Optional[BaseException] = None
        try:
            self.rollout.stop()
        except BaseException as exc:  # noqa: BLE001 - close the logs first
            error = exc
        if self.evaluator is not None:
            self.evaluator.close()
        self.state.events.close()
        self.state.ledger.close()
        if raise_errors:
            self.state.raise_if_error(unseen_only=True)
            if error is not None:
                raise error

    # ------------------------------------------------------------------ the step

    def run_step(
        self,
        train: Callable[[Any], Mapping[str, float]],
        hooks: StepHooks,
        prepare: Optional[Callable[[list[TrajectoryGroup]], Any]] = None,
    ) -> tuple[int, dict[str, float]]:
        """One outer step, top to bottom: (B × N) // M times fetch → prepare → train, then the
        step boundary. ``train(batch)`` does one training call and returns its metrics.

        Returns ``(rollout_step, metrics)`` as :meth:`step_boundary` does.
        """
        while True:
            groups = self.fetch(hooks)  # type: ignore[arg-type]
            batch: Any = groups
            if prepare is not None:
                with self.timer.time("process_traj"):  # wait, not training (docs/contract.md §4)
                    batch = prepare(groups)
            with self.train_block():
                metrics = train(batch)
            self.record(metrics)
            if self.minibatch_done():
                return self.step_boundary(hooks)

    def fetch(self, hooks: Optional[ColocateHooks] = None) -> list[TrajectoryGroup]:
        """M // N complete groups for one training call (main thread; ``timing/rollout``).

        Colocate mode: the first fetch of a step waits for the whole batch (B groups), then pauses
        rollout (``rollout.partial`` aborts the over-dispatched long tail, else waits for it) before
        any training, so rollout and training never overlap. With ``rollout.weight_update_mode:
        inflight`` the long tail is frozen in the engines instead, its KV cache kept, through training
        and the sync, after which it goes on decoding under the new weights (a boundary that saves or
        evaluates aborts it, as in fully-async mode). With colocate offload it then hands the devices
        to the trainer through ``hooks`` (``timing/offload_rollout``, ``timing/onload_train``).
        """
        self.state.raise_if_error()
        k, timeout = self.cfg.groups_per_minibatch, self.cfg.fully_async.fetch_timeout
        with self.timer.time("rollout"):
            if self.colocate and not self._rollout_done:
                self.rollout.wait_for_groups(self.cfg.B, timeout)
                if self.inflight_boundary(self.state.rollout_step):
                    t0 = self.clock()
                    self.pause(inflight=True)
                    self._frozen = True  # before the call: a freeze that fails half-way is thawed
                    self.rollout.freeze_in_flight(self.cfg.fully_async.pause_timeout)
                    self.timer.add("pause_delay", self.clock() - t0)
                else:
                    self.pause()
                self._rollout_done = True
            self.rollout.wait_for_groups(k, timeout)
            groups = self.state.try_fetch(k)
        if groups is None:  # only the main thread consumes, so the groups it waited for are there
            raise PipelineError(f"The PipelineBuffer lost groups between the wait and the fetch ({self.state.Q} < {k}).")
        if self.offload and not self._handed_to_train:
            hooks = self._require_colocate_hooks(hooks)
            with self.timer.time("offload_rollout"):
                hooks.offload_rollout()
            with self.timer.time("onload_train"):
                hooks.onload_train()
            self._handed_to_train = True
        return groups

    def _require_colocate_hooks(self, hooks: Optional[ColocateHooks]) -> ColocateHooks:
        if hooks is None:
            raise PipelineError("Colocate offload needs the driver's ColocateHooks: pass them to start() and fetch().")
        return hooks

    def inflight_boundary(self, step: int) -> bool:
        """Whether the boundary after ``step`` keeps the requests in flight: ``rollout.weight_update_mode:
        inflight``, and this boundary neither saves (the checkpoint must hold the partial trajectories,
        which needs them back from the engines), nor evaluates (evaluation meets no training request),
        nor follows lost engines."""
        return (self.cfg.boundary_mode == "inflight" and self.state.fault is None
                and not self.schedule.save_due(step) and not (self.evaluator is not None and self.schedule.eval_due(step)))

    def pause(self, inflight: bool = False) -> None:
        """Stop dispatch, cancel or await in-flight requests, collect what may be collected, then
        recycle complete groups, drop incomplete ones, clear TrajQueue and reset the strategy
        (docs/contract.md §2, step 2). The one pause-and-cleanup of every driver.

        ``inflight`` (:meth:`inflight_boundary`): only stop dispatch and reset the strategy; the
        requests in flight stay dispatched, their groups in TrajQueue (R, Q and the window unchanged),
        and the collector goes on. ``timing/pause_delay`` is then the sync's, the time the engines
        hold them frozen (:meth:`step_boundary`)."""
        fa = self.cfg.fully_async
        t0 = self.clock()
        self.state.begin_pause()
        if inflight:
            self.state.strategy.reset()
            return
        if self.cfg.rollout.partial:
            self.rollout.cancel_in_flight(fa.pause_timeout)
        else:
            self.rollout.await_in_flight(fa.pause_timeout)
        self.state.drain_collect(fa.pause_timeout)
        self.state.cleanup_after_pause()
        self.timer.add("pause_delay", self.clock() - t0)

    def begin_train(self) -> None:
        """A training call starts (``timing/train``); pair with :meth:`end_train`."""
        self._train_t0 = self.clock()

    def end_train(self) -> None:
        """The training call that :meth:`begin_train` opened has ended (or raised). Idempotent."""
        t0, self._train_t0 = self._train_t0, None
        if t0 is None:
            return
        dur = self.clock() - t0
        self.timer.add("train", dur)
        st = self.state
        st.events.emit("train", R=st.R, Q=st.Q, step=st.rollout_step, dur=round(dur, 6))

    @contextmanager
    def train_block(self) -> Iterator[None]:
        """Wrap the forward/backward/optimizer work of one training call (``timing/train``)."""
        self.begin_train()
        try:
            yield
        finally:
            self.end_train()

    def record(self, metrics: Mapping[str, float]) -> None:
        """Cache one training call's metrics for step-end aggregation."""
        self._train_records.append(dict(metrics))

    def minibatch_done(self) -> bool:
        """Count a finished training call; True when the step boundary is due."""
        return self.schedule.call_done()

    # ------------------------------------------------------------------ step boundary

    def step_boundary(self, hooks: StepHooks) -> tuple[int, dict[str, float]]:
        """Pause, aggregate, checkpoint on ``save_freq``, sync weights, evaluate on ``eval.*``, resume.

        Returns ``(rollout_step, metrics)``: the metrics of the step that just ended, to be logged
        on the main thread at that step.
        """
        self.state.raise_if_error()
        step = self.state.rollout_step
        inflight = self.inflight_boundary(step)
        self.sync_pause_mode = ({"keep": "in_place", "recompute": "retract"}[self.cfg.rollout.inflight_kv]
                                if inflight else "abort")
        if not self.colocate:
            self.pause(inflight)
        elif self._frozen and not inflight:  # a save forced (preemption) or engines lost since the freeze:
            self.pause()  # the frozen tail is aborted after all, so a checkpoint holds its tokens

        metrics = self.state.step_metrics()
        for source in self.metric_sources:
            metrics.update(source())
        metrics.update(aggregate_metrics(self._train_records))
        self._train_records = []

        self._in_boundary = True
        try:
            # Engines lost for good: this boundary saves, and the driver stops after it.
            if self.schedule.save_due(step) or self.state.fault is not None:
                # The ledger is durable up to the checkpoint, and says where the checkpoint is, so
                # an audit after a crash knows which consumptions the restored run replays.
                self.state.ledger.flush()
                with self.timer.time("save_ckpt"):
                    hooks.save_checkpoint(step)
                self.state.ledger.record("checkpoint", step=step, resume_step=step + 1)
                self.state.ledger.flush()
                self._saved_step = step
            handover = self._handed_to_train  # colocate offload: the devices go back to the engines
            if handover:
                stages = self._require_colocate_hooks(hooks)  # type: ignore[arg-type]
                with self.timer.time("offload_train"):
                    stages.offload_train()
                with self.timer.time("onload_rollout_weights"):
                    stages.onload_rollout_weights()
            t0 = self.clock()
            with self.timer.time("update_weights"):
                hooks.sync_weights(self.state.weight_version + 1)
            if inflight and not self.colocate:  # the engines held the requests frozen for exactly the sync
                self.timer.add("pause_delay", self.clock() - t0)
            if self._frozen:  # the sync resumed the engines; thawing again is idempotent (the simulator's)
                self._frozen = False
                self.rollout.thaw(self.cfg.fully_async.pause_timeout)
            self.state.events.emit(
                "sync", R=self.state.R, Q=self.state.Q, step=step, weight_version=self.state.weight_version + 1,
                dur=round(self.clock() - t0, 6),
            )
            if handover:  # after the sync, as slime: the KV cache comes back once the weights are in
                with self.timer.time("onload_rollout_kv"):
                    stages.onload_rollout_kv()
                self._handed_to_train = False
        finally:
            self._in_boundary = False
        if self.evaluator is not None and self.state.fault is None and self.schedule.eval_due(step):
            # The engines serve the new weights and nothing is in flight: evaluate before dispatch
            # resumes, so eval requests never meet training requests or their accounting.
            metrics.update(self.evaluate(step, self.state.weight_version + 1))
        self.state.resume()
        self._rollout_done = False
        for key, value in self.timer.finish_step().items():
            metrics[key] = metrics.get(key, 0.0) + value if key.startswith("timing/") else value
        self.state.ledger.flush()
        self.state.events.flush()
        return step, metrics

    def evaluate(self, step: int, weight_version: int) -> dict[str, float]:
        """Evaluate the weights the engines serve now (``weight_version``) and return the ``val/*``
        metrics to log at ``step``; ``{}`` without an evaluator. Timed as ``timing/eval`` and
        written to the event log as an ``eval`` event with its duration.

        Main thread, with nothing in flight (inside a step boundary after the weight sync, or before
        the pipeline starts). The pipeline state is not touched: eval requests take no sequence
        number and never enter R, Q, the window, the buffer, the ledger or ``rollout/*``.
        """
        ev = self.evaluator
        if ev is None:
            return {}
        st = self.state
        t0 = self.clock()
        with self.timer.time("eval"):
            metrics = ev.run(step, interrupt=st.check_interrupt)
        st.events.emit("eval", R=st.R, Q=st.Q, step=step, weight_version=weight_version, samples=ev.num_samples,
                       dur=round(self.clock() - t0, 6))
        st.events.flush()
        return metrics

    def evaluate_at_start(self) -> tuple[int, dict[str, float]]:
        """``eval.at_start``: evaluate the starting weights once they are synced, before
        :meth:`start`. Returns ``(step, metrics)`` to log, with ``timing/eval``: step is the rollout
        step that produced these weights, ``rollout_step - 1`` (-1 for a fresh run). A resumed run
        whose checkpoint's boundary evaluated them already (``eval.every_n_steps``) returns no metrics."""
        if self._started:
            raise PipelineError("evaluate_at_start() must run before the pipeline threads start.")
        step = self.rollout_step - 1
        if step >= 0 and self.schedule.eval_due(step):
            return step, {}
        t0 = self.clock()
        metrics = self.evaluate(step, self.weight_version)
        if metrics:
            metrics["timing/eval"] = self.clock() - t0
        return step, metrics

    def save_after_fault(self, hooks: StepHooks) -> Optional[int]:
        """The engines are lost for good (``rollout.engine_restart``) and the trainer could not reach
        the step's boundary (which saves, see :meth:`step_boundary`): if no training call of the
        current step has run, the run stands as the last boundary left it, so quiesce the pipeline
        and save a checkpoint as that boundary's (its in-flight groups are recycled). Returns the
        step saved, or None (a training call already ran, or nothing to save before step 0).

        Main thread, after the fault reached it; the caller re-raises it.
        """
        step = self.state.rollout_step - 1
        if step == self._saved_step:
            return step  # the boundary that ended it saved already
        if not self._started or self._closed or self.schedule.calls or self._train_t0 is not None or step < 0:
            return None
        self.pause()
        self.state.ledger.flush()
        hooks.save_checkpoint(step)
        self.state.ledger.record("checkpoint", step=step, resume_step=step + 1)
        self.state.ledger.flush()
        return step

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        """The pipeline's checkpoint state (callback ``state_dict``).

        Taken inside a step boundary it describes the run as it resumes: the next rollout step and
        the weight version the engines are about to serve.
        """
        sd = self.state.state_dict()
        if self._in_boundary:
            sd["rollout_step"] += 1
            sd["weight_version"] += 1
        return {"pipeline": sd}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._started:
            raise PipelineError("load_state_dict() must run before the pipeline threads start.")
        self.state.load_state_dict(state["pipeline"])
        self.state.ledger.record("resume", step=self.state.rollout_step, weight_version=self.state.weight_version)
