"""Evaluation during training (``eval.*``): at a step boundary, once the engines serve the new
weights and before dispatch resumes, the weights are evaluated on the engines outside the training
pipeline's accounting, and ``val/<source>/*`` is logged at that step.

Unit tests drive the real controller with the in-process instant engine; one slow test runs
`lightning-fasync fit` twice (a run, then its resume) on configs/tiny_cpu_eval.yaml with the
embedded engine and reads TensorBoard, the ledger and the event log back."""

from __future__ import annotations

import os
import sys

import pytest

from lightning_fasync.config import ConfigError, load_config, validate
from lightning_fasync.pipeline.controller import FullyAsyncController, StepSchedule
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.pipeline.engine_client import SamplingParams
from lightning_fasync.pipeline.evaluator import EvalSource, Evaluator, eval_metrics, take_samples
from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.pipeline.flow import SingleTurnFlow
from lightning_fasync.testing.instant_engine import InstantEngine
from lightning_fasync.pipeline.state import PipelineError
from lightning_fasync.types import PromptId, Trajectory, TrajectoryStatus
from tests.helpers.ledger_audit import audit_resume, run_fit
from tests.helpers.paths import REPO
from tests.helpers.pipeline import Hooks, make_cfg, run_steps

EVAL_PROMPTS = 6
# The controller's schedule reads eval.*, which needs an eval set; the tests hand the evaluator in.
HELDOUT = {"eval.data_source": [{"name": "heldout"}]}


def eval_length(rid: str) -> int:
    """Eval request ``eval-<name>-<prompt>-<sample>`` gets ``prompt + sample + 1`` tokens."""
    prompt, sample = rid.split("-")[-2:]
    return int(prompt) + int(sample) + 1


def even_reward(sample, traj) -> float:
    """1.0 for an even response length, else 0.25: known in advance from the request ids."""
    return 1.0 if len(traj.response_ids) % 2 == 0 else 0.25


class RecordingEngine(InstantEngine):
    """The instant engine serving the version the hooks synced, recording every request."""

    def __init__(self, **kwargs) -> None:
        super().__init__(
            length_fn=lambda rid: eval_length(rid) if rid.startswith("eval-") else 1 + sum(map(ord, rid)) % 16,
            version_fn=lambda: self.version, **kwargs,
        )
        self.version = 0
        self.seen: list[tuple[str, int, float]] = []  # rid, weight version served, temperature

    async def generate_batch(self, requests):
        self.seen.extend((r.rid, self.version, r.sampling_params.temperature) for r in requests)
        return await super().generate_batch(requests)


def pipeline_snapshot(ctl):
    """Everything eval must leave alone: R, Q, sequence numbers, window, buffer, datasource, the
    step's rollout statistics, the ledger."""
    st = ctl.state
    st.ledger.flush()
    return (st.view(), st.in_flight, st.paused, st.exhausted, st.rollout_step, st.weight_version,
            [g.seq for g in st.buffer.peek_all()], len(st.queue), st.datasource.state_dict(), st._stats,
            ctl.schedule.calls, os.path.getsize(st.ledger.path))


class SpyEvaluator(Evaluator):
    """Checks that the pipeline is paused and untouched across each evaluation."""

    ctl: FullyAsyncController

    def run(self, step, interrupt=None):
        before = pipeline_snapshot(self.ctl)
        assert self.ctl.state.paused, "eval ran while training dispatch was open"
        metrics = super().run(step, interrupt)
        assert pipeline_snapshot(self.ctl) == before
        return metrics


def eval_flow(engine, n: int, max_response_length: int = 16) -> SingleTurnFlow:
    sampling = SamplingParams(temperature=0.0 if n == 1 else 0.7)
    return SingleTurnFlow(engine, sampling, max_response_length, reward_fn=even_reward, rid_prefix="eval-heldout-")


def eval_source(engine, n: int = 1) -> EvalSource:
    prompts = ListDataSource([([9, 9, i], {"i": i}) for i in range(EVAL_PROMPTS)], shuffle=False)
    return EvalSource("heldout", eval_flow(engine, n), take_samples(prompts, 100))


