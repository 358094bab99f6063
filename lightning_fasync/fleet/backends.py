"""The rollout backends (``rollout.backend``, docs/backends.md), one :class:`~lightning_fasync.registry.EngineBackend`
record each at the end of this module (``EMBEDDED``, ``SGLANG``, ``EXTERNAL``): the embedded engine's
supervised pool (:mod:`lightning_fasync.fleet.pool`), and the two without a supervisor:

- ``sglang``: :class:`SGLangPool` launches one ``python -m sglang.launch_server`` per replica of
  ``rollout.sglang_replicas``, each on the GPUs the resource plan gives it (``CUDA_VISIBLE_DEVICES``),
  with the real sglang-router in front of several. Each server runs under
  :mod:`~lightning_fasync.fleet.watchdog` (it stops the server when the trainer dies) in a process
  group of its own, and is stopped by pid and process group; its output goes to
  ``<log dir>/sglang/<kind>-<i>.log``. :func:`check_sglang_backend` refuses, before anything starts,
  what SGLang cannot serve as configured.
- ``external``: :class:`ExternalEngines` checks that servers someone else runs answer ``/health``
  and hands out clients for them; it never starts or stops anything.

Neither has a supervisor: a server that dies is not restarted (its requests fail under the group
policy and ``rollout.max_consecutive_failed_groups`` ends the run).

Test hook: ``FASYNC_FAKE_SGLANG_PATH`` (read here only) names a directory holding a stand-in
``sglang`` package. It is put first on the ``PYTHONPATH`` of the launched server processes only, so
their ``python -m sglang.launch_server`` runs the stand-in; and :func:`check_sglang_backend` then
skips exactly two refusals that need SGLang's GPU runtime: no CUDA device visible (and too few
devices for the plan), and ``sglang`` not importable. Everything else (the model and option
refusals, the command line, ports, GPU assignment, health waits, logs, teardown) runs as it does
for real. The project's tests use it with ``tests/helpers/fake_sglang`` to run the launch path on CPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

from lightning_fasync.config import ConfigError, ConfigWarning, FasyncConfig, SGLangArgs
from lightning_fasync.registry import EngineBackend, EngineStart

FAKE_SGLANG_ENV = "FASYNC_FAKE_SGLANG_PATH"

PLUGIN_FLAGS: dict[str, str] = {
    "--model-path": "the policy's model (`model.model`)",
    "--model": "the policy's model (`model.model`)",
    "--host": "127.0.0.1 (servers bind the loopback address)",
    "--port": "`rollout.sglang_args.port`",
    "--tp-size": "`rollout.sglang_replicas.<kind>.num_gpus_per_replica`",
    "--tensor-parallel-size": "`rollout.sglang_replicas.<kind>.num_gpus_per_replica`",
    "--nccl-port": "a free port per server",
    "--skip-server-warmup": "`rollout.sglang_args.skip_server_warmup`",
    "--max-running-requests": "`rollout.sglang_args.max_running_requests`",
    "--mem-fraction-static": "`rollout.sglang_args.mem_fraction_static`",
    "--weight-version": "`rollout.sglang_args.weight_version`",
    "--context-length": "`rollout.sglang_args.context_length`",
    "--enable-lora": "`rollout.weight_sync: adapter`",
    "--max-lora-rank": "`rollout.sglang_args.max_lora_rank`",
    "--lora-target-modules": "`rollout.weight_sync: adapter` (all)",
}
"""``sglang.launch_server`` flags the plugin sets itself, and from what (not allowed in ``extra``)."""

EMBEDDED_ONLY_FLAGS = ("--threads", "--cpu-cores", "--parent-pid", "--require-weight-update-session",
                       "--return-original-logprob", "--keep-aborted-kv")
"""Flags of the embedded engine's server that ``sglang.launch_server`` does not have (tests check
this against both parsers)."""


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def extra_args(extra: Union[Mapping[str, Any], Sequence[str], None]) -> list[str]:
    """``rollout.sglang_args.extra`` as command-line tokens (see its docstring for the dict form)."""
    if not extra:
        return []
    if not isinstance(extra, Mapping):
        return [str(token) for token in extra]
    out: list[str] = []
    for key, value in extra.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        else:
            out += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return out


def check_extra(extra: Union[Mapping[str, Any], Sequence[str], None], key: str = "rollout.sglang_args.extra",
                flags: Optional[Mapping[str, str]] = None, server: str = "sglang.launch_server") -> None:
    """Refuse ``extra`` flags the plugin sets itself (``flags``: SGLang's :data:`PLUGIN_FLAGS` by
    default) or that only the embedded engine has.

    Raises:
        ConfigError: naming ``key`` and the flag.
    """
    flags = PLUGIN_FLAGS if flags is None else flags
    if extra is not None and not isinstance(extra, (Mapping, list, tuple)):
        raise ConfigError(f"`{key}` is {extra!r}; it must be a dict or a list of command-line tokens.")
    for token in extra_args(extra):
        flag = token.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        if flag in flags:
            raise ConfigError(
                f"`{key}` sets {flag}, which the plugin sets itself from {flags[flag]}; remove it from extra."
            )
        if flag in EMBEDDED_ONLY_FLAGS:
            raise ConfigError(
                f"`{key}` sets {flag}, an option of the embedded engine that {server} does not have; "
                "remove it from extra."
            )


def sglang_server_command(
    model: str, args: SGLangArgs, port: int, tp_size: int, nccl_port: int, context_length: Optional[int],
    host: str = "127.0.0.1",
) -> list[str]:
    """``python -m sglang.launch_server ...`` for one replica, every configured flag included."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port", str(port),
           "--tp-size", str(tp_size), "--nccl-port", str(nccl_port)]
    if args.skip_server_warmup:
        cmd.append("--skip-server-warmup")
    if args.max_running_requests is not None:
        cmd += ["--max-running-requests", str(args.max_running_requests)]
    if args.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", str(args.mem_fraction_static)]
    if args.weight_version is not None:
        cmd += ["--weight-version", str(args.weight_version)]
    if context_length is not None:
        cmd += ["--context-length", str(context_length)]
    return cmd + extra_args(args.extra)


