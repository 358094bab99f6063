"""Preemption: SIGTERM finishes the step, saves a checkpoint and exits 143; the resume loses and
duplicates nothing; a resume that would break accounting is refused, one with a new learning rate
warned about."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lightning_fasync.runtime.preemption import Preempted, Preemption
from lightning_fasync.pipeline.events import read_jsonl
from tests.helpers.ledger_audit import audit_resume, children_of
from tests.helpers.paths import REPO

TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")
B, STEPS = 16, 8


def test_the_handler_records_the_signal_and_the_grace_period_ends_the_step(capsys):
    requests = []
    p = Preemption(grace_s=0.2, on_request=lambda: requests.append(1))
    before = signal.getsignal(signal.SIGTERM)
    p.install()
    try:
        assert signal.getsignal(signal.SIGTERM) == p._handle
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler runs at the next bytecode boundary
        assert p.requested and requests == [1]
        p.check()  # within the grace period: go on
        time.sleep(0.25)
        with pytest.raises(Preempted) as info:
            p.check(lambda: "/ckpt/step-000002.ckpt")
        assert info.value.code == 143
        assert "abandoned; a resume with `--ckpt_path last` starts from /ckpt/step-000002.ckpt" in capsys.readouterr().err
        assert p.stop("/ckpt/step-000003.ckpt").code == 143
        assert "saved the checkpoint /ckpt/step-000003.ckpt" in capsys.readouterr().err
    finally:
        p.restore()
    assert signal.getsignal(signal.SIGTERM) is before  # given back
    p2 = Preemption(grace_s=30)
    p2._handle(signal.SIGINT, None)
    assert p2.stop(None).code == 130  # Ctrl-C
    p2._handle(signal.SIGINT, None)  # a second signal: abandon at the next check
    with pytest.raises(Preempted):
        p2.check()


def fit_cmd(root, *extra):
    return [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", TINY, f"--trainer.default_root_dir={root}",
            "--trainer.enable_progress_bar=false", f"--trainer.rollout_steps={STEPS}", *extra]


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_the_resume_loses_nothing(tmp_path):
    # No periodic checkpoints: the only one is the preemption's.
    with open(tmp_path / "run1.log", "w") as log:
        proc = subprocess.Popen(fit_cmd(tmp_path), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    ledger1 = os.path.join(tmp_path, "lightning_logs", "version_0", "ledger.jsonl")
    deadline = time.monotonic() + 300
    try:
        while True:
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached step 3"
            if os.path.exists(ledger1) and any(r["kind"] == "consume" and r["step"] >= 3 for r in read_jsonl(ledger1)):
                break
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = (tmp_path / "run1.log").read_text()
    assert rc == 143, out[-3000:]  # interrupted, not a success
    assert took < 30, f"exit took {took:.1f} s, past trainer.preempt_grace_s"
    assert "Interrupted by SIGTERM: saved the checkpoint" in out
    assert children_of(proc.pid) == [], "engine processes outlived the preempted trainer"
    checkpoints = os.path.join(tmp_path, "lightning_logs", "version_0", "checkpoints")
    assert os.path.islink(os.path.join(checkpoints, "last.ckpt"))
    run1 = read_jsonl(ledger1)
    assert any(r["kind"] == "checkpoint" for r in run1)

    # A resume that changes B would break exactly-once accounting: refused in one sentence.
    refused = subprocess.run(fit_cmd(tmp_path, "--data_source.num_prompts_per_step=8", "--trainer.mini_batch_size=16",
                                     "--ckpt_path", "last"), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert refused.returncode != 0
    assert "`data_source.num_prompts_per_step` is 8 but the checkpoint" in refused.stderr + refused.stdout

    # A new learning rate is only a warning; the resumed run finishes the remaining steps.
    resumed = subprocess.run(fit_cmd(tmp_path, "--model.lr=0.0005", "--ckpt_path", "last"), capture_output=True,
                             text=True, timeout=600, cwd=REPO)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "model.lr: 0.001 -> 0.0005" in resumed.stderr + resumed.stdout
    versions = sorted(os.listdir(os.path.join(tmp_path, "lightning_logs")))
    run2 = read_jsonl(os.path.join(tmp_path, "lightning_logs", versions[-1], "ledger.jsonl"))
    resume_step = audit_resume(run1, run2, B, STEPS)
    assert resume_step >= 4  # the step in progress at the signal was finished and saved


@pytest.mark.slow
def test_fabric_loop_saves_and_exits_143_on_sigterm(tmp_path):
    script = os.path.join(REPO, "examples", "fabric_loop.py")
    with open(tmp_path / "run.log", "w") as log:
        proc = subprocess.Popen([sys.executable, script, "--rollout-steps", "200", "--root", str(tmp_path)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    checkpoints = tmp_path / "checkpoints"
    deadline = time.monotonic() + 300
    try:
        # save_freq 2: wait for the step-1 checkpoint, so the run is well into its steps.
        while not (checkpoints / "step-000001.ckpt").exists():
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = (tmp_path / "run.log").read_text()
    assert rc == 143, out[-3000:]
    saved = out.split("saved the checkpoint ")[1].split(";")[0]
    assert os.path.realpath(checkpoints / "last.ckpt") == os.path.realpath(saved)  # the preemption's own save
    assert children_of(proc.pid) == []
