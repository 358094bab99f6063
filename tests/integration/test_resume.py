"""Nothing lost on resume: SIGKILL the trainer mid-step, resume from the last checkpoint, audit the
ledger; engines of the killed run stop by themselves."""

import os
import subprocess
import sys
import time

import pytest

from lightning_fasync.pipeline.events import read_jsonl
from tests.helpers.ledger_audit import audit_resume, children_of
from tests.helpers.paths import REPO

TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")
B, STEPS = 16, 10
SAVE_FREQ, KILL_IN_STEP = 2, 5  # checkpoints after steps 1, 3, 5, ...; the kill lands in step 5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["abort", "inflight"])
def test_sigkill_mid_step_then_resume_loses_and_duplicates_nothing(tmp_path, mode):
    """The main job aborts and resumes in-flight requests at each boundary (``abort``), or keeps them
    in flight across the boundaries that do not save (``inflight``: its groups then cross
    boundaries in TrajQueue, and the saving ones bring them back into the checkpoint)."""
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
           "--trainer.enable_progress_bar=false", f"--trainer.save_freq={SAVE_FREQ}", f"--trainer.rollout_steps={STEPS}",
           f"--rollout.weight_update_mode={mode}"]
    with open(tmp_path / "run1.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    ledger1 = os.path.join(tmp_path, "lightning_logs", "version_0", "ledger.jsonl")
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"the run never finished step {KILL_IN_STEP - 1}"
            # Wait for a state that stays once reached, not one that lasts only between two ledger
            # flushes: step 4's boundary saves nothing, and its ledger flush makes step 4's
            # consumptions durable after the step-3 checkpoint. From then on the trainer is in
            # step 5, before its checkpoint, unless this loop lags a whole step behind (the audit
            # below holds wherever the kill lands).
            if os.path.exists(ledger1):
                if any(r["kind"] == "consume" and r["step"] >= KILL_IN_STEP - 1 for r in read_jsonl(ledger1)):
                    break
            time.sleep(0.05)
    finally:
        proc.kill()  # SIGKILL; unlike os.kill, no ProcessLookupError hiding the failure if the run already exited
        proc.wait()

    # Orphaned engines (and the router supervisor, if any) notice and stop within seconds.
    t0 = time.monotonic()
    while children_of(proc.pid) and time.monotonic() - t0 < 15:
        time.sleep(0.2)
    assert children_of(proc.pid) == [], "engine processes outlived the killed trainer"

    resumed = subprocess.run(cmd + ["--ckpt_path", "last"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]

    run1 = read_jsonl(ledger1)
    run2 = read_jsonl(os.path.join(tmp_path, "lightning_logs", "version_1", "ledger.jsonl"))
    audit_resume(run1, run2, B, STEPS)