# --------------------------------------------------------------------------------------------
# What SGLang can serve
# --------------------------------------------------------------------------------------------


def sglang_architectures() -> Optional[set[str]]:
    """The model classes the installed SGLang registers (its ``srt/models/*.py`` ``EntryClass``
    names, read as text: importing them needs the GPU runtime); None when SGLang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.origin:
        return None
    models = os.path.join(os.path.dirname(spec.origin), "srt", "models")
    if not os.path.isdir(models):
        return None
    names: set[str] = set()
    pattern = re.compile(r"^EntryClass\s*=\s*(\[[^\]]*\]|\w+)", re.MULTILINE)
    for fname in os.listdir(models):
        if fname.endswith(".py"):
            with open(os.path.join(models, fname), encoding="utf-8", errors="replace") as f:
                for match in pattern.finditer(f.read()):
                    names.update(re.findall(r"\w+", match.group(1)))
    return names


def check_sglang_backend(cfg: FasyncConfig, engine_model: Optional[str], num_cpu_replicas: int = 1,
                         engine_threads: Optional[int] = None) -> list[Any]:
    """Refuse, before anything starts, a model or option SGLang cannot serve as configured; return
    the replicas' GPU plan (:func:`~lightning_fasync.fleet.resources.plan_rollout_gpus`).

    Arguments:
        cfg: the validated config (``rollout.backend: sglang``).
        engine_model: what the servers load (the policy's local Hugging Face directory).
        num_cpu_replicas, engine_threads: the trainer strategy's embedded-engine options
            (``FullyAsyncStrategy(rollout_replicas=..., engine_threads=...)``), which the sglang
            backend does not take.

    Raises:
        ConfigError: one sentence naming the key, the value and the rule.
    """
    from lightning_fasync.fleet.resources import plan_rollout_gpus
    from lightning_fasync.policy import PRESETS

    if num_cpu_replicas != 1:
        raise ConfigError(
            f"`trainer.strategy.init_args.rollout_replicas` is {num_cpu_replicas} while `rollout.backend` is sglang; "
            "it sizes the embedded engine's pool, the sglang backend's replicas come from `rollout.sglang_replicas`."
        )
    if engine_threads is not None:
        raise ConfigError(
            f"`trainer.strategy.init_args.engine_threads` is {engine_threads} while `rollout.backend` is sglang; "
            "it is an option of the embedded engine only, leave it unset."
        )
    if not engine_model:
        raise ConfigError("`model.model` is not set; `rollout.backend: sglang` needs the local Hugging Face "
                          "directory the servers load.")
    if engine_model in PRESETS:
        raise ConfigError(
            f"`model.model` is {engine_model!r}, a preset of the embedded engine that SGLang cannot load; "
            "`rollout.backend: sglang` needs a local Hugging Face model directory (or use rollout.backend: embedded)."
        )
    config_path = os.path.join(engine_model, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(
            f"`model.model` is {engine_model!r}, which is not a local Hugging Face model directory (no config.json); "
            "`rollout.backend: sglang` servers load the policy's own directory."
        )
    with open(config_path) as f:
        architectures = json.load(f).get("architectures") or []
    if not architectures:
        raise ConfigError(
            f"`model.model` is {engine_model!r}, whose config.json lists no `architectures`; SGLang picks its model "
            "class from them."
        )
    fake = os.environ.get(FAKE_SGLANG_ENV)
    if not fake and importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            "`rollout.backend` is sglang, but the `sglang` package is not importable; install SGLang with its GPU "
            "runtime (pip install 'lightning-fasync[gpu]', which installs sglang)."
        )
    known = sglang_architectures()
    if known is not None and architectures[0] not in known:
        warnings.warn(
            f"`model.model` is {engine_model!r}, a {architectures[0]}, which the installed SGLang has no model class "
            "for; SGLang will try its Transformers fallback.",
            ConfigWarning,
            stacklevel=2,
        )
    if cfg.rollout.placement == "ray":  # Ray gives each replica its GPUs on a rollout node
        from lightning_fasync.fleet.resources import GPUReplica

        return [GPUReplica(kind, i, [], []) for kind, spec in cfg.rollout.sglang_replicas.items()
                for i in range(spec.num_nodes * cfg.rollout.num_gpus_per_node // spec.num_gpus_per_replica)]
    replicas = plan_rollout_gpus(cfg)
    if not fake:
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            raise ConfigError(
                "`rollout.backend` is sglang, but no CUDA device is visible (torch.cuda.device_count() is 0); "
                "SGLang's servers run on GPUs, on CPU use rollout.backend: embedded."
            )
        needed = 1 + max(int(i) for r in replicas for i in r.indices)
        if needed > count:
            raise ConfigError(
                f"`rollout.num_gpus_per_node` is {cfg.rollout.num_gpus_per_node}: with the trainer's GPUs first "
                f"(`trainer.num_gpus_per_node` {cfg.trainer.num_gpus_per_node} unless colocated), the sglang "
                f"servers need {needed} GPUs on this host, but {count} are visible; lower the counts or run the "
                "servers elsewhere (rollout.backend: external)."
            )
    return replicas


# --------------------------------------------------------------------------------------------
# Pools
# --------------------------------------------------------------------------------------------


class _UnsupervisedPool:
    """What :class:`~lightning_fasync.runtime.rollout_runtime.RolloutRuntime` needs of a pool whose
    servers nobody restarts: URLs, clients, the weight-sync lock."""

    supervisor = None

    def __init__(self) -> None:
        self.sync_lock = threading.RLock()
        self.worker_urls: list[str] = []
        self.router_url: Optional[str] = None
        self.api_key: Optional[str] = None

    @property
    def url(self) -> str:
        """Where ``/generate`` goes: the router, or the only server."""
        return self.router_url or self.worker_urls[0]

    def client(self, **kwargs: Any) -> Any:
        """A new client of these servers (``/generate`` to the router, admin calls to every server)."""
        from lightning_fasync.fleet.client import SGLangClient

        return SGLangClient(self.worker_urls, router_url=self.router_url, api_key=self.api_key, **kwargs)

    def keep_weights(self, kept: Any) -> None:
        """No server is ever restarted here, so pushed weights are not kept: released at once."""
        kept.release()


def wait_for_health(urls: Sequence[str], timeout: float, key: str, api_key: Optional[str] = None,
                    what: str = "rollout.engine_urls") -> None:
    """Poll every URL's ``/health`` until each answers 200.

    Raises:
        EngineError: past ``timeout``, naming the URLs that did not answer and ``key``.
    """
    from lightning_fasync.pipeline.engine_client import EngineError

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    pending = {u: "no answer" for u in urls}
    deadline = time.monotonic() + timeout
    while pending:
        for url in list(pending):
            try:
                probe = max(0.5, min(5.0, deadline - time.monotonic()))
                with urllib.request.urlopen(urllib.request.Request(url + "/health", headers=headers), timeout=probe) as r:
                    if r.status == 200:
                        del pending[url]
            except urllib.error.HTTPError as exc:
                pending[url] = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                pending[url] = str(getattr(exc, "reason", exc))
        if not pending:
            return
        if time.monotonic() > deadline:
            listed = "; ".join(f"{u} ({why})" for u, why in pending.items())
            raise EngineError(
                f"The servers of `{what}` did not answer /health within {timeout:g} s (`{key}`): {listed}."
            )
        time.sleep(0.5)


class ExternalEngines(_UnsupervisedPool):
    """``rollout.backend: external``: servers someone else runs (a Slurm job, another host).

    Arguments:
        engine_urls: every server (``rollout.engine_urls``).
        router_url: the sglang-router in front of them (``rollout.router_url``), or None.
        startup_timeout: seconds they have to answer ``/health`` (``rollout.engine_startup_timeout``).
    """

    def __init__(self, engine_urls: Sequence[str], router_url: Optional[str] = None, startup_timeout: float = 180.0,
                 api_key: Optional[str] = None, client_class: Any = None) -> None:
        super().__init__()
        self.worker_urls = [u.rstrip("/") for u in engine_urls]
        self.router_url = router_url.rstrip("/") if router_url else None
        self.startup_timeout = startup_timeout
        self.api_key = api_key
        self.client_class = client_class

    def client(self, **kwargs: Any) -> Any:
        """A new client of these servers: an ``SGLangClient``, or the ``client_class`` given
        (``VLLMClient`` for vLLM servers, ``rollout.weight_sync: vllm``)."""
        if self.client_class is None:
            return super().client(**kwargs)
        return self.client_class(self.worker_urls, router_url=self.router_url, api_key=self.api_key, **kwargs)

    def start(self) -> "ExternalEngines":
        """Wait until every server (and the router) is healthy."""
        wait_for_health(self.worker_urls, self.startup_timeout, "rollout.engine_startup_timeout", self.api_key)
        if self.router_url:
            wait_for_health([self.router_url], self.startup_timeout, "rollout.engine_startup_timeout", self.api_key,
                            what="rollout.router_url")
        return self

    def stop(self) -> None:
        """Nothing to stop: the servers are not this run's."""


class SGLangPool(_UnsupervisedPool):
    """``rollout.backend: sglang``: one ``sglang.launch_server`` per replica, sglang-router in front
    of several; stopped by pid and process group.

    Arguments:
        model: the local Hugging Face directory every server loads.
        replicas: the GPU plan (:func:`~lightning_fasync.fleet.resources.plan_rollout_gpus`).
        args: ``rollout.sglang_args``.
        context_length: ``--context-length`` (the runtime's, from the datasource when not configured).
        log_dir: the run's log directory; each server logs to ``<log_dir>/sglang/<kind>-<i>.log``.
        startup_timeout: seconds each server has to answer ``/health`` (``rollout.engine_startup_timeout``).
        server_args: flags the run needs on every server, added unless ``args.extra`` has them.
        lora_rank: the adapter path (``rollout.weight_sync: adapter``): the servers' ``--max-lora-rank``;
            every client of the pool then names the trainer's adapter in each ``/generate``.
    """

    def __init__(self, model: str, replicas: Sequence[Any], args: SGLangArgs, context_length: Optional[int] = None,
                 log_dir: Optional[str] = None, startup_timeout: float = 180.0, router_policy: str = "round_robin",
                 server_args: Sequence[str] = (), placement: Any = None,
                 gpus_per_replica: Optional[dict[str, int]] = None, lora_rank: Optional[int] = None) -> None:
        super().__init__()
        self.lora_rank = lora_rank
        self.placement = placement
        self.gpus_per_replica = gpus_per_replica or {}
        if placement is not None:
            self.api_key = placement.api_key
        self.model = model
        self.replicas = list(replicas)
        self.args = args
        self.context_length = context_length
        self.log_dir = os.path.join(log_dir or tempfile.mkdtemp(prefix="fasync-"), "sglang")
        self.startup_timeout = startup_timeout
        self.router_policy = router_policy
        given = extra_args(args.extra)
        self.server_args = [a for a in server_args if a not in given]
        self.servers: list[Any] = []
        self.router: Any = None
        self._stopped = False

    def _launch(self, index: int, replica: Any) -> Any:
        from lightning_fasync.fleet.launch import free_port, spawn_watched

        fake = os.environ.get(FAKE_SGLANG_ENV)
        if self.placement is not None:  # on a rollout node: Ray gives the actor its GPUs, the server inherits them
            tp = self.gpus_per_replica[replica.kind]
            server = sglang_server_command(self.model, self.args, "{port}", tp_size=tp, nccl_port="{nccl_port}",
                                           context_length=self.context_length, host="{host}") + self.server_args
            command = [sys.executable, "-m", "lightning_fasync.fleet.watchdog", "--parent-pid", "{parent_pid}", "--",
                       *server, "--api-key", self.api_key]
            env = {"PYTHONPATH": os.pathsep.join([fake, *filter(None, [os.environ.get("PYTHONPATH")])])} if fake else {}
            return self.placement.launch(index, command, self.args.port + index if self.args.port else None, cpus=1,
                                         gpus=tp, env=env)
        port = self.args.port + index if self.args.port else free_port()
        server = sglang_server_command(self.model, self.args, port, tp_size=len(replica.gpus), nccl_port=free_port(),
                                       context_length=self.context_length) + self.server_args
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(replica.gpus))
        if fake:
            env["PYTHONPATH"] = os.pathsep.join([fake, *filter(None, [env.get("PYTHONPATH")])])
        return spawn_watched(server, replica.name, env, os.path.join(self.log_dir, f"{replica.name}.log"),
                             f"http://127.0.0.1:{port}", f"sglang server {replica.name}@{port}")

    def start(self) -> "SGLangPool":
        """Start every server at once, wait for each, then the router. Stops everything on failure."""
        from lightning_fasync.fleet.launch import launch_router

        os.makedirs(self.log_dir, exist_ok=True)
        try:
            if self.placement is not None:
                tps = [self.gpus_per_replica[r.kind] for r in self.replicas]
                self.placement.check_fits(len(self.replicas), 1, max(tps))
            for i, replica in enumerate(self.replicas):
                self.servers.append(self._launch(i, replica))
            for handle in self.servers:  # they start together: each wait mostly overlaps the others'
                handle.wait_healthy(self.startup_timeout, self.api_key, timeout_key="rollout.engine_startup_timeout")
            self.worker_urls = [h.url for h in self.servers]
            if len(self.servers) > 1 and self.placement is None:  # remote ones: the client routes (RolloutPool.start)
                self.router = launch_router(self.worker_urls, policy=self.router_policy, api_key=self.api_key,
                                            log_path=os.path.join(self.log_dir, "router.log"))
                self.router_url = self.router.url
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, **kwargs: Any) -> Any:
        if self.lora_rank is not None:
            from lightning_fasync.weights.lora_sync import DEFAULT_LORA_NAME

            kwargs.setdefault("lora_name", DEFAULT_LORA_NAME)
        client = super().client(**kwargs)
        if self.lora_rank is not None:
            client.max_lora_rank, client.max_lora_rank_key = self.lora_rank, "rollout.sglang_args.max_lora_rank"
        return client

    def stop(self) -> None:
        """Stop the router, then every server (SIGTERM, SIGKILL after a grace period), then SIGKILL
        whatever is left of each one's process group. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        errors = []
        for handle in ([self.router] if self.router is not None else []) + self.servers:
            try:
                handle.stop()
            except Exception as exc:  # keep stopping the others, then report
                errors.append(f"{handle}: {exc!r}")
            if self.placement is None or handle is self.router:  # a remote one's group is its actor's to kill
                try:
                    os.killpg(handle.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            else:
                handle.kill_tree()
        if self.placement is not None:
            try:
                self.placement.close()
            except Exception as exc:  # noqa: BLE001 - reported with the others
                errors.append(f"the Ray placement: {exc!r}")
        if errors:
            raise RuntimeError("Some sglang processes did not stop: " + "; ".join(errors))


# --------------------------------------------------------------------------------------------
# The backends' records (lightning_fasync.registry.ENGINE_BACKENDS names them)
# --------------------------------------------------------------------------------------------


def check_external_config(cfg: FasyncConfig) -> None:
    """``rollout.backend: external`` from the config alone: every server's URL is given, as http(s).

    Raises:
        ConfigError: naming the key.
    """
    ro = cfg.rollout
    if not ro.engine_urls:
        raise ConfigError("`rollout.engine_urls` is empty while `rollout.backend` is external; list every server's URL.")
    for key, url in [*((f"engine_urls[{i}]", u) for i, u in enumerate(ro.engine_urls)), ("router_url", ro.router_url)]:
        if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ConfigError(f"`rollout.{key}` is {url!r}; it must be an http:// or https:// URL.")
    if ro.boundary_mode == "inflight" and ro.inflight_kv == "keep" and ro.weight_sync != "vllm":
        warnings.warn("`rollout.weight_update_mode` is inflight with SGLang servers someone else runs: start them with "
                      "--disable-radix-cache, or a new request may reuse a prefix the old weights computed (the update "
                      "cannot flush the cache while frozen requests hold it).", ConfigWarning, stacklevel=2)


def check_sglang_config(cfg: FasyncConfig) -> None:
    """``rollout.backend: sglang`` from the config alone: the replicas' GPU split, SGLang's own
    arguments and the ``extra`` flags (what needs this host, CUDA and SGLang is :func:`check_sglang_backend`).

    Raises:
        ConfigError: naming the key.
    """
    ro, sa = cfg.rollout, cfg.rollout.sglang_args
    if not ro.sglang_replicas:
        raise ConfigError("`rollout.sglang_replicas` is empty while `rollout.backend` is sglang; name at least one replica kind.")
    if ro.num_gpus_per_node <= 0:
        raise ConfigError(f"`rollout.num_gpus_per_node` is {ro.num_gpus_per_node}; it must be a positive integer.")
    for kind, rep in ro.sglang_replicas.items():
        key = f"rollout.sglang_replicas.{kind}"
        if rep.num_nodes != 1 and ro.placement == "local":
            raise ConfigError(
                f"`{key}.num_nodes` is {rep.num_nodes} while `rollout.placement` is local; servers on other nodes need "
                "rollout.placement: ray (docs/multinode.md), or launch them yourself and use rollout.backend: external."
            )
        if rep.num_nodes < 1:
            raise ConfigError(f"`{key}.num_nodes` is {rep.num_nodes}; it must be >= 1.")
        if rep.num_gpus_per_replica <= 0 or ro.num_gpus_per_node % rep.num_gpus_per_replica:
            raise ConfigError(
                f"`{key}.num_gpus_per_replica` is {rep.num_gpus_per_replica}; it must be a positive divisor of "
                f"`rollout.num_gpus_per_node` ({ro.num_gpus_per_node})."
            )
    if sa.mem_fraction_static is not None and not 0 < sa.mem_fraction_static < 1:
        raise ConfigError(
            f"`rollout.sglang_args.mem_fraction_static` is {sa.mem_fraction_static}; it must be in (0, 1) or null."
        )
    if sa.weight_version is not None and sa.weight_version != "default" and not str(sa.weight_version).isdigit():
        raise ConfigError(
            f"`rollout.sglang_args.weight_version` is {sa.weight_version!r}; it must be default, a non-negative "
            "integer or null (the pipeline reads weight versions as integers)."
        )
    replicas = sum(ro.num_gpus_per_node // r.num_gpus_per_replica for r in ro.sglang_replicas.values())
    if sa.port is not None and not 1 <= sa.port <= 65536 - replicas:
        raise ConfigError(
            f"`rollout.sglang_args.port` is {sa.port}; it must be a TCP port (server i listens on port + i, "
            f"{replicas} servers) or null (free ports)."
        )
    check_extra(sa.extra)
    check_ray_placement(cfg)


def _start_embedded(start: EngineStart) -> Any:
    """The embedded engine: one supervised server process per replica of the plan, each pinned to its cores."""
    from lightning_fasync.errors import PipelineError
    from lightning_fasync.fleet.pool import RolloutPool

    if not start.engine_model:
        raise PipelineError(
            "The rollout engines need to know what to load: pass engine_model= (a preset such as 'tiny' or a "
            "local Hugging Face directory) or set the module's engine_model."
        )
    plan = start.plan
    placement = None
    if start.cfg.rollout.placement == "ray":
        from lightning_fasync.fleet.ray_placement import RayPlacement

        placement = RayPlacement(start.cfg, start.log_dir)
    return RolloutPool(
        start.engine_model,
        num_replicas=plan.num_replicas,
        threads_per_replica=start.engine_threads or max(1, len(plan.replica_cores[0])),
        max_running_requests=start.cfg.rollout.sglang_args.max_running_requests,
        cpu_cores=plan.replica_cores if placement is None else None,
        context_length=start.context_length,
        startup_timeout=start.startup_timeout,
        server_args=(list(start.server_args) + device_args(start.cfg.rollout.engine_device)
                     + (["--keep-aborted-kv"] if start.cfg.rollout.resume_kv == "keep" else [])),
        placement=placement,
    ).start()


def device_args(device: str) -> list[str]:
    """The embedded server's ``--device`` for ``rollout.engine_device`` (nothing for the CPU, its default)."""
    return [] if device == "cpu" else ["--device", device]


