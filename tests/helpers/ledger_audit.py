"""Shared by the real-process resume tests: the engines a trainer started, and the exactly-once
audit of two runs' ledgers (a run stopped early, then its resume)."""

from __future__ import annotations

import glob
import os
import subprocess
import time
from typing import Any, Optional


def run_fit(cmd: list[str], root: str, cwd: str, env: Optional[dict] = None, timeout: float = 600,
            **popen: Any) -> tuple[str, str]:
    """Run a ``fit`` command line to the end (killed past ``timeout``); assert it succeeded and left
    no engine behind. Returns ``(output, log_dir)``, the run's ``lightning_logs/version_*`` under ``root``.
    ``popen``: more arguments for ``subprocess.Popen`` (e.g. ``preexec_fn``)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env, **popen)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert children_of(proc.pid) == []
    (log_dir,) = glob.glob(os.path.join(root, "lightning_logs", "version_*"))
    return out, log_dir


def children_of(pid: int) -> list[int]:
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


def audit_resume(run1: list[dict], run2: list[dict], prompts_per_step: int, steps: int) -> int:
    """Every prompt trained once over the two runs, none lost; returns the step run 2 resumed at.

    The resumed run says which checkpoint it restored: everything run 1 consumed before that step
    is in the checkpoint, everything from that step on was rolled back and must be replayed. (A
    kill may land between writing the checkpoint and the ledger's "checkpoint" line, so the resume
    line decides.)
    """
    assert run2[0]["kind"] == "resume"
    resume_step = run2[0]["step"]
    assert run2[0]["weight_version"] == resume_step
    saved = {r["resume_step"] for r in run1 if r["kind"] == "checkpoint"}
    assert resume_step in saved or resume_step == max(saved) + 1, (resume_step, saved)
    committed = [r["prompt"] for r in run1 if r["kind"] == "consume" and r["step"] < resume_step]
    rolled_back = [r["prompt"] for r in run1 if r["kind"] == "consume" and r["step"] >= resume_step]
    replayed = [r["prompt"] for r in run2 if r["kind"] == "consume"]
    # Up to the checkpoint: every step's B prompts, each once.
    assert len(committed) == resume_step * prompts_per_step == len(set(committed))
    # After it: the resumed run trains the remaining steps; nothing twice, nothing lost.
    everything = committed + replayed
    assert len(everything) == steps * prompts_per_step
    assert len(set(everything)) == len(everything), "a prompt was trained twice"
    assert set(rolled_back) <= set(replayed), "prompts consumed after the checkpoint were lost"
    assert sorted({r["step"] for r in run2 if r["kind"] == "consume"}) == list(range(resume_step, steps))
    return resume_step


def wait_until(proc, root, what, predicate, timeout=240):
    """Poll a running ``fit`` under ``root`` until ``predicate(ledger, events)`` (both read from its
    ``lightning_logs/version_0``) returns something true, which is returned; fails with the run's
    log tail when the run ends first, and after ``timeout`` seconds."""
    from lightning_fasync.pipeline.events import read_jsonl

    deadline = time.monotonic() + timeout
    logs = os.path.join(root, "lightning_logs", "version_0")
    while True:
        assert proc.poll() is None, f"the run ended waiting for {what}:\n" + open(os.path.join(root, "run.log")).read()[-3000:]
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        ledger = read_jsonl(os.path.join(logs, "ledger.jsonl")) if os.path.exists(os.path.join(logs, "ledger.jsonl")) else []
        events = read_jsonl(os.path.join(logs, "events.jsonl")) if os.path.exists(os.path.join(logs, "events.jsonl")) else []
        got = predicate(ledger, events)
        if got:
            return got
        time.sleep(0.1)


def last_step(ledger):
    """The last rollout step of which the ledger has a consumed group (-1: none)."""
    return max((r["step"] for r in ledger if r["kind"] == "consume"), default=-1)
