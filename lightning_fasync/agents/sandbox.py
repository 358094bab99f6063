"""Run untrusted tool code (the policy's ``python`` tool calls) in a sandbox the kernel enforces.

``agentflow.sandbox.mode: bwrap`` (the default) runs each call in bubblewrap (``bwrap``, the
distribution's package): new user, PID, mount, network, IPC, UTS and cgroup namespaces, dying with
the trainer. Inside, the code runs as uid/gid 65534 with no capabilities and no further user
namespaces, in a fresh interpreter (``python -I -S -B``: no site-packages, no environment variables
read, no bytecode written) with only ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` (and bubblewrap's
``PWD``) set. It sees a
root of its own: ``/usr``, ``/lib*``, the Python installation and the dynamic loader's cache,
read-only; its own ``/proc`` (only the run's processes) and a minimal ``/dev``; and one writable
place, ``/tmp``, a tmpfs of ``disk_mb`` that is the working directory and is gone with the run. No
network interface but loopback, nothing of the trainer's (its processes, files, environment,
sockets) reachable. Limits per run: ``max_processes`` processes and threads (``RLIMIT_NPROC``,
which binds because the uid is not root, counted in the run's own user namespace), and per process
CPU seconds, address space, file size and 64 open files. At the wall-clock limit, or when the
code's interpreter exits, the sandbox's PID 1 is killed, and the kernel kills every process of the
run with it; :meth:`Sandbox.run_sync` returns only once they are gone.

When the trainer runs as root, bubblewrap's user namespace maps uid 0 and 65534 to the same host
uids (written by this module through ``--userns-block-fd``); the child finishes the setup as uid
0 there (forbidding further user namespaces), then drops to 65534 for good before it reads the
code. Run as any other user, bubblewrap maps that user to 65534 itself (``--disable-userns``).
Where bubblewrap is missing or cannot build the sandbox, :class:`Sandbox` refuses to start (and
:func:`check_config` refuses the config) in one sentence naming what is missing. Not used: a seccomp
filter or Landlock (the kernel's whole system-call surface stays reachable) and cgroups (memory and
CPU are bounded per process, the process count per run); docs/agents.md has the guarantees.

``mode: process`` is the weaker one a user must ask for: a plain subprocess in its own session
and a temporary directory, user + network namespaces where the kernel allows them
(:attr:`SandboxResult.network_isolated` says), the same per-process limits, and only the in-process
check (``sandbox_child.py``'s audit hook) against writes outside the directory, processes and
signals: a tripwire that the code it watches can switch off (PEP 578 says so). Under bubblewrap
that hook stays on as a second layer; it is what turns a forbidden call into a clear
``error: ...`` answer, while the kernel's isolation holds whether it is on or not.

A limit hit or a violation is the run's result (``outcome`` ``limit`` or ``violation`` and an
``error: ...`` message), never an exception: the agent's episode goes on. A violation or a limit
counts only when the child reported it with the run's token (a plain ``os._exit(90)`` is exit
status 90). :class:`SandboxError` is raised only when the sandbox itself cannot work.

Runs are blocking subprocess calls made in a small thread pool (``max_concurrent`` threads), so
:meth:`Sandbox.run` never blocks the caller's event loop and at most ``max_concurrent`` sandboxes
exist at once. No logging, no torch, no HTTP here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from lightning_fasync.config.schema import SandboxLimits  # noqa: F401 - agentflow.sandbox.*; re-exported
from lightning_fasync.errors import ConfigError

__all__ = ["Sandbox", "SandboxError", "SandboxLimits", "SandboxResult", "check_config", "check_host"]

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")

SANDBOX_ID = 65534
"""The uid and gid the code runs as under bubblewrap (``nobody``)."""

_CHILD_INSIDE = "/fasync/sandbox_child.py"  # where the child's file is mounted in the sandbox
_WORKDIR_INSIDE = "/tmp"  # the run's tmpfs; HOME, TMPDIR and the working directory
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
# Host files the interpreter may need, mounted read-only where they exist.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")

# What the child reports on its status pipe (sandbox_child.py): kind and exit code -> result.
_REPORTS = {
    ("V", 90): ("violation", "network access is not allowed"),
    ("V", 91): ("violation", "starting processes is not allowed"),
    ("V", 92): ("violation", "native code (ctypes) is not allowed"),
    ("V", 93): ("violation", "writing outside the working directory is not allowed"),
    ("V", 94): ("violation", "sending signals is not allowed"),
    ("V", 95): ("violation", "inspecting the interpreter's objects is not allowed"),
    ("L", 96): ("limit", "memory limit exceeded"),
    ("L", 97): ("limit", "file size limit exceeded"),
    ("L", 98): ("limit", "disk limit exceeded"),
}
_STATUS_MAX = 4096  # bytes of the status pipe kept (the code can write to it too)
_KILL_WAIT_S = 5.0  # a killed sandbox is gone within this long
_SETUP_S = 30.0
"""How long bubblewrap may take to set up a sandbox (namespaces, mounts, the id maps) before the
code starts. The code's own ``wall_s`` starts once it may run: on a loaded 2-core machine a setup
took over the 3 s a test's ``wall_s`` allows, nothing of the code having run."""