def check_ray_placement(cfg: FasyncConfig) -> None:
    """Refuse ``rollout.placement: ray`` without Ray or without the API key its replicas' servers need."""
    if cfg.rollout.placement != "ray":
        return
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("`rollout.placement` is ray, but Ray is not installed here: pip install "
                          "'lightning-fasync[ray]' (docs/multinode.md).")
    if not os.environ.get("FASYNC_ENGINE_API_KEY"):
        raise ConfigError("`rollout.placement` is ray, whose engine servers bind addresses other nodes reach: set "
                          "$FASYNC_ENGINE_API_KEY (required then on every route of every replica).")


def check_embedded_config(cfg: FasyncConfig) -> None:
    """Refuse ``rollout.engine_device`` on a GPU this process cannot see, and what
    :func:`check_ray_placement` refuses."""
    check_ray_placement(cfg)
    device = cfg.rollout.engine_device
    if device.startswith("cuda"):
        import torch

        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"`rollout.engine_device` is {device!r}, but this process sees {torch.cuda.device_count()} CUDA "
                "device(s); set it to cpu or to a visible device."
            )


def sglang_lora_args(cfg: FasyncConfig) -> list[str]:
    """SGLang's LoRA serving for the adapter path (``rollout.weight_sync: adapter``): ``--enable-lora``,
    ``--max-lora-rank`` (``rollout.sglang_args.max_lora_rank``) and every module a target; the pool's
    clients then name the trainer's adapter in each ``/generate`` (the first weight sync loads it
    before any generation). Nothing otherwise."""
    if cfg.rollout.weight_sync != "adapter":
        return []
    return ["--enable-lora", "--max-lora-rank", str(cfg.rollout.sglang_args.max_lora_rank), "--lora-target-modules", "all"]


