"""`lightning-fasync fit` with a real vLLM server (vLLM's CPU build) rolling out: the main job's
config with `rollout.backend: vllm` trains fully-async end to end, every prompt once, each token's
weight version from vLLM's own labels in line with the syncs, the step boundary's calls to vLLM's
RL API in the server's log in order; and a vLLM server killed mid-run comes back with the trainer's
weights (pushed over the same API, then checked), nothing lost."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from lightning_fasync.pipeline.events import read_jsonl
from tests.helpers.ledger_audit import children_of
from tests.helpers.paths import REPO
from tests.helpers.vllm import vllm_python

pytestmark = pytest.mark.slow

CONFIG = os.path.join(REPO, "configs", "tiny_cpu_vllm.yaml")
B = 16  # data_source.num_prompts_per_step of the config
BOUNDARY = ["/pause?mode=abort", "/start_weight_update", "/update_weights", "/finish_weight_update",
            "/reset_prefix_cache", "/resume"]


def start_fit(root, steps, *extra):
    env = dict(os.environ, FASYNC_VLLM_PYTHON=vllm_python())
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", CONFIG, f"--trainer.default_root_dir={root}",
           "--trainer.enable_progress_bar=false", f"--trainer.rollout_steps={steps}", "--trainer.save_freq=0",
           "--rollout.engine_restart.poll_interval_s=0.2", "--rollout.engine_restart.backoff_s=0.2", *extra]
    log = open(os.path.join(root, "run.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env), log


def finish(proc, log, root):
    """Wait for the run to end (killed past 15 minutes); its return code and output."""
    try:
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    return rc, (root / "run.log").read_text()


def run_dir(root):
    return os.path.join(root, "lightning_logs", "version_0")


def read(root, name):
    path = os.path.join(run_dir(root), name)
    return read_jsonl(path) if os.path.exists(path) else []


def last_step(ledger):
    return max((r["step"] for r in ledger if r["kind"] == "consume"), default=-1)


def audit(ledger, steps):
    consumed = [r for r in ledger if r["kind"] == "consume"]
    assert len({r["prompt"] for r in consumed}) == len(consumed) == steps * B, "a prompt was trained twice or lost"
    assert sorted({r["step"] for r in consumed}) == list(range(steps))


def server_calls(root):
    """The RL-API calls the vLLM server logged, in order (its access log lines)."""
    with open(os.path.join(run_dir(root), "vllm", "replica-0.log"), "rb") as f:
        text = f.read().decode(errors="replace")
    return re.findall(r'"POST (\S+) HTTP/1\.1" (\d+)', text)


def check_versions(ledger, events):
    """Each trained group's tokens carry versions vLLM labelled them with, and those are versions the
    trainer pushed by the time it trained them."""
    synced = {0} | {e["weight_version"] for e in events if e["event"] == "sync"}
    consumed = [r for r in ledger if r["kind"] == "consume"]
    for r in consumed:
        assert r["start_version"] in synced and r["end_version"] in synced, r
        assert r["start_version"] <= r["end_version"] <= r["step"], r  # the weights of step s are version s
    assert max(r["end_version"] for r in consumed) >= 2  # the rollouts did follow the syncs


def test_the_main_job_trains_on_a_vllm_server_with_its_weights_synced_over_vllms_rl_api(tmp_path):
    steps = 8
    proc, log = start_fit(tmp_path, steps)
    rc, out = finish(proc, log, tmp_path)
    assert rc == 0, out[-3000:]
    # (the cores are the plan's: under pytest-xdist the worker's own core)
    assert re.search(r"1 vLLM server\(s\) on cores \[\[[\d, ]+\]\]; weight sync `vllm`", out), out[-3000:]
    assert children_of(proc.pid) == [], "the vLLM server outlived the run"
    ledger, events = read(tmp_path, "ledger.jsonl"), read(tmp_path, "events.jsonl")
    audit(ledger, steps)
    check_versions(ledger, events)

    calls = [path for path, status in server_calls(tmp_path) if path != "/inference/v1/generate"]
    assert all(status == "200" for _, status in server_calls(tmp_path))
    assert calls.count("/init_weight_transfer_engine") == 1  # the group is formed once
    syncs = [e for e in events if e["event"] == "sync"]
    # Every step boundary (and the sync before the first step) makes vLLM's calls in this order.
    boundary = [c for c in calls if c in BOUNDARY]
    assert boundary == BOUNDARY * (len(syncs) + 1), boundary[:20]
    # And each is checked: a probe of the served log-probs after every resume.
    assert calls.count("/v1/completions") == len(syncs) + 1


def test_a_killed_vllm_server_comes_back_with_the_trainers_weights_and_nothing_is_lost(tmp_path):
    steps = 8
    proc, log = start_fit(tmp_path, steps)
    try:
        deadline = time.monotonic() + 600
        while last_step(read(tmp_path, "ledger.jsonl")) < 3:
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "step 3 did not come"
            time.sleep(0.2)
        (server,) = children_of(proc.pid)  # the watchdog, whose process group holds the vLLM server
        os.killpg(server, signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise
    finally:
        rc, out = finish(proc, log, tmp_path)
    assert rc == 0, out[-3000:]
    assert children_of(proc.pid) == []
    ledger, events = read(tmp_path, "ledger.jsonl"), read(tmp_path, "events.jsonl")
    audit(ledger, steps)
    check_versions(ledger, events)
    names = [e["event"] for e in events]
    assert names.count("engine_dead") == 1 and names.count("engine_restarted") == 1, names
    restarted = next(e for e in events if e["event"] == "engine_restarted")
    assert restarted["weight_version"] >= 3  # the trainer's weights of the step it died in, pushed and checked
    # The new server joined a new weight-transfer group and was probed before it served.
    calls = [path for path, _ in server_calls(tmp_path)]
    assert calls.count("/init_weight_transfer_engine") >= 2
