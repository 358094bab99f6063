"""Start engine servers and the sglang-router as child processes, and stop them by pid.

Every child gets ``--parent-pid`` (engines) or is started in its own session and stopped by the
handle (router), so a killed trainer leaves no engine behind. Startup waits on ``/health`` with a
deadline; a child that dies or never answers raises ``ServerStartError`` with its stderr tail.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Callable, Optional, Sequence

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


class ServerStartError(RuntimeError):
    """A child server exited or did not become healthy in time."""


def _ephemeral_low() -> int:
    """The first port of the system's ephemeral range (Linux's default when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``, below the system's ephemeral range.

    Between this answer and the server's own bind the port is free for anyone to take. The system
    hands out ephemeral ports all the time (every outgoing connection, every ``bind(0)``: a gloo
    process group opens dozens), so a port from that range can be gone by then; one below it is
    only ever taken by a process that names it, such as another caller of this function (1 in
    ~20,000 per pair of callers).
    """
    low = _ephemeral_low()
    if low > 11024:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(10000, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerHandle:
    """A child server process: its URL, its pid, and an idempotent ``stop``.

    Args:
        process: The child.
        url: ``http://host:port``.
        log_path: File receiving the child's stdout and stderr.
        name: For messages.
    """

    def __init__(self, process: subprocess.Popen, url: str, log_path: str, name: str) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path
        self.name = name
        self.keep_log = os.environ.get("FASYNC_KEEP_ENGINE_LOGS") == "1"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_status(self) -> Optional[int]:
        """The child's exit status (None while it runs)."""
        return self.process.poll()

    def log_tail(self, n_chars: int = 3000) -> str:
        """The last characters of the child's output."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n_chars))
                return f.read().decode(errors="replace")
        except OSError as exc:
            return f"<no log: {exc}>"

    def wait_healthy(self, timeout: float, api_key: Optional[str] = None, path: str = "/health",
                     should_stop: Callable[[], bool] = lambda: False, timeout_key: Optional[str] = None) -> None:
        """Poll ``path`` until it answers 200, the child exits, or ``timeout`` passes.

        ``should_stop``: polled between probes; when it turns true the child is stopped and
        :class:`ServerStartError` raised (a shutdown during a restart).
        ``timeout_key``: the config key of ``timeout``, named in the error when it passes.
        """
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        while True:
            if should_stop():
                self.stop()
                raise ServerStartError(f"{self.name} (pid {self.pid}): stopped while starting.")
            if not self.alive():
                raise ServerStartError(
                    f"{self.name} (pid {self.pid}) exited with status {self.exit_status()} before it was "
                    f"healthy. Output tail (full log: {self.log_path}):\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(urllib.request.Request(self.url + path, headers=headers), timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.keep_log = True
                self.stop()
                raise ServerStartError(
                    f"{self.name} (pid {self.pid}) did not answer {self.url}{path} within {timeout:.0f} s"
                    f"{f' (`{timeout_key}`)' if timeout_key else ''}. "
                    f"Output tail (full log: {self.log_path}):\n{tail}"
                )
            time.sleep(0.2)

    def kill_tree(self) -> None:
        """SIGKILL the child's whole process group (it leads its own session); reaps it. Idempotent."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; by pid, idempotent.

        The output log is removed after a stop unless ``keep_log`` (or ``FASYNC_KEEP_ENGINE_LOGS=1``).
        """
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout)
            except ProcessLookupError:
                pass
        if not self.keep_log and os.path.exists(self.log_path):
            os.unlink(self.log_path)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerHandle({self.name}, url={self.url}, pid={self.pid}, alive={self.alive()})"


def _spawn(cmd: list[str], name: str, env: Optional[dict[str, str]] = None,
           log_path: Optional[str] = None, cwd: Optional[str] = None) -> tuple[subprocess.Popen, str]:
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"fasync-{name}-", suffix=".log")
        log_file = os.fdopen(fd, "wb")
    else:
        log_file = open(log_path, "ab")
    with log_file as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True, cwd=cwd)
    return proc, log_path


def spawn_watched(server: list[str], name: str, env: dict[str, str], log_path: str, url: str, label: str,
                  cwd: Optional[str] = None, cpu_affinity: Optional[Sequence[int]] = None) -> ServerHandle:
    """Start a server command under :mod:`~lightning_fasync.fleet.watchdog` (stopped when this
    process dies) in a session of its own, the watchdog, the server and its workers one process
    group, its output in ``log_path`` (kept: the run's own log directory); not waited for.
    ``cpu_affinity``: the cores the server and its workers may run on (the watchdog sets them before
    starting it); None: this process's, inherited."""
    pin = ["--cpu-affinity", ",".join(str(c) for c in cpu_affinity)] if cpu_affinity else []
    cmd = [sys.executable, "-m", "lightning_fasync.fleet.watchdog", "--parent-pid", str(os.getpid()), *pin, "--", *server]
    proc, log_path = _spawn(cmd, name, env, log_path=log_path, cwd=cwd)
    handle = ServerHandle(proc, url, log_path, label)
    handle.keep_log = True
    return handle


def launch_server(
    model: str,
    port: Optional[int] = None,
    threads: int = 1,
    max_running_requests: Optional[int] = None,
    host: str = "127.0.0.1",
    api_key: Optional[str] = None,
    cpu_cores: Optional[Sequence[int]] = None,
    timeout: float = STARTUP_TIMEOUT_S,
    context_length: Optional[int] = None,
    extra_args: Sequence[str] = (),
    wait: bool = True,
) -> ServerHandle:
    """Start one embedded engine replica as a child process and wait until it is healthy.

    Args:
        model: Local HF directory or preset name.
        port: Port; a free one when None.
        threads: torch threads in the child.
        max_running_requests: Engine concurrency limit.
        host: Bind address.
        api_key: Require this bearer token.
        cpu_cores: Pin the child to these cores (``os.sched_setaffinity`` in the child).
        timeout: Seconds to wait for ``/health``.
        context_length: Tokens per request (prompt + response).
        extra_args: More server flags.
        wait: Wait for ``/health`` (False: the caller calls ``handle.wait_healthy`` later, e.g. to
            start several replicas in parallel).

    Returns:
        The running server's handle.

    Raises:
        ServerStartError: The child exited or stayed unhealthy; the message has its output tail.
    """
    port = port or free_port(host)
    cmd = server_args(model, threads, max_running_requests, cpu_cores, context_length, extra_args)
    cmd += ["--port", str(port), "--host", host, "--parent-pid", str(os.getpid())]
    env = server_env(threads)
    if api_key:
        env["FASYNC_ENGINE_API_KEY"] = api_key  # not on the command line, where `ps` shows it
    proc, log_path = spawn_command([*SERVE, *cmd], f"engine-{port}", {**os.environ, **env})
    handle = ServerHandle(proc, f"http://{host}:{port}", log_path, f"engine@{port}")
    if wait:
        handle.wait_healthy(timeout, api_key)
    return handle


def server_args(model: str, threads: int = 1, max_running_requests: Optional[int] = None,
                cpu_cores: Optional[Sequence[int]] = None, context_length: Optional[int] = None,
                extra_args: Sequence[str] = ()) -> list[str]:
    """``lightning-fasync serve``'s arguments for one replica, less where it listens (``--host``,
    ``--port``) and who it outlives (``--parent-pid``), which the launcher on its node adds."""
    cmd = ["--model", model, "--threads", str(threads)]
    if max_running_requests is not None:
        cmd += ["--max-running-requests", str(max_running_requests)]
    if context_length is not None:
        cmd += ["--context-length", str(context_length)]
    if cpu_cores is not None:
        cmd += ["--cpu-cores", ",".join(str(c) for c in cpu_cores)]
    return cmd + list(extra_args)


def server_env(threads: int) -> dict[str, str]:
    """The environment a replica adds to its launcher's: its OpenMP threads."""
    env = {}
    # Keep OpenMP from spinning more threads than asked for.
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(threads))
    # Idle OpenMP workers sleep instead of spinning: an engine waiting between steps (colocate's
    # training phase, a paused pipeline) must not steal the cores it shares with the trainer.
    env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    return env


