"""``lightning-fasync plan``: profile a config briefly, calibrate the simulator on it, predict every mode.

The profile is the real thing, short:

- two ``fit`` runs of the config, a few rollout steps each: colocate (rollout and training take
  turns on every core) and fully-async (the configured split). From their TensorBoard scalars and
  ledgers (``response_lengths`` of every consumed group): the trainer's seconds per training call
  and per thousand response tokens at each side's thread count (a least-squares fit over the
  steps), the weight sync, the pause and the rest of each step boundary, and the response lengths;
- the engine's decode throughput against concurrency, measured on a real engine server pinned as
  each mode pins it (every core for colocate, its own cores for fully-async); the simulator
  interpolates the measured points (a CPU engine's curve is not the GPU-shaped ``T(c) = peak * c /
  (c + half)``, which is fitted too and printed), at a short context and again at a long one: the
  replica's throughput then follows its longest running request's context (the embedded engine
  pads a batch's attention to its longest sequence); and the server's prefill rate, fixed cost per
  request and fixed cost per prefill batch (the last from the engine's own counters), each measured
  by difference so that none carries another's cost.

Each mode is then simulated (:mod:`lightning_fasync.simulate`, the live pipeline on a virtual clock)
with the calibration of its own resource layout, response lengths drawn from the profile's groups,
and the table gives each mode's predicted steady-state step (step 0 excluded) and speedup over
colocate, with a recommendation. A config with a ``simulate:`` section (a GPU cluster's, e.g. the
spec's ``configs/sim/dapo_h20.yaml``) is planned from that section's calibration, no profile, and
the recommendation also weighs other trainer : rollout GPU splits of the same cluster.

What the models leave out (docs/simulator.md): the response lengths are the profile's, early in
training, while a learning policy changes them (``--lengths_from`` a whole run's ledger replays its
lengths in the order it consumed them); thread counts other than the
profiled split are not measured; one engine curve moves by up to a third between two profiles on
a shared 2-core machine, at 64 requests most.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

from lightning_fasync.config import ConfigError, FasyncConfig, validate, with_overrides
from lightning_fasync.simulate import ReplicaModel, RunReplay, SimConfig, Simulation, summarize

__all__ = ["EngineCurve", "TrainerFit", "RunProfile", "Profile", "MODES", "batch_cost", "fit_curve", "fit_trainer",
           "tokens_vary", "load_profile", "predict", "main"]

_ABORT = {"rollout.partial": True, "rollout.weight_update_mode": "abort"}
_KEEP = {"rollout.resume_kv": "keep"}
_COLOCATE_PARTIAL = {"colocate": True, "fully_async.enable": False, "rollout.partial": True,
                     "rollout.weight_update_mode": None, "rollout.inflight_kv": "keep"}
_WINDOWED_FIFO_2 = {"fully_async.sliding_window": "windowed-fifo", "fully_async.stale_steps": 2.0, **_ABORT}
MODES: list[tuple[str, dict[str, Any]]] = [
    ("colocate", {"colocate": True, "fully_async.enable": False, "rollout.partial": False,
                  "rollout.weight_update_mode": None, "rollout.inflight_kv": "keep"}),
    ("colocate + partial", _COLOCATE_PARTIAL),
    ("colocate + partial, KV kept", {**_COLOCATE_PARTIAL, **_KEEP}),
    ("colocate + partial, tail frozen", {**_COLOCATE_PARTIAL, "rollout.weight_update_mode": "inflight",
                                         "colocate_offload": False}),
    ("fully-async, abort and resume", _ABORT),
    ("fully-async no-window, stale 1.0", {"fully_async.sliding_window": "no-window", "fully_async.stale_steps": 1.0, **_ABORT}),
    ("fully-async windowed-fifo, stale 1.0", {"fully_async.sliding_window": "windowed-fifo", "fully_async.stale_steps": 1.0,
                                              **_ABORT}),
    ("fully-async windowed-fifo, stale 2.0", _WINDOWED_FIFO_2),
    ("fully-async window-gated, stale 1.0", {"fully_async.sliding_window": "window-gated", "fully_async.stale_steps": 1.0,
                                             **_ABORT}),
    ("fully-async staleness-bounded, stale 1.0", {"fully_async.sliding_window": "staleness-bounded",
                                                  "fully_async.stale_steps": 1.0, **_ABORT}),
    ("fully-async windowed-fifo, stale 2.0, KV kept", {**_WINDOWED_FIFO_2, **_KEEP}),
    ("fully-async, boundary waits", {"rollout.partial": False, "rollout.weight_update_mode": None,
                                     "rollout.inflight_kv": "keep"}),
    ("fully-async, in-flight updates", {"rollout.partial": True, "rollout.weight_update_mode": "inflight"}),
    ("fully-async, in-flight updates, stale 2.0", {"rollout.partial": True, "rollout.weight_update_mode": "inflight",
                                                   "fully_async.stale_steps": 2.0}),
]
"""The modes a plan predicts (``benchmarks/speedup.py`` measures the same rows live); the fully-async
ones keep the config's other keys. The ``colocate + partial`` rows over-dispatch B // 4 groups
(``--oversample``); ``KV kept`` resumes the aborted requests from the caches they left
(``rollout.resume_kv: keep``, the embedded engine's: rows for it only); ``tail frozen`` freezes the
tail in the engines through training and the sync instead of aborting it, so the engines keep their
memory (no colocate offload)."""

CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64)
CURVE_TOKENS = 48
CURVE_PROMPT = [1, 5, 6, 7, 8, 9]
LONG_CONTEXT_FRACTION = 0.75
"""The long-context curve's prompts fill this share of the context length left after its
:data:`CURVE_TOKENS` new tokens (at most 4096 tokens). The prefill measurement's prompts spread
evenly from the short prompt to that length, as a resumed request's prompt and tokens so far do."""
CURVE_MIN_S = 0.3
CURVE_MIN_BATCHES = 3
CURVE_REPEATS = 3
"""Each figure of the engine's measurement is the median of ``CURVE_REPEATS`` differences, each
batch of a difference sent back to back for at least ``CURVE_MIN_S / 2`` seconds and
``CURVE_MIN_BATCHES`` times: one batch of 48 tokens lasts 0.05–0.15 s on a CPU, and single batches
put one engine's curve 60 % apart between runs."""
PROFILE_TIMEOUT_S = 1800.0
SHORT_BUDGET_DIVISOR = 4
"""The extra profile steps of a run whose steps all trained on about as many tokens answer within
``rollout.max_response_length // SHORT_BUDGET_DIVISOR`` tokens."""


# ------------------------------------------------------------------------------------------ models


@dataclass
class EngineCurve:
    """A replica's decode throughput against concurrency, measured, and its fit."""

    threads: int
    points: list[tuple[int, float]]
    """(concurrent requests, aggregate tokens/s)."""
    peak_tokens_per_s: float
    half_saturation: float
    prefill_tokens_per_s: float = 0.0
    """Prompt tokens/s the engine prefills at (0: not measured, prefill free in the simulation)."""
    request_s: float = 0.0
    """Seconds of the whole engine each request costs besides its prefill and decode (admission,
    HTTP, result handling; 0: not measured)."""
    prefill_batch_s: float = 0.0
    """Seconds each prefill batch costs the engine besides its requests' own (0: not measured)."""
    context: float = 0.0
    """The mean context length (prompt and tokens so far) ``points`` were measured at."""
    long_points: list[tuple[int, float]] = field(default_factory=list)
    """(concurrent requests, decode tokens/s) with every request at a long context, ``long_context``
    tokens on average (empty: not measured; the simulation's throughput then ignores the context)."""
    long_context: float = 0.0
    repeats: int = 0
    """Differences each measured figure is the median of (``plan --curve_repeats``; 0: not recorded)."""


@dataclass
class TrainerFit:
    """Seconds of training per rollout step: ``calls * base_s + s_per_ktoken * response tokens / 1000``."""

    threads: int
    base_s: float
    s_per_ktoken: float
    samples: list[tuple[int, float]] = field(default_factory=list)
    """(response tokens, seconds of training) of each profiled step."""


@dataclass
class RunProfile:
    """What one short live run measured (step 0 left out)."""

    mode: str
    steps: list[float]
    trainer: TrainerFit
    sync_s: float
    pause_s: float
    other_s: float
    """The rest of a step that is neither rollout wait, training, sync nor pause (metrics, logging, the boundary)."""
    lengths: list[list[int]]
    """The response lengths of every consumed group."""
    short_budget: int = 0
    """The shorter ``rollout.max_response_length`` of the extra steps the trainer's fit also took
    (0: none; they are taken when every profiled step trained on about as many tokens)."""


@dataclass
class Profile:
    cores: int
    colocate: RunProfile
    fully_async: RunProfile
    engine: dict[int, EngineCurve]
    """By engine threads: every core (colocate), and the fully-async replica's."""
    fa_engine_threads: int
    max_running_requests: int
    replicas: int
    """Engine replicas of the fully-async layout (``FullyAsyncStrategy``'s ``rollout_replicas``)."""


def fit_curve(points: Sequence[tuple[int, float]], threads: int = 1) -> EngineCurve:
    """The simulator's ``T(c) = peak * c / (c + half)`` fitted to measured (concurrency, tokens/s):
    least relative squared error, ``peak`` in closed form for each ``half`` of a log grid. (A fit of
    ``1 / T`` against ``1 / c`` lets the low-concurrency points, where a CPU engine's per-step
    overhead is noisiest, decide the peak.)"""
    best: Optional[tuple[float, float, float]] = None
    for i in range(241):
        half = 0.1 * 10 ** (i / 60)  # 0.1 .. 1000
        g = [c / (c + half) for c, _ in points]
        num = sum(gi / t for gi, (_, t) in zip(g, points))
        den = sum((gi / t) ** 2 for gi, (_, t) in zip(g, points))
        peak = num / den if den else 0.0
        err = sum((1 - peak * gi / t) ** 2 for gi, (_, t) in zip(g, points))
        if best is None or err < best[0]:
            best = (err, peak, half)
    assert best is not None
    return EngineCurve(threads, list(points), best[1], best[2])


TOKENS_SPREAD = 0.15
"""How far profiled steps' response tokens must spread (their standard deviation over their mean) for
a fit to tell a training call's fixed cost from its cost per token. The long tail's profiles spread
0.37–0.52; the main job's, every answer at the budget, 0.04–0.05, where a fit of 16 steps' noise
put colocate's fixed cost at 0.15 s a step against 0.085 s over a whole run's lengths."""


def tokens_vary(samples: Sequence[tuple[int, float]]) -> bool:
    """Whether profiled steps' response tokens spread enough (``TOKENS_SPREAD``) to separate a
    training call's fixed cost from its cost per token."""
    xs = [t for t, _ in samples]
    return len(xs) >= 3 and statistics.pstdev(xs) > TOKENS_SPREAD * max(statistics.fmean(xs), 1e-9)


def fit_trainer(samples: Sequence[tuple[int, float]], calls: int, threads: int) -> TrainerFit:
    """Least squares of ``seconds = calls * base + k * tokens / 1000`` over the profiled steps, both
    coefficients kept >= 0 (a fit through the origin when the tokens barely vary: :func:`profile`
    then adds steps at a shorter response budget)."""
    xs = [t / 1000.0 for t, _ in samples]
    ys = [s for _, s in samples]
    if tokens_vary(samples):
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        base = (my - k * mx) / max(calls, 1)
        if k >= 0 and base >= 0:
            return TrainerFit(threads, base, k, list(samples))
    k = sum(ys) / max(sum(xs), 1e-9)
    return TrainerFit(threads, 0.0, k, list(samples))


# ------------------------------------------------------------------------------------------ profile


def batch_cost(lone: Sequence[float], together: Sequence[float]) -> Optional[float]:
    """A prefill batch's fixed cost from two ``(batches, requests, seconds)`` readings of the engine's
    counters, one of requests sent one by one, one of the same requests sent together: the solution
    of ``seconds = batches * cost + requests * each`` (at least 0: a noisy reading), or None when
    the readings cannot separate the two (the requests sent together were admitted one by one too)."""
    (c1, q1, s1), (c2, q2, s2) = lone, together
    det = c1 * q2 - c2 * q1
    if det <= 0:
        return None
    return max(0.0, (s1 * q2 - s2 * q1) / det)


def _fit_args(config: str, overrides: Sequence[str]) -> list[str]:
    return ["--config", config, *overrides]


def _profile_run(name: str, args: Sequence[str], mode: Sequence[str], steps: int, root: str, calls: int,
                 threads: int) -> RunProfile:
    """A ``fit`` of ``steps`` rollout steps; its scalars and ledger, reduced to what the simulator takes."""
    from lightning_fasync.plots import read_scalars

    run_root = os.path.join(root, name)
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", *args, *mode, f"--trainer.rollout_steps={steps}",
           f"--trainer.default_root_dir={run_root}", "--trainer.enable_progress_bar=false", "--trainer.save_freq=0"]
    print(f"plan: profiling {name}, {steps} steps ...", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=PROFILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"The {name} profile run did not finish within {PROFILE_TIMEOUT_S:.0f} s.") from None
    if proc.returncode != 0:
        raise RuntimeError(f"The {name} profile run failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    (log_dir,) = [os.path.join(run_root, "lightning_logs", d) for d in os.listdir(os.path.join(run_root, "lightning_logs"))]
    tb = read_scalars(log_dir)
    get = lambda tag: [float(v) for _, v in tb.get(tag, [])]  # noqa: E731
    step, wait, train = get("timing/step"), get("timing/rollout"), get("timing/train")
    process = get("timing/process_traj") or [0.0] * len(step)
    sync, pause = get("timing/update_weights") or [0.0] * len(step), get("timing/pause_delay") or [0.0] * len(step)
    tokens = [0] * len(step)
    lengths: list[list[int]] = []
    with open(os.path.join(log_dir, "ledger.jsonl")) as fh:
        for line in fh:
            rec = json.loads(line)
            if rec.get("kind") == "consume" and "response_lengths" in rec:
                lengths.append(list(rec["response_lengths"]))
                if rec["step"] < len(tokens):
                    tokens[rec["step"]] += sum(rec["response_lengths"])
    keep = range(1, len(step))  # step 0 pays the start-up
    samples = [(tokens[i], train[i] + process[i]) for i in keep]
    trainer = fit_trainer(samples, calls, threads)
    other = [max(0.0, step[i] - wait[i] - train[i] - process[i] - sync[i] - pause[i]) for i in keep]
    return RunProfile(name, [step[i] for i in keep], trainer, statistics.median([sync[i] for i in keep]),
                      statistics.median([pause[i] for i in keep]), statistics.median(other), lengths)


def _engine_curve(model: str, cores: list[int], max_running: int, context_length: int, repeats: int) -> EngineCurve:
    """One real engine server pinned to ``cores`` (as the mode pins it), measured over HTTP as the
    simulator's replica splits its time: decode tokens/s at each concurrency ``c``, at a short
    context and again at a long one (:data:`LONG_CONTEXT_FRACTION` of ``context_length``: an engine
    that pads a batch's attention to its longest sequence decodes slower while one long response
    runs); prefill tokens/s; a fixed cost per request (admission, the round trip, the result); and
    a fixed cost per prefill batch (a forward pass's own, which requests admitted together share).

    Each is measured by difference, so that none carries another's cost: a batch of ``c`` requests
    with ``1 + CURVE_TOKENS`` new tokens less the same batch with one new token is their decode
    alone (short and long prompts interleaved, so a drift moves both alike); a batch of
    ``max_running`` requests (64 at most) with prompts spread from the short one to the long
    context's (as resumed requests' prompts and tokens so far are) less the same number of short
    prompts is their prefill; ``max_running`` short prompts less one is the per-request cost.
    Whole 48-token requests, timed as one figure, put the cost of a request's admission and round
    trip (about 0.5 ms on a CPU) into the decode rate, and a long curve got by subtracting an
    estimated prefill came out within the short one's noise, at some concurrencies above it."""
    from lightning_fasync.fleet.pool import RolloutPool
    from lightning_fasync.pipeline.engine_client import GenerateRequest, SamplingParams

    pool = RolloutPool(model, num_replicas=1, threads_per_replica=len(cores), max_running_requests=max_running,
                       cpu_cores=[cores], context_length=context_length).start()
    points: list[tuple[int, float]] = []
    long_points: list[tuple[int, float]] = []
    prefill: list[float] = []
    request: list[float] = []
    batch: list[float] = []
    long_len = min(4096, max(0, int(LONG_CONTEXT_FRACTION * (context_length - CURVE_TOKENS))))
    prompt = lambda i, n: [1] + [5 + (i * 7 + j) % 90 for j in range(n - 1)]  # noqa: E731

    async def measure() -> None:
        client = pool.client(generate_timeout_s=600.0)
        try:
            params = SamplingParams(max_new_tokens=CURVE_TOKENS, temperature=1.0, ignore_eos=True)
            one = SamplingParams(max_new_tokens=1, temperature=1.0, ignore_eos=True)
            more = SamplingParams(max_new_tokens=1 + CURVE_TOKENS, temperature=1.0, ignore_eos=True)
            await client.generate_batch([GenerateRequest("warm", CURVE_PROMPT, params)])

            async def batch_s(reqs: list[Any], min_s: float) -> float:
                """Seconds per batch, sending ``reqs`` back to back for ``min_s`` and CURVE_MIN_BATCHES."""
                batches, t0 = 0, time.perf_counter()
                while True:
                    await client.generate_batch(reqs)
                    batches += 1
                    dt = time.perf_counter() - t0
                    if dt >= min_s and batches >= CURVE_MIN_BATCHES:
                        return dt / batches

            async def decode_rate(reqs: list[Any], c: int) -> float:
                """Decode tokens/s of the ``c`` requests of ``reqs`` (each with one new token, then
                each with ``1 + CURVE_TOKENS``): the second batch's time less the first's."""
                t_one = await batch_s(reqs[:c], CURVE_MIN_S / 2)
                t_more = await batch_s(reqs[c:], CURVE_MIN_S / 2)
                return c * CURVE_TOKENS / max(t_more - t_one, 0.1 * t_more)

            for c in [c for c in CONCURRENCIES if c <= max_running]:
                short = [GenerateRequest(f"s{c}-{i}", CURVE_PROMPT, p) for p in (one, more) for i in range(c)]
                long = ([GenerateRequest(f"l{c}-{i}", prompt(i, long_len), p) for p in (one, more) for i in range(c)]
                        if long_len > 2 * len(CURVE_PROMPT) else None)
                rates: list[list[float]] = [[], []]
                for _ in range(repeats):  # short and long interleaved: a drift moves both alike
                    rates[0].append(await decode_rate(short, c))
                    if long:
                        rates[1].append(await decode_rate(long, c))
                points.append((c, statistics.median(rates[0])))
                if rates[1]:  # more context never decodes faster: what would is noise
                    long_points.append((c, min(statistics.median(rates[1]), points[-1][1])))
            # A batch of n requests with one new token each takes t0 + n * request_s + input / prefill:
            # short prompts alone, one and n of them, and n prompts spread up to the long context.
            n = min(max_running, 64)
            top = max(long_len, 4 * len(CURVE_PROMPT))
            lens = [len(CURVE_PROMPT) + round((top - len(CURVE_PROMPT)) * (i + 0.5) / n) for i in range(n)]
            single = [GenerateRequest("q-0", CURVE_PROMPT, one)]
            shorts = [GenerateRequest(f"q-{i}", CURVE_PROMPT, one) for i in range(n)]
            mixed = [GenerateRequest(f"p-{i}", prompt(i, k), one) for i, k in enumerate(lens)]
            found: list[tuple[float, float]] = []
            for _ in range(repeats):
                t1, tn, tm = [await batch_s(r, CURVE_MIN_S / 2) for r in (single, shorts, mixed)]
                rate_p = (sum(lens) - n * len(CURVE_PROMPT)) / max(tm - tn, 0.1 * tm)
                found.append((rate_p, max(0.0, (tn - t1) / max(n - 1, 1) - len(CURVE_PROMPT) / rate_p)))
            prefill.append(statistics.median(p for p, _ in found))
            request.append(statistics.median(q for _, q in found))
            batch.append(await prefill_batch_cost(client, single, shorts))
        finally:
            await client.close()

    async def prefill_batch_cost(client: Any, single: list[Any], shorts: list[Any]) -> float:
        """The fixed cost of one prefill batch, from the engine's own counters (``/get_server_info``'s
        ``num_prefill_batches``, ``num_prefill_requests``, ``prefill_busy_s``): lone short requests
        one after another (a batch each) against the same requests ``len(shorts)`` to a batch, so
        that ``seconds = batches * cost + requests * each`` has one solution. The client's round
        trip is no part of it: a saturated engine admits the request waiting for a freed slot with
        no round trip between, one prefill batch each."""
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60.0)) as http:
            async def counters() -> tuple[float, float, float]:
                async with http.get(pool.worker_urls[0] + "/get_server_info") as resp:
                    state = (await resp.json())["internal_states"][0]
                return state["num_prefill_batches"], state["num_prefill_requests"], state["prefill_busy_s"]

            async def measured(batches: list[list[Any]]) -> tuple[float, ...]:
                before = await counters()
                for reqs in batches:
                    await client.generate_batch(reqs)
                return tuple(a - b for a, b in zip(await counters(), before))

            found = []
            for _ in range(repeats):
                lone = await measured([single] * len(shorts))
                together = await measured([shorts] * CURVE_MIN_BATCHES)
                cost = batch_cost(lone, together)
                if cost is not None:
                    found.append(cost)
            return statistics.median(found) if found else 0.0

    try:
        asyncio.run(measure())
    finally:
        pool.stop()
    half = CURVE_TOKENS / 2
    return replace(fit_curve(points, threads=len(cores)), prefill_tokens_per_s=prefill[0], request_s=request[0],
                   prefill_batch_s=batch[0],
                   context=len(CURVE_PROMPT) + half, long_points=long_points,
                   long_context=long_len + half if long_points else 0.0, repeats=repeats)