def expected(n: int) -> dict[str, float]:
    lengths = [[i + j + 1 for j in range(n)] for i in range(EVAL_PROMPTS)]
    flat = [x for row in lengths for x in row]
    rewards = [1.0 if x % 2 == 0 else 0.25 for x in flat]
    out = {
        "val/heldout/num_samples": float(len(flat)),
        "val/heldout/reward_mean": sum(rewards) / len(rewards),
        "val/heldout/accuracy": sum(r == 1.0 for r in rewards) / len(rewards),
        "val/heldout/response_length/mean": sum(flat) / len(flat),
        "val/heldout/response_length_max": float(max(flat)),
        "val/heldout/response_length/clip_ratio": 0.0,
    }
    if n > 1:
        out["val/heldout/pass_at_n"] = sum(any(x % 2 == 0 for x in row) for row in lengths) / EVAL_PROMPTS
    return out


# ---------------------------------------------------------------------------------------- controller


@pytest.mark.parametrize("mode", ["fully_async", "colocate"])
def test_eval_runs_at_the_configured_steps_on_the_new_weights_outside_the_pipeline(tmp_path, mode):
    over = {**HELDOUT, "eval.every_n_steps": 2}
    if mode == "colocate":
        over.update({"colocate": True, "fully_async.enable": False})
    cfg = make_cfg(**over)
    engine = RecordingEngine()
    ds = ListDataSource([([1, 2, i % 7], {}) for i in range(400)], seed=1)
    flow = SingleTurnFlow(engine, SamplingParams(), cfg.rollout.max_response_length, reward_fn=lambda s, t: 0.5)
    evaluator = SpyEvaluator([eval_source(engine)], n=1, timeout=30)
    ctl = FullyAsyncController(cfg, ds, flow, engine, log_dir=str(tmp_path), evaluator=evaluator)
    evaluator.ctl = ctl
    ctl.start()
    try:
        results = run_steps(ctl, Hooks(engine), 5)
    finally:
        ctl.shutdown()
    ctl.shutdown()  # idempotent, evaluator included

    # Only after steps 1 and 3 (every_n_steps 2, counted from 0), with the step's other metrics.
    assert [s for s, m in results if any(k.startswith("val/") for k in m)] == [1, 3]
    assert [s for s, m in results if "timing/eval" in m] == [1, 3]
    for step, m in results:
        if step in (1, 3):
            assert {k: v for k, v in m.items() if k.startswith("val/")} == pytest.approx(expected(1))
            assert m["timing/eval"] > 0 and m["rollout/consumed_groups"] == cfg.B
    assert evaluator.runs == 2

    # Eval requests: their own prefix, greedy, served by the weights synced at that boundary.
    eval_reqs = [(rid, v, t) for rid, v, t in engine.seen if rid.startswith("eval-")]
    assert len(eval_reqs) == 2 * EVAL_PROMPTS
    assert {v for _, v, _ in eval_reqs} == {2, 4} and {t for _, _, t in eval_reqs} == {0.0}
    assert all(rid.startswith("fa-") for rid, _, _ in engine.seen if not rid.startswith("eval-"))

    events = read_jsonl(str(tmp_path / "events.jsonl"))
    evals = [e for e in events if e["event"] == "eval"]
    assert [(e["step"], e["weight_version"], e["samples"]) for e in evals] == [(1, 2, EVAL_PROMPTS), (3, 4, EVAL_PROMPTS)]
    for e in evals:
        i = events.index(e)
        sync, resume = events[i - 1], events[i + 1]
        assert sync["event"] == "sync" and resume["event"] == "resume" and e["dur"] > 0
        assert (e["R"], e["Q"]) == (sync["R"], sync["Q"]) == (resume["R"], resume["Q"])
    # No sequence number went to eval; the window contract holds throughout.
    seqs = [e["seq"] for e in events if e["event"] == "dispatch"]
    assert sorted(seqs) == list(range(len(seqs)))
    assert all(e["R"] + e["Q"] <= ctl.state.C for e in events)
    # The ledger holds training prompts only: B per step, each once.
    consumed = [r for r in read_jsonl(str(tmp_path / "ledger.jsonl")) if r["kind"] == "consume"]
    assert len(consumed) == 5 * cfg.B == len({r["prompt"] for r in consumed})
    assert all(len([r for r in consumed if r["step"] == s]) == cfg.B for s in range(5))


