"""``lightning-fasync simulate``: the real pipeline objects on a virtual clock.

Plan ``stale_steps`` and the window strategy before renting GPUs. The simulator drives the live
run's :class:`~lightning_fasync.pipeline.controller.FullyAsyncController` (step schedule, pause and
cleanup, capacity, window strategy, TrajQueue, filter and failure policy, PipelineBuffer, metrics
and timers) on a virtual clock; only the engines and the trainer's compute are models:

- rollout replicas decode with a throughput-vs-concurrency curve: aggregate tokens/s
  ``T(c) = peak * c / (c + half)``, shared equally by the ``c`` running requests (processor
  sharing), with ``c`` capped at ``rollout.sglang_args.max_running_requests`` (the rest queue);
  with a prefill rate, each request first prefills its input (a resumed one its tokens so far too,
  unless ``rollout.resume_kv: keep``: then nothing), and no request on that replica decodes
  meanwhile, nor for a fixed time per request admitted (``request_s``) and per prefill batch
  (``prefill_batch_s``: the requests admitted together share one; a saturated replica admits each
  waiting request in a batch of its own as a slot frees); a colocate step whose tail is frozen
  (``rollout.weight_update_mode: inflight``) holds every replica still through training and the sync;
- response lengths are long-tailed (log-normal, truncated at ``rollout.max_response_length``),
  replayed from a trace (``--trace``: JSONL lines ``{"prompt": index, "lengths": [N ints]}``), or
  replayed from whole earlier runs in the order they consumed their groups (:class:`RunReplay`: a
  learning policy's lengths change over a run, and a step's cost with them);
- a training call takes ``train_base_s + tokens * train_s_per_ktoken / 1000`` seconds on the
  reference trainer pool, scaled by how many GPUs train; weight sync and pause have fixed costs;
  colocate mode adds the offload/onload switches (``colocate_offload``, on for the simulated GPUs
  unless set false), each timed under the spec's name as in a live run.

Everything is deterministic for a given seed; nothing sleeps.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_fasync.config import FasyncConfig, colocate_offload_enabled, validate, with_overrides
from lightning_fasync.pipeline.controller import FullyAsyncController
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.pipeline.flow import continuation
from lightning_fasync.pipeline.state import PipelineState
from lightning_fasync.types import PromptSample, Trajectory, TrajectoryStatus


@dataclass
class ReplicaModel:
    """One rollout replica's decode throughput."""

    peak_tokens_per_s: float = 6000.0
    """Aggregate decode tokens/s of one replica at saturation (reference: its GPU count below)."""
    half_saturation: float = 64.0
    """Concurrency at which a replica reaches half its peak throughput."""
    measured: list[list[float]] = field(default_factory=list)
    """Measured ``[concurrency, aggregate tokens/s]`` points (``lightning-fasync plan`` gives them);
    when given, the throughput at ``c`` is their piecewise-linear interpolation (flat past the last
    point, ``T(1) * c`` below the first) instead of the curve above."""
    prefill_tokens_per_s: float = 0.0
    """Input tokens/s the replica prefills at: every request first prefills its prompt, and a resumed
    one its prompt and its tokens so far again (an aborted request's KV is gone). ``L`` input tokens
    hold the whole replica ``L / prefill_tokens_per_s`` seconds. 0 (the default): prefill is free,
    the model of an engine that prefills far faster than it decodes."""

    request_s: float = 0.0
    """Seconds each admitted request holds the whole replica besides its prefill (scheduling, the
    HTTP round trip, handing back its result), again for a resumed request. 0 (the default): free."""
    prefill_batch_s: float = 0.0
    """Seconds each prefill batch holds the whole replica besides its requests' own (a forward pass's
    fixed cost): the requests a replica admits together share one. A saturated replica admits the
    requests waiting for a slot one batch per finish, each a batch of its own. 0 (the default): free."""

    measured_context: float = 0.0
    """The context length (tokens in the cache: prompt and response so far) ``measured`` was taken
    at, on average."""
    measured_long: list[list[float]] = field(default_factory=list)
    """The same points measured with every request at a long context, ``measured_long_context``
    tokens on average. When given, a replica's throughput depends on the longest context it runs:
    an engine that pads its batch's attention to its longest sequence (the embedded one) decodes
    every request of a batch holding one long response at that length's cost. The time per token is
    linear in that length between (and past) the two measurements. Empty: no dependence."""
    measured_long_context: float = 0.0

    def __post_init__(self) -> None:
        # Sorted once: throughput() interpolates them at every event of the simulation.
        self.measured = sorted([float(a), float(b)] for a, b in self.measured)
        self.measured_long = sorted([float(a), float(b)] for a, b in self.measured_long)

    def throughput(self, c: int, context: Optional[float] = None) -> float:
        """Aggregate decode tokens/s with ``c`` requests running, the longest at ``context`` tokens
        (used only with :attr:`measured_long`)."""
        if c <= 0:
            return 0.0
        if not self.measured:
            return self.peak_tokens_per_s * c / (c + self.half_saturation)
        short = _interpolate(self.measured, c)
        if not self.measured_long or context is None or context <= self.measured_context:
            return short
        long = _interpolate(self.measured_long, c)
        span = max(self.measured_long_context - self.measured_context, 1.0)
        per_token = 1.0 / short + (1.0 / long - 1.0 / short) * (context - self.measured_context) / span
        return 1.0 / per_token if per_token > 0 else short


