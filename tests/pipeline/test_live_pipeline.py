"""The live pipeline: producer and collector threads, the step protocol, errors, logs."""

import json
import os
import threading
import time

import pytest

from lightning_fasync.pipeline.controller import FullyAsyncController
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.pipeline.engine_client import SamplingParams
from lightning_fasync.pipeline.events import EVENTS, read_jsonl
from lightning_fasync.pipeline.flow import SingleTurnFlow
from lightning_fasync.testing.instant_engine import InstantEngine
from lightning_fasync.pipeline.state import PipelineError
from tests.helpers.pipeline import Hooks, make_cfg, run_steps

SPEC_ROLLOUT_METRICS = {
    "rollout/pipeline_buf_size", "rollout/filter_drop", "rollout/partial_ratio", "rollout/partial_span_max",
    "timing/pause_delay", "perf/wait_ratio",
}


def build(cfg, tmp_path, engine=None, reward=lambda s, t: float(len(t.response_ids)), group_filter=None, prompts=400):
    engine = engine or InstantEngine()
    ds = ListDataSource([([1, 2, i % 7], {}) for i in range(prompts)], seed=1)
    flow = SingleTurnFlow(engine, SamplingParams(), cfg.rollout.max_response_length, reward_fn=reward)
    ctl = FullyAsyncController(cfg, ds, flow, engine, log_dir=str(tmp_path), group_filter=group_filter)
    return ctl, engine


def test_steps_run_and_report_the_spec_metrics(tmp_path):
    cfg = make_cfg(**{"trainer.save_freq": 2})
    ctl, _ = build(cfg, tmp_path)
    hooks = Hooks()
    ctl.start()
    try:
        results = run_steps(ctl, hooks, 4)
    finally:
        ctl.shutdown()
    steps = [s for s, _ in results]
    assert steps == [0, 1, 2, 3]
    assert hooks.saved == [1, 3]  # save_freq 2
    assert hooks.synced == [1, 2, 3, 4]  # weight version + 1 at each boundary
    for _, m in results:
        assert SPEC_ROLLOUT_METRICS <= set(m)
        assert m["rollout/consumed_groups"] == cfg.B
        assert m["train/loss"] == 1.0 and m["train/is_max"] == 2.0
        assert m["timing/old_log_prob"] == pytest.approx(0.01 * cfg.minibatches_per_step)
        assert 0.0 <= m["perf/wait_ratio"] <= 1.0
        assert m["timing/step"] >= m["timing/train"]
    assert ctl.rollout_step == 4 and ctl.weight_version == 4


def test_event_log_and_ledger(tmp_path):
    cfg = make_cfg()
    ctl, _ = build(cfg, tmp_path)
    ctl.start()
    try:
        run_steps(ctl, Hooks(), 3)
    finally:
        ctl.shutdown()
    events = read_jsonl(os.path.join(tmp_path, "events.jsonl"))
    assert events and all(set(e) >= {"t", "event", "seq", "prompt", "R", "Q", "step"} for e in events)
    assert {e["event"] for e in events} <= set(EVENTS)
    assert {"dispatch", "complete", "collect", "consume", "pause", "resume", "sync"} <= {e["event"] for e in events}
    assert all(e["R"] + e["Q"] <= cfg.capacity for e in events)
    ledger = read_jsonl(os.path.join(tmp_path, "ledger.jsonl"))
    consumed = [r["prompt"] for r in ledger if r["kind"] == "consume"]
    assert len(consumed) == 3 * cfg.B and len(set(consumed)) == len(consumed)


