"""The pipeline tests' config and step drivers, shared by tests/pipeline/ (the live pipeline, the
controller, the evaluator)."""

from __future__ import annotations

import time

from lightning_fasync.config import load_config, validate


def make_cfg(**over):
    data = {
        "colocate": False,
        "fully_async": {"enable": True, "sliding_window": "windowed-fifo", "stale_steps": 1.0, "fetch_timeout": 10, "pause_timeout": 10},
        "data_source": {"num_prompts_per_step": 8, "num_trajectories_per_prompt": 4},
        "trainer": {"mini_batch_size": 8},
        "rollout": {"partial": True, "max_response_length": 16, "max_consecutive_failed_groups": 4},
    }
    for key, value in over.items():
        d = data
        parts = key.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    return validate(load_config(data))


class Hooks:
    def __init__(self, engine=None):
        self.saved, self.synced = [], []
        self.engine = engine

    def save_checkpoint(self, step):
        self.saved.append(step)

    def sync_weights(self, version):
        self.synced.append(version)
        if self.engine is not None:
            self.engine.version = version


def run_steps(ctl, hooks, steps):
    out = []
    for _ in range(steps):
        while True:
            groups = ctl.fetch()
            assert len(groups) == ctl.cfg.groups_per_minibatch
            assert all(len(g.trajectories) == ctl.cfg.N for g in groups)
            with ctl.train_block():
                time.sleep(0.001)
            ctl.record({"train/loss": 1.0, "train/is_max": 2.0, "timing/old_log_prob": 0.01})
            if ctl.minibatch_done():
                break
        out.append(ctl.step_boundary(hooks))
    return out
