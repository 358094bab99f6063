"""``rollout.backend: embedded | sglang | external``.

The ``sglang`` backend's launch path runs on CPU against a FAKE ``sglang.launch_server``
(``tests/helpers/fake_sglang``, put on the launched servers' PYTHONPATH only through
``FASYNC_FAKE_SGLANG_PATH``): it records its command line and ``CUDA_VISIBLE_DEVICES`` and serves
through the embedded engine. Real SGLang needs its GPU runtime, which cannot run here; its own
argument parser (``ServerArgs``) and model registry are what the command line and the model checks
are compared against.
"""

from __future__ import annotations

import asyncio
import glob
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import yaml
from aiohttp import web

from lightning_fasync.config import ConfigError, ConfigWarning, SGLangArgs, load_config, validate
from lightning_fasync.fleet.resources import plan_cpu_resources, plan_rollout_gpus
from lightning_fasync.pipeline.engine_client import EngineError
from lightning_fasync.fleet import backends
from lightning_fasync.fleet.backends import (
    EMBEDDED_ONLY_FLAGS, PLUGIN_FLAGS, SGLangPool, check_sglang_backend, extra_args, sglang_lora_args,
    sglang_server_command,
)
from lightning_fasync.fleet.client import SGLangClient, server_protocol
from lightning_fasync.fleet.launch import ServerStartError, free_port
from tests.helpers.paths import FAKE_SGLANG, HELPERS, REPO
from tests.helpers.required import RAY, SGLANG, located, require

HAS_SGLANG = located(*SGLANG) is not None  # missing, a failure under LFA_REQUIRE_SGLANG=1