def test_partial_pause_cancels_everything_quickly(tmp_path):
    cfg = make_cfg()
    engine = InstantEngine(hold=True)  # every request hangs until aborted
    ctl, _ = build(cfg, tmp_path, engine=engine)
    ctl.start()
    try:
        deadline = time.monotonic() + 5
        while len(engine._held) < cfg.capacity * cfg.N and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ctl.state.in_flight == cfg.capacity * cfg.N == len(engine._held)
        ctl.pause()  # the one pause-and-cleanup of every driver
        assert ctl.state.in_flight == 0
        m = ctl.state.step_metrics()
        assert m["rollout/partial_restored_count"] == cfg.capacity * cfg.N
        assert m["rollout/partial_dropped_incomplete_count"] == 0
        assert ctl.state.R == 0 and ctl.state.datasource.num_recycled == cfg.capacity
        # Recycled groups carry their partial tokens and come back first.
        first = ctl.state.datasource._recycled[0]
        assert first.resume is not None and len(first.resume[0].response_ids) == 1
    finally:
        ctl.shutdown()


def test_non_partial_pause_waits_for_in_flight(tmp_path):
    cfg = make_cfg(**{"rollout.partial": False, "fully_async.pause_timeout": 0.5})
    engine = InstantEngine(hold=True)
    ctl, _ = build(cfg, tmp_path, engine=engine)
    ctl.start()
    try:
        time.sleep(0.2)
        with pytest.raises(PipelineError, match="fully_async.pause_timeout"):
            ctl.pause()
    finally:
        ctl.shutdown(raise_errors=False)


def test_fetch_timeout_is_a_clear_error(tmp_path):
    cfg = make_cfg(**{"fully_async.fetch_timeout": 0.3})
    ctl, _ = build(cfg, tmp_path, engine=InstantEngine(hold=True))
    ctl.start()
    try:
        with pytest.raises(PipelineError, match="fully_async.fetch_timeout"):
            ctl.fetch()
    finally:
        ctl.shutdown(raise_errors=False)


def test_engine_failures_reach_the_main_thread(tmp_path):
    cfg = make_cfg()
    ctl, _ = build(cfg, tmp_path, engine=InstantEngine(fail_fn=lambda rid: True))
    ctl.start()
    with pytest.raises(PipelineError, match="max_consecutive_failed_groups"):
        ctl.fetch()
    ctl.shutdown(raise_errors=False)
    ctl.shutdown()  # idempotent: a second shutdown does nothing, so it does not raise again...
    # ...and the error is still reported: shutdown does not clear it, the next main-thread call raises it.
    with pytest.raises(PipelineError, match="max_consecutive_failed_groups"):
        ctl.fetch()
    ledger = read_jsonl(os.path.join(tmp_path, "ledger.jsonl"))
    assert any(r["kind"] == "recycle" and r["reason"] == "failed" for r in ledger)


def test_exception_in_user_filter_is_raised_on_main_thread(tmp_path):
    cfg = make_cfg()

    def bad_filter(group):
        raise RuntimeError("boom")

    ctl, _ = build(cfg, tmp_path, group_filter=bad_filter)
    ctl.start()
    with pytest.raises(PipelineError, match="rollout.filter"):
        ctl.fetch()
    ctl.shutdown(raise_errors=False)


def test_filter_drops_are_counted(tmp_path):
    cfg = make_cfg()
    ctl, _ = build(cfg, tmp_path, group_filter=lambda g: g.prompt_id.index % 2 == 0)
    ctl.start()
    try:
        (_, m), = run_steps(ctl, Hooks(), 1)
    finally:
        ctl.shutdown()
    assert m["rollout/filter_drop"] > 0
    ledger = read_jsonl(os.path.join(tmp_path, "ledger.jsonl"))
    dropped = {r["prompt"] for r in ledger if r["kind"] == "drop"}
    consumed = {r["prompt"] for r in ledger if r["kind"] == "consume"}
    assert dropped and not (dropped & consumed)
    assert all(int(p.split(":")[1]) % 2 == 0 for p in consumed)