def _interpolate(pts: list[list[float]], c: int) -> float:
    """Piecewise-linear through ``[concurrency, tokens/s]`` points sorted by concurrency: flat past
    the last point, ``T(first) * c / first`` below the first."""
    if c <= pts[0][0]:
        return pts[0][1] * c / pts[0][0]
    for (c0, t0), (c1, t1) in zip(pts, pts[1:]):
        if c <= c1:
            return t0 + (t1 - t0) * (c - c0) / (c1 - c0)
    return pts[-1][1]


@dataclass
class LengthModel:
    """Response lengths when no trace is given: log-normal, truncated at the max response length."""

    median: float = 5000.0
    """Median response length in tokens."""
    sigma: float = 0.9
    """Log-normal shape; larger means a longer tail."""


@dataclass
class Variant:
    """One row of the output table: a name and dotted config overrides."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class SimConfig:
    """``simulate.*``: the models and the runs to compare."""

    steps: int = 100
    """Outer steps per run."""
    seed: int = 0
    """Seed of the length model and the prompt order."""
    num_prompts: int = 4096
    """Prompts in the simulated dataset."""
    total_gpus: int = 16
    """GPUs of the whole cluster; colocate mode time-shares all of them."""
    replica: ReplicaModel = field(default_factory=ReplicaModel)
    """Replica throughput model."""
    lengths: LengthModel = field(default_factory=LengthModel)
    """Response length model."""
    train_base_s: float = 2.0
    """Fixed seconds per training call on ``train_reference_gpus`` GPUs."""
    train_s_per_ktoken: float = 0.06
    """Seconds per thousand response tokens per training call on ``train_reference_gpus`` GPUs."""
    train_reference_gpus: int = 8
    """GPU count the train times above refer to; time scales inversely with the trainer's GPUs."""
    weight_sync_s: float = 8.0
    """Weight sync (update + cache flush) per step."""
    pause_overhead_s: float = 0.5
    """Fixed cost of pause (abort round-trips, cleanup)."""
    colocate_switch_s: float = 20.0
    """Colocate with ``colocate_offload`` only: offload rollout + onload train + offload train + onload
    rollout weights + onload rollout KV, per step, split evenly over the five (``timing/offload_rollout``,
    ``timing/onload_train``, ``timing/offload_train``, ``timing/onload_rollout_weights``,
    ``timing/onload_rollout_kv``)."""
    variants: list[Variant] = field(default_factory=list)
    """Runs to compare; the first is the speedup baseline."""


class _Count:
    """A token list that only knows its length (the simulator never needs the token ids)."""

    __slots__ = ("n",)

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __deepcopy__(self, memo: dict) -> "_Count":
        return _Count(self.n)


@dataclass
class _Request:
    traj: Trajectory
    sample: PromptSample
    target: int  # total response length this trajectory will reach
    key: float = 0.0  # finish point on the replica's virtual-progress axis
    start_progress: float = 0.0
    base_len: int = 0
    version: int = 0
    dead: bool = False