_PROBES: dict[tuple, Optional[str]] = {}  # (bwrap, interpreter, euid) -> None or why bwrap fails here
_PROBES_LOCK = threading.Lock()


class SandboxError(RuntimeError):
    """The sandbox itself failed (bubblewrap or its interpreter did not start), not the code it ran;
    ``output`` is what it printed."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass
class SandboxResult:
    """What one run produced.

    Attributes:
        output: stdout and stderr, merged, decoded, at most ``max_output`` bytes.
        outcome: ``ok``; ``error`` (the code raised or exited non-zero); ``limit`` (time, memory,
            file size, disk or output limit); ``violation`` (the in-process check stopped a
            network, process, signal, ``ctypes``, write or introspection call).
        message: why a run that is not ``ok`` ended (``time limit exceeded``, ...).
        exit_code: the child's exit status (negative: killed by that signal; bubblewrap reports
            a signal N as status 128 + N, read back as -N).
        network_isolated: whether the run had its own network namespace (always under bubblewrap;
            None when the child died before saying).
    """

    output: str
    outcome: str
    message: str = ""
    exit_code: Optional[int] = None
    network_isolated: Optional[bool] = None

    @property
    def text(self) -> str:
        """The tool's answer: the output, then ``error: <message>`` when the run did not end well."""
        out = self.output.rstrip("\n")
        if self.outcome == "ok":
            return out
        if self.outcome == "error" and out.splitlines()[-1:] and out.splitlines()[-1].startswith("error: "):
            return out  # the child already printed the exception as "error: ..."
        error = f"error: {self.message}"
        return f"{out}\n{error}" if out else error


