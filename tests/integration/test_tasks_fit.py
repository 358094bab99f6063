"""A real task end to end through `lightning-fasync fit`: prompts from the dapo-math fixture file,
a reward that hangs on one prompt and raises on another (timed out and counted, neither blocking
the pipeline), math-verify on the rest, and a KL penalty to a frozen
reference whose time is `timing/teacher` in TensorBoard."""

from __future__ import annotations

import os
import sys

import pytest

from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.plots import read_scalars
from tests.helpers.ledger_audit import run_fit
from tests.helpers.paths import HELPERS, REPO

STEPS = 4


@pytest.mark.slow
def test_file_prompts_a_hanging_and_a_raising_reward_and_a_reference_model(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HELPERS, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu_math.yaml"),
           f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false", f"--trainer.rollout_steps={STEPS}",
           "--data_source.reward=flaky_rewards:hang_or_raise", "--data_source.reward_timeout=1",
           # threads here; tests/pipeline/test_reward_runner.py kills stuck worker processes
           "--data_source.reward_processes=0",
           "--algorithm.kl_coef=0.05", "--algorithm.reference.model=policy",
           # The tiny policy earns math rewards of 0 (no advantage, no update): an entropy bonus moves
           # it off the reference so train/ref_kl has something to measure.
           "--algorithm.entropy_coef=0.01"]
    out, log_dir = run_fit(cmd, str(tmp_path), REPO, env=env)
    tb = read_scalars(log_dir)
    # The reference model's time, once per step, summed over the step's training calls.
    assert [s for s, _ in tb["timing/teacher"]] == list(range(STEPS))
    assert all(v > 0 for _, v in tb["timing/teacher"])
    # k3 is never negative; the policy drifts from the frozen reference once it trains.
    assert [s for s, _ in tb["train/ref_kl"]] == list(range(STEPS))
    assert all(v >= 0 for _, v in tb["train/ref_kl"])
    assert any(v > 0 for _, v in tb["train/ref_kl"])
    # The hanging reward timed out and the raising one failed: counted, and the run went on.
    assert sum(v for _, v in tb["rollout/reward_timeout"]) >= 1
    assert sum(v for _, v in tb["rollout/reward_failed"]) > sum(v for _, v in tb["rollout/reward_timeout"])
    ledger = read_jsonl(os.path.join(log_dir, "ledger.jsonl"))
    failed = [r for r in ledger if r["kind"] in ("recycle", "drop") and r.get("reason") == "failed"]
    assert any("data_source.reward_timeout" in (r.get("error") or [""])[0] for r in failed)
    assert any("the verifier crashed" in (r.get("error") or [""])[0] for r in failed)
    consumed = [r["prompt"] for r in ledger if r["kind"] == "consume"]
    assert len(consumed) == STEPS * 4 == len(set(consumed))
