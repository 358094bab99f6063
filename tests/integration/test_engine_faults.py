"""Engine and router faults with real processes: a replica killed (SIGKILL of its process tree,
the router not told) or stopped (SIGSTOP), the router killed. The run notices, keeps going with
what serves, restarts what died with the trainer's current weights (checked by SGLang's
``/weights_checker`` checksums) and loses no prompt; past its limits it stops with an error that
names the key."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_fasync.pipeline.engine_client import GenerateRequest, SamplingParams
from lightning_fasync.pipeline.events import read_jsonl
from lightning_fasync.fleet.pool import RolloutPool
from lightning_fasync.fleet.workers import EngineLostError
from lightning_fasync.weights.checksum import checksums
from lightning_fasync.weights.sync import TensorWeightSync
from tests.helpers.ledger_audit import children_of, last_step, wait_until
from tests.helpers.paths import REPO

TINY = os.path.join(REPO, "configs", "tiny_cpu.yaml")
B = 16


class Events:
    """Collects the supervisor's events (it emits from its own threads)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict]] = []
        self.lock = threading.Lock()

    def __call__(self, event: str, **fields) -> None:
        with self.lock:
            self.items.append((event, fields))

    def named(self, name: str) -> list[dict]:
        with self.lock:
            return [f for e, f in self.items if e == name]

    def wait(self, name: str, timeout: float = 60.0, count: int = 1) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.named(name)) < count:
            assert time.monotonic() < deadline, f"no {name} event within {timeout} s: {self.items}"
            time.sleep(0.05)
        return self.named(name)


def perturbed() -> dict[str, torch.Tensor]:
    """The tiny policy's weights, changed: what a trainer would push after some steps."""
    from lightning_fasync.policy import build_policy

    model, _ = build_policy("tiny")
    torch.manual_seed(0)
    return {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=1.0, max_new_tokens=4))


def test_requests_wait_for_a_serving_replica_until_the_timeout_that_names_its_key():
    from lightning_fasync.fleet.workers import WorkerSet

    ws = WorkerSet([], router=False, wait_timeout_s=0.3)

    async def run():
        t0 = time.monotonic()
        with pytest.raises(EngineLostError, match=r"No rollout engine served for 0.3 s \(`rollout.engine_restart.timeout_s`\)"):
            await ws.wait_available(ws.abort_epoch)
        assert 0.25 < time.monotonic() - t0 < 5
        # An abort_all meanwhile: the waiting request returns (aborted) instead.
        waiter = asyncio.ensure_future(ws.wait_available(ws.abort_epoch))
        await asyncio.sleep(0.05)
        ws.bump_abort()
        assert await waiter is False
        # A replica comes back: the request goes on.
        waiter = asyncio.ensure_future(ws.wait_available(ws.abort_epoch))
        ws.add("http://127.0.0.1:1")
        assert await waiter is True
        # Behind a router, the router must be up too; once the supervisor gives up, waiting ends.
        routed = WorkerSet(["http://127.0.0.1:1"], router=True, wait_timeout_s=60)
        routed.set_router_up(False)
        waiter = asyncio.ensure_future(routed.wait_available(routed.abort_epoch))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        routed.fatal = EngineLostError("gave up (`rollout.engine_restart.max_attempts`)")
        with pytest.raises(EngineLostError, match="max_attempts"):
            await waiter

    asyncio.run(run())


