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
import warnings

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


def server_errors(root):
    """The vLLM server log's error lines (for a failed assertion's message)."""
    with open(os.path.join(run_dir(root), "vllm", "replica-0.log"), "rb") as f:
        lines = f.read().decode(errors="replace").splitlines()
    return [ln for ln in lines if re.search(r"ERROR|Traceback|Error:|Exception", ln)][-40:]


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def cores_of(pid):
    """The cores process ``pid`` may run on (its main thread's, from /proc); None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            (line,) = [ln for ln in f if ln.startswith("Cpus_allowed_list:")]
    except FileNotFoundError:
        return None
    cores = set()
    for part in line.split(":")[1].strip().split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def check_versions(ledger, events):
    """Each trained group's tokens carry versions vLLM labelled them with, and those are versions the
    trainer pushed by the time it trained them."""
    synced = {0} | {e["weight_version"] for e in events if e["event"] == "sync"}
    consumed = [r for r in ledger if r["kind"] == "consume"]
    for r in consumed:
        assert r["start_version"] in synced and r["end_version"] in synced, r
        assert r["start_version"] <= r["end_version"] <= r["step"], r  # the weights of step s are version s
    assert max(r["end_version"] for r in consumed) >= 2  # the rollouts did follow the syncs


def test_the_main_job_trains_on_vllm_over_its_rl_api_and_a_killed_server_comes_back_with_its_weights(tmp_path):
    """One fit (a vLLM CPU server takes ~25 s to start, so the two claims share it): the main job
    trains on vLLM with every boundary's calls in order, and a server killed at step 3 comes back
    with the trainer's weights, nothing lost."""
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
        # The restarted server runs where the first one did, not on the core the trainer has pinned
        # itself to since (its API and engine-core processes would share the trainer's core).
        while not any(e["event"] == "engine_restarted" for e in read(tmp_path, "events.jsonl")):
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server was not restarted"
            time.sleep(0.2)
        (restarted,) = children_of(proc.pid)
        group = {p: cores_of(p) for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if _pgid(p) == restarted}
        group = {p: cores for p, cores in group.items() if cores is not None}  # not gone meanwhile
        trainer = cores_of(proc.pid)
        assert len(group) >= 2
        if trainer < os.sched_getaffinity(0):  # the trainer pinned to cores of its own (not under one pytest-xdist core)
            # None on the trainer's alone (vLLM binds its engine-core process to the replica's cores itself).
            assert not any(cores <= trainer for cores in group.values()), (trainer, group)
    except BaseException:
        proc.kill()
        raise
    finally:
        rc, out = finish(proc, log, tmp_path)
    assert rc == 0, out[-3000:]
    # (the cores are the plan's: under pytest-xdist the worker's own core)
    assert re.search(r"1 vLLM server\(s\) on cores \[\[[\d, ]+\]\]; weight sync `vllm`", out), out[-3000:]
    assert children_of(proc.pid) == [], "the vLLM server outlived the run"
    ledger, events = read(tmp_path, "ledger.jsonl"), read(tmp_path, "events.jsonl")
    audit(ledger, steps)
    check_versions(ledger, events)
    names = [e["event"] for e in events]
    assert names.count("engine_dead") == 1 and names.count("engine_restarted") == 1, names
    restarted = next(e for e in events if e["event"] == "engine_restarted")
    assert restarted["weight_version"] >= 3  # the trainer's weights of the step it died in, pushed and checked
    # A restart attempt that fails (its server is stopped and another started) is recorded as such:
    # the supervisor's retry is the recovery under test too, but never a silent one.
    failed = [e for e in events if e["event"] == "engine_restart_failed"]
    assert restarted["attempt"] == len(failed) + 1, (restarted, failed)
    for e in failed:
        warnings.warn(f"restart attempt {e['attempt']} of the vLLM server failed: {e['error']}")
    # The new server joined a new weight-transfer group and was probed before it served.
    calls = [path for path, status in server_calls(tmp_path) if path != "/inference/v1/generate"]
    assert all(status == "200" for _, status in server_calls(tmp_path))
    inits = [i for i, c in enumerate(calls) if c == "/init_weight_transfer_engine"]
    assert len(inits) >= 2  # the new server joined a new weight-transfer group
    # The first server: every boundary (and the sync before step 0) made vLLM's calls in this order,
    # each checked by a probe of the served log-probs after its resume, until the kill cut one short.
    first = calls[inits[0]:inits[1]]
    boundary = [c for c in first if c in BOUNDARY]
    assert len(boundary) >= 4 * len(BOUNDARY) and boundary == (BOUNDARY * len(boundary))[:len(boundary)], boundary
    assert first.count("/v1/completions") >= 4
    # The restarted server got the trainer's weights over the same API and was probed before it served
    # (it was not paused: it served nothing yet); after it rejoined, every boundary again in order.
    # Each failed attempt's server (the log is appended to) joined at most once before it was stopped.
    joined = ["/init_weight_transfer_engine", *BOUNDARY[1:5], "/v1/completions"]
    join = next((i for i in inits[1:] if calls[i:i + 6] == joined), None)
    assert join is not None and inits.index(join) - 1 <= len(failed), (
        [calls[i:i + 6] for i in inits[1:]], [e["error"] for e in failed], server_errors(tmp_path), out[-3000:])
    last = calls[inits[-1]:]
    boundary = [c for c in last if c in BOUNDARY]
    assert boundary and boundary == BOUNDARY * (len(boundary) // len(BOUNDARY)), boundary
    assert last.count("/v1/completions") == len(boundary) // len(BOUNDARY)
