"""``rollout.placement: ray`` on a real two-node Ray cluster made on this host with Ray's own
multi-node test cluster (``ray.cluster_utils.Cluster``): a head node (the trainer's: the ``fit``
process joins the cluster there) and a rollout node that alone holds the ``rollout_node`` resource
(and two GPUs declared to Ray, for the sglang replicas; the FAKE ``sglang.launch_server`` of
tests/helpers/fake_sglang serves them through the embedded engine, recording what it was given).

A fully-async ``fit`` places its two engine replicas on the rollout node, trains to the end with
every prompt trained once, survives one replica's server SIGKILLed mid-run (restarted on its node
and port, the trainer's weights checked), keeps the replicas' logs under its run directory, and
leaves no server process behind. The servers bind the node's address, so they require the API key
on every route, /health included.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from lightning_fasync.pipeline.events import read_jsonl
from tests.helpers.ledger_audit import last_step, wait_until
from tests.helpers.paths import FAKE_SGLANG, REPO
from tests.helpers.required import RAY, require

pytestmark = pytest.mark.slow

B = 8
STEPS = 3  # the runs that end by themselves; the kill test runs until it is stopped


def _require_ray():
    require(*RAY)


@pytest.fixture(scope="module")
def cluster():
    _require_ray()
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True,
                head_node_args={"num_cpus": 1, "resources": {"trainer_node": 1}, "include_dashboard": False})
    # Two GPUs declared to Ray (none exists): what it hands the sglang replicas' actors.
    rollout = c.add_node(num_cpus=2, num_gpus=2, resources={"rollout_node": 2})
    try:
        yield c, rollout
    finally:
        c.shutdown()


def _servers_with(key: str) -> list[int]:
    """Every engine server process on this host started with API key ``key`` (read from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
            env = open(f"/proc/{d}/environ", "rb").read()
        except OSError:
            continue
        if b"lightning_fasync.engine.server" in cmd and f"FASYNC_ENGINE_API_KEY={key}".encode() in env:
            out.append(int(d))
    return out


def _fit(root, address, key, *extra, steps=STEPS):
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"),
           f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false", f"--trainer.rollout_steps={steps}",
           "--trainer.save_freq=0", f"--data_source.num_prompts_per_step={B}", "--trainer.mini_batch_size=32",
           "--rollout.placement=ray", f"--rollout.ray.address={address}", '--rollout.ray.replica_resources={"rollout_node": 1}',
           "--trainer.strategy.rollout_replicas=2", "--rollout.engine_restart.poll_interval_s=0.2",
           "--rollout.engine_restart.backoff_s=0.2", *extra]
    log = open(os.path.join(root, "run.log"), "w")
    env = {**os.environ, "FASYNC_ENGINE_API_KEY": key}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env), log