@pytest.mark.slow
def test_a_killed_single_replica_comes_back_with_the_trainers_weights_or_is_not_put_back():
    events = Events()
    fatal: list[BaseException] = []
    with RolloutPool("tiny", num_replicas=1, context_length=64) as pool:
        pool.supervise(max_attempts=2, backoff_s=0.1, timeout_s=120, poll_s=0.2, emit=events, on_fatal=fatal.append)
        weights = perturbed()

        async def push_kill_generate(tensors, version):
            client = pool.client()
            try:
                pool.keep_weights(await TensorWeightSync(client, keep=True, pause_mode=None).push(tensors, version))
                pool.servers[0].kill_tree()
                killed = time.time()
                result = await client.generate(request(f"after-kill-{version}"))  # waits for the restart
                return killed, result, await client.weight_checksums()
            finally:
                await client.close()

        killed, result, (reported,) = asyncio.run(push_kill_generate(weights, 3))
        dead = events.wait("engine_dead")[0]
        assert dead["wall"] - killed < 10, "the death was noticed later than 10 s"
        assert "exited" in dead["reason"]
        restarted = events.wait("engine_restarted")[0]
        assert restarted["weight_version"] == 3 and restarted["attempt"] == 1
        # The restarted replica holds the pushed weights, tensor for tensor, and serves version 3.
        expected = checksums(weights)
        assert {k: expected[k] for k in reported} == reported
        assert result.finish_reason in ("stop", "length") and set(result.weight_versions) == {3}
        assert pool.workers.urls == pool.worker_urls
        first_kept = pool.weights

        # Now the kept weights hold one tensor in half precision: the engine loads it into its
        # float32 parameter, so what it holds differs from what the trainer sent. The check says
        # so, the replica is not put back, and once its restarts are spent the run is told to stop.
        name = next(k for k in weights if k.endswith("q_proj.weight"))
        weights[name] = weights[name].half()
        with pytest.raises(EngineLostError, match=r"rollout\.engine_restart\.max_attempts"):
            asyncio.run(push_kill_generate(weights, 4))
        assert first_kept.buckets is None, "the previous kept weights were not replaced"
        failures = events.wait("engine_restart_failed", count=2)
        assert all("does not hold the trainer's weights of version 4" in f["error"] and name in f["error"]
                   for f in failures), [f["error"] for f in failures]
        assert len(events.named("engine_restarted")) == 1
        assert pool.workers.urls == []
        deadline = time.monotonic() + 10
        while not fatal and time.monotonic() < deadline:
            time.sleep(0.05)
        kept = pool.weights
    assert kept.buckets is None, "the kept weights outlived the pool"
    assert len(fatal) == 1 and isinstance(fatal[0], EngineLostError)
    assert "`rollout.engine_restart" in str(fatal[0]) and "resume it from its last checkpoint" in str(fatal[0])


@pytest.mark.slow
def test_a_stopped_replica_is_killed_after_hang_timeout_and_admin_calls_do_not_wait_for_it():
    events = Events()
    with RolloutPool("tiny", num_replicas=2, context_length=64) as pool:
        pool.supervise(max_attempts=1, backoff_s=0.1, timeout_s=60, hang_timeout_s=2, poll_s=0.2, emit=events)
        stopped = pool.servers[1]
        os.kill(stopped.pid, signal.SIGSTOP)

        async def run():
            client = pool.client(admin_timeout_s=120)
            try:
                t0 = time.monotonic()
                await client.abort_all()  # the stopped replica leaves the set: the call returns
                took = time.monotonic() - t0
                results = await client.generate_batch([request(f"r{i}") for i in range(4)])
                return took, results
            finally:
                await client.close()

        took, results = asyncio.run(run())
        assert took < 30
        assert all(not isinstance(r, BaseException) and r.finish_reason != "abort" for r in results), results
        dead = events.wait("engine_dead")[0]
        assert dead["replica"] == 1 and "hang_timeout_s" in dead["reason"]
        events.wait("engine_restarted")
        assert sorted(pool.workers.urls) == sorted(pool.worker_urls)


# ---------------------------------------------------------------------------------------- fit


