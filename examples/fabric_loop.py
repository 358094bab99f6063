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

from lightning_fasync.config import load_config
from lightning_fasync.lightning.fabric_loop import FullyAsyncFabricLoop
from lightning_fasync.lightning.module import RLPolicyModule

CONFIG = load_config(
    {
        "colocate": False,
        "fully_async": {"enable": True, "sliding_window": "windowed-fifo", "stale_steps": 1.0},
        "data_source": {"num_prompts_per_step": 8, "num_trajectories_per_prompt": 4, "task": "repeat"},
        "trainer": {"mini_batch_size": 16, "save_freq": 2},
        "rollout": {"partial": True, "max_response_length": 48},
    }
)


def main(rollout_steps: int = 4, root: str = "runs/fabric_loop") -> FullyAsyncFabricLoop:
    # The module implements FullyAsyncHooks (engine model, weights, batch preparation, the
    # old-actor snapshot at each step, the call's metrics); the loop calls nothing else.
    module = RLPolicyModule("tiny", lr=2e-3, **RLPolicyModule.algorithm_args(CONFIG))
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=TensorBoardLogger(root))
    loop = FullyAsyncFabricLoop(fabric, CONFIG, log_dir=root)
    model, optimizer = fabric.setup(module, module.configure_optimizers())
    loop.fit(model, optimizer, rollout_steps)
    return loop


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollout-steps", type=int, default=4)
    parser.add_argument("--root", default="runs/fabric_loop")
    args = parser.parse_args()
    main(args.rollout_steps, args.root)
