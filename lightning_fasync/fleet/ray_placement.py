"""``rollout.placement: ray``: engine replicas on other nodes, placed by a Ray cluster (docs/multinode.md).

Each replica is one Ray actor, :class:`EngineHost`, scheduled with the CPUs (or GPUs) the replica
needs plus ``rollout.ray.replica_resources`` (e.g. ``{"rollout_node": 1}``, a resource only the
rollout nodes were started with). The actor starts the embedded engine's server on its node as a
child process (``--parent-pid`` is the actor: the server exits with it), bound to the node's
address, with the run's API key (required on every route then), and answers for it: alive, kill,
stop, the log. On the trainer's side a :class:`RayServerHandle` stands where a local
:class:`~lightning_fasync.fleet.launch.ServerHandle` stands, so the pool, the router and the
engine supervisor treat remote replicas as local ones: health, restart on the same node and port
with the trainer's weights checked (``distributed`` weight sync: remote replicas share no memory
with the trainer), the log copied under the run's log directory.

Every call to an actor is bounded by ``rollout.ray.timeout_s``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Any, Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from lightning_fasync.errors import ConfigError
from lightning_fasync.fleet.launch import ServerHandle, ServerStartError, free_port, spawn_command

API_KEY_ENV = "FASYNC_ENGINE_API_KEY"


@ray.remote(max_restarts=0)
class EngineHost:
    """One replica's host on its node: starts, watches and stops the engine server there."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: Optional[subprocess.Popen] = None
        self.log_path: Optional[str] = None

    def address(self) -> str:
        return ray.util.get_node_ip_address()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def start(self, command: list[str], port: Optional[int], env: dict[str, str]) -> tuple[str, int, int]:
        """Start the server: ``command`` with its arguments ``{host}``, ``{port}`` (None: a free one on
        this node), ``{nccl_port}`` (another free one) and ``{parent_pid}`` (this actor) filled in, in a
        session of its own; returns (url, port, pid)."""
        self.stop()
        host = self.address()
        port = port or free_port(host)
        fill = {"{host}": host, "{port}": str(port), "{parent_pid}": str(os.getpid()),
                "{nccl_port}": str(free_port(host))}
        argv = [fill.get(a, a) for a in command]  # whole arguments only: a model path may hold braces
        proc, log_path = spawn_command(argv, f"{self.name}-{port}", {**os.environ, **env})
        self.proc, self.log_path = proc, log_path
        return f"http://{host}:{port}", port, proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> Optional[int]:
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL the server's process group (it leads its own session) and reap it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``. Idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.terminate()
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        except ProcessLookupError:
            pass

    def drop_log(self) -> None:
        """Remove the server's log on this node (the trainer keeps its copy)."""
        if self.log_path is not None and os.path.exists(self.log_path):
            os.unlink(self.log_path)
        self.log_path = None

    def log(self, tail: Optional[int] = None) -> str:
        """The server's output on this node (its last ``tail`` characters)."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as fh:
                if tail is not None:
                    fh.seek(0, os.SEEK_END)
                    fh.seek(max(0, fh.tell() - tail))
                return fh.read().decode(errors="replace")
        except OSError as exc:
            return f"<no log on {self.address()}: {exc}>"


class RayServerHandle(ServerHandle):
    """A replica on another node, behind its :class:`EngineHost`: a :class:`ServerHandle` to the
    pool and the supervisor. ``log_path`` is the copy of the remote log under the run's log
    directory, refreshed at every stop and restart."""

    def __init__(self, actor: Any, url: str, pid: int, log_path: str, name: str, timeout_s: float) -> None:
        self.actor, self.url, self._pid, self.log_path, self.name = actor, url, pid, log_path, name
        self.timeout_s = timeout_s
        self.keep_log = True
        self._stopped = False

    def _get(self, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError:
            raise ServerStartError(f"{self.name}: its Ray actor did not answer within {self.timeout_s:g} s "
                                   "(`rollout.ray.timeout_s`).") from None

    @property
    def pid(self) -> int:
        return self._pid

    def alive(self) -> bool:
        try:
            return bool(self._get(self.actor.alive.remote()))
        except (RayActorError, ServerStartError):
            return False

    def exit_status(self) -> Optional[int]:
        try:
            return self._get(self.actor.returncode.remote())
        except (RayActorError, ServerStartError):
            return None

    def log_tail(self, n_chars: int = 3000) -> str:
        try:
            return self._get(self.actor.log.remote(n_chars))
        except (RayActorError, ServerStartError) as exc:
            return f"<no log: {exc}>"

    def kill_tree(self) -> None:
        try:
            self._get(self.actor.kill.remote())
        except RayActorError:
            pass

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server on its node and copy its log here. Idempotent."""
        if self._stopped:
            return
        try:
            self._get(self.actor.stop.remote(timeout))
            text = self._get(self.actor.log.remote())
            with open(self.log_path, "a") as fh:
                fh.write(text)
            self._get(self.actor.drop_log.remote())
        except RayActorError:
            pass
        self._stopped = True

    def __repr__(self) -> str:
        return f"RayServerHandle({self.name}, url={self.url}, remote pid={self.pid})"


