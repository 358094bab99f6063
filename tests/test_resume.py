"""Nothing lost on resume: SIGKILL the trainer mid-step, resume from the last checkpoint, audit the
ledger; engines of the killed run stop by themselves."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_fasync.pipeline.events import read_jsonl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")
B, CALLS_PER_STEP, STEPS = 16, 4, 10


def children_of(pid):
    """Processes started with --parent-pid PID (engines, router supervisors), read from /proc."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = open(f"/proc/{d}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"--parent-pid" in argv and argv[argv.index(b"--parent-pid") + 1] == str(pid).encode():
            out.append(int(d))
    return out


def ledger_kinds(path):
    kinds = []
    with open(path) as fh:
        for line in fh:
            if line.strip().endswith("}"):
                kinds.append(json.loads(line)["kind"])
    return kinds


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_loses_and_duplicates_nothing(tmp_path):
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", TINY, f"--trainer.default_root_dir={tmp_path}",
           "--trainer.enable_progress_bar=false", "--trainer.save_freq=1", f"--trainer.max_steps={STEPS * CALLS_PER_STEP}"]
    with open(tmp_path / "run1.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    ledger1 = os.path.join(tmp_path, "lightning_logs", "version_0", "ledger.jsonl")
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached its third checkpoint"
            if os.path.exists(ledger1):
                kinds = ledger_kinds(ledger1)
                # Mid-step: three checkpoints written and the next step already consuming.
                if kinds.count("checkpoint") >= 3 and kinds[-1] == "consume":
                    break
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
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
    # The resumed run says which checkpoint it restored: everything run 1 consumed before that
    # step is in the checkpoint, everything from that step on was rolled back. (The kill may land
    # between writing last.ckpt and the ledger's "checkpoint" line, so the resume line decides.)
    assert run2[0]["kind"] == "resume"
    resume_step = run2[0]["step"]
    assert run2[0]["weight_version"] == resume_step
    saved = {r["resume_step"] for r in run1 if r["kind"] == "checkpoint"}
    assert resume_step in saved or resume_step == max(saved) + 1, (resume_step, saved)
    committed = [r["prompt"] for r in run1 if r["kind"] == "consume" and r["step"] < resume_step]
    rolled_back = [r["prompt"] for r in run1 if r["kind"] == "consume" and r["step"] >= resume_step]
    replayed = [r["prompt"] for r in run2 if r["kind"] == "consume"]

    # Up to the checkpoint: every step's B prompts, each once.
    assert len(committed) == resume_step * B == len(set(committed))
    # After it: the resumed run trains the remaining steps; nothing twice, nothing lost.
    everything = committed + replayed
    assert len(everything) == STEPS * B
    assert len(set(everything)) == len(everything), "a prompt was trained twice"
    assert set(rolled_back) <= set(replayed), "prompts consumed after the checkpoint were lost"
    assert sorted({r["step"] for r in run2 if r["kind"] == "consume"}) == list(range(resume_step, STEPS))