class _Replica:
    """Processor sharing via a virtual-progress axis: every running request advances by the same
    number of tokens per second, so finish order is a heap on ``start + remaining``. A prefill
    (:attr:`ReplicaModel.prefill_tokens_per_s`) stops every request's decoding for its time:
    ``debt`` seconds the replica owes before the axis moves again."""

    CONTEXT_STEP = 16.0
    """With a context-dependent throughput (:attr:`ReplicaModel.measured_long`), the rate is taken
    again after at most this many tokens of progress: the longest context grows as it decodes."""

    def __init__(self, model: ReplicaModel, max_running: Optional[int], keep_resumed: bool = False) -> None:
        self.model = model
        self.max_running = max_running or 1 << 30
        self.keep_resumed = keep_resumed
        """``rollout.resume_kv: keep``: a resumed request goes on from the cache its aborted request
        left, with no prefill (its fixed ``request_s`` stays)."""
        self.progress = 0.0
        self.running: list[tuple[float, int, _Request]] = []
        self.num_running = 0
        self.waiting: list[_Request] = []
        self.debt = 0.0
        self._tie = 0
        self._batch_open = False  # requests admitted before the replica's clock moves share one prefill batch
        # The longest running request's context is progress + _offset (each request's context is its
        # input plus progress since its admission).
        self._offset = -math.inf

    def context(self) -> float:
        """Tokens in the cache of the longest running request."""
        return self.progress + self._offset if self.num_running else 0.0

    def rate(self) -> float:
        c = self.num_running
        return self.model.throughput(c, self.context()) / c if c else 0.0

    def _track(self) -> None:
        self._offset = max((len(r.sample.input_ids) + r.base_len - r.start_progress
                            for _, _, r in self.running if not r.dead), default=-math.inf)

    def advance(self, dt: float) -> None:
        if dt > 0:
            self._batch_open = False
        paid = min(dt, self.debt)
        self.debt -= paid
        self.progress += self.rate() * (dt - paid)

    def admit(self, req: _Request) -> None:
        if self.num_running >= self.max_running:
            self.waiting.append(req)
            return
        req.start_progress = self.progress
        prefilled = not (req.base_len and self.keep_resumed)
        if self.model.prefill_tokens_per_s > 0 and prefilled:
            # L input tokens hold the whole replica L / P seconds: no running request decodes meanwhile.
            self.debt += (len(req.sample.input_ids) + req.base_len) / self.model.prefill_tokens_per_s
        if prefilled and not self._batch_open:
            self.debt += self.model.prefill_batch_s
            self._batch_open = True
        self.debt += self.model.request_s
        req.key = self.progress + (req.target - req.base_len)
        self._tie += 1
        heapq.heappush(self.running, (req.key, self._tie, req))
        self.num_running += 1
        self._offset = max(self._offset, len(req.sample.input_ids) + req.base_len - req.start_progress)

    def next_finish_dt(self) -> float:
        while self.running and self.running[0][2].dead:
            heapq.heappop(self.running)
        if not self.running:
            return math.inf
        tokens = max(self.running[0][0] - self.progress, 0.0)
        if self.model.measured_long:
            tokens = min(tokens, self.CONTEXT_STEP)  # the rate changes as the longest context grows
        return self.debt + tokens / self.rate()

    def pop_finished(self) -> list[_Request]:
        done = []
        while self.running and (self.running[0][2].dead or self.running[0][0] <= self.progress + 1e-3 + 1e-9 * abs(self.progress)):
            _, _, req = heapq.heappop(self.running)
            if req.dead:
                continue
            self.num_running -= 1
            done.append(req)
        if done:
            self._track()
        while self.waiting and self.num_running < self.max_running:
            self.admit(self.waiting.pop(0))
        return done

    def abort_all(self) -> list[tuple[_Request, int]]:
        out = []
        for _, _, req in self.running:
            if not req.dead:
                req.dead = True
                out.append((req, max(0, int(self.progress - req.start_progress))))
        for req in self.waiting:
            out.append((req, 0))
        self.running, self.waiting, self.num_running, self.debt = [], [], 0, 0.0  # no prefill left to owe
        self._batch_open = False
        self._offset = -math.inf
        return out