class RayPlacement:
    """Starts each replica's :class:`EngineHost` once and its server on it (again, on a restart).

    Arguments:
        cfg: the run's config (``rollout.ray.*``, the backend's GPUs per replica).
        log_dir: where the replicas' logs are copied (``<log_dir>/ray/replica-<i>.log``); None: a
            temporary directory's.
    """

    def __init__(self, cfg: Any, log_dir: Optional[str]) -> None:
        self.cfg = cfg
        self.ray_cfg = cfg.rollout.ray
        self.log_dir = os.path.join(log_dir, "ray") if log_dir else None
        self.actors: dict[int, Any] = {}
        self.where: dict[int, dict[str, str]] = {}
        """Replica index -> its node id and URL (written to ``<log_dir>/ray/placement.json``)."""
        # check_embedded_config refused a run without it, before anything started.
        self.api_key = os.environ[API_KEY_ENV]
        self._connect()

    def _connect(self) -> None:
        if not ray.is_initialized():
            ray.init(address=self.ray_cfg.address, namespace=self.ray_cfg.namespace, log_to_driver=False)

    def check_fits(self, replicas: int, cpus: float, gpus: float) -> None:
        """Refuse, before any replica starts, a layout the cluster cannot place: more replicas than
        the nodes holding ``rollout.ray.replica_resources`` have room for."""
        need = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **self.ray_cfg.replica_resources}
        room = 0
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            have = node.get("Resources", {})
            room += int(min((have.get(k, 0.0) // v if v else float("inf")) for k, v in need.items()))
        if room < replicas:
            raise ConfigError(
                f"{replicas} engine replicas need {need} each, and the Ray cluster's live nodes hold room for {room} "
                "(`rollout.ray.replica_resources`, the replicas' CPUs and GPUs); add nodes or lower the replica count."
            )

    def launch(self, index: int, command: Sequence[str], port: Optional[int], cpus: float, gpus: float,
               env: dict[str, str]) -> RayServerHandle:
        """Replica ``index``'s server, ``command`` (see :meth:`EngineHost.start`), on its actor's node
        (a new actor only the first time, or after its node went away)."""
        # The run's own FASYNC_* settings go with the replica (not a LoRA directory: a path of this host).
        forwarded = {k: v for k, v in os.environ.items() if k.startswith("FASYNC_") and k != "FASYNC_ENGINE_LORA_DIR"}
        env = {**forwarded, **env, API_KEY_ENV: self.api_key}
        for attempt in (0, 1):
            actor = self.actors.get(index)
            if actor is None:
                actor = EngineHost.options(
                    name=f"fasync-replica-{index}-{os.getpid()}", num_cpus=cpus, num_gpus=gpus,
                    resources=dict(self.ray_cfg.replica_resources) or None,
                ).remote(f"engine-{index}")
                self.actors[index] = actor
            try:
                url, _, pid = ray.get(actor.start.remote(list(command), port, env), timeout=self.ray_cfg.timeout_s)
                node = ray.get(actor.node.remote(), timeout=self.ray_cfg.timeout_s)
                break
            except GetTimeoutError:
                raise ServerStartError(f"engine replica {index}: its Ray actor was not placed within "
                                       f"{self.ray_cfg.timeout_s:g} s (`rollout.ray.timeout_s`); do the nodes holding "
                                       f"{self.ray_cfg.replica_resources or 'CPUs'} have room?") from None
            except RayActorError:
                if attempt:
                    raise
                self.actors.pop(index)  # its node went away: a new actor, wherever Ray places it
        log_dir = self.log_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"), "fasync-ray-logs")
        os.makedirs(log_dir, exist_ok=True)
        self.where[index] = {"node": node, "url": url}
        with open(os.path.join(log_dir, "placement.json"), "w") as fh:
            json.dump({"trainer_node": ray.get_runtime_context().get_node_id(), "replicas": self.where}, fh, indent=1)
        return RayServerHandle(actor, url, pid, os.path.join(log_dir, f"replica-{index}.log"), f"engine replica {index}",
                               self.ray_cfg.timeout_s)

    def close(self) -> None:
        """Kill every actor (their servers exit with them) and leave the cluster. Idempotent."""
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass
        self.actors.clear()
        if ray.is_initialized():
            ray.shutdown()
