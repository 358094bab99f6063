"""Run untrusted tool code (the policy's ``python`` tool calls) in a subprocess with hard limits.

Each run gets a fresh interpreter (``python -I -S -B``: no site-packages, no environment
variables read, no bytecode written) in a fresh temporary working directory that is deleted
afterwards, with a minimal environment, started in its own session so the whole process group is
killed at the wall-clock limit. The child (``sandbox_child.py``) limits itself before the code
runs: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), file size (``RLIMIT_FSIZE``),
64 open files, no core dumps, no new processes (``RLIMIT_NPROC``, binding for non-root users);
it moves into new user and network namespaces where the kernel allows it (no network at all),
and in every case installs a Python audit hook that ends the process on any socket, process,
signal, ``ctypes`` or interpreter-introspection event and on any write outside its directory.

What this does not guarantee: an audit hook is a tripwire, not a security boundary (PEP 578 says
so), and without the namespaces (a kernel or container that refuses unprivileged user
namespaces; :attr:`SandboxResult.network_isolated` says which) the network is closed by the hook
alone. The code runs as the trainer's user and may read what that user reads. For adversarial
code, run the whole job in a container or VM as well.

A limit hit or a violation is the run's result (``outcome`` ``limit`` or ``violation`` and an
``error: ...`` message), never an exception: the agent's episode goes on. :class:`SandboxError` is
raised only when the sandbox itself cannot work (the interpreter does not start).

Runs are blocking subprocess calls made in a small thread pool (``max_concurrent`` threads), so
:meth:`Sandbox.run` never blocks the caller's event loop and at most ``max_concurrent`` sandboxes
exist at once. No logging, no torch, no HTTP here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional

from lightning_fasync.config.schema import SandboxLimits  # noqa: F401 - agentflow.sandbox.*; re-exported

__all__ = ["Sandbox", "SandboxError", "SandboxLimits", "SandboxResult"]

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")

# Exit codes of sandbox_child.py.
_EXIT_MESSAGES = {
    90: ("violation", "network access is not allowed"),
    91: ("violation", "starting processes is not allowed"),
    92: ("violation", "native code (ctypes) is not allowed"),
    93: ("violation", "writing outside the working directory is not allowed"),
    94: ("violation", "sending signals is not allowed"),
    95: ("violation", "inspecting the interpreter's objects is not allowed"),
    96: ("limit", "memory limit exceeded"),
    97: ("limit", "file size limit exceeded"),
}
_KILL_WAIT_S = 5.0  # a SIGKILLed process group is reaped within this long


class SandboxError(RuntimeError):
    """The sandbox itself failed (its interpreter did not start), not the code it ran."""


@dataclass
class SandboxResult:
    """What one run produced.

    Attributes:
        output: stdout and stderr, merged, decoded, at most ``max_output`` bytes.
        outcome: ``ok``; ``error`` (the code raised or exited non-zero); ``limit`` (time, memory,
            file size or output limit); ``violation`` (network, processes, signals, ``ctypes``,
            writes outside the directory, interpreter introspection).
        message: why a run that is not ``ok`` ended (``time limit exceeded``, ...).
        exit_code: the child's exit status (negative: killed by that signal).
        network_isolated: whether the run had its own empty network namespace (None when the
            child died before saying).
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
        limits: the limits (``agentflow.sandbox``); default :class:`SandboxLimits`.
        python: the interpreter to run (default: this one).
        namespaces: try the user + network namespaces (False: the audit hook alone, as on a
            kernel that refuses them; tests use it to check the hook by itself).
    """

    def __init__(self, limits: Optional[SandboxLimits] = None, python: Optional[str] = None, namespaces: bool = True) -> None:
        self.limits = limits if limits is not None else SandboxLimits()
        for key in ("cpu_s", "wall_s", "memory_mb", "file_mb", "max_output", "max_concurrent"):
            if not getattr(self.limits, key) > 0:
                raise ValueError(f"`agentflow.sandbox.{key}` is {getattr(self.limits, key)}; it must be > 0.")
        self.python = python or sys.executable
        self.namespaces = namespaces
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen] = set()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._closed = False

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
        """Run ``code`` in a sandbox and wait for it (at most ``wall_s`` plus the kill)."""
        lim = self.limits
        workdir = tempfile.mkdtemp(prefix="fasync-sandbox-")
        status_r, status_w = os.pipe()
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        limits = json.dumps({k: v for k, v in asdict(lim).items() if k in ("cpu_s", "memory_mb", "file_mb")})
        try:
            try:
                proc = subprocess.Popen(
                    [self.python, "-I", "-S", "-B", CHILD, workdir, limits, str(status_w), "1" if self.namespaces else "0"],
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
                return self._communicate(proc, code, status_r)
            finally:
                with self._lock:
                    self._live.discard(proc)
        finally:
            os.close(status_r)
            shutil.rmtree(workdir, ignore_errors=True)

    def _communicate(self, proc: subprocess.Popen, code: str, status_r: int) -> SandboxResult:
        lim = self.limits
        deadline = time.monotonic() + lim.wall_s
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(code.encode("utf-8", "replace"))
            proc.stdin.close()
        except BrokenPipeError:  # the child died before reading; its exit status tells why
            pass
        output = bytearray()
        status = b""
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
                        status += chunk
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
        isolated = {b"N": True, b"A": False}.get(status[:1])
        code_ = proc.returncode
        if stopped is not None:
            return SandboxResult(text, stopped[0], stopped[1], code_, isolated)
        if code_ == 0:
            return SandboxResult(text, "ok", "", code_, isolated)
        if code_ in _EXIT_MESSAGES:
            outcome, message = _EXIT_MESSAGES[code_]
            return SandboxResult(text, outcome, message, code_, isolated)
        if isolated is None:
            raise SandboxError(f"The sandbox interpreter exited with status {code_} before running the code: {text[-500:]}")
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