class _SimRollout:
    """The engine side on the virtual clock: replicas with a throughput curve, the producer's
    dispatch and the collector's passes run between engine events. Plugged into the real
    :class:`~lightning_fasync.pipeline.controller.FullyAsyncController` in place of threads."""

    def __init__(self, sim: "Simulation", state: PipelineState) -> None:
        self.sim = sim
        self.state = state

    def start(self) -> None:
        self.sim.run_until(self.sim.now)

    def stop(self) -> None:
        pass

    def wait_for_groups(self, k: int, timeout: float) -> None:
        self.sim.run_until_buffer(k)

    def cancel_in_flight(self, timeout: float) -> None:
        sim = self.sim
        for r in sim.replicas:
            for req, generated in r.abort_all():
                sim.finish(req, min(generated, req.target - req.base_len), TrajectoryStatus.CANCELLED)
        sim.now += sim.sim.pause_overhead_s

    def await_in_flight(self, timeout: float) -> None:
        sim = self.sim
        while self.state.in_flight > 0:
            t = sim.next_engine_time()
            if math.isinf(t):
                raise RuntimeError("Simulation stalled while waiting for in-flight requests.")
            sim.advance_to(t)
        sim.now += sim.sim.pause_overhead_s

    def freeze_in_flight(self, timeout: float) -> None:
        self.sim.frozen = True
        self.sim.now += self.sim.sim.pause_overhead_s

    def thaw(self, timeout: float) -> None:
        self.sim.frozen = False