def _start_sglang(start: EngineStart) -> "SGLangPool":
    assert start.engine_model and start.prepared is not None
    ro = start.cfg.rollout
    # In-flight updates keeping the KV cache: the update cannot flush SGLang's radix cache while the
    # frozen requests hold it, so no prefix the old weights computed may be reused by a new request.
    radix = ["--disable-radix-cache"] if start.cfg.boundary_mode == "inflight" and ro.inflight_kv == "keep" else []
    placement = None
    if ro.placement == "ray":
        from lightning_fasync.fleet.ray_placement import RayPlacement

        placement = RayPlacement(start.cfg, start.log_dir)
    lora = sglang_lora_args(start.cfg)
    return SGLangPool(start.engine_model, start.prepared, ro.sglang_args,
                      context_length=start.context_length, log_dir=start.log_dir,
                      startup_timeout=start.startup_timeout, server_args=[*start.server_args, *radix, *lora],
                      lora_rank=ro.sglang_args.max_lora_rank if lora else None,
                      placement=placement,
                      gpus_per_replica={k: v.num_gpus_per_replica for k, v in ro.sglang_replicas.items()}).start()


def _start_external(start: EngineStart) -> "ExternalEngines":
    ro = start.cfg.rollout
    client_class = None
    if ro.weight_sync == "vllm":  # vLLM servers someone else runs
        from lightning_fasync.fleet.vllm import VLLMClient

        client_class = VLLMClient
    return ExternalEngines(ro.engine_urls, ro.router_url, startup_timeout=start.startup_timeout,
                           client_class=client_class).start()


EMBEDDED = EngineBackend(
    name="embedded", start=_start_embedded, check_config=check_embedded_config, supervised=True,
    describe=lambda cfg, plan: ((f"{plan.num_replicas} embedded engine replica(s) on cores {plan.replica_cores}"
                                 if cfg.rollout.placement == "local" else
                                 f"{plan.num_replicas} embedded engine replica(s) placed by Ray ({cfg.rollout.ray.address})")
                                + ("" if cfg.rollout.engine_device == "cpu" else f", generating on {cfg.rollout.engine_device}")),
)
SGLANG = EngineBackend(
    name="sglang", start=_start_sglang, check_config=check_sglang_config, prepare=check_sglang_backend,
    describe=lambda cfg, plan: "engines of rollout.backend `sglang`" + (
        f", placed by Ray ({cfg.rollout.ray.address})" if cfg.rollout.placement == "ray" else ""),
)
EXTERNAL = EngineBackend(
    name="external", start=_start_external, check_config=check_external_config,
    describe=lambda cfg, plan: "engines of rollout.backend `external`",
)