def sglang_cfg(**rollout):
    """Two one-GPU replicas after the trainer's one GPU."""
    ro = {"backend": "sglang", "num_gpus_per_node": 2, "sglang_replicas": {"regular": {"num_nodes": 1, "num_gpus_per_replica": 1}}}
    return load_config({"colocate": False, "trainer": {"num_gpus_per_node": 1}, "rollout": {**ro, **rollout}})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny policy as a Hugging Face directory (what SGLang servers load)."""
    from lightning_fasync.policy import build_policy, save_policy

    return save_policy(*build_policy("tiny"), str(tmp_path_factory.mktemp("model") / "tiny"))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; only its parent's wait is missing
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout=60.0) -> list[int]:
    """The pids still alive after ``timeout`` (a bounded wait, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def procs_mentioning(*needles: str) -> list[int]:
    """Live processes whose command line contains one of ``needles`` (read from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmdline = open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if any(n in cmdline for n in needles) and alive(int(d)):
                out.append(int(d))
    return out


def records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "data, key, fragment",
    [
        ({"rollout": {"backend": "trtllm"}}, "`rollout.backend`", "embedded, sglang, vllm, external"),
        ({"rollout": {"engine_urls": ["http://127.0.0.1:1"]}}, "`rollout.engine_urls`", "rollout.backend: external"),
        ({"rollout": {"backend": "external"}}, "`rollout.engine_urls`", "list every server"),
        ({"rollout": {"backend": "external", "engine_urls": ["127.0.0.1:30000"]}}, "`rollout.engine_urls[0]`", "http://"),
        ({"rollout": {"sglang_args": {"mem_fraction_static": 0.8}}}, "`rollout.sglang_args.mem_fraction_static`", "sglang"),
        ({"rollout": {"sglang_args": {"extra": ["--ep-size", "2"]}}}, "`rollout.sglang_args.extra`", "rollout.backend: sglang"),
        ({"rollout": {"backend": "sglang", "sglang_replicas": {"regular": {"num_nodes": 2, "num_gpus_per_replica": 4}}}},
         "`rollout.sglang_replicas.regular.num_nodes`", "need rollout.placement: ray"),
        ({"rollout": {"backend": "sglang", "sglang_replicas": {"regular": {"num_nodes": 1, "num_gpus_per_replica": 3}}}},
         "`rollout.sglang_replicas.regular.num_gpus_per_replica`", "divisor"),
        ({"rollout": {"backend": "sglang", "sglang_args": {"extra": {"port": 1234}}}}, "`rollout.sglang_args.extra`", "--port"),
        ({"rollout": {"backend": "sglang", "sglang_args": {"extra": ["--tp-size=2"]}}}, "`rollout.sglang_args.extra`",
         "num_gpus_per_replica"),
        ({"rollout": {"backend": "sglang", "sglang_args": {"extra": {"threads": 4}}}}, "`rollout.sglang_args.extra`",
         "embedded engine"),
        ({"rollout": {"backend": "sglang", "sglang_args": {"weight_version": "v1"}}}, "`rollout.sglang_args.weight_version`",
         "integer"),
        ({"rollout": {"backend": "sglang", "sglang_args": {"mem_fraction_static": 1.5}}},
         "`rollout.sglang_args.mem_fraction_static`", "(0, 1)"),
        ({"rollout": {"backend": "sglang", "sglang_args": {"port": 65535}}}, "`rollout.sglang_args.port`", "port + i"),
        ({"rollout": {"engine_startup_timeout": 0}}, "`rollout.engine_startup_timeout`", "> 0"),
    ],
)
def test_backend_configurations_that_cannot_run_are_refused_naming_the_key(data, key, fragment):
    with pytest.raises(ConfigError) as info:
        validate(load_config(data))
    msg = str(info.value)
    assert key in msg and fragment in msg, msg
    assert "\n" not in msg


def test_extra_args_pass_through_verbatim():
    assert extra_args(["--ep-size", "4", "--enable-memory-saver"]) == ["--ep-size", "4", "--enable-memory-saver"]
    assert extra_args({"ep_size": 4, "enable-memory-saver": True, "disable_radix_cache": False, "dtype": None,
                       "cuda_graph_bs": [1, 2], "json_model_override_args": {"a": 1}}) == [
        "--ep-size", "4", "--enable-memory-saver", "--cuda-graph-bs", "1", "2", "--json-model-override-args", '{"a": 1}']


def test_the_gpu_plan_puts_each_replica_on_its_own_devices():
    cfg = sglang_cfg(num_gpus_per_node=4, sglang_replicas={"regular": {"num_nodes": 1, "num_gpus_per_replica": 2},
                                                           "long": {"num_nodes": 1, "num_gpus_per_replica": 4}})
    plan = plan_rollout_gpus(cfg, visible="")
    assert [(r.name, r.gpus) for r in plan] == [("regular-0", ["1", "2"]), ("regular-1", ["3", "4"]), ("long-0", ["5", "6", "7", "8"])]
    # Through this process's own CUDA_VISIBLE_DEVICES; colocated, the trainer's devices are shared.
    assert [r.gpus for r in plan_rollout_gpus(sglang_cfg(), visible="4,5,6")] == [["5"], ["6"]]
    colocated = load_config({**sglang_cfg().to_dict(), "colocate": True})
    assert [r.gpus for r in plan_rollout_gpus(colocated, visible="")] == [["0"], ["1"]]
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES lists 2"):
        plan_rollout_gpus(sglang_cfg(), visible="0,1")


# ----------------------------------------------------------------------------- what SGLang can serve


def test_sglang_backend_refuses_what_sglang_cannot_serve_before_anything_starts(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(backends.FAKE_SGLANG_ENV, raising=False)
    cfg = validate(sglang_cfg())
    for model, fragment in (("tiny", "a preset of the embedded engine"), ("qwen3-0.6b-shape", "preset"),
                            (str(tmp_path / "nowhere"), "no config.json"), (None, "not set")):
        with pytest.raises(ConfigError, match="`model.model`") as info:
            check_sglang_backend(cfg, model)
        assert fragment in str(info.value)
    with pytest.raises(ConfigError, match="`trainer.strategy.init_args.rollout_replicas` is 2"):
        check_sglang_backend(cfg, tiny_dir, num_cpu_replicas=2)
    with pytest.raises(ConfigError, match="`trainer.strategy.init_args.engine_threads` is 3"):
        check_sglang_backend(cfg, tiny_dir, engine_threads=3)
    # SGLang's GPU runtime: the package, then a CUDA device, then enough of them.
    real_find_spec = importlib.util.find_spec
    with monkeypatch.context() as m:
        m.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real_find_spec(name, *a))
        with pytest.raises(ConfigError, match=r"`sglang` package is not importable; .*lightning-fasync\[gpu\]"):
            check_sglang_backend(cfg, tiny_dir)
    if HAS_SGLANG:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        with pytest.raises(ConfigError, match=r"no CUDA device is visible"):
            check_sglang_backend(cfg, tiny_dir)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        with pytest.raises(ConfigError, match=r"`rollout.num_gpus_per_node` is 2: .* need 3 GPUs on this host, but 2"):
            check_sglang_backend(cfg, tiny_dir)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
        assert [r.gpus for r in check_sglang_backend(cfg, tiny_dir)] == [["1"], ["2"]]
    # The test hook skips exactly the GPU-runtime refusals, nothing else.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv(backends.FAKE_SGLANG_ENV, FAKE_SGLANG)
    assert [r.gpus for r in check_sglang_backend(cfg, tiny_dir)] == [["1"], ["2"]]
    with pytest.raises(ConfigError, match="a preset of the embedded engine"):
        check_sglang_backend(cfg, "tiny")


def test_sglang_backend_serves_qwen3_moe_which_the_embedded_engine_refuses(tmp_path, monkeypatch):
    """The embedded engine's refusal of MoE models is its own, not the sglang backend's."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from lightning_fasync.engine.model_runner import ModelRunner, UnsupportedModelError

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                            num_experts_per_tok=2, architectures=["Qwen3MoeForCausalLM"])
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="qwen3_moe"):
        ModelRunner(AutoModelForCausalLM.from_config(config), max_slots=1, context_length=8)
    monkeypatch.setenv(backends.FAKE_SGLANG_ENV, FAKE_SGLANG)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # no "no model class" warning either
        assert len(check_sglang_backend(validate(sglang_cfg()), str(tmp_path))) == 2
    if HAS_SGLANG:  # read from the installed SGLang's own model registry
        assert "Qwen3MoeForCausalLM" in backends.sglang_architectures()
        config.architectures = ["NoSuchModelForCausalLM"]
        config.save_pretrained(tmp_path)
        with pytest.warns(ConfigWarning, match="Transformers fallback"):
            check_sglang_backend(validate(sglang_cfg()), str(tmp_path))


