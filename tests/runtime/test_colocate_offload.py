"""Colocate with ``colocate_offload``: the spec's five hand-over stages, written once in the controller.

Around each training phase the engines release their weights and KV cache and the trainer moves its
state onto its device and back, in slime's order, each stage timed under the spec's name
(``timing/offload_rollout``, ``timing/onload_train``, ``timing/offload_train``,
``timing/onload_rollout_weights``, ``timing/onload_rollout_kv``); fully-async mode runs none of
them. Checked on the simulator (virtual clock), the Fabric loop (a recording engine client, no
engine process) and, end to end, ``lightning-fasync fit`` with a real engine process on CPU.
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import subprocess
import sys
import tempfile

import lightning as L
import pytest
import torch

from lightning_fasync.config import ConfigError, colocate_offload_enabled, load_config, validate
from lightning_fasync.lightning.fabric_loop import FullyAsyncFabricLoop
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.runtime.offload import offload_training_state, onload_training_state
from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.testing.instant_engine import InstantEngine
from tests.helpers.paths import REPO

STAGES = ("timing/offload_rollout", "timing/onload_train", "timing/offload_train", "timing/onload_rollout_weights",
          "timing/onload_rollout_kv")
COLOCATE = {"colocate": True, "fully_async": {"enable": False}}
FULLY_ASYNC = {"colocate": False, "fully_async": {"enable": True}}


def test_config_key_rules_and_resolution():
    assert load_config({}).colocate_offload == "auto"
    for value in (True, False, "auto"):
        assert load_config({**COLOCATE, "colocate_offload": value}).colocate_offload == value
    # auto: on exactly when the trainer is on CUDA; never outside colocate mode.
    on = {(v, dev): colocate_offload_enabled(validate(load_config({**COLOCATE, "colocate_offload": v})), dev)
          for v in (True, False, "auto") for dev in ("cpu", "cuda")}
    assert on == {(True, "cpu"): True, (True, "cuda"): True, (False, "cpu"): False, (False, "cuda"): False,
                  ("auto", "cpu"): False, ("auto", "cuda"): True}
    assert not colocate_offload_enabled(validate(load_config(FULLY_ASYNC)), "cuda")
    with pytest.raises(ConfigError, match=r"`colocate_offload` is true while `fully_async.enable` is true"):
        validate(load_config({**FULLY_ASYNC, "colocate_offload": True}))
    with pytest.raises(ConfigError, match=r"`colocate_offload` is true while `colocate` is false"):
        validate(load_config({"colocate": False, "colocate_offload": True}))
    with pytest.raises(ConfigError, match=r"`colocate_offload` is 'sometimes'; it must be one of"):
        load_config({"colocate_offload": "sometimes"})


def test_trainer_state_stays_put_on_cpu():
    """A CPU trainer's device is the memory the engines share: the hooks move nothing."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    ptrs = [p.data_ptr() for p in model.parameters()] + [v.data_ptr() for s in opt.state.values() for v in s.values()]
    offload_training_state(model, [opt])
    onload_training_state(model, [opt])
    assert [p.data_ptr() for p in model.parameters()] + [v.data_ptr() for s in opt.state.values() for v in s.values()] == ptrs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trainer_state_leaves_the_gpu_and_comes_back():
    model = torch.nn.Linear(1024, 1024).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 1024, device="cuda")).sum().backward()
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    held = torch.cuda.memory_allocated()
    offload_training_state(model, [opt])
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())
    assert torch.cuda.memory_allocated() < held - 3 * 1024 * 1024 * 4  # weights and both Adam moments
    onload_training_state(model, [opt])
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert {s["exp_avg"].device.type for s in opt.state.values()} == {"cuda"}
    opt.step()  # the optimizer still steps the same parameters


def test_simulator_times_the_five_stages_in_colocate_only():
    from lightning_fasync.config import load_config_file, with_overrides
    from lightning_fasync.simulate import SimConfig, Simulation

    cfg, sections = load_config_file(os.path.join(REPO, "configs", "sim", "dapo_h20.yaml"), simulate=SimConfig)
    sim = sections["simulate"]
    sim.steps = 3
    colocate = {"colocate": True, "fully_async.enable": False, "rollout.partial": False,
                "rollout.mask_offpolicy_in_partial_rollout": False}
    run = Simulation(validate(with_overrides(cfg, colocate)), sim).run()  # auto: the simulated cluster is GPUs
    for m in run.step_metrics:
        assert [m[k] for k in STAGES] == pytest.approx([sim.colocate_switch_s / 5] * 5)
    off = Simulation(validate(with_overrides(cfg, {**colocate, "colocate_offload": False})), sim).run()
    fully_async = Simulation(validate(cfg), sim).run()
    for m in off.step_metrics + fully_async.step_metrics:
        assert not set(STAGES) & set(m)
    # The switches are time each colocate step spends; nothing else moves.
    assert sum(run.step_times) == pytest.approx(sum(off.step_times) + sim.steps * sim.colocate_switch_s)


# ------------------------------------------------------------------------------ the Fabric loop


class RecordingEngine(InstantEngine):
    """An engine client with no model that records the admin calls it gets."""

    def __init__(self, log: list) -> None:
        super().__init__(length_fn=lambda rid: 4)
        self.log = log

    async def update_weights_from_tensor(self, named_tensors, weight_version=None):
        self.log.append(("sync", weight_version))

    async def release_memory_occupation(self, tags=None):
        self.log.append(("release", tuple(tags)))

    async def resume_memory_occupation(self, tags=None):
        self.log.append(("resume", tuple(tags)))


