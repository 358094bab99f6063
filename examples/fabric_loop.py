"""Fully-async RL with Lightning Fabric: the same step protocol as the Lightning callback.

Run it (about a minute on 2 CPU cores):  python examples/fabric_loop.py

The policy is the embedded default (`tiny`); the rollout engine runs in its own process on its
own core; the loop fetches complete prompt groups, trains, and at every step boundary pauses
rollout, logs the spec's metrics to TensorBoard, saves a checkpoint and syncs the weights.
"""

from __future__ import annotations

import argparse

import lightning as L
from lightning.fabric.loggers import TensorBoardLogger

from lightning_fasync.lightning.batch import RolloutBatch
from lightning_fasync.lightning.fabric_loop import FullyAsyncFabricLoop
from lightning_fasync.lightning.module import RLPolicyModule

CONFIG = {
    "colocate": False,
    "fully_async": {"enable": True, "sliding_window": "windowed-fifo", "stale_steps": 1.0},
    "data_source": {"num_prompts_per_step": 8, "num_trajectories_per_prompt": 4, "task": "repeat"},
    "trainer": {"mini_batch_size": 16, "save_freq": 2},
    "rollout": {"partial": True, "max_response_length": 48},
}


class SnapshotHooks:
    """Fabric callback: a new rollout step makes the old-actor snapshot stale."""

    def __init__(self, module: RLPolicyModule) -> None:
        self.module = module

    def on_rollout_step_start(self, loop, step: int) -> None:
        self.module.begin_rollout_step(step)


def main(rollout_steps: int = 4, root: str = "runs/fabric_loop") -> FullyAsyncFabricLoop:
    module = RLPolicyModule("tiny", lr=2e-3)
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=TensorBoardLogger(root), callbacks=[SnapshotHooks(module)])
    loop = FullyAsyncFabricLoop(fabric, CONFIG, log_dir=root)
    module.fasync_config = loop.cfg
    model, optimizer = fabric.setup(module, module.configure_optimizers())

    def prepare(groups):
        return RolloutBatch(groups=groups, data=module.prepare_rollout_batch(groups))

    def training_step(batch):
        loss = model.training_step(batch, 0)
        return loss, module.last_metrics

    loop.fit(model, optimizer, rollout_steps, training_step, prepare=prepare, engine_model=module.engine_model)
    return loop


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollout-steps", type=int, default=4)
    parser.add_argument("--root", default="runs/fabric_loop")
    args = parser.parse_args()
    main(args.rollout_steps, args.root)