@pytest.mark.skipif(not HAS_SGLANG, reason="sglang is not installed (tests/requirements-sglang.txt)")
def test_the_launch_command_parses_with_sglangs_own_server_args():
    """Every flag the plugin writes is one of SGLang's, with the value meant; the embedded-only
    flags are exactly the embedded server's flags SGLang lacks."""
    args = SGLangArgs(max_running_requests=8, mem_fraction_static=0.7, weight_version="3",
                      extra={"ep_size": 2, "enable_memory_saver": True}, max_lora_rank=32)
    adapter = validate(load_config({"rollout": {"backend": "sglang", "weight_sync": "adapter",
                                                "sglang_args": {"max_lora_rank": 32}}}))
    cmd = sglang_server_command("models/m", args, port=31000, tp_size=4, nccl_port=31500,
                                context_length=2048) + sglang_lora_args(adapter)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    script = textwrap.dedent("""
        import argparse, json, sys
        sys.path.insert(0, sys.argv[1])
        from sglang_driver import install_sglang_triton_stubs
        install_sglang_triton_stubs()
        from sglang.srt.server_args import ServerArgs
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        ns = parser.parse_args(json.loads(sys.argv[2]))
        flags = sorted(s for a in parser._actions for s in a.option_strings)
        print(json.dumps({"parsed": {k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list))},
                          "flags": flags}))
    """)
    proc = subprocess.run([sys.executable, "-c", script, HELPERS, json.dumps(cmd[3:])], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    parsed = out["parsed"]
    assert (parsed["model_path"], parsed["host"], parsed["port"], parsed["tp_size"], parsed["nccl_port"]) == (
        "models/m", "127.0.0.1", 31000, 4, 31500)
    assert parsed["skip_server_warmup"] is True and parsed["max_running_requests"] == 8
    assert parsed["mem_fraction_static"] == 0.7 and parsed["weight_version"] == "3" and parsed["context_length"] == 2048
    assert parsed["ep_size"] == 2 and parsed["enable_memory_saver"] is True
    # The adapter path: SGLang's LoRA serving, every module a target, the configured largest rank.
    assert parsed["enable_lora"] is True and parsed["max_lora_rank"] == 32 and parsed["lora_target_modules"] == ["all"]
    sglang_flags = set(out["flags"])
    assert set(PLUGIN_FLAGS) <= sglang_flags
    assert embedded_server_flags() - sglang_flags == set(EMBEDDED_ONLY_FLAGS)


def embedded_server_flags() -> set[str]:
    """The embedded server's own flags, from its parser (caught as ``parse_args`` builds it)."""
    from unittest import mock

    from lightning_fasync.engine import server

    parsers = []

    class Catching(server.ArgumentParser):  # type: ignore[misc, valid-type]
        def parse_args(self, *args, **kwargs):
            parsers.append(self)
            return super().parse_args(*args, **kwargs)

    with mock.patch.object(server, "ArgumentParser", Catching):
        server.parse_args(["--model", "m", "--port", "1"])
    return {s for a in parsers[0]._actions for s in a.option_strings if s.startswith("--")} - {
        "--help", "--print_config", "--print_shtab"}


# ----------------------------------------------------------------------------- protocol detection


def test_server_protocol_from_version_or_model_info():
    p = server_protocol({"version": "0.5.23"})
    assert (p.protocol, p.version, p.update_bracket) == ("0.5.23", "0.5.23", True)
    p = server_protocol({"version": "0.5.15.post1"})
    assert (p.protocol, p.update_bracket) == ("0.5.15", False)
    assert server_protocol({"version": "0.5.19"}).update_bracket is None  # in between: probed
    assert server_protocol({"version": "0.6.0"}).update_bracket is True
    # No /get_server_info version: /model_info's fields (0.5.23 added served_model_name, load_format).
    p = server_protocol(None, {"model_path": "m", "weight_version": "default", "served_model_name": "m", "load_format": "auto"})
    assert (p.protocol, p.version, p.update_bracket) == ("0.5.23", None, None)
    assert server_protocol(None, {"model_path": "m", "weight_version": "default"}).protocol == "0.5.15"


class FakeServer:
    """An SGLang-shaped HTTP server of a given version, counting what it is asked (not SGLang)."""

    def __init__(self, version, bracket, server_info=True):
        self.version, self.bracket, self.calls = version, bracket, []
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self.handle)
        self.server_info = server_info
        self.runner = web.AppRunner(app)

    async def handle(self, request):
        path = request.path
        self.calls.append(path)
        if path == "/get_server_info" and self.server_info:
            return web.json_response({"version": self.version, "model_path": "m"})
        if path == "/model_info":
            return web.json_response({"model_path": "m", "weight_version": "default"})
        if path in ("/begin_weight_update", "/end_weight_update") and self.bracket:
            return web.json_response({"success": True, "message": "Success"})
        return web.Response(status=404)

    async def __aenter__(self):
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


