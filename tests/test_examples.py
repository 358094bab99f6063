"""The drop-in callback and Fabric loop examples run for real (engines in their own processes)."""

import glob
import math
import os
import sys

import pytest

from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.plots import read_scalars

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example(name):
    sys.path.insert(0, os.path.join(REPO, "examples"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def test_custom_window_example_runs():
    custom_window = load_example("custom_window")
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        table = custom_window.main(steps=3)
    finally:
        os.chdir(cwd)
    assert "capped-fifo" in table


@pytest.mark.slow
def test_drop_in_callback_example(tmp_path):
    drop_in = load_example("drop_in_callback")
    trainer = drop_in.main(rollout_steps=3, root=str(tmp_path))
    assert trainer.global_step == 3 * 4
    (log_dir,) = glob.glob(os.path.join(tmp_path, "lightning_logs", "version_*"))
    tb = read_scalars(log_dir)
    assert [s for s, _ in tb["rollout/reward_mean"]] == [0, 1, 2]
    assert all(math.isfinite(v) for _, v in tb["perf/wait_ratio"])
    consumed = [r for r in read_jsonl(os.path.join(log_dir, "ledger.jsonl")) if r["kind"] == "consume"]
    assert len(consumed) == 3 * 16 and len({r["prompt"] for r in consumed}) == 3 * 16


@pytest.mark.slow
def test_fabric_loop_example(tmp_path):
    fabric_loop = load_example("fabric_loop")
    loop = fabric_loop.main(rollout_steps=4, root=str(tmp_path))
    assert loop.controller.rollout_step == 4
    ckpts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(tmp_path, "checkpoints", "*.ckpt")))
    assert ckpts == ["last.ckpt", "step-000001.ckpt", "step-000003.ckpt"]
    (log_dir,) = glob.glob(os.path.join(tmp_path, "lightning_logs", "version_*"))
    tb = read_scalars(log_dir)
    for name in ("train/loss", "rollout/pipeline_buf_size", "perf/wait_ratio", "timing/process_traj", "timing/pause_delay"):
        assert [s for s, _ in tb[name]] == [0, 1, 2, 3], name
    # The same step protocol as the callback: the ledger shows B groups per step, each once.
    consumed = [r for r in read_jsonl(os.path.join(tmp_path, "ledger.jsonl")) if r["kind"] == "consume"]
    assert len(consumed) == 4 * 8 and len({r["prompt"] for r in consumed}) == 4 * 8
    assert [r["step"] for r in read_jsonl(os.path.join(tmp_path, "ledger.jsonl")) if r["kind"] == "checkpoint"] == [1, 3]