def test_a_boundary_that_ends_the_run_on_a_signal_does_not_evaluate(tmp_path):
    cfg = make_cfg(**{**HELDOUT, "eval.every_n_steps": 1})
    engine = RecordingEngine()
    ds = ListDataSource([([1, 2, i % 7], {}) for i in range(400)], seed=1)
    flow = SingleTurnFlow(engine, SamplingParams(), cfg.rollout.max_response_length)
    ctl = FullyAsyncController(cfg, ds, flow, engine, log_dir=str(tmp_path), evaluator=Evaluator([eval_source(engine)]))
    ctl.start()
    try:
        (step, first), = run_steps(ctl, Hooks(engine), 1)
        ctl.schedule.force_save = True  # what the drivers set on SIGTERM or lost engines
        (_, last), = run_steps(ctl, Hooks(engine), 1)
    finally:
        ctl.shutdown()
    assert "val/heldout/accuracy" in first and not any(k.startswith("val/") for k in last)


def test_eval_at_start_evaluates_the_starting_weights_at_the_step_before():
    engine = RecordingEngine()
    cfg = make_cfg(**{**HELDOUT, "eval.at_start": True})
    ds = ListDataSource([([1, 2, i % 7], {}) for i in range(40)], seed=1)
    flow = SingleTurnFlow(engine, SamplingParams(), cfg.rollout.max_response_length)
    ctl = FullyAsyncController(cfg, ds, flow, engine, evaluator=Evaluator([eval_source(engine)]))
    try:
        step, metrics = ctl.evaluate_at_start()
        assert step == -1 and metrics["timing/eval"] > 0
        assert {k: v for k, v in metrics.items() if k.startswith("val/")} == pytest.approx(expected(1))
        assert ctl.state.next_seq == 0 and ctl.state.R == ctl.state.Q == 0
        ctl.start()
        with pytest.raises(PipelineError, match="before the pipeline threads start"):
            ctl.evaluate_at_start()
    finally:
        ctl.shutdown()


def test_a_resumed_run_keeps_the_schedule_of_the_global_step_and_the_ledger_audit_holds(tmp_path):
    """Run 1 trains steps 0-1 (saved after step 1, evaluated there), run 2 resumes from that
    checkpoint for steps 2-3: its at_start skips the weights step 1 evaluated, it evaluates after
    step 3, and the two ledgers pass the exactly-once audit."""
    cfg = make_cfg(**{**HELDOUT, "eval.every_n_steps": 2, "eval.at_start": True, "trainer.save_freq": 2})

    class SavingHooks(Hooks):
        def save_checkpoint(self, step):
            super().save_checkpoint(step)
            self.state = ctl.state_dict()

    logs = [tmp_path / "run1", tmp_path / "run2"]
    evaluated, state = [], None
    for log_dir in logs:
        engine = RecordingEngine()
        ds = ListDataSource([([1, 2, i % 7], {}) for i in range(400)], seed=1)
        flow = SingleTurnFlow(engine, SamplingParams(), cfg.rollout.max_response_length, reward_fn=lambda s, t: 0.5)
        ctl = FullyAsyncController(cfg, ds, flow, engine, log_dir=str(log_dir), evaluator=Evaluator([eval_source(engine)]))
        hooks = SavingHooks(engine)
        try:
            if state is not None:
                ctl.load_state_dict(state)
                engine.version = ctl.weight_version
            at, metrics = ctl.evaluate_at_start()
            evaluated += [at] if metrics else []
            ctl.start()
            results = run_steps(ctl, hooks, 2)
        finally:
            ctl.shutdown()
        evaluated += [s for s, m in results if "val/heldout/accuracy" in m]
        state = hooks.state
    assert evaluated == [-1, 1, 3]
    ledgers = [read_jsonl(str(d / "ledger.jsonl")) for d in logs]
    assert audit_resume(ledgers[0], ledgers[1], cfg.B, 4) == 2