def test_partial_trajectories_span_versions(tmp_path):
    """A token-by-token engine that honours abort: resumed trajectories cross weight versions."""
    import asyncio

    from lightning_fasync.pipeline.engine_client import EngineClient, GenerateResult

    class TickingEngine(EngineClient):
        version = 0

        def __init__(self):
            self.aborted = set()
            self.live = set()

        async def generate(self, request):
            self.live.add(request.rid)
            out, versions = [], []
            try:
                for _ in range(request.sampling_params.max_new_tokens):
                    if request.rid in self.aborted:
                        return GenerateResult(request.rid, out, [-0.5] * len(out), versions, "abort")
                    await asyncio.sleep(0.0005)
                    out.append(4)
                    versions.append(self.version)
                return GenerateResult(request.rid, out, [-0.5] * len(out), versions, "length")
            finally:
                self.live.discard(request.rid)
                self.aborted.discard(request.rid)

        async def abort(self, rid):
            self.aborted.update(r for r in self.live if r.startswith(rid))

        async def abort_all(self):
            await self.abort("")

    cfg = make_cfg(**{"rollout.max_response_length": 24})
    engine = TickingEngine()
    ctl, _ = build(cfg, tmp_path, engine=engine)
    hooks = Hooks(engine)
    consumed = []
    orig_fetch = ctl.fetch

    def fetch():
        groups = orig_fetch()
        consumed.extend(t for g in groups for t in g.trajectories)
        return groups

    ctl.fetch = fetch
    ctl.start()
    try:
        results = run_steps(ctl, hooks, 6)
    finally:
        ctl.shutdown()
    assert any(m.get("rollout/partial_restored_count", 0) > 0 for _, m in results)
    assert any(m["rollout/partial_ratio"] > 0 and m["rollout/partial_span_max"] >= 1 for _, m in results)
    for t in consumed:
        assert len(t.response_ids) == 24 == len(t.weight_versions) == len(t.rollout_log_probs) == len(t.loss_mask)
        assert t.weight_versions == sorted(t.weight_versions)
        assert (t.start_version, t.end_version) == (t.weight_versions[0], t.weight_versions[-1])
    # The spec's partial_ratio: share of consumed trajectories whose start and end versions differ.
    total = sum(m["rollout/consumed_groups"] for _, m in results) * cfg.N
    assert total == len(consumed)


def test_shutdown_is_idempotent_and_stops_threads(tmp_path):
    cfg = make_cfg()
    ctl, _ = build(cfg, tmp_path)
    ctl.start()
    ctl.shutdown()
    ctl.shutdown()
    names = {t.name for t in threading.enumerate()}
    assert "fasync-producer" not in names and "fasync-collector" not in names
    with pytest.raises(PipelineError):
        ctl.start()


def test_checkpoint_state_regenerates_unconsumed_prompts_first(tmp_path):
    cfg = make_cfg(**{"trainer.save_freq": 1})
    ctl, _ = build(cfg, tmp_path)
    saved = {}

    class SavingHooks(Hooks):
        def save_checkpoint(self, step):
            saved["state"] = json.loads(json.dumps(ctl.state_dict()))
            # Taken at the save, while paused: after resume() the producer may refill the buffer.
            saved["in_buffer"] = [str(g.prompt_id) for g in ctl.state.buffer.peek_all()]

    ctl.start()
    try:
        for _ in range(cfg.minibatches_per_step):
            ctl.fetch()
            ctl.record({})
            ctl.minibatch_done()
        # Pause only once the pipeline is full and idle (buffer at capacity, nothing in flight), so
        # the pause cancels nothing: no group is recycled next to the buffer's unconsumed prompts,
        # and which prompts the checkpoint holds does not depend on thread timing.
        deadline = time.monotonic() + 10
        while not (ctl.state.Q == cfg.capacity and ctl.state.R == 0 and ctl.state.in_flight == 0):
            assert time.monotonic() < deadline, (ctl.state.Q, ctl.state.R, ctl.state.in_flight)
            time.sleep(0.005)
        ctl.step_boundary(SavingHooks())
    finally:
        ctl.shutdown()
    pipeline = saved["state"]["pipeline"]
    assert pipeline["rollout_step"] == 1
    assert pipeline["weight_version"] == 1
    assert pipeline["datasource"]["recycled"] == []
    unconsumed = [p["prompt_id"] for p in pipeline["unconsumed_prompts"]]
    assert unconsumed == saved["in_buffer"] and len(unconsumed) == cfg.capacity

    ctl2, _ = build(cfg, tmp_path / "resumed")
    ctl2.load_state_dict(saved["state"])
    served = [str(ctl2.state.datasource.next_sample().prompt_id) for _ in range(len(unconsumed) + 1)]
    # The unconsumed prompts come back first, oldest prompt id first; then new prompts continue
    # where the checkpoint's datasource stopped.
    assert served[: len(unconsumed)] == sorted(unconsumed, key=lambda p: tuple(map(int, p.split(":"))))
    assert served[len(unconsumed)] == f"{pipeline['datasource']['epoch']}:{pipeline['datasource']['position']}"
    assert ctl2.rollout_step == 1
    ctl2.shutdown()


