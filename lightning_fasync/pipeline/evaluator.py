"""Evaluation of the current weights at a step boundary, outside the training pipeline's accounting.

At the boundary that ends a step on ``eval.every_n_steps`` (see ``StepSchedule.eval_due``), once
the engines serve the new weights and before dispatch resumes, the controller runs
:meth:`Evaluator.run`. Each named eval source sends its prompts through its own agent flow (built
like the training flow, with the eval sampling and request ids ``eval-<source>-``), ``n`` samples
per prompt, and the evaluator reduces the scored trajectories to ``val/<source>/*`` metrics
(docs/tasks.md, "Evaluation during training").

Nothing here touches :class:`~lightning_fasync.pipeline.state.PipelineState`: eval groups take no
sequence number and never enter R, Q, the window, TrajQueue, the PipelineBuffer, the ledger or the
``rollout/*`` metrics. The evaluator runs on its own asyncio event loop on the calling (main)
thread, not on the producer's, bounded by ``eval.timeout``.

Layering: no Lightning, HTTP or model imports.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from lightning_fasync.pipeline.datasource import DataSource
from lightning_fasync.pipeline.engine_client import EngineClient
from lightning_fasync.pipeline.flow import AgentFlow, continuation, mark_failed
from lightning_fasync.pipeline.state import PipelineError
from lightning_fasync.types import PromptSample, Trajectory, TrajectoryStatus

__all__ = ["EvalSource", "Evaluator", "eval_metrics", "take_samples"]

_POLL_S = 0.5  # how often a running evaluation looks at the main thread's interrupt check


def take_samples(datasource: DataSource, limit: int) -> list[PromptSample]:
    """The eval set of ``datasource``: its first epoch, at most ``limit`` prompts, read once.

    Every evaluation scores the same prompts, so values at different steps compare.
    """
    samples: list[PromptSample] = []
    while len(samples) < limit:
        sample = datasource.next_sample()
        if sample is None or sample.prompt_id.epoch > 0:
            break
        samples.append(sample)
    return samples


@dataclass
class EvalSource:
    """One named eval set: its prompts and the agent flow that generates and scores them."""

    name: str
    """The metric prefix is ``val/<name>/``."""
    flow: AgentFlow
    """Built with the eval sampling and the source's reward; its request ids start ``eval-<name>-``."""
    samples: list[PromptSample]
    """The prompts (see :func:`take_samples`)."""


def eval_metrics(name: str, groups: Sequence[Sequence[Trajectory]], accuracy_threshold: float) -> dict[str, float]:
    """``val/<name>/*`` of one source's groups (one group of ``n`` trajectories per prompt).

    Over the finished (completed or truncated) trajectories: ``num_samples`` (their count),
    ``response_length/mean``, ``response_length_max`` and ``response_length/clip_ratio`` (the share
    cut at the response budget); over those with a reward: ``reward_mean`` and ``accuracy``, the
    share with ``reward >= accuracy_threshold``; with ``n > 1``, ``pass_at_n``, the share of prompts
    with at least one such sample. Trajectories that did not finish (an engine error, a reward that
    raised or timed out) are counted in ``num_failed`` when there are any, and left out of the rest.
    """
    p = f"val/{name}/"
    trajs = [t for g in groups for t in g]
    finished = [t for t in trajs if t.status.finished]
    scored = [t for t in finished if t.reward is not None]
    m: dict[str, float] = {p + "num_samples": float(len(finished))}
    if len(finished) < len(trajs):
        m[p + "num_failed"] = float(len(trajs) - len(finished))
    if finished:
        lengths = [len(t.response_ids) for t in finished]
        m[p + "response_length/mean"] = sum(lengths) / len(lengths)
        # Named with the _max suffix: the naming rule of docs/contract.md §4 takes its max wherever
        # metrics are aggregated.
        m[p + "response_length_max"] = float(max(lengths))
        truncated = sum(t.status is TrajectoryStatus.TRUNCATED for t in finished)
        m[p + "response_length/clip_ratio"] = truncated / len(finished)
    if scored:
        rewards = [float(t.reward) for t in scored]  # type: ignore[arg-type]
        m[p + "reward_mean"] = sum(rewards) / len(rewards)
        m[p + "accuracy"] = sum(r >= accuracy_threshold for r in rewards) / len(rewards)
    if max((len(g) for g in groups), default=0) > 1:
        answered = [g for g in groups if any(t.status.finished and t.reward is not None for t in g)]
        if answered:
            solved = sum(
                any(t.status.finished and t.reward is not None and t.reward >= accuracy_threshold for t in g) for g in answered
            )
            m[p + "pass_at_n"] = solved / len(answered)
    return m