# ---------------------------------------------------------------------------------------- evaluator


def test_sampled_eval_with_n_samples_per_prompt_and_known_rewards():
    engine = RecordingEngine()
    evaluator = Evaluator([eval_source(engine, n=3)], n=3, timeout=30, max_connections=6)
    try:
        metrics = evaluator.run(step=0)
    finally:
        evaluator.close()
    assert metrics == pytest.approx(expected(3))
    assert metrics["val/heldout/num_samples"] == 3 * EVAL_PROMPTS
    rids = sorted(rid for rid, _, _ in engine.seen)
    assert rids == sorted(f"eval-heldout-{i}-{j}" for i in range(EVAL_PROMPTS) for j in range(3))
    assert {t for _, _, t in engine.seen} == {0.7}


def test_eval_metrics_of_known_trajectories():
    def traj(i, length, status=TrajectoryStatus.COMPLETED, reward=None):
        t = Trajectory.fresh(PromptId(0, i), 0, [1], 0)
        t.extend([5] * length, [-1.0] * length, [1] * length)
        t.status, t.reward = status, reward
        return t

    groups = [
        [traj(0, 4, reward=1.0), traj(0, 8, TrajectoryStatus.TRUNCATED, reward=0.5)],
        [traj(1, 2, reward=0.9), traj(1, 0, TrajectoryStatus.FAILED)],  # a reward that raised or an engine error
    ]
    m = eval_metrics("math", groups, accuracy_threshold=0.9)
    assert m == pytest.approx({
        "val/math/num_samples": 3.0, "val/math/num_failed": 1.0,
        "val/math/reward_mean": (1.0 + 0.5 + 0.9) / 3, "val/math/accuracy": 2 / 3,
        "val/math/response_length/mean": 14 / 3, "val/math/response_length_max": 8.0,
        "val/math/response_length/clip_ratio": 1 / 3, "val/math/pass_at_n": 1.0,
    })
    # Greedy (n = 1): no pass_at_n; exactly 1.0 needed at the default threshold.
    m = eval_metrics("g", [[traj(0, 3, reward=1.0)], [traj(1, 3, reward=0.99)]], accuracy_threshold=1.0)
    assert m["val/g/accuracy"] == 0.5 and "val/g/pass_at_n" not in m and "val/g/num_failed" not in m


def test_an_eval_past_its_timeout_fails_naming_the_key_and_an_interrupt_abandons_it():
    engine = InstantEngine(hold=True)  # never answers
    evaluator = Evaluator([eval_source(engine)], timeout=0.3)
    try:
        with pytest.raises(PipelineError, match=r"evaluation at step 4 did not finish within 0.3 s \(`eval.timeout`\)"):
            evaluator.run(step=4)
        assert engine._held == {}  # the requests were cancelled, nothing left waiting
        evaluator.timeout = 60

        def interrupt():  # a preemption past its grace period (Preempted is a SystemExit)
            raise SystemExit(143)

        with pytest.raises(SystemExit):
            evaluator.run(step=5, interrupt=interrupt)
        assert engine._held == {}
    finally:
        evaluator.close()
    evaluator.close()


def test_take_samples_reads_the_first_epoch_at_most_limit():
    ds = ListDataSource([([i], {}) for i in range(5)], seed=3)
    assert len(take_samples(ds, 3)) == 3
    ds = ListDataSource([([i], {}) for i in range(5)], seed=3)
    assert sorted(s.input_ids[0] for s in take_samples(ds, 100)) == list(range(5))


# ---------------------------------------------------------------------------------------- schedule, config


def test_eval_schedule_counts_global_steps():
    cfg = make_cfg(**{"eval.every_n_steps": 3, "eval.at_end": True, "eval.data_source": [{"name": "x"}]})
    schedule = StepSchedule.from_config(cfg)
    assert [s for s in range(10) if schedule.eval_due(s)] == [2, 5, 8]
    schedule.final_step = 6  # a resumed run's steps are global: its last one is known to the driver
    assert [s for s in range(4, 7) if schedule.eval_due(s)] == [5, 6]
    assert not any(StepSchedule(4, 0).eval_due(s) for s in range(10))