def test_fresh_trajectory_matches_the_dataclass_defaults():
    from lightning_fasync.types import PromptId, Trajectory

    a = Trajectory.fresh(PromptId(1, 2), 3, [4, 5], 6)
    b = Trajectory(prompt_id=PromptId(1, 2), sample_index=3, prompt_ids=[4, 5], seq=6)
    assert a == b
    a.extend([1], [-0.1], [0])
    assert b.response_ids == [] and Trajectory.fresh(PromptId(0, 0), 0, [], 0).response_ids == []


@pytest.mark.parametrize("partial,oversample", [(False, 0), (True, 4)])
def test_colocate_rolls_out_the_batch_then_trains(tmp_path, partial, oversample):
    """Colocate baseline: dispatch B (+ over-dispatch), pause once B groups are complete, then train."""
    cfg = make_cfg(**{"colocate": True, "fully_async.enable": False, "rollout.partial": partial,
                      "rollout.sampler.num_oversample": oversample})
    ctl, _ = build(cfg, tmp_path)
    assert ctl.colocate and ctl.state.C == cfg.B + oversample
    ctl.start()
    try:
        results = run_steps(ctl, Hooks(), 3)
    finally:
        ctl.shutdown()
    assert all(m["rollout/consumed_groups"] == cfg.B for _, m in results)
    events = read_jsonl(os.path.join(tmp_path, "events.jsonl"))
    # The events the check below relies on were logged: each step's groups consumed, a rollout phase paused.
    names = [e["event"] for e in events]
    assert names.count("consume") == 3 * cfg.B
    assert names.count("pause") >= 3 and names.count("resume") >= 2
    assert names.count("dispatch") >= 3 * cfg.B
    # Nothing is dispatched between a pause and the next resume: training never overlaps rollout.
    paused = False
    for e in events:
        if e["event"] == "pause":
            paused = True
        elif e["event"] == "resume":
            paused = False
        elif e["event"] == "dispatch":
            assert not paused
        elif e["event"] == "consume":
            assert paused, "colocate trains only after the rollout phase paused"


def test_event_log_lines_are_json_with_the_fixed_keys(tmp_path):
    from lightning_fasync.pipeline.events import EventLog
    from lightning_fasync.types import PromptId

    path = str(tmp_path / "e.jsonl")
    log = EventLog(path, clock=lambda: 1.2345678)
    log.emit("dispatch", seq=3, prompt=PromptId(0, 5), R=1, Q=2, step=0)  # the formatted fast path
    log.emit("train", step=1, R=0, Q=4, dur=0.5)  # with extra keys: the encoder
    log.close()
    assert read_jsonl(path) == [
        {"t": 1.234568, "event": "dispatch", "seq": 3, "prompt": "0:5", "R": 1, "Q": 2, "step": 0},
        {"t": 1.234568, "event": "train", "seq": -1, "prompt": None, "R": 0, "Q": 4, "step": 1, "dur": 0.5},
    ]
