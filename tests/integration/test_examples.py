"""The drop-in callback and Fabric loop examples run for real (engines in their own processes)."""

import glob
import math
import os
import sys

import pytest
import torch

from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.plots import read_scalars
from tests.helpers.paths import REPO


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


def _csv_rows(path):
    import csv

    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_own_policy_example_under_a_plain_trainer_and_its_resume_with_ckpt_path_last(tmp_path, capfd):
    """examples/own_policy.py: one's own tokenizer (id 2 is the letter 'c'), model directory,
    datasource, reward and loss under a plain Trainer; self.log lands at the rollout step; a new
    Trainer resumes the run with fit(ckpt_path="last") and trains every prompt exactly once."""
    from tests.helpers.ledger_audit import audit_resume

    own = load_example("own_policy")
    eos = own.build_tokenizer().eos_token_id

    class LoggingPolicy(own.OwnPolicy):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("call/loss", loss)  # on Lightning's logger, as a user's module would
            return loss

    model_dir = own.save_own_model(str(tmp_path / "model"))
    root = str(tmp_path / "run")
    module = LoggingPolicy(model_dir)
    trainer = own.train_with_trainer(model_dir, 3, root, module=module)
    assert trainer.global_step == 3 * own.CALLS_PER_STEP
    err = capfd.readouterr().err
    # The mode and the policy's own EOS are said at start; responses end there, not at id 2.
    assert "lightning-fasync: fully-async (windowed-fifo, fully_async.stale_steps 1), partial rollout; trainer on" in err
    assert f"responses end at token ids [{eos}] (the policy's EOS ('<eos>'))" in err
    completed = [ids for status, ids in module.trained_on if status == "completed"]
    assert completed and all(ids[-1] == eos for ids in completed)
    assert any(2 in ids for _, ids in module.trained_on), "no 'c' was generated: the check above proves nothing"
    # One logger, one step axis: the module's self.log rows and the plugin's rows at rollout steps.
    run1 = os.path.join(root, "lightning_logs", "version_0")
    rows = _csv_rows(os.path.join(run1, "metrics.csv"))
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps) and set(steps) == {0, 1, 2}
    assert {int(r["step"]) for r in rows if r.get("call/loss")} == {0, 1, 2}
    assert [int(r["step"]) for r in rows if r.get("rollout/reward_mean")] == [0, 1, 2]
    assert [int(r["step"]) for r in rows if r.get("train/reward")] == [0, 1, 2]  # rollout_metrics(), once a step

    resumed = own.train_with_trainer(model_dir, 5, root, resume=True)  # a new Trainer, a new logger version
    assert resumed.global_step == 5 * own.CALLS_PER_STEP
    assert os.path.basename(resumed.ckpt_path) == "step-000002.ckpt"
    run2 = os.path.join(root, "lightning_logs", "version_1")
    assert audit_resume(read_jsonl(os.path.join(run1, "ledger.jsonl")), read_jsonl(os.path.join(run2, "ledger.jsonl")),
                        prompts_per_step=8, steps=5) == 3
    assert [int(r["step"]) for r in _csv_rows(os.path.join(run2, "metrics.csv")) if r.get("rollout/reward_mean")] == [3, 4]


@pytest.mark.slow
def test_own_policy_example_under_fabric(tmp_path, capfd):
    """The same module and rollout side under FullyAsyncFabricLoop: a CSVLogger's metrics.csv is
    written on a short run, the loop clips and steps the scheduler once per call, and the
    checkpoints hold the scheduler."""
    own = load_example("own_policy")
    eos = own.build_tokenizer().eos_token_id
    root = str(tmp_path / "run")
    loop = own.train_with_fabric(own.save_own_model(str(tmp_path / "model")), 3, root)
    assert loop.controller.rollout_step == 3
    assert f"responses end at token ids [{eos}] (the policy's EOS ('<eos>'))" in capfd.readouterr().err
    rows = _csv_rows(os.path.join(root, "lightning_logs", "version_0", "metrics.csv"))
    assert [int(r["step"]) for r in rows if r.get("rollout/reward_mean")] == [0, 1, 2]
    assert loop._scheduler.last_epoch == 3 * own.CALLS_PER_STEP
    saved = torch.load(loop.files.last(), weights_only=True)
    assert saved["lr_scheduler"]["last_epoch"] == 3 * own.CALLS_PER_STEP