@pytest.mark.parametrize("over,message", [
    ({"eval.every_n_steps": -1}, "`eval.every_n_steps` is -1; it must be >= 0"),
    ({"eval.every_n_steps": 5}, "`eval.every_n_steps` is 5 while `eval.data_source` is empty"),
    ({"eval.at_end": True}, "`eval.at_end` is true while `eval.data_source` is empty"),
    ({"eval.data_source": [{"name": "a/b"}]}, r"`eval.data_source\[0\].name` is 'a/b'; it must be letters"),
    ({"eval.data_source": [{"name": "a"}, {"name": "a"}]}, r"`eval.data_source\[1\].name` is 'a', which another"),
    ({"eval.data_source": [{"name": "a", "num_prompts": 0}]}, r"`eval.data_source\[0\].num_prompts` is 0"),
    ({"eval.data_source": [{"name": "f", "path": "x.jsonl"}]}, r"`eval.data_source\[0\].path` is set but `eval.data_source\[0\].reward` is not"),
    ({"eval.sampling.n": 4}, "`eval.sampling.n` is 4 while `eval.sampling.greedy` is true"),
    ({"eval.sampling.n": 0}, "`eval.sampling.n` is 0; it must be a positive integer"),
    ({"eval.sampling.top_p": 0.0}, r"`eval.sampling.top_p` is 0.0; it must be in \(0, 1\]"),
    ({"eval.sampling.max_response_length": 0}, "`eval.sampling.max_response_length` is 0"),
    ({"eval.timeout": 0}, "`eval.timeout` is 0.0; it must be > 0 seconds"),
])
def test_bad_eval_keys_are_refused_naming_the_key(over, message):
    with pytest.raises(ConfigError, match=message):
        make_cfg(**over)


def test_eval_keys_parse_from_yaml_shape():
    cfg = validate(load_config({"eval": {
        "every_n_steps": 4, "data_source": [{"name": "heldout", "num_prompts": 32, "seed": 7}],
        "sampling": {"greedy": False, "n": 4, "temperature": 0.6, "max_response_length": 128},
    }}))
    (src,) = cfg.eval.data_source
    assert (src.name, src.num_prompts, src.seed, src.task) == ("heldout", 32, 7, "repeat")
    assert (cfg.eval.sampling.n, cfg.eval.sampling.temperature, cfg.eval.accuracy_threshold) == (4, 0.6, 1.0)
    assert load_config({}).eval.every_n_steps == 0


# ---------------------------------------------------------------------------------------- runtime


class TensorClient(InstantEngine):
    """An engine client someone else runs (no process starts), taking weight syncs."""

    async def update_weights_from_tensor(self, named_tensors, weight_version=None):
        self.synced = weight_version


def test_runtime_builds_the_eval_sets_like_the_training_source():
    from lightning_fasync.fleet.resources import plan_cpu_resources
    from lightning_fasync.runtime.rollout_runtime import RolloutRuntime

    cfg = make_cfg(**{
        "rollout.max_response_length": 65,
        "eval.every_n_steps": 2,
        "eval.data_source": [{"name": "repeat_heldout", "num_prompts": 5, "seed": 99},
                             {"name": "short", "num_prompts": 3, "seed": 5, "task_args": {"max_len": 4}}],
        "agentflow.flow_args": {"rid_prefix": "train-"},
    })
    client = TensorClient()
    runtime = RolloutRuntime(cfg, None, plan_cpu_resources(1), log_dir=None, pin=False, client=client)
    try:
        ev = runtime.controller.evaluator
        train_flow = runtime.controller.producer.flow
        assert train_flow.rid_prefix == "train-"  # agentflow.flow_args, for training only
        assert [s.name for s in ev.sources] == ["repeat_heldout", "short"] and ev.n == 1
        for source, size in zip(ev.sources, (5, 3)):
            assert len(source.samples) == size
            assert type(source.flow) is type(train_flow) and source.flow is not train_flow
            assert source.flow.rid_prefix == f"eval-{source.name}-"
            assert source.flow.sampling.temperature == 0.0  # greedy
            assert source.flow.sampling.stop_token_ids == train_flow.sampling.stop_token_ids
            assert source.flow.max_response_length == 65  # rollout.max_response_length
            assert source.flow.reward_fn is not train_flow.reward_fn  # a reward runner of its own
        assert max(s.metadata["length"] for s in ev.sources[1].samples) <= 4  # its own task_args
        # The training datasource is untouched by building the eval sets.
        assert runtime.controller.state.datasource.state_dict()["position"] == 0
        metrics = ev.run(step=1)
        assert metrics["val/repeat_heldout/num_samples"] == 5 and metrics["val/short/num_samples"] == 3
        assert 0.0 <= metrics["val/repeat_heldout/reward_mean"] <= 1.0
    finally:
        runtime.shutdown()


