"""FullyAsyncFabricLoop on two CPU processes (gloo), as a user's Fabric script runs it.

    python tests/helpers/fabric_ranks_driver.py OUT_DIR ddp|fsdp2|tp2

Fabric's launcher re-runs this script for rank 1. Three runs in the same two processes:

1. ``run1``: 3 rollout steps of the embedded ``tiny`` policy, a checkpoint at step 1 (save_freq 2).
2. ``run2``: resumes from run 1's ``last.ckpt`` (every rank: ``fabric.load``; rank 0 passes the
   pipeline state) and trains step 2; rank 1 alone gets SIGTERM at its first training call, so the
   step-2 boundary saves and the run ends with status 143 on both ranks.
3. ``run3``: rank 0 is given a pipeline state it must refuse before its engines start; rank 1 is
   told and raises instead of waiting.

Each rank writes what it saw to ``OUT_DIR/rank{r}.json`` for tests/lightning/test_fabric_ranks.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import lightning as L
import torch

from lightning_fasync.config import load_config, validate
from lightning_fasync.lightning.fabric_loop import FullyAsyncFabricLoop
from lightning_fasync.lightning.module import RLPolicyModule
from lightning_fasync.runtime.ranks import reduce_metrics
from lightning_fasync.weights.tensor_stream import TensorStream

STEPS = 3
CONFIG = {
    "colocate": False,
    "fully_async": {"enable": True, "sliding_window": "windowed-fifo", "stale_steps": 0.0},
    # 2 calls per step of M // N = 2 groups: one group per data-parallel rank and call.
    "data_source": {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 4, "task": "repeat", "num_prompts": 256},
    "trainer": {"mini_batch_size": 8, "save_freq": 2},
    "rollout": {"partial": True, "max_response_length": 12},
}


def varied(sample, trajectory) -> float:
    """A reward that differs between a group's samples (the untrained policy scores 0 on the task),
    so every training call has advantages and gradients."""
    ids = trajectory.response_ids
    return len(set(ids)) / max(1, len(ids))


def checksum(module) -> float:
    """The sum of the policy's full weights (a collective on every rank when it is sharded)."""
    weights = module.engine_state_dict()
    items = weights if isinstance(weights, TensorStream) else weights.items()
    return float(sum(t.double().sum() for _, t in items))


class Probe:
    """A Fabric callback: what this rank trained on and the step metrics it was told; SIGTERM to
    itself at the first training call when ``signal_at_first_call``."""

    def __init__(self) -> None:
        self.shares: list[list[str]] = []
        self.steps: list[dict] = []
        self.calls: list[dict] = []
        self.weights: list[float] = []  # the policy's checksum after each step's boundary
        self.module = None
        self.signal_at_first_call = False

    def on_rollout_batch_start(self, loop, groups):
        self.shares.append([str(g.prompt_id) for g in groups])
        if self.signal_at_first_call:
            self.signal_at_first_call = False
            os.kill(os.getpid(), signal.SIGTERM)

    def on_rollout_batch_end(self, loop, metrics):
        self.calls.append({k: float(v) for k, v in metrics.items()})

    def on_rollout_step_end(self, loop, step, metrics):
        self.steps.append({"step": step, **{k: float(v) for k, v in metrics.items()}})
        self.weights.append(checksum(self.module))


def strategy(name: str):
    if name == "ddp":
        return "ddp"
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_fasync.trainers.fsdp.sharding import shard_policy

    def parallelize(module, device_mesh):
        shard_policy(module.policy, device_mesh)
        return module

    dp, tp = {"fsdp2": (2, 1), "tp2": (1, 2)}[name]
    return ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=dp, tensor_parallel_size=tp)


def setup(fabric: L.Fabric, cfg):
    module = RLPolicyModule("tiny", lr=2e-3, **RLPolicyModule.algorithm_args(cfg))
    model = fabric.setup_module(module)  # sharded first: the optimizer takes the sharded parameters
    optimizer = fabric.setup_optimizers(module.configure_optimizers())
    return model, optimizer


def main() -> None:
    out, name = sys.argv[1], sys.argv[2]
    probe = Probe()
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy(name), callbacks=[probe])
    fabric.launch()
    torch.manual_seed(0)
    cfg = validate(load_config(CONFIG))
    rank = fabric.global_rank
    report: dict = {"rank": rank}
    # The metric reduction by itself, over both ranks.
    report["reduced"] = reduce_metrics(
        {"train/loss": 1.0 + rank, "timing/train": 2.0, "train/is_max": 3.0 * rank, "train/lag_min": -rank}, 2)

    loop = FullyAsyncFabricLoop(fabric, cfg, log_dir=os.path.join(out, "run1"), reward=varied)
    model, optimizer = setup(fabric, cfg)
    probe.module = model.module
    report["initial"] = checksum(model.module)
    loop.fit(model, optimizer, STEPS)
    report["run1"] = {"shares": probe.shares, "steps": probe.steps, "weights": probe.weights, "calls": probe.calls}
    report["run1_versions"] = loop.controller.weight_version if loop.controller is not None else None

    probe.shares, probe.steps, probe.weights, probe.calls = [], [], [], []
    probe.signal_at_first_call = fabric.global_rank == 1
    loop = FullyAsyncFabricLoop(fabric, cfg, log_dir=os.path.join(out, "run2"), reward=varied)
    model, optimizer = setup(fabric, cfg)
    probe.module = model.module
    rest = fabric.load(os.path.join(out, "run1", "checkpoints", "last.ckpt"), {"model": model, "optimizer": optimizer})
    report["restored"] = checksum(model.module)
    try:
        loop.fit(model, optimizer, STEPS, state=rest["fasync"])
        report["run2_exit"] = None
    except SystemExit as exc:
        report["run2_exit"] = exc.code
    report["run2"] = {"shares": probe.shares, "steps": probe.steps, "weights": probe.weights}

    loop = FullyAsyncFabricLoop(fabric, cfg, log_dir=os.path.join(out, "run3"))
    wrong = {**rest["fasync"], "identity": {"config": {"trainer.mini_batch_size": 4}, "model_shape": None}}
    try:
        loop.fit(model, optimizer, 1, state=wrong)
        report["run3_error"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["run3_error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(out, f"rank{fabric.global_rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