class RecordingPolicy(RLPolicyModule):
    def offload_train(self, optimizers):
        self.calls.append(("offload_train", len(optimizers)))
        super().offload_train(optimizers)

    def onload_train(self, optimizers):
        self.calls.append(("onload_train", len(optimizers)))
        super().onload_train(optimizers)


class StepMetrics:
    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_rollout_step_end(self, loop, step, metrics):
        self.steps.append(dict(metrics))


@pytest.fixture
def keep_affinity():
    """The loop pins its process's cores and torch threads (the trainer's share); give them back."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    threads = torch.get_num_threads()
    yield
    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def _fabric_fit(tmp_path, mode: dict, steps: int = 2) -> tuple[list, list[dict]]:
    cfg = validate(load_config({
        **mode,
        "data_source": {"num_prompts_per_step": 2, "num_trajectories_per_prompt": 2, "task": "repeat", "num_prompts": 64},
        "trainer": {"mini_batch_size": 2},
        "rollout": {"max_response_length": 8},
    }))
    log: list = []
    module = RecordingPolicy("tiny", **RLPolicyModule.algorithm_args(cfg))
    module.calls = log
    probe = StepMetrics()
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[probe])
    loop = FullyAsyncFabricLoop(fabric, cfg, log_dir=str(tmp_path), client=RecordingEngine(log))
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    loop.fit(model, optimizer, steps)
    return log, probe.steps


def test_fabric_loop_hands_the_devices_over_in_slimes_order(tmp_path, keep_affinity):
    log, metrics = _fabric_fit(tmp_path, {**COLOCATE, "colocate_offload": True})
    per_step = [("release", ("weights", "kv_cache", "cuda_graph")), ("onload_train", 1), ("offload_train", 1),
                ("resume", ("weights",)), "sync", ("resume", ("kv_cache", "cuda_graph"))]
    expected = [("sync", 0), ("offload_train", 1)]  # the first sync, then the trainer leaves for step 0's rollout
    for step in range(2):
        expected += [("sync", step + 1) if e == "sync" else e for e in per_step]
    assert log == expected
    assert len(metrics) == 2
    for m in metrics:
        assert all(math.isfinite(m[k]) and m[k] >= 0 for k in STAGES), m


@pytest.mark.parametrize("mode", [COLOCATE, FULLY_ASYNC], ids=["colocate-auto-on-cpu", "fully-async"])
def test_no_stage_runs_without_colocate_offload(tmp_path, keep_affinity, mode):
    log, metrics = _fabric_fit(tmp_path, mode)
    assert log == [("sync", 0), ("sync", 1), ("sync", 2)]
    assert len(metrics) == 2 and not any(set(STAGES) & set(m) for m in metrics)


# ------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_colocate_fit_with_offload_on_cpu(tmp_path):
    """``lightning-fasync fit`` in colocate mode with ``--colocate_offload=true``: a real engine
    process (started with --enable-memory-saver) releases and resumes its memory at every step,
    the five stages are in TensorBoard at every step, and the synced weights are what generates."""
    from lightning_fasync.plots import read_scalars

    steps = 2
    # The engine's log is a temporary file: kept, in a directory of the test's own (a short path:
    # torch's shared-memory manager puts its socket in TMPDIR too, and socket paths are short).
    engine_tmp = tempfile.mkdtemp(prefix="fasync-t-")
    env = {**os.environ, "FASYNC_KEEP_ENGINE_LOGS": "1", "TMPDIR": engine_tmp}
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"),
           f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
           "--colocate=true", "--fully_async.enable=false", "--colocate_offload=true", f"--trainer.rollout_steps={steps}",
           "--data_source.num_prompts_per_step=4", "--data_source.num_trajectories_per_prompt=4",
           "--trainer.mini_batch_size=8", "--trainer.save_freq=0"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        (engine_log,) = glob.glob(os.path.join(engine_tmp, "fasync-engine-*.log"))
        with open(engine_log) as f:
            lines = f.read().splitlines()
    finally:
        shutil.rmtree(engine_tmp, ignore_errors=True)
    (log_dir,) = glob.glob(os.path.join(tmp_path, "lightning_logs", "version_*"))

    tb = read_scalars(log_dir)
    for name in (*STAGES, "timing/update_weights", "rollout/reward_mean"):
        assert [s for s, _ in tb[name]] == list(range(steps)), name
        assert all(math.isfinite(v) and v >= 0 for _, v in tb[name]), name

    released = [line for line in lines if "Released memory weights,kv_cache,cuda_graph:" in line]
    assert len(released) == steps and all(" 0.0 MiB" not in line for line in released)  # freed for real
    assert sum("Resumed memory weights." in line for line in lines) == steps
    assert sum("Resumed memory kv_cache,cuda_graph." in line for line in lines) == steps

    # Weights flow: version s + 1 is synced after step s, and every group of step s was generated by
    # version s, i.e. by the weights loaded into the resumed memory (step 0: the first sync's).
    events = read_jsonl(os.path.join(log_dir, "events.jsonl"))
    assert [e["weight_version"] for e in events if e["event"] == "sync"] == list(range(1, steps + 1))
    consumed = [r for r in read_jsonl(os.path.join(log_dir, "ledger.jsonl")) if r["kind"] == "consume"]
    assert sorted({r["step"] for r in consumed}) == list(range(steps))
    assert all(r["start_version"] == r["end_version"] == r["step"] for r in consumed)