class RunReplay:
    """Response lengths of whole earlier runs in the order each consumed its groups: the ``k``-th
    prompt a simulation dispatches takes one of the ``spread`` groups around the ``k``-th group of a
    run drawn at random (past a run's end, one of its last ``spread``). Groups a step apart are
    exchangeable; groups a hundred steps apart are not when the policy learns to answer shorter."""

    def __init__(self, runs: list[list[list[int]]], spread: int, seed: int) -> None:
        self.runs = [r for r in runs if r]
        if not self.runs:
            raise ValueError("RunReplay needs at least one run with a consumed group.")
        if spread < 1:
            raise ValueError(f"RunReplay's spread is {spread}; it must be >= 1 (groups to draw each one from).")
        self.spread, self.rng, self.served = spread, random.Random(seed), 0

    def next(self) -> list[int]:
        run = self.runs[self.rng.randrange(len(self.runs))]
        centre = min(self.served, len(run) - 1)
        lo = max(0, min(centre - self.spread // 2, len(run) - self.spread))
        self.served += 1
        return list(run[lo + self.rng.randrange(min(self.spread, len(run)))])


class Simulation:
    """One simulated run of ``cfg`` (fully-async, or colocate with or without partial rollout).

    The step protocol is the live one: :meth:`run` drives a
    :class:`~lightning_fasync.pipeline.controller.FullyAsyncController` (its schedule, its pause and
    cleanup, its filter and failure policy, its metrics and timers) on the virtual clock; only the
    engines and the trainer's compute are modelled.
    """

    def __init__(self, cfg: FasyncConfig, sim: SimConfig, trace: Optional[dict[int, list[int]]] = None,
                 events_path: Optional[str] = None, replay: Optional[RunReplay] = None) -> None:
        if trace is not None and replay is not None:
            raise ValueError("Simulation takes a trace or a replay of whole runs, not both.")
        self.cfg, self.sim, self.trace, self.replay = cfg, sim, trace, replay
        self.now = 0.0
        self.frozen = False  # colocate in-flight: the engines hold their requests (_SimRollout.freeze_in_flight)
        self.rng = random.Random(sim.seed)
        fa = cfg.fully_async.enable
        per_replica = max(1, _gpus_per_replica(cfg))
        trainer_gpus = cfg.trainer.num_nodes * cfg.trainer.num_gpus_per_node
        rollout_gpus = sim.total_gpus if not fa else _rollout_gpus(cfg)
        self.train_gpus = sim.total_gpus if not fa else trainer_gpus
        n_replicas = max(1, rollout_gpus // per_replica)
        self.replicas = [_Replica(sim.replica, cfg.rollout.sglang_args.max_running_requests,
                                  keep_resumed=cfg.rollout.resume_kv == "keep") for _ in range(n_replicas)]
        prompts = [([0] * 8, {}) for _ in range(sim.num_prompts)]
        self.datasource = ListDataSource(prompts, shuffle=True, seed=sim.seed)
        self.controller = FullyAsyncController(
            cfg, self.datasource, clock=lambda: self.now, rollout=lambda state: _SimRollout(self, state), events_path=events_path,
            colocate_offload=colocate_offload_enabled(cfg, "cuda"),  # the simulated cluster is GPUs
        )
        self.state = self.controller.state
        self.step_times: list[float] = []
        self.step_metrics: list[dict[str, float]] = []

    # ------------------------------------------------------------------ engine model

    def _target_length(self, sample: PromptSample, index: int) -> int:
        lengths = sample.metadata.get("_lengths")
        if lengths is None:
            ds_index = sample.metadata["dataset_index"]
            if self.replay is not None:
                lengths = self.replay.next()
                if len(lengths) != self.cfg.N:
                    raise ValueError(f"A replayed group has {len(lengths)} lengths; N is {self.cfg.N}.")
            elif self.trace is not None:
                lengths = self.trace.get(ds_index)
                if lengths is None:
                    raise ValueError(f"The trace has no line for prompt {ds_index}; it needs one per simulated prompt.")
                if len(lengths) != self.cfg.N:
                    raise ValueError(f"The trace line for prompt {ds_index} has {len(lengths)} lengths; N is {self.cfg.N}.")
            else:
                lm = self.sim.lengths
                lengths = [max(1, int(self.rng.lognormvariate(math.log(lm.median), lm.sigma))) for _ in range(self.cfg.N)]
            sample.metadata["_lengths"] = lengths
        return max(1, min(int(lengths[index]), self.cfg.rollout.max_response_length))

    def _dispatch(self) -> None:
        for seq, sample in self.state.plan_dispatch():
            for i in range(self.cfg.N):
                traj = continuation(sample, i, seq)
                if not isinstance(traj.response_ids, _Count):
                    traj.response_ids = _Count(0)
                target = self._target_length(sample, i)
                if traj.status.finished or len(traj.response_ids) >= target:
                    traj.status = TrajectoryStatus.COMPLETED if target < self.cfg.rollout.max_response_length else TrajectoryStatus.TRUNCATED
                    self.state.add_trajectory(traj)
                    continue
                req = _Request(traj=traj, sample=sample, target=target, base_len=len(traj.response_ids), version=self.state.weight_version)
                # The router's choice: the least-loaded replica.
                least = min(self.replicas, key=lambda r: r.num_running + len(r.waiting))
                least.admit(req)

    def finish(self, req: _Request, generated: int, status: TrajectoryStatus) -> None:
        traj = req.traj
        if generated > 0:
            traj.response_ids = _Count(req.base_len + generated)
            if traj.start_version is None:
                traj.start_version = req.version
            # The weights in force now: a request kept in flight across a boundary
            # (rollout.weight_update_mode: inflight) ends under newer ones than it started with.
            traj.end_version = self.state.weight_version
        traj.status = status
        self.state.add_trajectory(traj)

    def advance_to(self, t: float) -> None:
        dt = t - self.now
        if dt > 0 and self.frozen:
            self.now = t
        elif dt > 0:
            for r in self.replicas:
                r.advance(dt)
            self.now = t
        for r in self.replicas:
            for req in r.pop_finished():
                final = req.target >= self.cfg.rollout.max_response_length
                self.finish(req, req.target - req.base_len, TrajectoryStatus.TRUNCATED if final else TrajectoryStatus.COMPLETED)
        self.state.collect_once()

    def next_engine_time(self) -> float:
        if self.frozen:
            return math.inf
        return self.now + min((r.next_finish_dt() for r in self.replicas), default=math.inf)

    def run_until(self, t_end: float) -> None:
        """Engines (and producer, collector) run until virtual time ``t_end``."""
        while True:
            self._dispatch()
            t = self.next_engine_time()
            if t > t_end:
                self.advance_to(t_end)
                self._dispatch()
                return
            self.advance_to(t)

    def run_until_buffer(self, k: int) -> None:
        while self.state.Q < k:
            self._dispatch()
            t = self.next_engine_time()
            if math.isinf(t):
                self.state.raise_if_error()
                raise RuntimeError(
                    f"Simulation stalled: the trainer needs {k} groups, the buffer holds {self.state.Q} and nothing is generating."
                )
            self.advance_to(t)

    # ------------------------------------------------------------------ trainer model (StepHooks)

    def _train(self, groups: list) -> dict[str, float]:
        """One training call: the engines go on generating while it runs (they are paused in colocate)."""
        tokens = sum(len(t.response_ids) for g in groups for t in g.trajectories)
        scale = self.sim.train_reference_gpus / max(self.train_gpus, 1)
        self.run_until(self.now + (self.sim.train_base_s + tokens * self.sim.train_s_per_ktoken / 1000.0) * scale)
        return {}

    def save_checkpoint(self, step: int) -> None:
        pass

    def sync_weights(self, version: int) -> None:
        self.now += self.sim.weight_sync_s

    # Colocate offload (ColocateHooks): each of the five stages takes a fifth of colocate_switch_s.

    def _switch(self) -> None:
        self.now += self.sim.colocate_switch_s / 5

    offload_rollout = onload_train = offload_train = onload_rollout_weights = onload_rollout_kv = _switch

    # ------------------------------------------------------------------ run

    def run(self) -> "Simulation":
        ctl = self.controller
        ctl.start(self)  # the trainer's first offload is set-up, outside step 0 (as in a live run)
        last = self.now
        try:
            for _ in range(self.sim.steps):
                _, metrics = ctl.run_step(self._train, self)
                self.step_times.append(self.now - last)
                last = self.now
                self.step_metrics.append(metrics)
        finally:
            ctl.shutdown()
        return self


def _gpus_per_replica(cfg: FasyncConfig) -> int:
    kinds = list(cfg.rollout.sglang_replicas.values())
    return kinds[0].num_gpus_per_replica if kinds else 1


def _rollout_gpus(cfg: FasyncConfig) -> int:
    return sum(k.num_nodes * cfg.rollout.num_gpus_per_node for k in cfg.rollout.sglang_replicas.values())


def load_trace(path: str) -> dict[int, list[int]]:
    """Read a response-length trace: one JSON object per line, ``{"prompt": i, "lengths": [...]}``."""
    trace: dict[int, list[int]] = {}
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                trace[int(rec["prompt"])] = [int(x) for x in rec["lengths"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{lineno}: each trace line must be {{\"prompt\": int, \"lengths\": [int, ...]}} ({exc})."
                ) from None
    if not trace:
        raise ValueError(f"{path} holds no trace lines.")
    return trace


def summarize(name: str, run: Simulation) -> dict[str, Any]:
    times = run.step_times
    ms = run.step_metrics
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "config": name,
        "resource": "colocate" if not run.cfg.fully_async.enable else f"{run.train_gpus}:{sum(1 for _ in run.replicas) * _gpus_per_replica(run.cfg)}",
        "avg_step": mean(times),
        "avg_step_excl0": mean(times[1:]),
        "pipeline_buf_size": mean([m.get("rollout/pipeline_buf_size", 0.0) for m in ms]) if run.cfg.fully_async.enable else None,
        "partial_ratio": mean([m.get("rollout/partial_ratio", 0.0) for m in ms]),
        # Per-step mean over all steps (0 where nothing was recycled), as the spec's tables read.
        "partial_restored_count": mean([m.get("rollout/partial_restored_count", 0.0) for m in ms]),
    }


def run_variants(base: FasyncConfig, sim: SimConfig, trace=None, events_path: Optional[str] = None) -> list[dict[str, Any]]:
    """Run every variant on a copy of ``base`` and return table rows with speedups."""
    variants = sim.variants or [Variant(name="as configured")]
    rows = []
    for v in variants:
        cfg = validate(with_overrides(base, v.overrides))
        path = None
        if events_path:
            path = events_path if len(variants) == 1 else events_path.replace(".jsonl", "") + f".{_slug(v.name)}.jsonl"
        rows.append(summarize(v.name, Simulation(cfg, sim, trace=trace, events_path=path).run()))
    base_row = rows[0]
    for r in rows:
        r["speedup"] = base_row["avg_step"] / r["avg_step"]
        r["speedup_excl0"] = base_row["avg_step_excl0"] / r["avg_step_excl0"] if r["avg_step_excl0"] == r["avg_step_excl0"] else float("nan")
    return rows


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()


def format_table(rows: list[dict[str, Any]]) -> str:
    """The spec's 5.2–5.4 table shape, as Markdown."""
    head = "| config | resource | avg step | speedup | avg step (excl. step 0) | speedup (excl. step 0) | pipeline_buf_size | partial_ratio | partial_restored_count |"
    sep = "|" + "---|" * 9
    lines = [head, sep]
    for r in rows:
        buf = "-" if r["pipeline_buf_size"] is None else f"{r['pipeline_buf_size']:.1f}"
        lines.append(
            f"| {r['config']} | {r['resource']} | {r['avg_step']:.2f} | {r['speedup']:.2f}x | {r['avg_step_excl0']:.2f} | "
            f"{r['speedup_excl0']:.2f}x | {buf} | {r['partial_ratio']:.3f} | {r['partial_restored_count']:.0f} |"
        )
    return "\n".join(lines)
