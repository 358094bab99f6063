"""Step boundaries with ``rollout.weight_update_mode: inflight`` (docs/weight_sync.md, "In-flight updates").

- The controller (fast, a fake clock): an in-flight boundary stops dispatch only, leaves the groups
  in flight dispatched (R, TrajQueue unchanged), tells the sync to freeze in place (or to retract,
  for ``inflight_kv: recompute``), and ``timing/pause_delay`` is the sync's time exactly; a boundary
  that saves runs as ``abort``.
- Real embedded engine (slow): six steps of the repeat task with weights pushed over the
  ``tensor`` path at every boundary. Nothing is aborted or prefilled twice on the engine; trajectories
  cross one and two swaps with per-token versions that only grow, exactly as the engine reports them;
  ``partial_ratio`` and ``partial_span_max`` count those crossings; nothing is recycled; every
  prompt is consumed once (ledger). The same in colocate, where the step's over-dispatched tail is
  frozen through training and the sync.
- Colocate (fast, a pausable fake engine): the tail is paused ``in_place`` once the step's B groups
  are in, not one token is decoded while the trainer runs, and a boundary that saves, forced after
  the freeze too, aborts it instead.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
import torch

from lightning_fasync.pipeline.controller import FullyAsyncController
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.pipeline.engine_client import EngineClient, SamplingParams
from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.pipeline.flow import SingleTurnFlow
from lightning_fasync.testing.instant_engine import InstantEngine
from tests.helpers.pipeline import Hooks, make_cfg, run_steps


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class SlowSync(Hooks):
    """A sync that takes 5 s of the fake clock and records the pause mode the runtime would use."""

    def __init__(self, clock, ctl_ref):
        super().__init__()
        self.clock, self.ctl_ref, self.modes, self.R_at_sync = clock, ctl_ref, [], []

    def sync_weights(self, version):
        ctl = self.ctl_ref[0]
        self.modes.append(ctl.sync_pause_mode)
        self.R_at_sync.append(ctl.state.R)
        self.clock.t += 5.0
        super().sync_weights(version)


@pytest.mark.parametrize("setting,kv,mode", [("inflight", "keep", "in_place"), ("inflight", "recompute", "retract"),
                                              ("auto", "keep", "in_place")])
def test_an_inflight_boundary_stops_dispatch_only(tmp_path, setting, kv, mode):
    """``auto`` on the embedded engine in a fully-async run is in-flight, like ``inflight`` itself."""
    cfg = make_cfg(**{"rollout.weight_update_mode": setting, "rollout.inflight_kv": kv, "trainer.save_freq": 3})
    clock = Clock()
    ds = ListDataSource([([1, 2, i % 7], {}) for i in range(400)], seed=1)
    engine = InstantEngine()
    flow = SingleTurnFlow(engine, SamplingParams(), cfg.rollout.max_response_length, reward_fn=lambda s, t: 1.0)
    ctl = FullyAsyncController(cfg, ds, flow, engine, log_dir=str(tmp_path), clock=clock)
    ref = [ctl]
    hooks = SlowSync(clock, ref)
    seen = []
    orig_cleanup = ctl.state.cleanup_after_pause

    def cleanup():
        seen.append(ctl.state.rollout_step)
        orig_cleanup()

    ctl.state.cleanup_after_pause = cleanup
    ctl.start()
    try:
        results = run_steps(ctl, hooks, 4)
    finally:
        ctl.shutdown()
    # Steps 0, 1, 3 keep their requests in flight; step 2 saves (save_freq 3), so it aborts.
    assert hooks.saved == [2]
    assert hooks.modes == [mode, mode, "abort", mode]
    assert seen == [2]  # the one abort boundary drained and cleaned TrajQueue, the others left it
    for step, m in results:
        if step == 2:
            assert m["timing/pause_delay"] != 5.0
        else:  # the fake clock moved only inside the sync: pause_delay is exactly its time
            assert m["timing/pause_delay"] == 5.0 == m["timing/update_weights"]


@pytest.fixture(scope="module")
def policy():
    from lightning_fasync.policy import build_policy

    return build_policy("tiny")[0]


def _engine_counters(url: str) -> dict:
    with urllib.request.urlopen(url + "/get_server_info", timeout=30) as r:
        states = json.load(r)["internal_states"][0]
    return states["memory_usage"]


def _six_steps_on_the_embedded_engine(tmp_path, policy, mode, rollout, seed):
    """Six steps of the repeat task on a real embedded engine, a new policy pushed over the
    ``tensor`` path at every boundary: (cfg, the step results, the consumed trajectories, the
    engine's counters at the end)."""
    from lightning_fasync.config import load_config, validate
    from lightning_fasync.fleet.resources import plan_cpu_resources
    from lightning_fasync.runtime.rollout_runtime import RolloutRuntime

    colocate = mode == "colocate"
    cfg = validate(load_config({
        "colocate": colocate,
        "fully_async": {"enable": not colocate, "sliding_window": "windowed-fifo", "stale_steps": 1.0,
                        "fetch_timeout": 120, "pause_timeout": 60},
        "data_source": {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 4, "task": "repeat",
                        "num_prompts": 256, "task_args": {"max_len": 48}},
        "trainer": {"mini_batch_size": 8},
        "rollout": {"partial": True, "max_response_length": 49, "mask_offpolicy_in_partial_rollout": True,
                    "sampler": {"num_oversample": 4 if colocate else 0}, **rollout},
    }))
    runtime = RolloutRuntime(cfg, "tiny", plan_cpu_resources(1), log_dir=str(tmp_path), pin=False)
    ctl = runtime.controller
    model = policy
    gen = torch.Generator().manual_seed(seed)

    class Push(Hooks):
        def sync_weights(self, version):
            with torch.no_grad():  # a new policy every step
                for p in model.parameters():
                    p.add_(0.01 * p.abs().mean() * torch.randn(p.shape, generator=gen))
            runtime.sync_weights(dict(model.state_dict()), version)
            self.synced.append(version)

    consumed = []
    orig_fetch = ctl.fetch

    def fetch(hooks=None):
        groups = orig_fetch(hooks)
        consumed.extend(t for g in groups for t in g.trajectories)
        return groups

    ctl.fetch = fetch
    try:
        runtime.sync_weights(dict(model.state_dict()), 0)
        ctl.start()
        results = run_steps(ctl, Push(), 6)
        counters = _engine_counters(runtime.pool.worker_urls[0])
    finally:
        runtime.shutdown()
    return cfg, results, consumed, counters


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", ["fully-async", "colocate"])
def test_inflight_updates_on_the_embedded_engine(tmp_path, policy, mode):
    """Fully-async: the requests in flight at each boundary are frozen for the push. Colocate (the
    tail frozen through training and the sync): the same engine calls, held longer."""
    from lightning_fasync.algorithms.corrections import mask_offpolicy_tokens

    colocate = mode == "colocate"
    cfg, results, consumed, counters = _six_steps_on_the_embedded_engine(
        tmp_path, policy, mode, {"weight_update_mode": "inflight"}, seed=3)
    assert cfg.boundary_mode == "inflight"
    # Nothing aborted, nothing retracted: no request was prefilled twice.
    assert counters["aborted_requests"] == 0 and counters["retracted_requests"] == 0
    ledger = read_jsonl(str(tmp_path / "ledger.jsonl"))
    assert not [r for r in ledger if r["kind"] == "recycle"]
    spans = [t.version_span for t in consumed]
    # (a colocate step freezes its tail once, so crossing two swaps needs a long answer frozen twice)
    assert max(spans) >= (1 if colocate else 2), f"too few swaps crossed: spans {sorted(set(spans))}"
    assert 1 in spans and 0 in spans
    for t in consumed:
        v = t.weight_versions
        assert len(v) == len(t.response_ids) == len(t.rollout_log_probs)
        assert v == sorted(v) and (t.start_version, t.end_version) == (v[0], v[-1])
        mask = mask_offpolicy_tokens(torch.ones(1, len(v)), torch.tensor([v]))[0]
        assert mask.tolist() == [1.0 if x == v[-1] else 0.0 for x in v]
    total = len(consumed)
    partial = sum(1 for s in spans if s)
    reported = sum(m["rollout/partial_ratio"] * m["rollout/consumed_groups"] * cfg.N for _, m in results)
    assert reported == pytest.approx(partial)
    assert max(m["rollout/partial_span_max"] for _, m in results) == max(spans)
    assert all("rollout/partial_restored_count" not in m for _, m in results)
    prompts = [r["prompt"] for r in ledger if r["kind"] == "consume"]
    assert len(prompts) == len(set(prompts)) == 6 * cfg.B == total // cfg.N


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", ["fully-async", "colocate"])
def test_aborted_requests_resume_from_their_kept_cache_on_the_embedded_engine(tmp_path, policy, mode):
    """``rollout.resume_kv: keep`` with the spec's abort boundary: the engine (launched with
    ``--keep-aborted-kv``) keeps each aborted request's cache through the push, which flushes
    nothing, and the resumed requests go on from it (SGLang's ``cached_tokens``), in fully-async and
    in colocate + partial. Every prompt is still consumed once and no trajectory loses a token."""
    cfg, _, consumed, counters = _six_steps_on_the_embedded_engine(
        tmp_path, policy, mode, {"weight_update_mode": "abort", "resume_kv": "keep"}, seed=5)
    ledger = read_jsonl(str(tmp_path / "ledger.jsonl"))
    resumed = [r for r in ledger if r["kind"] == "recycle" and r["reason"] == "partial"]
    assert counters["aborted_requests"] > 0 and resumed
    # The resumed requests went on from the caches their aborted requests left (none was dropped by
    # a flush: that would leave no hit at all).
    assert counters["kept_kv_hits"] > 0 and counters["kept_kv_tokens"] > counters["kept_kv_hits"]
    for t in consumed:
        v = t.weight_versions
        assert len(v) == len(t.response_ids) == len(t.rollout_log_probs) and v == sorted(v)
    assert max(t.version_span for t in consumed) >= 1
    prompts = [r["prompt"] for r in ledger if r["kind"] == "consume"]
    assert len(prompts) == len(set(prompts)) == 6 * cfg.B


class TickingEngine(EngineClient):
    """Token by token, honouring aborts (returns what it has), labelling tokens with its version;
    records every request's input ids. While ``paused`` (set by :class:`PausableEngine`) no request
    decodes a token."""

    def __init__(self):
        self.version, self.aborted, self.live, self.inputs = 0, set(), set(), []
        self.paused, self.tokens = False, 0

    async def generate(self, request):
        from lightning_fasync.pipeline.engine_client import GenerateResult

        self.inputs.append(list(request.input_ids))
        self.live.add(request.rid)
        out, versions = [], []
        try:
            while len(out) < request.sampling_params.max_new_tokens:
                while self.paused and request.rid not in self.aborted:
                    await asyncio.sleep(0.001)
                if request.rid in self.aborted:
                    return GenerateResult(request.rid, out, [-0.5] * len(out), versions, "abort")
                await asyncio.sleep(0.002)
                if self.paused:
                    continue  # paused meanwhile: this token is decoded after the resume
                out.append(4)
                versions.append(self.version)
                self.tokens += 1
            return GenerateResult(request.rid, out, [-0.5] * len(out), versions, "length")
        finally:
            self.live.discard(request.rid)
            self.aborted.discard(request.rid)

    async def abort(self, rid):
        self.aborted.update(r for r in self.live if r.startswith(rid))

    async def abort_all(self):
        await self.abort("")


def test_a_checkpoint_keeps_the_trajectories_in_flight_and_a_resumed_run_continues_them(tmp_path):
    """At a saving boundary of an in-flight run, the requests in flight come back with their tokens
    (that boundary runs as abort) and the checkpoint holds them: tokens, log-probs, versions. A run
    restored from it sends them on from prompt + those tokens, not from the prompt."""
    cfg = make_cfg(**{"rollout.weight_update_mode": "inflight", "trainer.save_freq": 2,
                      "rollout.max_response_length": 40})
    engine = TickingEngine()
    ds = ListDataSource([([1, 2, i % 7], {}) for i in range(400)], seed=1)
    flow = SingleTurnFlow(engine, SamplingParams(), cfg.rollout.max_response_length, reward_fn=lambda s, t: 1.0)
    ctl = FullyAsyncController(cfg, ds, flow, engine, log_dir=str(tmp_path))
    saved = {}

    class Saving(Hooks):
        def save_checkpoint(self, step):
            saved["state"] = json.loads(json.dumps(ctl.state_dict()))

    ctl.start()
    try:
        run_steps(ctl, Saving(engine), 2)  # step 0 in flight, step 1 saves
    finally:
        ctl.shutdown()
    recycled = saved["state"]["pipeline"]["datasource"]["recycled"]
    partial = [t for s in recycled for t in (s["resume"] or []) if t["response_ids"]]
    assert partial, "nothing was in flight at the saving boundary"
    for t in partial:
        assert len(t["response_ids"]) == len(t["rollout_log_probs"]) == len(t["weight_versions"]) < 40
    # A fresh run from the checkpoint: the first requests continue those trajectories.
    engine2 = TickingEngine()
    ds2 = ListDataSource([([1, 2, i % 7], {}) for i in range(400)], seed=1)
    flow2 = SingleTurnFlow(engine2, SamplingParams(), cfg.rollout.max_response_length, reward_fn=lambda s, t: 1.0)
    ctl2 = FullyAsyncController(cfg, ds2, flow2, engine2, log_dir=str(tmp_path / "resumed"))
    ctl2.load_state_dict(saved["state"])
    ctl2.start()
    try:
        groups = ctl2.fetch()
    finally:
        ctl2.shutdown()
    continued = {tuple(t["prompt_ids"] + t["response_ids"]) for t in partial if t["status"] != "completed"}
    assert continued & {tuple(i) for i in engine2.inputs}, "no saved partial trajectory was continued from its tokens"
    assert groups


class PausableEngine(TickingEngine):
    """:class:`TickingEngine` that honours ``pause`` / ``resume`` as SGLang does: ``in_place`` keeps
    the requests where they are, ``abort`` aborts them; either way none decodes until ``resume``."""

    def __init__(self):
        super().__init__()
        self.pauses, self.abort_calls = [], 0

    async def abort_all(self):
        self.abort_calls += 1
        await super().abort_all()

    async def pause(self, mode="abort"):
        self.pauses.append(mode)
        self.paused = True
        if mode == "abort":
            await self.abort_all()

    async def resume(self):
        self.paused = False


def test_colocate_inflight_freezes_the_tail_through_training_and_the_sync(tmp_path):
    """Colocate with ``weight_update_mode: inflight``: once the step's B groups are in, the
    over-dispatched requests are frozen in the engines (not aborted) until after the sync; no token
    is decoded while the trainer runs; they then go on under the new weights, so trajectories span
    versions. A boundary that saves aborts them instead (its checkpoint holds
    them), also when the save is forced after the freeze (a preempted run), and the sync's pause mode
    follows (``in_place`` or ``abort``)."""
    cfg = make_cfg(**{"colocate": True, "fully_async.enable": False, "rollout.weight_update_mode": "inflight",
                      "rollout.sampler.num_oversample": 4, "rollout.max_response_length": 40, "trainer.save_freq": 3})
    assert cfg.boundary_mode == "inflight"
    engine = PausableEngine()
    ds = ListDataSource([([1, 2, i % 7], {"sampling": {"max_new_tokens": 4 + 9 * (i % 4)}}) for i in range(400)], seed=1)
    flow = SingleTurnFlow(engine, SamplingParams(), cfg.rollout.max_response_length, reward_fn=lambda s, t: 1.0)
    ctl = FullyAsyncController(cfg, ds, flow, engine, log_dir=str(tmp_path))
    modes, during_training, consumed = [], [], []

    class Sync(Hooks):
        def sync_weights(self, version):
            modes.append(ctl.sync_pause_mode)
            # Frozen until the sync, also where a forced save then aborted the tail (step 3; the
            # sync's own pause and resume follow); at step 2, saving as planned, nothing was frozen.
            assert engine.paused == (ctl.rollout_step != 2)
            super().sync_weights(version)

    hooks = Sync(engine)
    ctl.start()
    try:
        for _ in range(5):
            while True:
                groups = ctl.fetch()
                consumed.extend(t for g in groups for t in g.trajectories)
                before = engine.tokens
                with ctl.train_block():
                    time.sleep(0.05)  # ~25 tokens per request if the engine were decoding
                    if ctl.rollout_step == 3:
                        ctl.schedule.force_save = True  # SIGTERM while the tail is frozen
                during_training.append((ctl.rollout_step, engine.paused, engine.tokens - before))
                ctl.record({"train/loss": 1.0})
                if ctl.minibatch_done():
                    break
            ctl.step_boundary(hooks)
            ctl.schedule.force_save = False  # (a preempted run would stop here; this one goes on)
    finally:
        ctl.shutdown()
    assert hooks.saved == [2, 3]
    assert modes == ["in_place", "in_place", "abort", "abort", "in_place"]
    # Every training call ran with the engines frozen (at the saving step: the tail aborted, nothing
    # in flight): not one token decoded.
    assert len(during_training) == 5 * cfg.B * cfg.N // cfg.trainer.mini_batch_size
    assert all(paused == (step != 2) and tokens == 0 for step, paused, tokens in during_training), during_training
    # Frozen, not aborted, except at the saving boundary; the tail then spans weight versions.
    assert engine.pauses == ["in_place"] * 4 and engine.abort_calls >= 2
    assert any(t.version_span >= 1 for t in consumed), "no frozen trajectory went on under new weights"
    ledger = read_jsonl(str(tmp_path / "ledger.jsonl"))
    prompts = [r["prompt"] for r in ledger if r["kind"] == "consume"]
    assert len(prompts) == len(set(prompts)) == 5 * cfg.B


def test_colocate_offload_with_the_frozen_tail_is_refused_before_any_engine_starts(tmp_path, monkeypatch):
    """``colocate_offload: auto`` resolves on for a CUDA trainer; the frozen tail needs the engines'
    memory through training, so the runtime refuses before it starts an engine, as the controller
    does (the simulator's and a custom driver's way in)."""
    from lightning_fasync.fleet.resources import plan_cpu_resources
    from lightning_fasync.config import ConfigError
    from lightning_fasync.runtime.rollout_runtime import RolloutRuntime

    cfg = make_cfg(**{"colocate": True, "fully_async.enable": False, "rollout.weight_update_mode": "inflight",
                      "rollout.sampler.num_oversample": 4})
    import lightning_fasync.runtime.rollout_runtime as rr

    def no_engines(name):
        raise AssertionError(f"an engine backend ({name}) was reached before the refusal")

    monkeypatch.setattr(rr.ENGINE_BACKENDS, "get", no_engines)
    with pytest.raises(ConfigError, match="`colocate_offload` is auto, on for a CUDA trainer, while "
                                          "`rollout.weight_update_mode` is inflight"):
        RolloutRuntime(cfg, "tiny", plan_cpu_resources(1), log_dir=str(tmp_path), pin=False, colocate_offload=True)
    ds = ListDataSource([([1, 2, 3], {})], seed=1)
    engine = PausableEngine()
    flow = SingleTurnFlow(engine, SamplingParams(), 16, reward_fn=lambda s, t: 1.0)
    with pytest.raises(ConfigError, match="set colocate_offload: false, or weight_update_mode: abort"):
        FullyAsyncController(cfg, ds, flow, engine, colocate_offload=True)
    FullyAsyncController(cfg, ds, flow, engine, colocate_offload=False).shutdown()