SERVE = [sys.executable, "-m", "lightning_fasync.engine.server"]
"""``lightning-fasync serve`` as this interpreter runs it."""


def spawn_command(argv: Sequence[str], name: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start ``argv`` in a session of its own, its output in a temporary log; returns (process, log path)."""
    return _spawn(list(argv), name, env)


def launch_router(
    worker_urls: Sequence[str],
    port: Optional[int] = None,
    host: str = "127.0.0.1",
    policy: str = "round_robin",
    timeout: float = 60.0,
    api_key: Optional[str] = None,
    extra_args: Sequence[str] = (),
    log_path: Optional[str] = None,
) -> ServerHandle:
    """Start the real ``sglang-router`` in front of ``worker_urls`` and wait until it is healthy.

    Args:
        worker_urls: Engine URLs (already healthy).
        port: Router port; a free one when None.
        host: Bind address.
        policy: Routing policy (``round_robin``, ``cache_aware``, ``random``, ``power_of_two``).
        timeout: Seconds to wait for the router's ``/health``.
        api_key: Passed to the router (``--api-key``), which forwards it to the workers.
        extra_args: More router flags.
        log_path: Where its output goes (kept after a stop); None: a temporary file.

    Returns:
        The router's handle (stopped by pid like an engine).
    """
    port = port or free_port(host)
    # Through our wrapper, which adds the parent-death watchdog the router lacks.
    cmd = [sys.executable, "-m", "lightning_fasync.fleet.router", "--parent-pid", str(os.getpid()),
           "--worker-urls", *worker_urls,
           "--host", host, "--port", str(port), "--policy", policy, "--log-level", "warn",
           "--shutdown-grace-period-secs", "2",
           "--worker-startup-timeout-secs", str(int(timeout)),
           # Its metrics exporter would bind 0.0.0.0:29000: a second router on the host could not start.
           "--prometheus-host", host, "--prometheus-port", str(free_port(host))]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += list(extra_args)
    keep_log = log_path is not None
    proc, log_path = _spawn(cmd, f"router-{port}", log_path=log_path)
    handle = ServerHandle(proc, f"http://{host}:{port}", log_path, f"sglang-router@{port}")
    handle.keep_log = handle.keep_log or keep_log
    handle.wait_healthy(timeout, api_key)
    return handle