class Sandbox:
    """Runs Python code under :class:`SandboxLimits`; safe to share across episodes and threads.

    Arguments:
        limits: the mode and limits (``agentflow.sandbox``); default :class:`SandboxLimits`.
        python: the interpreter to run (default: this one's installation).
        audit_hook: install the in-process check (False: the kernel's isolation alone, mode
            ``bwrap`` only; tests use it to show that isolation holds by itself).

    Raises:
        ConfigError: a limit out of range, or mode ``bwrap`` on a host where bubblewrap is missing
            or cannot create the sandbox (one sentence naming what is missing).
    """

    def __init__(self, limits: Optional[SandboxLimits] = None, python: Optional[str] = None, audit_hook: bool = True) -> None:
        self.limits = limits if limits is not None else SandboxLimits()
        self.limits.check()
        if not audit_hook and self.limits.mode != "bwrap":
            raise ValueError(
                "Sandbox(audit_hook=False) needs `agentflow.sandbox.mode: bwrap`; the process mode has no other layer."
            )
        self.python = python or sys.executable
        self.audit_hook = audit_hook
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen] = set()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._closed = False
        self._bwrap: Optional[str] = None
        self._mounts: list[str] = []
        if self.limits.mode == "bwrap":
            self._bwrap, self._mounts = self._prepare_bwrap()

    @property
    def running(self) -> int:
        """Sandbox processes alive now (at most ``max_concurrent``)."""
        with self._lock:
            return len(self._live)

    async def run(self, code: str) -> SandboxResult:
        """Run ``code`` in a sandbox off the event loop; waits for a free slot first."""
        with self._lock:
            if self._closed:
                raise SandboxError("The sandbox is closed.")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(self.limits.max_concurrent, "fasync-sandbox")
            executor = self._executor
        return await asyncio.get_running_loop().run_in_executor(executor, self.run_sync, code)

    def run_sync(self, code: str) -> SandboxResult:
        """Run ``code`` in a sandbox and wait for it (at most ``wall_s`` plus the kill); when this
        returns, no process of the run is left (mode ``bwrap``)."""
        if self.limits.mode == "bwrap":
            return self._run_bwrap(code)
        return self._run_process(code)

    # ------------------------------------------------------------------ bubblewrap

    def _prepare_bwrap(self) -> tuple[str, list[str]]:
        """bubblewrap's path and the interpreter's directories to mount, once the host has been
        seen to build a working sandbox (cached per bwrap, interpreter and user)."""
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise ConfigError(
                "`agentflow.sandbox.mode` is bwrap but bubblewrap (bwrap) is not installed; install it (Debian: apt-get "
                "install bubblewrap) or set `agentflow.sandbox.mode: process` to accept the weaker in-process check."
            )
        mounts = _interpreter_dirs(self.python)
        key = (bwrap, os.path.realpath(self.python), os.geteuid())
        with _PROBES_LOCK:
            if key not in _PROBES:
                _PROBES[key] = self._probe(bwrap, mounts)
            problem = _PROBES[key]
        if problem is not None:
            raise ConfigError(
                f"`agentflow.sandbox.mode` is bwrap but bubblewrap cannot build the sandbox on this host ({problem}); it "
                "needs user, PID, mount and network namespaces (a container must allow them, a kernel may need "
                "kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0), or set "
                "`agentflow.sandbox.mode: process` to accept the weaker in-process check."
            )
        return bwrap, mounts

    def _probe(self, bwrap: str, mounts: list[str]) -> Optional[str]:
        """None where a real run under the default limits (the host is what is tried, not the
        configured limits) prints; else why not, in bubblewrap's words where it gave some."""
        limits, self.limits = self.limits, SandboxLimits()
        self._bwrap, self._mounts = bwrap, mounts
        try:
            result = self._run_bwrap("print('ok')")
        except SandboxError as exc:
            lines = [line.strip() for line in (exc.output or str(exc)).splitlines() if line.strip()]
            return lines[-1].rstrip(".") if lines else str(exc).rstrip(".")
        finally:
            self.limits, self._bwrap, self._mounts = limits, None, []
        if (result.outcome, result.output.strip()) != ("ok", "ok"):
            return f"a test run ended with {result.outcome}: {result.text[-300:]!r}"
        return None

    def _bwrap_argv(self, status_w: int, info_w: int, block_r: int, as_root: bool) -> list[str]:
        lim = self.limits
        argv = [self._bwrap or "bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
                "--cap-drop", "ALL", "--info-fd", str(info_w)]
        if as_root:
            # Uid 0 and 65534 mapped (written by _write_id_maps); the child drops to 65534.
            argv += ["--userns-block-fd", str(block_r),
                     "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SYS_RESOURCE"]
            nproc = lim.max_processes  # the sandbox's init stays uid 0: not counted
        else:
            argv += ["--block-fd", str(block_r), "--disable-userns", "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID)]
            nproc = lim.max_processes + 1  # the sandbox's init runs as the same uid
        for path in _SYSTEM_DIRS:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        for path in _ETC_FILES:
            argv += ["--ro-bind-try", path, path]
        for path in self._mounts:
            for parent in _parents(path):  # created 0755: the host's may be closed (a 0700 home)
                argv += ["--perms", "0755", "--dir", parent]
            argv += ["--ro-bind", path, path]
        argv += ["--perms", "0755", "--dir", os.path.dirname(_CHILD_INSIDE), "--ro-bind", CHILD, _CHILD_INSIDE,
                 "--proc", "/proc", "--dev", "/dev",
                 "--perms", "1777", "--size", str(lim.disk_mb * 2**20), "--tmpfs", _WORKDIR_INSIDE,
                 "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", _WORKDIR_INSIDE, "--clearenv"]
        for name, value in {**_ENV, "HOME": _WORKDIR_INSIDE, "TMPDIR": _WORKDIR_INSIDE}.items():
            argv += ["--setenv", name, value]
        limits = json.dumps({"cpu_s": lim.cpu_s, "memory_mb": lim.memory_mb, "file_mb": lim.file_mb, "nproc": nproc})
        argv += ["--", os.path.realpath(self.python), "-I", "-S", "-B", _CHILD_INSIDE, _WORKDIR_INSIDE, limits,
                 str(status_w), "drop" if as_root else "none", "1" if self.audit_hook else "0"]
        return argv

    def _run_bwrap(self, code: str) -> SandboxResult:
        setup_deadline = time.monotonic() + _SETUP_S
        as_root = os.geteuid() == 0
        status_r, status_w = os.pipe()
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        pidfd: Optional[int] = None
        try:
            try:
                proc = subprocess.Popen(
                    self._bwrap_argv(status_w, info_w, block_r, as_root),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd="/", env={},
                    start_new_session=True, pass_fds=(status_w, info_w, block_r), close_fds=True,
                    extra_groups=[] if as_root else None,  # root's supplementary groups stay outside
                )
            except OSError as exc:
                raise SandboxError(f"bubblewrap ({self._bwrap}) could not start: {exc}.") from exc
            finally:
                for fd in (status_w, info_w, block_r):
                    os.close(fd)
            with self._lock:
                self._live.add(proc)
            try:
                try:
                    pid = _read_child_pid(info_r, setup_deadline)
                    if pid is not None:
                        pidfd = os.pidfd_open(pid)  # the sandbox's PID 1: blocked on block_w, so still there
                        if as_root:
                            _write_id_maps(pid)
                except OSError as exc:
                    self._kill(proc)
                    raise SandboxError(f"The sandbox could not be set up: {exc}.") from exc
                deadline = time.monotonic() + self.limits.wall_s  # the code's time starts as it may run
                try:
                    os.write(block_w, b"1")  # go on (a bubblewrap that failed is gone: its output says why)
                except BrokenPipeError:
                    pass
                os.close(block_w)
                block_w = -1
                return self._communicate(proc, code, status_r, deadline, signals_as_status=True)
            finally:
                if block_w != -1:
                    os.close(block_w)
                if pidfd is not None:
                    _reap(pidfd)
                with self._lock:
                    self._live.discard(proc)
        finally:
            os.close(status_r)
            os.close(info_r)

    # ------------------------------------------------------------------ process mode

    def _run_process(self, code: str) -> SandboxResult:
        lim = self.limits
        deadline = time.monotonic() + lim.wall_s
        workdir = tempfile.mkdtemp(prefix="fasync-sandbox-")
        status_r, status_w = os.pipe()
        env = {**_ENV, "HOME": workdir, "TMPDIR": workdir}
        limits = json.dumps({"cpu_s": lim.cpu_s, "memory_mb": lim.memory_mb, "file_mb": lim.file_mb, "nproc": 0})
        try:
            try:
                proc = subprocess.Popen(
                    [self.python, "-I", "-S", "-B", CHILD, workdir, limits, str(status_w), "unshare", "1"],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=workdir, env=env,
                    start_new_session=True, pass_fds=(status_w,), close_fds=True,
                )
            except OSError as exc:
                raise SandboxError(f"The sandbox interpreter {self.python} could not start: {exc}.") from exc
            finally:
                os.close(status_w)
            with self._lock:
                self._live.add(proc)
            try:
                return self._communicate(proc, code, status_r, deadline, signals_as_status=False)
            finally:
                self._kill(proc)  # what is left of its process group (a child in a session of its own is not)
                with self._lock:
                    self._live.discard(proc)
        finally:
            os.close(status_r)
            shutil.rmtree(workdir, ignore_errors=True)

    # ------------------------------------------------------------------ both

    def _communicate(self, proc: subprocess.Popen, code: str, status_r: int, deadline: float,
                     signals_as_status: bool) -> SandboxResult:
        lim = self.limits
        token = secrets.token_hex(16)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(f"{token}\n{code}".encode("utf-8", "replace"))
            proc.stdin.close()
        except BrokenPipeError:  # the child died before reading; its exit status tells why
            pass
        output = bytearray()
        status = bytearray()
        stopped: Optional[tuple[str, str]] = None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, "out")
            sel.register(status_r, selectors.EVENT_READ, "status")
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    stopped = ("limit", "time limit exceeded")
                    break
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.data == "status":
                        status += chunk[: max(0, _STATUS_MAX - len(status))]
                    else:
                        output += chunk
                if len(output) > lim.max_output:
                    stopped = ("limit", "output limit exceeded")
                    break
        if stopped is None:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stopped = ("limit", "time limit exceeded")
        if stopped is not None:
            self._kill(proc)
        proc.stdout.close()
        text = bytes(output[: lim.max_output]).decode("utf-8", "replace")
        lines = bytes(status).decode("utf-8", "replace").splitlines()
        ready = next((line for line in lines if line.startswith("ready ")), None)
        isolated = {"ready N": True, "ready A": False}.get(ready) if ready else None
        code_ = proc.returncode
        if signals_as_status and code_ is not None and code_ > 128 and code_ - 128 in signal.valid_signals():
            code_ = -(code_ - 128)  # bubblewrap's "killed by signal N"
        if stopped is not None:
            return SandboxResult(text, stopped[0], stopped[1], code_, isolated)
        if ready is None:
            raise SandboxError(f"The sandbox exited with status {code_} before running the code: {text[-500:]}", text)
        reported = [m.groups() for m in (re.fullmatch(r"([VL])(\d+) ([0-9a-f]+)", line) for line in lines) if m]
        for kind, number, line_token in reported:
            if line_token == token and int(number) == code_ and (kind, code_) in _REPORTS:
                outcome, message = _REPORTS[(kind, code_)]
                return SandboxResult(text, outcome, message, code_, isolated)
        if code_ == 0:
            return SandboxResult(text, "ok", "", code_, isolated)
        if code_ == -signal.SIGXCPU:  # RLIMIT_CPU's soft limit
            return SandboxResult(text, "limit", "time limit exceeded", code_, isolated)
        if code_ == -signal.SIGKILL:  # RLIMIT_CPU's hard limit (SIGXCPU ignored), or the kernel's OOM killer
            return SandboxResult(text, "limit", "killed (time or memory limit)", code_, isolated)
        if code_ < 0:
            try:
                name = signal.Signals(-code_).name
            except ValueError:
                name = f"signal {-code_}"
            return SandboxResult(text, "error", f"killed by {name}", code_, isolated)
        return SandboxResult(text, "error", f"exit status {code_}", code_, isolated)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """SIGKILL ``proc``'s process group (bubblewrap's launcher: the sandbox's PID 1 and every
        process of the run die with it) and reap it."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        """Kill running sandboxes and stop the thread pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            live = list(self._live)
            executor, self._executor = self._executor, None
        for proc in live:
            self._kill(proc)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


