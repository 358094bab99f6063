"""The one driver of the step: StepSchedule decides boundaries and saves, FullyAsyncController.pause
is the one pause-and-cleanup, run_step reads top to bottom, and the simulator drives the same
controller (so the filter and the capacity rules it checks are the live ones)."""

import pytest

from lightning_fasync.components import ComponentError, instantiate, load_object
from lightning_fasync.config import load_config, validate
from lightning_fasync.pipeline.controller import FullyAsyncController, StepSchedule, build_state
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.pipeline.engine_client import SamplingParams
from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.pipeline.flow import SingleTurnFlow
from lightning_fasync.testing.instant_engine import InstantEngine
from lightning_fasync.simulate import SimConfig, Simulation
from tests.helpers.pipeline import Hooks, make_cfg


def drop_odd_prompts(group):
    """A `rollout.filter` for the tests: keep groups of even dataset index."""
    return group.sample.metadata["dataset_index"] % 2 == 0


def build(cfg, tmp_path, engine=None):
    engine = engine or InstantEngine()
    ds = ListDataSource([([1, 2, i % 7], {}) for i in range(400)], seed=1)
    flow = SingleTurnFlow(engine, SamplingParams(), cfg.rollout.max_response_length, reward_fn=lambda s, t: 1.0)
    return FullyAsyncController(cfg, ds, flow, engine, log_dir=str(tmp_path))


def test_step_schedule_is_the_one_place_that_decides_boundaries_and_saves():
    cfg = make_cfg(**{"trainer.save_freq": 3})
    schedule = StepSchedule.from_config(cfg)
    assert schedule.calls_per_step == cfg.minibatches_per_step == 4
    boundaries = [schedule.call_done() for _ in range(12)]
    assert boundaries == [False, False, False, True] * 3
    assert [s for s in range(9) if schedule.save_due(s)] == [2, 5, 8]
    assert not any(StepSchedule(4, 0).save_due(s) for s in range(10))


def test_run_step_reads_top_to_bottom_and_reports_the_step(tmp_path):
    cfg = make_cfg(**{"trainer.save_freq": 2})
    ctl, hooks = build(cfg, tmp_path), Hooks()
    prepared, trained = [], []
    ctl.start()
    try:
        for expected_step in range(2):
            step, metrics = ctl.run_step(
                lambda batch: trained.append(batch) or {"train/loss": float(batch)},
                hooks,
                prepare=lambda groups: prepared.append(groups) or len(groups),
            )
            assert step == expected_step
            assert metrics["rollout/consumed_groups"] == cfg.B
            assert metrics["train/loss"] == cfg.groups_per_minibatch
            assert metrics["timing/train"] > 0 and "timing/process_traj" in metrics
    finally:
        ctl.shutdown()
    assert len(prepared) == len(trained) == 2 * cfg.minibatches_per_step
    assert hooks.saved == [1] and hooks.synced == [1, 2]
    events = read_jsonl(str(tmp_path / "events.jsonl"))
    assert sum(e["event"] == "train" for e in events) == 2 * cfg.minibatches_per_step


def test_a_training_call_that_raises_closes_its_timing_block(tmp_path):
    cfg = make_cfg()
    ctl = build(cfg, tmp_path)
    ctl.start()
    try:
        ctl.fetch()
        with pytest.raises(RuntimeError, match="boom"):
            with ctl.train_block():
                raise RuntimeError("boom")
        assert ctl._train_t0 is None
        ctl.end_train()  # idempotent: on_exception may close it again
        assert ctl.timer._totals["train"] > 0
    finally:
        ctl.shutdown()
    trains = [e for e in read_jsonl(str(tmp_path / "events.jsonl")) if e["event"] == "train"]
    assert len(trains) == 1


def test_colocate_capacity_is_b_plus_the_oversample():
    cfg = validate(load_config({"colocate": True, "data_source": {"num_prompts_per_step": 8, "num_trajectories_per_prompt": 2},
                                "trainer": {"mini_batch_size": 4}, "rollout": {"sampler": {"num_oversample": 3}}}))
    state = build_state(cfg, ListDataSource([([1], {})], seed=0))
    assert state.C == 8 + 3
    # B + oversample exactly, not int(B * (1 + oversample / B)), which rounds 3 + 4 down to 6.
    odd = validate(load_config({"colocate": True, "data_source": {"num_prompts_per_step": 3, "num_trajectories_per_prompt": 2},
                                "trainer": {"mini_batch_size": 2}, "rollout": {"sampler": {"num_oversample": 4}}}))
    assert build_state(odd, ListDataSource([([1], {})], seed=0)).C == 7
    fa = make_cfg(**{"fully_async.stale_steps": 0.5})
    assert build_state(fa, ListDataSource([([1], {})], seed=0)).C == int(fa.B * 1.5)