@pytest.mark.parametrize("version, bracket, server_info, protocol, begins", [
    ("0.5.23", True, True, "0.5.23", 2),          # the version says: bracket, no probe
    ("0.5.15.post1", False, True, "0.5.15", 0),   # the version says: no bracket, never asked
    ("0.5.15", False, False, "0.5.15", 1),        # only /model_info: one probe, then no more
])
def test_the_detected_version_drives_the_weight_update_bracket(version, bracket, server_info, protocol, begins):
    async def run():
        async with FakeServer(version, bracket, server_info) as server:
            client = SGLangClient([server.url], retries=0)
            try:
                for _ in range(2):  # two weight updates, as a sync path brackets them
                    if await client.begin_weight_update():
                        await client.end_weight_update()
                assert client.protocol == protocol
            finally:
                await client.close()
            return server.calls

    calls = asyncio.run(run())
    assert calls.count("/begin_weight_update") == begins
    assert calls.count("/end_weight_update") == (2 if bracket else 0)
    assert calls.count("/get_server_info") == 1


# ----------------------------------------------------------------------------- sglang: launch path


def test_a_server_that_never_becomes_healthy_fails_naming_the_key_with_its_log(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(backends.FAKE_SGLANG_ENV, FAKE_SGLANG)
    monkeypatch.setenv("FASYNC_FAKE_SGLANG_RECORD", str(tmp_path / "record.jsonl"))
    monkeypatch.setenv("FASYNC_FAKE_SGLANG_HANG", "1")
    cfg = validate(sglang_cfg(num_gpus_per_node=1))
    pool = SGLangPool(tiny_dir, check_sglang_backend(cfg, tiny_dir), cfg.rollout.sglang_args, log_dir=str(tmp_path),
                      startup_timeout=3)
    with pytest.raises(ServerStartError) as info:
        pool.start()
    msg = str(info.value)
    assert "within 3 s (`rollout.engine_startup_timeout`)" in msg
    assert "FAKE sglang.launch_server: told to hang" in msg  # the tail of its log
    assert os.path.isfile(tmp_path / "sglang" / "regular-0.log")
    (rec,) = records(tmp_path / "record.jsonl")
    assert wait_gone([rec["pid"]]) == []
    pool.stop()  # idempotent


DRIVER = textwrap.dedent("""
    import sys, time
    from lightning_fasync.config import load_config
    from lightning_fasync.fleet.backends import SGLangPool, check_sglang_backend
    cfg = load_config({"colocate": False, "trainer": {"num_gpus_per_node": 1}, "rollout": {"backend": "sglang",
        "num_gpus_per_node": 1, "sglang_replicas": {"regular": {"num_nodes": 1, "num_gpus_per_replica": 1}}}})
    pool = SGLangPool(sys.argv[1], check_sglang_backend(cfg, sys.argv[1]), cfg.rollout.sglang_args, log_dir=sys.argv[2],
                      startup_timeout=120).start()
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
def test_sglang_servers_die_with_a_sigkilled_trainer(tiny_dir, tmp_path):
    env = dict(os.environ, **{backends.FAKE_SGLANG_ENV: FAKE_SGLANG, "FASYNC_FAKE_SGLANG_RECORD": str(tmp_path / "record.jsonl")})
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, tiny_dir, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
        (rec,) = records(tmp_path / "record.jsonl")
        watchdog = int(open(f"/proc/{rec['pid']}/stat").read().split(")")[1].split()[1])  # the server's parent
        assert alive(rec["pid"]) and alive(watchdog)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert wait_gone([rec["pid"], watchdog]) == []
        assert procs_mentioning(tiny_dir) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def consecutive_free_ports(n: int) -> int:
    for _ in range(100):
        port = free_port()
        try:
            socks = []
            for p in range(port, port + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no consecutive free ports")


def test_an_adapter_runs_sglang_pool_clients_name_the_adapter():
    pool = SGLangPool("m", [], SGLangArgs(), lora_rank=16)
    pool.worker_urls = ["http://a:1"]
    client = pool.client()
    assert client.lora_name == "policy" and client.max_lora_rank == 16
    assert client.max_lora_rank_key == "rollout.sglang_args.max_lora_rank"
    plain = SGLangPool("m", [], SGLangArgs())
    plain.worker_urls = ["http://a:1"]
    assert plain.client().lora_name is None and plain.client().max_lora_rank is None
    assert sglang_lora_args(validate(load_config({"rollout": {"backend": "sglang"}}))) == []
    with pytest.raises(ConfigError, match=r"`rollout.weight_update_mode` is inflight while `rollout.weight_sync` is "
                                          r"adapter on sglang"):
        validate(load_config({"rollout": {"backend": "sglang", "weight_sync": "adapter", "partial": True,
                                          "weight_update_mode": "inflight"}}))
    with pytest.raises(ConfigError, match=r"`rollout.sglang_args.extra` sets --max-lora-rank"):
        validate(load_config({"rollout": {"backend": "sglang", "sglang_args": {"extra": ["--max-lora-rank", "8"]}}}))


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["full", "adapter"])
def test_fit_with_the_sglang_backend_end_to_end_on_cpu(tiny_dir, tmp_path, sync):
    """``lightning-fasync fit`` with ``rollout.backend: sglang``: two FAKE sglang servers on the GPUs
    the plan gives them and the real sglang-router in front; the run trains; every process is gone
    after teardown. ``adapter``: ``model.lora.sync: adapter`` over ``rollout.weight_sync: adapter``,
    the servers started with SGLang's LoRA flags, the adapter loaded through SGLang's
    ``/unload_lora_adapter`` and ``/load_lora_adapter`` and named by every ``/generate`` (the embedded
    engine behind the fake refuses a request naming an adapter it has not loaded)."""
    port = consecutive_free_ports(2)
    config = {
        "seed_everything": 1, "colocate": False,
        "fully_async": {"enable": True, "sliding_window": "windowed-fifo"},
        "data_source": {"num_prompts_per_step": 4, "num_trajectories_per_prompt": 2, "task": "repeat", "num_prompts": 64},
        "trainer": {"mini_batch_size": 8, "rollout_steps": 2, "num_gpus_per_node": 1, "default_root_dir": str(tmp_path),
                    "enable_progress_bar": False},
        "rollout": {"backend": "sglang", "num_gpus_per_node": 2, "partial": True, "max_response_length": 12,
                    "sglang_replicas": {"regular": {"num_nodes": 1, "num_gpus_per_replica": 1}},
                    "sglang_args": {"max_running_requests": 8, "mem_fraction_static": 0.6, "weight_version": "0",
                                    "port": port, "extra": {"ep_size": 1, "enable_memory_saver": True}}},
        "model": {"model": tiny_dir, "lr": 0.001},
    }
    if sync == "adapter":
        config["model"]["lora"] = {"r": 8, "alpha": 16.0, "sync": "adapter"}
        config["rollout"]["weight_sync"] = "adapter"
    path = tmp_path / "sglang_cpu.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    record = tmp_path / "record.jsonl"
    env = dict(os.environ, **{backends.FAKE_SGLANG_ENV: FAKE_SGLANG, "FASYNC_FAKE_SGLANG_RECORD": str(record)})
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run([sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", str(path)],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    recs = records(record)
    assert len(recs) == 2 and {r["cuda_visible_devices"] for r in recs} == {"1", "2"}
    context = None
    for rec in recs:  # in the order the servers got to write, which is not theirs
        argv = rec["argv"]
        i = int(argv[argv.index("--port") + 1]) - port  # server i listens on port + i
        assert rec["cuda_visible_devices"] == str(i + 1)  # after the trainer's GPU 0
        nccl = argv[argv.index("--nccl-port") + 1]
        context = argv[argv.index("--context-length") + 1]
        expected = sglang_server_command(tiny_dir, SGLangArgs(**config["rollout"]["sglang_args"]), port + i, tp_size=1,
                                         nccl_port=int(nccl), context_length=int(context))
        lora = ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"] if sync == "adapter" else []
        assert argv == expected[3:] + lora
        assert argv[len(argv) - len(lora) - 3:len(argv) - len(lora)] == ["--ep-size", "1", "--enable-memory-saver"]
    assert int(context) > 12
    (log_dir,) = glob.glob(str(tmp_path / "lightning_logs" / "version_*"))
    assert sorted(os.listdir(os.path.join(log_dir, "sglang"))) == ["regular-0.log", "regular-1.log", "router.log"]
    assert "FAKE sglang.launch_server" in open(os.path.join(log_dir, "sglang", "regular-1.log")).read()
    # The run trained through them: B groups per step, the synced weight version in the tokens.
    ledger = [json.loads(line) for line in open(os.path.join(log_dir, "ledger.jsonl"))]
    consumed = [r for r in ledger if r["kind"] == "consume"]
    assert len(consumed) == 2 * 4 and {r["step"] for r in consumed} == {0, 1}
    if sync == "adapter":
        assert "weight sync `adapter`" in proc.stdout + proc.stderr
    # Teardown stopped everything: the servers, their watchdogs, the router and its supervisor.
    assert wait_gone([r["pid"] for r in recs], timeout=30) == []
    assert procs_mentioning(tiny_dir, f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}") == []


# ----------------------------------------------------------------------------- external


def test_external_backend_uses_running_servers_and_leaves_them_running(tmp_path):
    from lightning_fasync.runtime.rollout_runtime import RolloutRuntime
    from lightning_fasync.policy import build_policy
    from lightning_fasync.fleet.launch import launch_server

    unreachable = f"http://127.0.0.1:{free_port()}"
    cfg = validate(load_config({"rollout": {"backend": "external", "engine_urls": [unreachable], "engine_startup_timeout": 1}}))
    with pytest.raises(EngineError, match=r"did not answer /health within 1 s \(`rollout.engine_startup_timeout`\)"):
        RolloutRuntime(cfg, "tiny", plan_cpu_resources(1), str(tmp_path), pin=False)

    handle = launch_server("tiny", max_running_requests=8, timeout=120)
    try:
        cfg = validate(load_config({
            "data_source": {"num_prompts_per_step": 2, "num_trajectories_per_prompt": 2, "num_prompts": 16},
            "trainer": {"mini_batch_size": 4}, "rollout": {"max_response_length": 8, "backend": "external",
                                                            "engine_urls": [handle.url + "/"]}}))
        runtime = RolloutRuntime(cfg, "tiny", plan_cpu_resources(1), str(tmp_path), pin=False)
        try:
            assert runtime.pool.worker_urls == [handle.url]
            model, _ = build_policy("tiny")
            runtime.sync_weights({k: v + 0.01 for k, v in model.state_dict().items()}, 3)
            info = asyncio.run(_model_info(runtime.pool))
            assert info[0]["weight_version"] == "3"
            runtime.controller.start()
            groups = runtime.controller.fetch()
            assert groups and all(set(t.weight_versions) == {3} for g in groups for t in g.trajectories if t.response_ids)
        finally:
            runtime.shutdown()
            runtime.shutdown()
        assert handle.alive()  # someone else's server: not stopped
    finally:
        handle.stop()


async def _model_info(pool):
    client = pool.client()
    try:
        return await client.model_info()
    finally:
        await client.close()


# ----------------------------------------------------------------------------- the GPU config


def plugin_keys(path: str) -> dict:
    """A fit YAML's plugin keys (Lightning's own trainer/model keys left out), as ``load_config`` takes them."""
    from lightning_fasync.config import GROUPS, SCALARS, TrainerConfig

    data = yaml.safe_load(open(path))
    out = {k: v for k, v in data.items() if k in GROUPS or k in SCALARS}
    out["trainer"] = {k: v for k, v in data["trainer"].items() if k in TrainerConfig.__dataclass_fields__}
    return out


@pytest.mark.parametrize("fully_async", [False, True])
def test_the_qwen3_30b_config_uses_the_sglang_backend_and_validates(fully_async):
    path = os.path.join(REPO, "configs", "qwen3_30b_a3b", "dapo_h20_1node.yaml")
    data = plugin_keys(path)
    if fully_async:  # the spec's launch line: --colocate=false --fully_async.enable=true
        data["colocate"], data["fully_async"]["enable"] = False, True
    cfg = validate(load_config(data))
    assert cfg.rollout.backend == "sglang"
    assert [r.gpus for r in plan_rollout_gpus(cfg, visible="")] == (
        [["8", "9", "10", "11"], ["12", "13", "14", "15"]] if fully_async else [["0", "1", "2", "3"], ["4", "5", "6", "7"]])
    text = open(path).read()
    for marker in ("model.model", "data_source.path", "trainer.default_root_dir", "GPU topology"):
        assert marker in text.split("seed_everything")[0], marker  # each REPLACE explained in the header


def test_the_qwen3_30b_two_node_overlay_places_its_replicas_with_ray(tiny_dir, monkeypatch):
    """configs/qwen3_30b_a3b/dapo_h20_2node.yaml over the one-node config: fully-async, SGLang replicas
    placed by Ray on the rollout node (one per 4 of its 8 GPUs), weights over the network."""
    require(*RAY)
    from lightning_fasync.weights.sync import resolve_weight_sync

    one = plugin_keys(os.path.join(REPO, "configs", "qwen3_30b_a3b", "dapo_h20_1node.yaml"))
    overlay = yaml.safe_load(open(os.path.join(REPO, "configs", "qwen3_30b_a3b", "dapo_h20_2node.yaml")))
    for group, value in overlay.items():
        one[group] = {**one[group], **value} if isinstance(value, dict) and isinstance(one.get(group), dict) else value
    monkeypatch.setenv("FASYNC_ENGINE_API_KEY", "k")
    cfg = validate(load_config(one))
    assert (cfg.colocate, cfg.fully_async.enable, cfg.rollout.placement, cfg.rollout.backend) == (False, True, "ray", "sglang")
    assert resolve_weight_sync(cfg) == "distributed"
    monkeypatch.setenv(backends.FAKE_SGLANG_ENV, FAKE_SGLANG)
    replicas = check_sglang_backend(cfg, tiny_dir)
    assert [(r.kind, r.index) for r in replicas] == [("regular", 0), ("regular", 1)]
    monkeypatch.delenv("FASYNC_ENGINE_API_KEY")
    with pytest.raises(ConfigError, match=r"set \$FASYNC_ENGINE_API_KEY"):
        validate(cfg)


def test_free_port_is_below_the_ephemeral_range_and_free():
    # The system hands ephemeral ports to every outgoing connection and bind(0) (a gloo group opens
    # dozens); a port chosen there could be taken before the server binds it.
    from lightning_fasync.fleet.launch import _ephemeral_low

    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert 10000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_embedded_engine_device_reaches_every_server(monkeypatch):
    """``rollout.engine_device`` becomes the embedded server's own ``--device`` flag, in the pool's
    server arguments (which a supervised restart reuses), and the server's parser takes it."""
    from lightning_fasync.engine.server import parse_args
    from lightning_fasync.fleet import pool as pool_module
    from lightning_fasync.registry import ENGINE_BACKENDS, EngineStart

    seen = []

    class Pool:
        def __init__(self, model, **kwargs):
            seen.append(kwargs["server_args"])

        def start(self):
            return self

    monkeypatch.setattr(pool_module, "RolloutPool", Pool)
    for device, flags in (("cpu", []), ("cuda:1", ["--device", "cuda:1"])):
        cfg = load_config({"rollout": {"engine_device": device}})
        ENGINE_BACKENDS.get("embedded").start(EngineStart(cfg=cfg, engine_model="tiny", plan=plan_cpu_resources(1),
                                                          prepared=None, context_length=128, log_dir=None,
                                                          startup_timeout=60, server_args=["--enable-memory-saver"]))
        assert seen[-1] == ["--enable-memory-saver", *flags]
    assert parse_args(["--model", "tiny", *seen[-1]]).device == "cuda:1"