def check_host(limits: SandboxLimits, python: Optional[str] = None) -> None:
    """Refuse, in one sentence naming what is missing, a host that cannot give ``limits.mode``'s
    isolation (mode ``bwrap``: bubblewrap installed and able to build the sandbox, tried once per
    process with a real run).

    Raises:
        ConfigError: as :class:`Sandbox` raises it.
    """
    Sandbox(limits, python).close()


def check_config(agentflow: Any) -> None:
    """``agentflow.*``'s part that depends on this host, checked with the rest of the config before
    anything starts: when ``agentflow.tools`` has ``python`` and ``agentflow.flow`` takes a
    ``sandbox``, :func:`check_host` of ``agentflow.sandbox``. A flow that cannot be imported is left
    to the runtime, which names it."""
    if "python" not in agentflow.tools:
        return
    from lightning_fasync.components import load_object

    try:
        parameters = inspect.signature(load_object(agentflow.flow, "agentflow.flow")).parameters
    except (ConfigError, TypeError, ValueError):
        return
    if "sandbox" in parameters:
        check_host(agentflow.sandbox)


# ------------------------------------------------------------------------------------ helpers


def _interpreter_dirs(python: str) -> list[str]:
    """The directories ``python`` runs from (its installation's prefixes and the executable's
    directory) that the system directories do not already hold, outermost first."""
    real = os.path.realpath(python)
    if real == os.path.realpath(sys.executable):
        prefixes = [sys.base_prefix, sys.base_exec_prefix]
    else:
        try:
            out = subprocess.run([real, "-I", "-S", "-c", "import sys; print(sys.base_prefix); print(sys.base_exec_prefix)"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxError(f"The sandbox interpreter {python} could not start: {exc}.") from exc
        prefixes = out.split()
    dirs: list[str] = []
    for path in sorted({os.path.realpath(p) for p in [*prefixes, os.path.dirname(real)]}):
        covered = [d for d in (*_SYSTEM_DIRS, *dirs) if path == d or path.startswith(d.rstrip("/") + "/")]
        if not covered and path != "/":
            dirs.append(path)
    return dirs


def _parents(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/a", "/a/b"]``."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _read_child_pid(info_r: int, deadline: float) -> Optional[int]:
    """The sandbox's PID 1 (a host pid) from bubblewrap's ``--info-fd`` JSON; None when bubblewrap
    closed it without one (it failed: its message is in the output)."""
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(info_r, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise OSError("bubblewrap did not report its sandbox in time")
            chunk = os.read(info_r, 4096)
            if not chunk:
                break
            data += chunk
    if not data:
        return None
    try:
        return int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError) as exc:
        raise OSError(f"bubblewrap's --info-fd said {data[:200]!r}") from exc


def _write_id_maps(pid: int) -> None:
    """Map uid/gid 0 and 65534 of the sandbox's user namespace to the same host ids (root only)."""
    mapping = f"0 0 1\n{SANDBOX_ID} {SANDBOX_ID} 1\n"
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
            f.write(mapping)


def _reap(pidfd: int) -> None:
    """Wait until the sandbox's PID 1 has exited (the kernel has then killed and reaped every other
    process of its PID namespace), killing it if it lingers; closes ``pidfd``."""
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(pidfd, selectors.EVENT_READ)
            if not sel.select(_KILL_WAIT_S):
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                sel.select(_KILL_WAIT_S)
    finally:
        os.close(pidfd)