@pytest.mark.parametrize("colocate", [False, True])
def test_the_simulator_applies_the_live_filter(colocate):
    over = {"rollout.filter": f"{__name__}:drop_odd_prompts"}
    if colocate:
        over.update({"colocate": True, "fully_async.enable": False})
    cfg = make_cfg(**over)
    sim = SimConfig(steps=3, num_prompts=256, total_gpus=2, train_reference_gpus=1)
    sim.lengths.median = 8.0
    run = Simulation(cfg, sim).run()
    dropped = sum(m["rollout/filter_drop"] for m in run.step_metrics)
    assert dropped > 0, "rollout.filter never ran in the simulator"
    assert all(m["rollout/consumed_groups"] == cfg.B for m in run.step_metrics)
    # The controller's timers run on the virtual clock.
    assert all(m["timing/step"] == pytest.approx(t) for m, t in zip(run.step_metrics, run.step_times))


def test_components_load_by_module_and_name_and_name_the_key_when_wrong():
    assert load_object(f"{__name__}:drop_odd_prompts", "rollout.filter") is drop_odd_prompts
    with pytest.raises(ComponentError, match="`rollout.filter` is 'nocolon'"):
        load_object("nocolon", "rollout.filter")
    with pytest.raises(ComponentError, match="`agentflow.flow` is 'no_such_mod:X', which cannot be imported"):
        load_object("no_such_mod:X", "agentflow.flow")
    ds = instantiate("lightning_fasync.pipeline.datasource:ListDataSource", "data_source.datasource", {"seed": 3},
                     prompts=[([1], {})])
    assert ds.seed == 3
    with pytest.raises(ComponentError, match="`data_source.datasource` arguments set prompts"):
        instantiate("lightning_fasync.pipeline.datasource:ListDataSource", "data_source.datasource", {"prompts": []}, prompts=[])
    with pytest.raises(ComponentError, match="`data_source.datasource` .* could not be built"):
        instantiate("lightning_fasync.pipeline.datasource:ListDataSource", "data_source.datasource", {"nope": 1})


def test_shutdown_raises_a_background_error_only_if_the_main_thread_has_not_seen_it(tmp_path):
    from lightning_fasync.pipeline.state import PipelineError

    failing = lambda rid: True  # noqa: E731 - every request fails: the group policy gives up
    seen = build(make_cfg(), tmp_path / "seen", engine=InstantEngine(fail_fn=failing))
    seen.start()
    with pytest.raises(PipelineError, match="max_consecutive_failed_groups"):
        seen.fetch()
    seen.shutdown()  # raised once on the main thread already: teardown does not raise it again

    unseen = build(make_cfg(), tmp_path / "unseen", engine=InstantEngine(fail_fn=failing))
    unseen.start()
    import time

    deadline = time.monotonic() + 10
    while unseen.state._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(PipelineError, match="max_consecutive_failed_groups"):
        unseen.shutdown()


def test_engines_lost_for_good_save_at_the_boundary_or_before_the_step_trains(tmp_path):
    from lightning_fasync.fleet.workers import EngineLostError

    cfg = make_cfg(**{"trainer.save_freq": 0})
    ctl, hooks = build(cfg, tmp_path), Hooks()
    train = lambda batch: {"train/loss": 1.0}  # noqa: E731
    ctl.start()
    try:
        ctl.run_step(train, hooks)
        # Lost mid-step: dispatch stops, the step finishes from the buffer, its boundary saves
        # (save_freq is 0), and a save afterwards does not save again.
        ctl.fetch()
        ctl.state.set_fault(EngineLostError("lost (`rollout.engine_restart.timeout_s`)"))
        assert ctl.state.plan_dispatch() == []
        with ctl.train_block():
            pass
        while not ctl.minibatch_done():
            ctl.fetch()
        step, _ = ctl.step_boundary(hooks)
        assert step == 1 and hooks.saved == [1]
        assert ctl.save_after_fault(hooks) == 1 and hooks.saved == [1]
        ledger = read_jsonl(str(tmp_path / "ledger.jsonl"))
        assert ledger[-1]["kind"] != "consume"
        assert [r["resume_step"] for r in ledger if r["kind"] == "checkpoint"] == [2]
    finally:
        ctl.shutdown()

    # Lost while the trainer waits at the start of a step, with too little in the buffer: the fetch
    # raises the fault itself, and the run is saved as the last boundary left it.
    ctl, hooks = build(cfg, tmp_path / "b"), Hooks()
    ctl.start()
    try:
        ctl.run_step(train, hooks)
        ctl.state.set_fault(EngineLostError("lost"))
        while True:
            try:
                ctl.state.try_fetch(1) or ctl.fetch()
            except EngineLostError:
                break
        assert ctl.save_after_fault(hooks) == 0 and hooks.saved == [0]
        sd = ctl.state_dict()["pipeline"]
        assert sd["rollout_step"] == 1 and sd["weight_version"] == 1
    finally:
        ctl.shutdown()
