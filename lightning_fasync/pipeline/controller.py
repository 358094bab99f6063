"""The step protocol, written once (spec section 2; DESIGN.md "Pipeline").

One outer step reads like the spec:

1. the producer and collector run in the background; the trainer fetches M // N groups per
   training call, (B × N) // M times;
2. ``pause()``: stop dispatch, cancel (``rollout.partial: true``) or await in-flight requests, let
   the collector settle, recycle complete groups and drop incomplete ones, clear TrajQueue, reset
   the strategy; groups already in the PipelineBuffer stay;
3. aggregate the step's metrics; save a checkpoint when ``trainer.save_freq`` says so (the
   PipelineBuffer's unconsumed prompts are recorded in it); sync the new weights to every engine
   (which flushes its cache);
4. ``resume()``: rollout step + 1, weight version + 1, production continues.

The Lightning callback and the Fabric loop both drive :class:`FullyAsyncController`; neither
re-implements any of it.
"""

from __future__ import annotations

import importlib
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Protocol

from lightning_fasync.config import FasyncConfig
from lightning_fasync.pipeline.collector import Collector
from lightning_fasync.pipeline.datasource import DataSource
from lightning_fasync.pipeline.engine import EngineClient
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


def load_callable(path: str, key: str) -> Callable[..., Any]:
    """Import ``module:attribute`` named by config key ``key``."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise PipelineError(f"`{key}` is {path!r}; it must have the form module:function.")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise PipelineError(f"`{key}` is {path!r}, which cannot be imported: {exc}.") from exc
    if not callable(fn):
        raise PipelineError(f"`{key}` is {path!r}, which is not callable.")
    return fn


class FullyAsyncController:
    """Owns the pipeline threads and runs the step protocol.

    Arguments:
        cfg: the validated configuration.
        datasource: the prompt supply.
        flow: the agent flow the producer runs.
        client: the engine client (for abort at partial step boundaries).
        log_dir: where ``events.jsonl`` and ``ledger.jsonl`` go (None: not written).
        group_filter: overrides ``rollout.filter``.
        clock: wall clock for timings.
    """

    def __init__(
        self,
        cfg: FasyncConfig,
        datasource: DataSource,
        flow: AgentFlow,
        client: Optional[EngineClient],
        log_dir: Optional[str] = None,
        group_filter: Optional[GroupFilter] = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        t0 = time.monotonic()
        events = EventLog(
            os.path.join(log_dir, "events.jsonl") if (log_dir and cfg.fully_async.event_log) else None,
            clock=lambda: time.monotonic() - t0,
        )
        ledger = Ledger(os.path.join(log_dir, "ledger.jsonl") if log_dir else None)
        if group_filter is None and cfg.rollout.filter:
            group_filter = load_callable(cfg.rollout.filter, "rollout.filter")
        # Colocate (the spec's baseline): roll out the batch, pause, then train on the same
        # resources. Capacity is B plus the synchronous over-dispatch; no window strategy applies.
        self.colocate = not cfg.fully_async.enable
        stale = cfg.rollout.sampler.num_oversample / cfg.B if self.colocate else cfg.fully_async.stale_steps
        window = "no-window" if self.colocate else cfg.fully_async.sliding_window
        self.state = PipelineState(
            num_prompts_per_step=cfg.B,
            num_trajectories_per_prompt=cfg.N,
            stale_steps=stale,
            strategy=make_window_strategy(window),
            datasource=datasource,
            event_log=events,
            ledger=ledger,
            group_filter=group_filter,
            max_consecutive_failed_groups=cfg.rollout.max_consecutive_failed_groups,
        )
        self.producer = RolloutProducer(self.state, flow, client, max_connections=cfg.agentflow.router.max_connections)
        self.collector = Collector(self.state)
        self.timer = StepTimer(clock)
        self._train_records: list[Mapping[str, float]] = []
        self._minibatches = 0
        self._rollout_done = False  # colocate: the current step's rollout phase has ended
        self._in_boundary = False
        self._started = False
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def rollout_step(self) -> int:
        return self.state.rollout_step

    @property
    def weight_version(self) -> int:
        return self.state.weight_version

    @property
    def minibatches_per_step(self) -> int:
        return self.cfg.minibatches_per_step

    def start(self) -> None:
        """Start producer and collector (after any checkpoint restore)."""
        if self._closed:
            raise PipelineError("This FullyAsyncController was shut down; build a new one.")
        if self._started:
            return
        self.producer.start()
        self.collector.start()
        self.timer.restart()
        self._started = True

    def shutdown(self, raise_errors: bool = True) -> None:
        """Stop threads and close the logs. Idempotent.

        With ``raise_errors`` a background error not yet seen by the main thread is raised here.
        """
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for stop in (self.producer.stop, self.collector.stop):
            try:
                stop()
            except BaseException as exc:  # noqa: BLE001 - stop the rest first
                errors.append(exc)
        self.state.events.close()
        self.state.ledger.close()
        if raise_errors:
            self.state.raise_if_error()
            if errors:
                raise errors[0]

    # ------------------------------------------------------------------ trainer side

    def fetch(self) -> list[TrajectoryGroup]:
        """M // N complete groups for one training call (main thread; ``timing/rollout``).

        Colocate mode: the first fetch of a step waits for the whole batch (B groups), then pauses
        rollout (``rollout.partial`` aborts the over-dispatched long tail, else waits for it) before
        any training, so rollout and training never overlap.
        """
        self.state.raise_if_error()
        fa = self.cfg.fully_async
        with self.timer.time("rollout"):
            if self.colocate and not self._rollout_done:
                self.state.fetch_wait(self.cfg.B, fa.fetch_timeout)
                self._pause()
                self._rollout_done = True
            return self.state.fetch(self.cfg.groups_per_minibatch, fa.fetch_timeout)

    def _pause(self) -> None:
        fa = self.cfg.fully_async
        t0 = self.clock()
        self.producer.pause(partial=self.cfg.rollout.partial, timeout=fa.pause_timeout)
        self.state.drain_collect(fa.pause_timeout)
        self.state.cleanup_after_pause()
        self.timer.add("pause_delay", self.clock() - t0)

    @contextmanager
    def train_block(self) -> Iterator[None]:
        """Wrap the forward/backward/optimizer work of one training call (``timing/train``)."""
        t0 = self.clock()
        with self.timer.train():
            yield
        st = self.state
        st.events.emit("train", R=st.R, Q=st.Q, step=st.rollout_step, dur=round(self.clock() - t0, 6))

    def record(self, metrics: Mapping[str, float]) -> None:
        """Cache one training call's metrics for step-end aggregation."""
        self._train_records.append(dict(metrics))

    def minibatch_done(self) -> bool:
        """Count a finished training call; True when the step boundary is due."""
        self._minibatches += 1
        return self._minibatches >= self.minibatches_per_step

    # ------------------------------------------------------------------ step boundary

    def step_boundary(self, hooks: StepHooks) -> tuple[int, dict[str, float]]:
        """Pause, aggregate, checkpoint on ``save_freq``, sync weights, resume.

        Returns ``(rollout_step, metrics)``: the metrics of the step that just ended, to be logged
        on the main thread at that step.
        """
        self.state.raise_if_error()
        step = self.state.rollout_step
        if not self.colocate:
            self._pause()

        metrics = self.state.step_metrics()
        train = aggregate_metrics(self._train_records)
        self._train_records = []
        metrics.update(train)

        self._in_boundary = True
        try:
            save_freq = self.cfg.trainer.save_freq
            if save_freq > 0 and (step + 1) % save_freq == 0:
                # The ledger is durable up to the checkpoint, and says where the checkpoint is, so
                # an audit after a crash knows which consumptions the restored run replays.
                self.state.ledger.flush()
                with self.timer.time("save_ckpt"):
                    hooks.save_checkpoint(step)
                self.state.ledger.record("checkpoint", step=step, resume_step=step + 1)
                self.state.ledger.flush()
            t0 = self.clock()
            with self.timer.time("update_weights"):
                hooks.sync_weights(self.state.weight_version + 1)
            self.state.events.emit(
                "sync", R=self.state.R, Q=self.state.Q, step=step, weight_version=self.state.weight_version + 1,
                dur=round(self.clock() - t0, 6),
            )
        finally:
            self._in_boundary = False
        self.state.resume()
        self._rollout_done = False
        timing = self.timer.finish_step()
        for key, value in timing.items():
            metrics[key] = metrics.get(key, 0.0) + value if key.startswith("timing/") else value
        self._minibatches = 0
        self.state.ledger.flush()
        self.state.events.flush()
        return step, metrics

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