def test_a_fit_trains_with_its_replicas_on_another_ray_node_and_survives_one_killed(cluster, tmp_path):
    c, rollout = cluster
    key = secrets.token_hex(16)
    proc, log = _fit(tmp_path, c.address, key, steps=1000)
    logs = tmp_path / "lightning_logs" / "version_0"
    try:
        wait_until(proc, tmp_path, "step 2", lambda ledger, ev: last_step(ledger) >= 2, timeout=300)
        placement = json.loads((logs / "ray" / "placement.json").read_text())
        replicas = placement["replicas"]
        assert sorted(replicas) == ["0", "1"]
        # Both replicas on the rollout node; the trainer joined the cluster on the head node.
        assert {r["node"] for r in replicas.values()} == {rollout.node_id}
        assert placement["trainer_node"] != rollout.node_id
        url = replicas["0"]["url"]
        assert not url.startswith("http://127.")  # bound to the node's address: the key on every route
        for path in ("/health", "/get_server_info"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url + path, timeout=10)
            assert refused.value.code == 401
        req = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {key}"})
        assert urllib.request.urlopen(req, timeout=10).status == 200

        servers = _servers_with(key)
        assert len(servers) == 2
        victim = next(p for p in servers if f"--port {url.rsplit(':', 1)[1]} ".encode()
                      in open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ") + b" ")
        os.killpg(victim, signal.SIGKILL)
        dead = wait_until(proc, tmp_path, "engine_dead", lambda l, ev: [e for e in ev if e["event"] == "engine_dead"])[0]
        restarted = wait_until(proc, tmp_path, "engine_restarted",
                               lambda l, ev: [e for e in ev if e["event"] == "engine_restarted"], timeout=300)[0]
        assert restarted["weight_version"] >= 1  # the trainer's weights, checked before it served again
        assert dead["url"] == restarted["url"] == url  # the same node and port
        at = last_step(read_jsonl(str(logs / "ledger.jsonl")))
        wait_until(proc, tmp_path, "two steps after the restart", lambda l, ev: last_step(l) >= at + 2, timeout=300)
        proc.send_signal(signal.SIGTERM)  # a graceful stop: a checkpoint at the boundary, then exit 143
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    out = (tmp_path / "run.log").read_text()
    assert rc == 143, out[-3000:]
    assert "placed by Ray" in out
    placement = json.loads((logs / "ray" / "placement.json").read_text())
    assert placement["replicas"]["0"]["node"] == rollout.node_id  # restarted where it was
    ledger = read_jsonl(str(logs / "ledger.jsonl"))
    consumed = [r for r in ledger if r["kind"] == "consume"]
    prompts = [r["prompt"] for r in consumed]
    assert len(prompts) == len(set(prompts))  # none trained twice
    steps = last_step(ledger) + 1
    per_step = [sum(1 for r in consumed if r["step"] == s) for s in range(steps)]
    assert per_step[:-1] == [B] * (steps - 1) and 0 < per_step[-1] <= B, per_step  # none lost on the way
    # The replicas' logs came back to the run directory, the killed one's first life included.
    for i in (0, 1):
        text = (logs / "ray" / f"replica-{i}.log").read_text()
        assert text.count(f"Serving tiny on {replicas[str(i)]['url']}") == (2 if i == 0 else 1), text[-2000:]
    deadline = time.monotonic() + 30
    while _servers_with(key) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _servers_with(key) == [], "engine servers outlived the run"


def test_a_layout_the_cluster_cannot_place_is_refused_before_any_replica_starts(cluster, tmp_path):
    c, _ = cluster
    key = secrets.token_hex(16)
    proc, log = _fit(tmp_path, c.address, key, "--trainer.strategy.rollout_replicas=3")
    try:
        rc = proc.wait(timeout=300)
    finally:
        log.close()
    out = (tmp_path / "run.log").read_text()
    assert rc != 0
    assert "3 engine replicas need" in out and "room for 2" in out, out[-2000:]
    assert _servers_with(key) == []


@pytest.mark.parametrize("extra, message", [
    (["--rollout.weight_sync=tensor"], "`rollout.weight_sync` is tensor while `rollout.placement` is ray"),
    (["--rollout.backend=external", "--rollout.engine_urls=[http://127.0.0.1:1]"],
     "`rollout.placement` is ray while `rollout.backend` is external"),
])
def test_what_cannot_cross_hosts_is_refused_in_one_sentence(tmp_path, extra, message):
    _require_ray()
    proc, log = _fit(tmp_path, "127.0.0.1:1", "k", *extra)
    try:
        rc = proc.wait(timeout=120)
    finally:
        log.close()
    out = (tmp_path / "run.log").read_text()
    assert rc == 2 and message in out, out[-2000:]


def test_without_an_api_key_a_ray_run_is_refused(tmp_path):
    _require_ray()
    env = {k: v for k, v in os.environ.items() if k != "FASYNC_ENGINE_API_KEY"}
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"),
           f"--trainer.default_root_dir={tmp_path}", "--rollout.placement=ray"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "set $FASYNC_ENGINE_API_KEY" in proc.stderr, proc.stderr[-2000:]


def test_sglang_replicas_get_their_gpus_and_the_key_on_the_rollout_node(cluster, tmp_path):
    """``rollout.backend: sglang`` through Ray, as configs/qwen3_30b_a3b/dapo_h20_2node.yaml lays it
    out: each replica's actor asks Ray for its GPUs on the rollout node and its server inherits them
    (``CUDA_VISIBLE_DEVICES``), binds the node's address and requires the key (``--api-key``)."""
    from lightning_fasync.policy import build_policy, save_policy

    c, rollout = cluster
    model_dir = tmp_path / "tiny"
    save_policy(*build_policy("tiny"), str(model_dir))
    record = tmp_path / "sglang.jsonl"
    key = secrets.token_hex(16)
    os.environ["FASYNC_FAKE_SGLANG_PATH"], os.environ["FASYNC_FAKE_SGLANG_RECORD"] = FAKE_SGLANG, str(record)
    try:
        proc, log = _fit(tmp_path, c.address, key, "--rollout.backend=sglang", f"--model.model={model_dir}",
                         "--rollout.num_gpus_per_node=2", "--rollout.sglang_replicas.regular.num_gpus_per_replica=1",
                         "--trainer.strategy.rollout_replicas=1")
    finally:
        del os.environ["FASYNC_FAKE_SGLANG_PATH"], os.environ["FASYNC_FAKE_SGLANG_RECORD"]
    try:
        rc = proc.wait(timeout=600)
    finally:
        log.close()
    out = (tmp_path / "run.log").read_text()
    assert rc == 0, out[-3000:]
    assert "placed by Ray" in out
    launched = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(launched) == 2
    assert sorted(r["cuda_visible_devices"] for r in launched) == ["0", "1"]
    for r in launched:
        argv = r["argv"]
        assert argv[argv.index("--api-key") + 1] == key
        assert not argv[argv.index("--host") + 1].startswith("127.")
    placement = json.loads((tmp_path / "lightning_logs" / "version_0" / "ray" / "placement.json").read_text())
    assert {r["node"] for r in placement["replicas"].values()} == {rollout.node_id}
    ledger = read_jsonl(str(tmp_path / "lightning_logs" / "version_0" / "ledger.jsonl"))
    assert len({r["prompt"] for r in ledger if r["kind"] == "consume"}) == 3 * B
    assert _servers_with(key) == []