class Evaluator:
    """Runs every eval source's prompts through its flow and returns the ``val/*`` metrics.

    Arguments:
        sources: the named eval sets (names unique).
        n: samples per prompt (``eval.sampling.n``).
        timeout: seconds one evaluation (every source) may take (``eval.timeout``).
        accuracy_threshold: ``eval.accuracy_threshold``.
        max_connections: concurrent engine requests (``agentflow.router.max_connections``), applied
            as ``max_connections // n`` concurrent groups, at least one.
        client: the eval flows' engine client, closed on this evaluator's loop by :meth:`close`.
    """

    def __init__(
        self,
        sources: Sequence[EvalSource],
        n: int = 1,
        timeout: float = 600.0,
        accuracy_threshold: float = 1.0,
        max_connections: int = 512,
        client: Optional[EngineClient] = None,
    ) -> None:
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"Eval source names must be unique, got {names}.")
        for source in sources:
            if not source.samples:
                raise ValueError(f"The eval source {source.name!r} has no prompts.")
        self.sources = list(sources)
        self.n = n
        self.timeout = timeout
        self.accuracy_threshold = accuracy_threshold
        self.max_groups = max(1, max_connections // n)
        self.client = client
        self.runs = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closed = False

    @property
    def num_samples(self) -> int:
        """Trajectories one evaluation generates."""
        return sum(len(s.samples) for s in self.sources) * self.n

    def run(self, step: int, interrupt: Optional[Callable[[], None]] = None) -> dict[str, float]:
        """Evaluate the weights the engines serve now; the ``val/*`` metrics of every source.

        Main thread; blocks until done. ``interrupt`` runs about every 0.5 s and may raise to
        abandon the evaluation (a preemption past its grace period).

        Raises:
            PipelineError: the evaluation took longer than ``eval.timeout``.
        """
        if self._closed:
            raise PipelineError("This Evaluator was closed.")
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        results = self._loop.run_until_complete(self._run(step, interrupt))
        self.runs += 1
        metrics: dict[str, float] = {}
        for source, groups in zip(self.sources, results):
            metrics.update(eval_metrics(source.name, groups, self.accuracy_threshold))
        return metrics

    async def _run(self, step: int, interrupt: Optional[Callable[[], None]]) -> list[list[list[Trajectory]]]:
        sem = asyncio.Semaphore(self.max_groups)
        done = 0

        async def group(source: EvalSource, seq: int, sample: PromptSample) -> list[Trajectory]:
            nonlocal done
            async with sem:
                try:
                    trajs = list(await source.flow.run_group(sample, seq, self.n))
                except Exception as exc:  # noqa: BLE001 - a flow bug fails its group, not the run
                    trajs = [_failed(sample, i, seq, exc) for i in range(self.n)]
            done += 1
            return trajs

        async def source_groups(source: EvalSource) -> list[list[Trajectory]]:
            return list(await asyncio.gather(*(group(source, i, s) for i, s in enumerate(source.samples))))

        task = asyncio.ensure_future(asyncio.gather(*(source_groups(s) for s in self.sources)))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            while not task.done():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise PipelineError(
                        f"The evaluation at step {step} did not finish within {self.timeout:g} s (`eval.timeout`); "
                        f"{done} of {sum(len(s.samples) for s in self.sources)} eval prompts were done."
                    )
                await asyncio.wait({task}, timeout=min(remaining, _POLL_S))
                if interrupt is not None and not task.done():
                    interrupt()
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def close(self) -> None:
        """Close the eval client on this evaluator's loop, then the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop, self._loop = self._loop, None
        if self.client is not None:
            loop = loop or asyncio.new_event_loop()
            try:
                loop.run_until_complete(asyncio.wait_for(self.client.close(), 30.0))
            except Exception:  # noqa: BLE001 - closing connections must not hide the run's outcome
                pass
        if loop is not None:
            loop.close()


def _failed(sample: PromptSample, index: int, seq: int, exc: BaseException) -> Trajectory:
    traj = continuation(sample, index, seq)
    mark_failed(traj, exc)
    return traj