def profile(args: Sequence[str], cfg: FasyncConfig, ns: Any, steps: int, curve_repeats: int = CURVE_REPEATS) -> Profile:
    """The short live runs and the engine curves (module docstring), each figure of a curve the median
    of ``curve_repeats`` differences."""
    from lightning_fasync.engine.engine import DEFAULT_MAX_RUNNING_REQUESTS
    from lightning_fasync.fleet.resources import available_cores, plan_cpu_resources

    if cfg.rollout.backend != "embedded" or str(cfg.rollout.engine_device) != "cpu":
        raise ConfigError(
            f"`rollout.backend` is {cfg.rollout.backend} on {cfg.rollout.engine_device}; plan profiles the embedded "
            "engine on CPU. For a GPU cluster, give plan a config with a `simulate:` section (its calibration), as "
            "configs/sim/dapo_h20.yaml."
        )
    strategy = (ns.get("trainer") or {}).get("strategy")
    init = getattr(strategy, "init_args", None) or {}
    get = (lambda k: getattr(init, k, None)) if not isinstance(init, dict) else init.get
    replicas = get("rollout_replicas") or 1
    split = plan_cpu_resources(replicas, get("trainer_cores"), get("rollout_cores"))
    cores = available_cores()
    model = ns["model"]["model"]
    calls = cfg.minibatches_per_step
    max_running = cfg.rollout.sglang_args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
    short = max(1, cfg.rollout.max_response_length // SHORT_BUDGET_DIVISOR)
    with tempfile.TemporaryDirectory(prefix="fasync-plan-") as root:
        runs = []
        for name, mode, threads in (
                ("colocate", ["--colocate=true", "--fully_async.enable=false", "--rollout.partial=false"], len(cores)),
                ("fully-async", ["--colocate=false", "--fully_async.enable=true"], len(split.trainer_cores))):
            run = _profile_run(name, args, mode, steps, root, calls, threads)
            if not tokens_vary(run.trainer.samples) and short < cfg.rollout.max_response_length:
                # Every step trained on as many tokens (answers at the budget, a policy early in its
                # learning): steps at a quarter of the budget separate the fixed cost of a training
                # call from the cost per token, which a policy that learns to answer shorter pays.
                more = _profile_run(f"{name}-short", [*args, f"--rollout.max_response_length={short}"], mode,
                                    max(3, steps // 2), root, calls, threads)
                run = replace(run, trainer=fit_trainer(run.trainer.samples + more.trainer.samples, calls, threads),
                              short_budget=short)
            runs.append(run)
        col, fa = runs
    print("plan: measuring the engine's throughput curve ...", file=sys.stderr, flush=True)
    # The run's context: the configured one, else the longest response and a short prompt's room.
    context = cfg.rollout.sglang_args.context_length or cfg.rollout.max_response_length + 64
    engine = {len(cores): _engine_curve(model, list(cores), max_running, context, curve_repeats)}
    fa_threads = len(split.replica_cores[0])
    if fa_threads not in engine:
        engine[fa_threads] = _engine_curve(model, list(split.replica_cores[0]), max_running, context, curve_repeats)
    return Profile(len(cores), col, fa, engine, fa_threads, max_running, replicas)


def load_profile(path: str) -> Profile:
    """The profile an earlier plan wrote (its ``plan.json``), to predict again without profiling:
    with other response lengths (``--lengths_from``), seeds or steps."""
    try:
        with open(path) as fh:
            raw = json.load(fh)["profile"]
        runs = {k: RunProfile(**{**raw[k], "trainer": TrainerFit(**raw[k]["trainer"])}) for k in ("colocate", "fully_async")}
        engine = {int(t): EngineCurve(**c) for t, c in raw["engine"].items()}
        return Profile(**{**raw, **runs, "engine": engine})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"`--profile_from` is {path!r}, which is not a plan.json with a profile ({exc!r}); it takes "
                          "the plan.json of an earlier plan of a fit config (`--out`).") from None


# ------------------------------------------------------------------------------------------ predict


def _cpu_sim(cfg: FasyncConfig, prof: Profile, colocate: bool, steps: int, seed: int) -> tuple[FasyncConfig, SimConfig]:
    """The simulator's cluster as the live CPU run lays it out: one replica with the measured curve,
    the trainer as measured, at this mode's thread counts (no scaling by GPU counts)."""
    run = prof.colocate if colocate else prof.fully_async
    curve = prof.engine[prof.cores if colocate else prof.fa_engine_threads]
    per = max(1, next(iter(cfg.rollout.sglang_replicas.values())).num_gpus_per_replica) if cfg.rollout.sglang_replicas else 1
    over: dict[str, Any] = {"rollout.sglang_args.max_running_requests": prof.max_running_requests,
                            "rollout.num_gpus_per_node": per * (1 if colocate else prof.replicas),
                            "trainer.num_nodes": 1, "trainer.num_gpus_per_node": 1}
    kinds = list(cfg.rollout.sglang_replicas)
    if kinds:
        over[f"rollout.sglang_replicas.{kinds[0]}.num_nodes"] = 1
    cfg = validate(with_overrides(cfg, over))
    # The colocate profile run never stops requests in flight; a colocate + partial step does, at the
    # cost the fully-async run measured for its boundary.
    pause = max(run.pause_s, prof.fully_async.pause_s) if colocate and cfg.rollout.partial else run.pause_s
    sim = SimConfig(steps=steps, seed=seed, num_prompts=4096, total_gpus=per,
                    replica=ReplicaModel(curve.peak_tokens_per_s, curve.half_saturation,
                                         measured=[[c, t] for c, t in curve.points],
                                         prefill_tokens_per_s=curve.prefill_tokens_per_s, request_s=curve.request_s,
                                         prefill_batch_s=curve.prefill_batch_s,
                                         measured_context=curve.context,
                                         measured_long=[[c, t] for c, t in curve.long_points],
                                         measured_long_context=curve.long_context),
                    train_base_s=run.trainer.base_s, train_s_per_ktoken=run.trainer.s_per_ktoken,
                    train_reference_gpus=per if colocate else 1, weight_sync_s=run.sync_s + run.other_s,
                    pause_overhead_s=pause, colocate_switch_s=0.0)
    return cfg, sim


def _trace(groups: list[list[int]], n: int, prompts: int, seed: int) -> dict[int, list[int]]:
    """Response lengths of ``prompts`` simulated prompts, each a profiled group drawn at random."""
    rng = random.Random(seed)
    usable = [g for g in groups if len(g) == n]
    if not usable:
        raise ValueError("The profile consumed no complete group to draw response lengths from.")
    return {i: list(rng.choice(usable)) for i in range(prompts)}


def _replay(runs: list[list[list[int]]], n: int, step_groups: int, seed: int) -> RunReplay:
    """Whole runs' complete groups replayed in their order, each drawn from a step's worth of groups."""
    usable = [[g for g in run if len(g) == n] for run in runs]
    if not any(usable):
        raise ValueError(f"The runs to replay consumed no complete group of {n} response lengths.")
    return RunReplay(usable, step_groups, seed)


def read_lengths(paths: Sequence[str]) -> list[list[int]]:
    """The ``response_lengths`` of every consumed group in ledgers (``ledger.jsonl`` of earlier runs)."""
    groups: list[list[int]] = []
    for path in paths:
        with open(path) as fh:
            for line in fh:
                rec = json.loads(line)
                if rec.get("kind") == "consume" and rec.get("response_lengths"):
                    groups.append([int(x) for x in rec["response_lengths"]])
    if not groups:
        raise ValueError(f"{', '.join(paths)}: no consumed group with response_lengths to draw lengths from.")
    return groups


def predict(cfg: FasyncConfig, prof: Optional[Profile], sim: Optional[SimConfig] = None, steps: int = 100,
            seed: int = 0, modes: Sequence[tuple[str, dict[str, Any]]] = MODES,
            lengths: Optional[list[list[int]]] = None, oversample: Optional[int] = None,
            seeds: int = 1, replay_runs: Optional[list[list[list[int]]]] = None) -> list[dict[str, Any]]:
    """Each mode's simulated run: ``avg_step_excl0`` and ``speedup_excl0`` over the first mode's,
    with the mode's own calibration (``prof``) or the config's ``simulate:`` section (``sim``).
    ``lengths``: the groups' response lengths to draw from at random (default: the profile's);
    ``replay_runs``: instead, whole earlier runs' groups, each in the order it consumed them, replayed in
    that order (:class:`~lightning_fasync.simulate.RunReplay`, one step's groups of spread); ``oversample``:
    the groups ``colocate + partial`` over-dispatches (default B // 4).

    ``seeds`` runs of each mode (seeds ``seed .. seed + seeds - 1``: the prompt order and the
    lengths drawn), as the live tables take rounds: a row's step times are the median over them,
    its speedups the median (and ``speedup_excl0_min``/``_max`` the range) of each seed's ratio to
    the first mode's run of the same seed. A heavy-tailed length law moves one run's mean step
    by tens of percent, so one seed is a draw, not a prediction."""
    runs: list[list[dict[str, Any]]] = []
    for name, over in modes:
        over = dict(over)
        if over.get("rollout.resume_kv") == "keep" and cfg.rollout.backend != "embedded":
            continue  # the embedded engine's (--keep-aborted-kv): no such row for another backend
        if name.startswith("colocate + partial"):
            over["rollout.sampler.num_oversample"] = cfg.B // 4 if oversample is None else oversample
        if not over.get("colocate", False):
            over.setdefault("colocate", False)
            over.setdefault("fully_async.enable", True)
        if over.get("rollout.partial") is False:  # nothing spans versions to mask
            over["rollout.mask_offpolicy_in_partial_rollout"] = False
        mode_cfg = validate(with_overrides(cfg, over))
        per_seed = []
        for k in range(max(1, seeds)):
            run_seed = seed + k
            trace, replay = None, None
            if prof is not None:
                run_cfg, mode_sim = _cpu_sim(mode_cfg, prof, over.get("colocate", False), steps, run_seed)
                if replay_runs is not None:
                    replay = _replay(replay_runs, cfg.N, cfg.B, run_seed)
                else:
                    groups = lengths if lengths is not None else prof.colocate.lengths + prof.fully_async.lengths
                    trace = _trace(groups, cfg.N, mode_sim.num_prompts, run_seed)
            else:
                assert sim is not None
                run_cfg, mode_sim = mode_cfg, copy.deepcopy(sim)
                mode_sim.steps, mode_sim.seed, mode_sim.variants = steps, run_seed, []
            per_seed.append(summarize(name, Simulation(run_cfg, mode_sim, trace=trace, replay=replay).run()))
        runs.append(per_seed)
    rows = []
    for per_seed in runs:
        row = dict(per_seed[0])
        for key in ("avg_step", "avg_step_excl0", "partial_ratio", "partial_restored_count", "pipeline_buf_size"):
            if row.get(key) is not None:
                row[key] = statistics.median(r[key] for r in per_seed)
        for key, base_key in (("speedup_excl0", "avg_step_excl0"), ("speedup", "avg_step")):
            ratios = [b[base_key] / r[base_key] for r, b in zip(per_seed, runs[0])]
            row[key] = statistics.median(ratios)
            row[f"{key}_min"], row[f"{key}_max"] = min(ratios), max(ratios)
        row["seeds"] = len(per_seed)
        rows.append(row)
    return rows


def gpu_splits(cfg: FasyncConfig, sim: SimConfig, steps: int, seed: int) -> list[dict[str, Any]]:
    """The configured fully-async mode at every trainer : rollout GPU split of the simulated cluster
    whose trainer is whole nodes' worth or less and whose rollout side holds whole replicas."""
    per = max(1, next(iter(cfg.rollout.sglang_replicas.values())).num_gpus_per_replica)
    kind = next(iter(cfg.rollout.sglang_replicas))
    rows = []
    for train in range(per, sim.total_gpus, per):
        roll = sim.total_gpus - train
        over = {"colocate": False, "fully_async.enable": True, "trainer.num_nodes": 1, "trainer.num_gpus_per_node": train,
                "rollout.num_gpus_per_node": roll, f"rollout.sglang_replicas.{kind}.num_nodes": 1}
        mode_cfg = validate(with_overrides(cfg, over))
        mode_sim = copy.deepcopy(sim)
        mode_sim.steps, mode_sim.seed, mode_sim.variants = steps, seed, []
        rows.append(summarize(f"{train}:{roll}", Simulation(mode_cfg, mode_sim).run()))
    return rows


# ------------------------------------------------------------------------------------------ output


def speedup_cell(row: dict[str, Any]) -> str:
    """A row's predicted steady-state speedup, with the range over its seeds when it has several."""
    spread = f" ({row['speedup_excl0_min']:.2f}-{row['speedup_excl0_max']:.2f})" if row.get("seeds", 1) > 1 else ""
    return f"{row['speedup_excl0']:.2f}x{spread}"


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| mode | predicted avg step, excl. step 0 (s) | predicted speedup | predicted avg step, all steps (s) | "
             "pipeline_buf_size | partial_ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        buf = "-" if r["pipeline_buf_size"] is None else f"{r['pipeline_buf_size']:.1f}"
        lines.append(f"| {r['config']} | {r['avg_step_excl0']:.3f} | {speedup_cell(r)} | {r['avg_step']:.3f} | "
                     f"{buf} | {r['partial_ratio']:.3f} |")
    return "\n".join(lines)


def _profile_text(prof: Profile) -> str:
    lens = sorted(x for g in prof.colocate.lengths + prof.fully_async.lengths for x in g)
    q = lambda p: lens[min(len(lens) - 1, int(p * len(lens)))]  # noqa: E731
    out = [f"Profile ({prof.cores} cores):",
           f"- response lengths over {len(lens)} trajectories: median {q(0.5)}, p90 {q(0.9)}, p99 {q(0.99)}, max {lens[-1]}"]
    for threads, c in sorted(prof.engine.items()):
        pts = ", ".join(f"{n}: {t:.0f}" for n, t in c.points)
        prefill = f"; prefill {c.prefill_tokens_per_s:.0f} tokens/s" if c.prefill_tokens_per_s else ""
        prefill += f", {1000 * c.request_s:.2f} ms per request" if c.request_s else ""
        prefill += f", {1000 * c.prefill_batch_s:.2f} ms per prefill batch" if c.prefill_batch_s else ""
        each = f", each the median of {c.repeats} difference{'s' if c.repeats > 1 else ''}" if c.repeats else ""
        out.append(f"- engine on {threads} core(s): tokens/s by concurrency {{{pts}}} (context ~{c.context:.0f}{each}); "
                   f"fit peak {c.peak_tokens_per_s:.0f} tokens/s, half-saturation {c.half_saturation:.1f}{prefill}")
        if c.long_points:
            out.append(f"  at context ~{c.long_context:.0f}: {{{', '.join(f'{n}: {t:.0f}' for n, t in c.long_points)}}}")
    for run in (prof.colocate, prof.fully_async):
        t = run.trainer
        budgets = (f" (fit over steps at response budgets {run.short_budget} and the config's)" if run.short_budget
                   else "" if tokens_vary(t.samples) else " (through the origin: the profiled steps' tokens barely vary)")
        out.append(f"- trainer ({run.mode}, {t.threads} thread(s)): {t.base_s:.3f} s per call + {t.s_per_ktoken:.3f} s per "
                   f"1k response tokens{budgets}; boundary: sync {run.sync_s:.3f} s, pause {run.pause_s:.3f} s, "
                   f"other {run.other_s:.3f} s")
    return "\n".join(out)


def recommendation(rows: list[dict[str, Any]], splits: Optional[list[dict[str, Any]]] = None) -> str:
    best = min(rows, key=lambda r: r["avg_step_excl0"])
    text = (f"Recommended: {best['config']} (predicted {best['avg_step_excl0']:.3f} s per steady-state step, "
            f"{best['speedup_excl0']:.2f}x colocate).")
    fa = [r for r in rows if r["config"].startswith("fully-async")]
    if fa:
        close = [r["config"] for r in fa if r["avg_step_excl0"] <= 1.02 * best["avg_step_excl0"] and r is not best]
        if close:
            text += f" Within 2 %: {', '.join(close)}; of those, the smaller stale_steps trains on fresher data."
    if splits:
        s = min(splits, key=lambda r: r["avg_step_excl0"])
        text += (f" Trainer : rollout GPUs: {s['config']} (predicted {s['avg_step_excl0']:.1f} s per step at the "
                 f"configured window and stale_steps; " + ", ".join(f"{r['config']}: {r['avg_step_excl0']:.1f} s"
                                                              for r in splits) + ").")
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``lightning-fasync plan --config X [--profile_steps N] [--steps S] [--seeds N] [--out DIR] [fit overrides]``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="lightning-fasync plan", allow_abbrev=False,
        description="Profile a config briefly (or take a simulate: section's calibration), simulate every mode on it and "
                    "recommend one. Other arguments are fit overrides, applied to the profile runs too.")
    parser.add_argument("--config", required=True, help="a fit config (profiled), or one with a simulate: section")
    parser.add_argument("--profile_steps", type=int, default=16,
                        help="rollout steps of each profile run (step 0 excluded; the trainer's fit needs steps of "
                             "different sizes: from 8 steps it missed a later step by up to 28 %%, from 16 by 6 %%)")
    parser.add_argument("--curve_repeats", type=int, default=None, metavar="N",
                        help=f"each figure of the engine's measurement is the median of N differences (default "
                             f"{CURVE_REPEATS}; 1 is quicker and noisier: at 64 requests one difference varied by a "
                             f"quarter between runs)")
    parser.add_argument("--steps", type=int, default=None, help="simulated steps per mode (default: trainer.rollout_steps "
                                                                 "or the simulate section's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=3, metavar="N",
                        help="simulated runs per mode (seeds seed..seed+N-1), as the live tables take rounds: the "
                             "median and range of their speedups")
    parser.add_argument("--out", default=None, help="write plan.md and plan.json here")
    parser.add_argument("--lengths_from", nargs="+", default=None, metavar="LEDGER",
                        help="replay the response lengths of these ledger.jsonl files (whole earlier runs), each in "
                             "the order it consumed its groups: a learning policy's lengths change after the profile's "
                             "first steps")
    parser.add_argument("--profile_from", default=None, metavar="PLAN_JSON",
                        help="take the profile of an earlier plan of this config (its plan.json) instead of profiling")
    parser.add_argument("--oversample", type=int, default=None, metavar="K",
                        help="groups the colocate + partial row over-dispatches (default B // 4)")
    args, overrides = parser.parse_known_args(list(argv) if argv is not None else None)
    if not os.path.exists(args.config):
        raise ConfigError(f"`--config` is {args.config!r}, which does not exist.")
    if args.profile_steps < 3:
        raise ConfigError(f"`--profile_steps` is {args.profile_steps}; the fits need at least 3 steps (step 0 is left out).")
    if args.curve_repeats is not None and args.curve_repeats < 1:
        raise ConfigError(f"`--curve_repeats` is {args.curve_repeats}; it must be >= 1 (differences per measured figure).")
    if args.seeds < 1:
        raise ConfigError(f"`--seeds` is {args.seeds}; it must be >= 1 (simulated runs per mode).")
    if args.oversample is not None and args.oversample < 0:
        raise ConfigError(f"`--oversample` is {args.oversample}; it must be >= 0 (groups colocate + partial over-dispatches).")
    t0 = time.perf_counter()
    import yaml

    with open(args.config) as fh:
        has_sim = "simulate" in (yaml.safe_load(fh) or {})
    splits = None
    if args.curve_repeats is not None and (has_sim or args.profile_from):
        why = "--profile_from is given" if args.profile_from else f"{args.config} has a `simulate:` section"
        raise ConfigError(f"`--curve_repeats` is given while {why}; it sets how the engine is measured, and nothing "
                          "is measured then.")
    if has_sim and args.profile_from:
        raise ConfigError(f"`--profile_from` is given while {args.config} has a `simulate:` section, which is its calibration; "
                          "give one or the other.")
    if has_sim:
        from lightning_fasync.config import load_config_file

        cfg, sections = load_config_file(args.config, overrides, simulate=SimConfig)
        sim = sections["simulate"]
        steps = args.steps or sim.steps
        rows = predict(cfg, None, sim, steps=steps, seed=args.seed, oversample=args.oversample, seeds=args.seeds)
        splits = gpu_splits(cfg, sim, steps, args.seed)
        prof_text = f"Calibration: the `simulate:` section of {args.config} (no profile)."
        prof = None
    else:
        from lightning_fasync.lightning.cli import parse_fit_args

        fit = _fit_args(args.config, overrides)
        cfg, ns = parse_fit_args(fit)
        steps = args.steps or cfg.trainer.rollout_steps or 100
        prof = load_profile(args.profile_from) if args.profile_from else profile(fit, cfg, ns, args.profile_steps + 1,
                                                                                      args.curve_repeats or CURVE_REPEATS)
        # Each ledger a run, replayed in its order: a learning policy's lengths change over a run.
        runs = [read_lengths([p]) for p in args.lengths_from] if args.lengths_from else None
        rows = predict(cfg, prof, steps=steps, seed=args.seed, replay_runs=runs, oversample=args.oversample,
                       seeds=args.seeds)
        prof_text = _profile_text(prof) + (f"\n- the profile of {args.profile_from}" if args.profile_from else "") + (
            f"\n- simulated response lengths replayed in the order they were consumed from "
            f"{sum(len(r) for r in runs)} groups of {', '.join(args.lengths_from)}" if runs else "")
    text = "\n\n".join([prof_text, _table(rows), recommendation(rows, splits),
                        f"{steps} simulated steps per mode, {args.seeds} seed(s) (the median, and the range in brackets); "
                        f"{time.perf_counter() - t0:.0f} s in all."])
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "plan.md"), "w") as fh:
            fh.write(text + "\n")
        with open(os.path.join(args.out, "plan.json"), "w") as fh:
            json.dump({"config": args.config, "overrides": overrides, "steps": steps, "rows": rows, "splits": splits,
                       "profile": asdict(prof) if prof is not None else None}, fh, indent=1,
                      default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    return 0