# ---------------------------------------------------------------------------------------- fit


@pytest.mark.slow
def test_fit_logs_val_at_the_configured_steps(tmp_path):
    """`lightning-fasync fit` on configs/tiny_cpu_eval.yaml with the embedded engine, 3 steps, eval
    every 2 steps, at start and at end (a checkpoint after step 1 too): val/* in TensorBoard at
    steps -1, 1 and 2 only; an `eval` event for each, during which nothing was dispatched; each
    prompt trained once, B per step; R + Q <= C in every event."""
    from lightning_fasync.plots import read_scalars

    B, steps = 16, 3
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu_eval.yaml"),
           f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false", "--trainer.save_freq=2",
           f"--trainer.rollout_steps={steps}", "--eval.every_n_steps=2", "--eval.at_start=true", "--eval.at_end=true",
           '--eval.data_source=[{"name": "repeat_heldout", "num_prompts": 16, "seed": 4321}]']
    out, log_dir = run_fit(cmd, str(tmp_path), REPO)

    evaluated = [-1, 1, 2]
    tb = read_scalars(log_dir)
    for name in ("accuracy", "reward_mean", "response_length/mean", "response_length_max", "response_length/clip_ratio",
                 "num_samples"):
        assert [s for s, _ in tb[f"val/repeat_heldout/{name}"]] == evaluated, name
    assert all(0.0 <= v <= 1.0 for _, v in tb["val/repeat_heldout/accuracy"] + tb["val/repeat_heldout/reward_mean"])
    assert [v for _, v in tb["val/repeat_heldout/num_samples"]] == [16.0] * len(evaluated)
    assert [s for s, _ in tb["timing/eval"]] == evaluated
    assert [s for s, _ in tb["rollout/reward_mean"]] == list(range(steps))  # the training metrics as usual

    events = read_jsonl(os.path.join(log_dir, "events.jsonl"))
    evals = [e for e in events if e["event"] == "eval"]
    assert [(e["step"], e["weight_version"]) for e in evals] == [(-1, 0), (1, 2), (2, 3)]
    for e in evals:
        # Eval ran with training dispatch closed (R = 0 after the pause): nothing was dispatched meanwhile.
        assert e["R"] == 0 and e["samples"] == 16
        assert not [d for d in events if d["event"] == "dispatch" and e["t"] - e["dur"] < d["t"] < e["t"]]
    assert all(e["R"] + e["Q"] <= B for e in events)  # C = B at stale_steps 0
    seqs = [e["seq"] for e in events if e["event"] == "dispatch"]
    assert sorted(seqs) == list(range(len(seqs)))

    ledger = read_jsonl(os.path.join(log_dir, "ledger.jsonl"))
    consumed = [r for r in ledger if r["kind"] == "consume"]
    assert len(consumed) == steps * B == len({r["prompt"] for r in consumed})
    assert sorted({r["step"] for r in consumed}) == list(range(steps))
    assert [r["resume_step"] for r in ledger if r["kind"] == "checkpoint"] == [2]