def fit(root, steps, *extra):
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", TINY, f"--trainer.default_root_dir={root}",
           "--trainer.enable_progress_bar=false", f"--trainer.rollout_steps={steps}", "--trainer.save_freq=0",
           "--rollout.engine_restart.poll_interval_s=0.2", "--rollout.engine_restart.backoff_s=0.2", *extra]
    log = open(os.path.join(root, "run.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log


def audit(ledger, complete_steps, last_may_be_partial=False):
    """Every consumed prompt once, B per step, and every drop with its reason. A run stopped by a
    fault may have consumed part of its last step (rolled back by the checkpoint)."""
    consumed = [r for r in ledger if r["kind"] == "consume"]
    prompts = [r["prompt"] for r in consumed]
    assert len(prompts) == len(set(prompts)), "a prompt was trained twice"
    per_step = {}
    for r in consumed:
        per_step[r["step"]] = per_step.get(r["step"], 0) + 1
    assert sorted(per_step) == list(range(len(per_step)))
    assert all(per_step[s] == B for s in range(complete_steps)), per_step
    if len(per_step) > complete_steps:
        assert last_may_be_partial and len(per_step) == complete_steps + 1, per_step
    for r in ledger:
        if r["kind"] == "drop":
            assert r.get("reason"), r


def events_of(root):
    return read_jsonl(os.path.join(root, "lightning_logs", "version_0", "events.jsonl"))


@pytest.mark.slow
def test_two_replicas_survive_a_killed_engine_a_stopped_engine_and_a_killed_router(tmp_path):
    proc, log = fit(
        tmp_path, 1000,
        "--trainer.strategy=lightning_fasync.lightning.strategy.FullyAsyncStrategy",
        "--trainer.strategy.rollout_replicas=2", "--trainer.strategy.trainer_cores=[0]", "--trainer.strategy.rollout_cores=[0,1]",
        "--rollout.request_timeout=3",
    )
    try:
        wait_until(proc, tmp_path, "step 3", lambda ledger, ev: last_step(ledger) >= 3)
        engines = [p for p in children_of(proc.pid) if b"engine.server" in open(f"/proc/{p}/cmdline", "rb").read()]
        router = [p for p in children_of(proc.pid) if b"fleet.router" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(engines) == 2 and len(router) == 1

        # 1. SIGKILL one replica's process tree; the router is not told.
        os.killpg(engines[0], signal.SIGKILL)
        killed = time.time()
        step_at_kill = last_step(read_jsonl(os.path.join(tmp_path, "lightning_logs", "version_0", "ledger.jsonl")))
        dead = wait_until(proc, tmp_path, "engine_dead", lambda l, ev: [e for e in ev if e["event"] == "engine_dead"])[0]
        assert dead["wall"] - killed < 10
        # The run goes on with the survivor while the dead one restarts.
        wait_until(proc, tmp_path, "steps with one replica", lambda l, ev: last_step(l) >= step_at_kill + 2)
        restarted = wait_until(proc, tmp_path, "engine_restarted", lambda l, ev: [e for e in ev if e["event"] == "engine_restarted"])[0]
        assert restarted["weight_version"] >= 1  # the trainer's current weights, checked by checksum

        # 2. SIGSTOP the other replica for longer than rollout.request_timeout, then SIGCONT.
        os.kill(engines[1], signal.SIGSTOP)
        time.sleep(5)
        os.kill(engines[1], signal.SIGCONT)
        at = last_step(read_jsonl(os.path.join(tmp_path, "lightning_logs", "version_0", "ledger.jsonl")))
        wait_until(proc, tmp_path, "steps after SIGCONT", lambda l, ev: last_step(l) >= at + 2)

        # 3. SIGKILL the router (its supervisor and the router under it).
        os.killpg(router[0], signal.SIGKILL)
        wait_until(proc, tmp_path, "router_restarted", lambda l, ev: [e for e in ev if e["event"] == "router_restarted"])
        at = last_step(read_jsonl(os.path.join(tmp_path, "lightning_logs", "version_0", "ledger.jsonl")))
        wait_until(proc, tmp_path, "steps after the router restart", lambda l, ev: last_step(l) >= at + 2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        log.close()
    out = (tmp_path / "run.log").read_text()
    assert rc == 143, out[-3000:]
    assert children_of(proc.pid) == [], "rollout processes outlived the run"
    ledger = read_jsonl(os.path.join(tmp_path, "lightning_logs", "version_0", "ledger.jsonl"))
    audit(ledger, last_step(ledger) + 1)
    events = events_of(tmp_path)
    names = [e["event"] for e in events]
    assert names.count("engine_dead") >= 1 and names.count("engine_restarted") >= 1 and "router_restarted" in names
    assert "engine_fatal" not in names
    # The survivor served while the dead replica restarted: groups were consumed in between.
    dead_t = next(e["t"] for e in events if e["event"] == "engine_dead")
    back_t = next(e["t"] for e in events if e["event"] == "engine_restarted")
    assert sum(1 for e in events if e["event"] == "consume" and dead_t < e["t"] < back_t) >= B


@pytest.mark.slow
def test_one_replica_killed_the_run_waits_for_its_restart_and_stops_with_a_checkpoint_when_none_comes(tmp_path):
    # One training call per step (M = B x N): a fault reaching the trainer after a training call of
    # its step can save nothing (FullyAsyncController.save_after_fault), and with 4 calls a step
    # whether one had run when the restart failed depended on the machine's load. With one call,
    # the fault lands either before it (the last boundary is saved) or at the boundary right after
    # it (which saves): a checkpoint either way.
    proc, log = fit(tmp_path, 1000, "--rollout.engine_restart.max_attempts=1", "--trainer.mini_batch_size=128")
    try:
        wait_until(proc, tmp_path, "step 3", lambda ledger, ev: last_step(ledger) >= 3)
        (engine,) = [p for p in children_of(proc.pid) if b"engine.server" in open(f"/proc/{p}/cmdline", "rb").read()]
        os.killpg(engine, signal.SIGKILL)
        # The run waits for the restart (with the trainer's current weights), then goes on.
        restarted = wait_until(proc, tmp_path, "engine_restarted", lambda l, ev: [e for e in ev if e["event"] == "engine_restarted"])[0]
        assert restarted["weight_version"] >= 3
        at = last_step(read_jsonl(os.path.join(tmp_path, "lightning_logs", "version_0", "ledger.jsonl")))
        wait_until(proc, tmp_path, "steps after the restart", lambda l, ev: last_step(l) >= at + 2)

        # Killed again, and its port taken meanwhile: the one restart attempt fails, and the run
        # saves a checkpoint and stops with an error naming the key, not a success.
        (engine,) = [p for p in children_of(proc.pid) if b"engine.server" in open(f"/proc/{p}/cmdline", "rb").read()]
        port = int(restarted["url"].rsplit(":", 1)[1])
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        os.killpg(engine, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while True:
            try:
                squatter.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline, "the killed engine's port did not free up"
                time.sleep(0.01)
        squatter.listen()
        squatter.settimeout(0.1)

        def refuse():  # accept and close at once: a port taken by something that is not an engine
            while squatter.fileno() != -1:
                try:
                    squatter.accept()[0].close()
                except OSError:
                    pass

        threading.Thread(target=refuse, daemon=True).start()
        rc = proc.wait(timeout=300)
        squatter.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    out = (tmp_path / "run.log").read_text()
    assert rc != 0, out[-3000:]
    assert "`rollout.engine_restart.max_attempts` is 1" in out
    saved = out.split("The rollout engines are lost: a resume with `--ckpt_path last` starts from ")[1].split(".ckpt")[0] + ".ckpt"
    checkpoints = os.path.join(tmp_path, "lightning_logs", "version_0", "checkpoints")
    assert os.path.realpath(os.path.join(checkpoints, "last.ckpt")) == os.path.realpath(saved)
    assert children_of(proc.pid) == []
    ledger = read_jsonl(os.path.join(tmp_path, "lightning_logs", "version_0", "ledger.jsonl"))
    step = int(os.path.basename(saved)[5:11])
    assert [r for r in ledger if r["kind"] == "checkpoint"][-1]["resume_step"] == step + 1
    audit(ledger, step + 1, last_may_be_partial=True)
    names = [e["event"] for e in events_of(tmp_path)]
    assert names.count("engine_dead") == 2 and names.count("engine_restarted") == 1
    assert "engine_restart_failed" in names and "engine_fatal" in names


def test_engine_restart_keys_are_validated():
    from lightning_fasync.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match=r"`rollout.engine_restart.max_attempts` is -1; it must be >= 0"):
        validate(load_config({"rollout": {"engine_restart": {"max_attempts": -1}}}))
    with pytest.raises(ConfigError, match=r"`rollout.engine_restart.timeout_s` is 0.0; it must be > 0 seconds"):
        validate(load_config({"rollout": {"engine_restart": {"timeout_s": 0}}}))
