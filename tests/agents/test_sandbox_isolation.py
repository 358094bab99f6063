"""The sandbox's isolation, attack by attack: each escape an outside review found against the
in-process check (issue 31) rerun against ``agentflow.sandbox.mode: bwrap``, with the in-process
check switched off by the code itself or not installed at all (the kernel alone), and shown
blocked; and the parent (this pytest process) unaffected each time: its limits, its environment's
secret, its signals, its files, no process of the run left behind, the run's disk and process
limits counted over the whole run, no network. Then the refusal where bubblewrap is missing or
fails, and the weaker ``process`` mode one must ask for, with what it does not stop."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from lightning_fasync.agents import sandbox as sandbox_module
from lightning_fasync.agents.sandbox import CHILD, Sandbox, SandboxLimits, check_config
from lightning_fasync.config.schema import AgentFlowConfig
from lightning_fasync.errors import ConfigError
from tests.helpers.paths import REPO

LIMITS = SandboxLimits(cpu_s=2.0, wall_s=5.0, memory_mb=256, file_mb=1, disk_mb=2, max_processes=6,
                       max_output=8192, max_concurrent=2)
SECRET_NAME = "FASYNC_SANDBOX_TEST_SECRET"
STDLIB = os.path.dirname(os.__file__)

# Prepended to every attack: each attempt is recorded as "done" or the exception that stopped it,
# and the results are printed as one JSON line at the end.
PRELUDE = """
import ctypes, json, os, signal, socket, stat, sys, time
results = {}
def attempt(name, fn):
    try:
        value = fn()
        results[name] = "done" if value is None else "done: " + str(value)[:200]
    except BaseException as exc:
        results[name] = "blocked: " + type(exc).__name__ + ": " + str(exc)[:120]
def libc(name, *args):
    lib = ctypes.CDLL(None, use_errno=True)
    if getattr(lib, name)(*args) == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
"""
EPILOGUE = "\nprint('RESULTS ' + json.dumps(results))\n"


def results_of(result) -> dict:
    lines = [line for line in result.output.splitlines() if line.startswith("RESULTS ")]
    assert lines, result
    return json.loads(lines[-1][len("RESULTS "):])


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line holds ``marker``."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


@pytest.fixture(scope="module")
def kernel_only():
    """The kernel's isolation alone: no audit hook in the child."""
    box = Sandbox(LIMITS, audit_hook=False)
    yield box
    box.close()


@pytest.fixture(scope="module")
def layered():
    """The default: the kernel's isolation with the in-process check as a second layer."""
    box = Sandbox(LIMITS)
    yield box
    box.close()


@pytest.fixture
def host(tmp_path, monkeypatch):
    """The parent's state that no run may change: a secret in its environment, a canary file and
    directory outside the run, its resource limits, a signal handler that counts, a listener on
    127.0.0.1 and an abstract Unix socket; checked after the test."""
    marker = f"fasync-sandbox-test-{uuid.uuid4().hex}"
    # A canary among the interpreter's own files (mounted read-only in the sandbox), for the
    # attacks that would delete or rename what they reach: a real file of the host is never at stake.
    stdlib_canary = os.path.join(STDLIB, f".{marker}-canary")
    try:
        with open(stdlib_canary, "w") as f:
            f.write("untouched")
    except OSError as exc:
        if os.geteuid() == 0:  # CI runs as root: these tests must not skip there
            raise
        pytest.skip(f"no canary can go into the interpreter's library {STDLIB} as a user other than root ({exc})")
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv(SECRET_NAME, secret)
    canary = tmp_path / "canary.txt"
    canary.write_text("untouched")
    before = canary.stat()
    limits = {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")}
    received = []
    old = signal.signal(signal.SIGUSR1, lambda *_: received.append(1))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.02)  # a connection made would be waiting already
    abstract = socket.socket(socket.AF_UNIX)
    abstract_name = f"\0fasync-sandbox-test-{uuid.uuid4().hex}"
    abstract.bind(abstract_name)
    abstract.listen(8)
    abstract.settimeout(0.02)
    # Host files a root process could write: the project's source, the interpreter's library, home.
    sensitive = {path: os.stat(path).st_mtime_ns for path in (CHILD, os.__file__, sandbox_module.__file__, stdlib_canary)}
    info = {
        "secret": secret, "canary": str(canary), "canary_dir": str(tmp_path), "pid": os.getpid(),
        "port": listener.getsockname()[1], "abstract": abstract_name, "stdlib": STDLIB, "stdlib_canary": stdlib_canary,
        "junk": f".{marker}-junk", "home_file": os.path.join(os.path.expanduser("~"), f".{marker}"),
        "bashrc": os.path.expanduser("~/.bashrc"), "project_file": CHILD,
        "project_toml": os.path.join(REPO, "pyproject.toml"),
        "venv_python": sys.executable, "marker": marker,
    }
    try:
        yield info
        assert canary.read_text() == "untouched" and canary.stat().st_mtime_ns == before.st_mtime_ns
        assert sorted(os.listdir(tmp_path)) == ["canary.txt"], os.listdir(tmp_path)
        assert not os.path.exists(info["home_file"])
        assert open(stdlib_canary).read() == "untouched"
        assert {path: os.stat(path).st_mtime_ns for path in sensitive} == sensitive
        assert [n for n in os.listdir(STDLIB) if n.startswith(info["junk"])] == []
        assert {name: resource.getrlimit(getattr(resource, name)) for name in limits} == limits
        assert received == [], "a run sent this process a signal"
        for sock in (listener, abstract):
            with pytest.raises(socket.timeout):
                sock.accept()  # nothing ever connected
        assert processes_with(info["marker"]) == []
    finally:
        signal.signal(signal.SIGUSR1, old)
        listener.close()
        abstract.close()
        for name in os.listdir(STDLIB):  # the canary, and what a broken sandbox left
            path = os.path.join(STDLIB, name)
            if name.startswith(f".{marker}") and os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            elif name.startswith(f".{marker}"):
                os.unlink(path)


def attack(template: str, host: dict) -> str:
    """An attack's code with the host's facts filled in (``{canary}``, ``{pid}``, ...)."""
    return PRELUDE + template.format(**{k: json.dumps(v) for k, v in host.items()}) + EPILOGUE


# Each escape class the review found, as the kernel sees it (the in-process check not installed).
ATTACKS = {
    # Writes outside the run's directory, plain and through every route the in-process check missed.
    # (Opened for appending and closed: a broken sandbox shows as "done" without changing a file.)
    "writes": """
attempt("canary", lambda: open({canary}, "a").close())
attempt("canary-dir", lambda: open(os.path.join({canary_dir}, "new.txt"), "w").close())
attempt("home", lambda: open({home_file}, "w").close())
attempt("bashrc", lambda: open({bashrc}, "a").close())
attempt("project-source", lambda: open({project_file}, "a").close())
attempt("project-source-inside", lambda: open("/fasync/sandbox_child.py", "a").close())
attempt("stdlib", lambda: open({stdlib_canary}, "a").close())
attempt("venv", lambda: open({venv_python}, "a").close())
attempt("root", lambda: open("/evil", "w").close())
attempt("dev", lambda: open("/dev/evil", "w").close())
attempt("dev-shm", lambda: open("/dev/shm/evil", "w").close())
""",
    # Reading what is the host's: only /usr, /lib*, the interpreter and the loader's cache are there.
    "reads": """
attempt("canary", lambda: open({canary}).read())
attempt("project", lambda: open({project_toml}).read())
attempt("bashrc", lambda: open({bashrc}).read())
attempt("passwd", lambda: open("/etc/passwd").read())
attempt("shadow", lambda: open("/etc/shadow").read())
attempt("host-dir", lambda: os.listdir({canary_dir}))
""",
    "dir_fd": """
attempt("open-host-dir", lambda: os.open({canary_dir}, os.O_RDONLY))
d = os.open({stdlib}, os.O_RDONLY)
canary = os.path.basename({stdlib_canary})
attempt("create", lambda: os.open({junk} + ".py", os.O_CREAT | os.O_WRONLY, dir_fd=d))
attempt("mkdir", lambda: os.mkdir({junk} + "-dir", dir_fd=d))
attempt("unlink", lambda: os.unlink(canary, dir_fd=d))
attempt("rename", lambda: os.rename(canary, {junk} + "-moved", src_dir_fd=d, dst_dir_fd=d))
attempt("symlink", lambda: os.symlink("/tmp", {junk} + "-link", dir_fd=d))
""",
    # A read-only descriptor to a host file; the mode, times and owner set are the file's own.
    "fd_chmod_utime": """
fd = os.open({stdlib_canary}, os.O_RDONLY)
st = os.fstat(fd)
attempt("fchmod", lambda: os.fchmod(fd, stat.S_IMODE(st.st_mode)))
attempt("futime", lambda: os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns)))
attempt("fchown", lambda: os.fchown(fd, st.st_uid, st.st_gid))
""",
    "fifo_mknod": """
attempt("mkfifo", lambda: os.mkfifo(os.path.join({stdlib}, {junk} + "-fifo")))
attempt("mknod-device", lambda: os.mknod("/tmp/null2", stat.S_IFCHR | 0o666, os.makedev(1, 3)))
attempt("mknod-outside", lambda: os.mknod(os.path.join({stdlib}, {junk} + "-node"), stat.S_IFREG | 0o644))
""",
    "sqlite_readline": """
import sqlite3, readline
attempt("sqlite3", lambda: sqlite3.connect(os.path.join({canary_dir}, "x.db")).execute("create table t (x)"))
attempt("sqlite3-stdlib", lambda: sqlite3.connect(os.path.join({stdlib}, {junk} + ".db")).execute("create table t (x)"))
attempt("readline", lambda: readline.write_history_file(os.path.join({canary_dir}, "history")))
attempt("readline-stdlib", lambda: readline.write_history_file(os.path.join({stdlib}, {junk} + "-history")))
""",
    # The parent: signals, limits, memory, environment, by its pid (the sandbox's PID namespace has
    # no such process; getppid() is the sandbox's own PID 1).
    "parent": """
import resource
attempt("pidfd-signal", lambda: signal.pidfd_send_signal(os.pidfd_open({pid}), signal.SIGUSR1))
attempt("kill", lambda: os.kill({pid}, signal.SIGUSR1))
attempt("prlimit", lambda: resource.prlimit({pid}, resource.RLIMIT_CPU, (1, 1)))
attempt("proc-mem", lambda: open("/proc/%d/mem" % {pid}, "r+b"))
attempt("proc-environ", lambda: open("/proc/%d/environ" % {pid}, "rb").read())
attempt("proc-root", lambda: os.listdir("/proc/%d/root/" % {pid}))
attempt("setuid-0", lambda: os.setuid(0))
attempt("raise-a-hard-limit", lambda: resource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6)))
""",
    "network": """
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"leak"))
attempt("abstract-unix", lambda: socket.socket(socket.AF_UNIX).connect({abstract}))
attempt("outside", lambda: socket.create_connection(("192.0.2.1", 80), timeout=1))
""",
    # What would undo the rest: a user namespace of its own (capabilities, an unbounded tmpfs).
    "namespaces": """
attempt("unshare-user", lambda: libc("unshare", 0x10000000))
attempt("unshare-mount", lambda: libc("unshare", 0x00020000))
attempt("mount-tmpfs", lambda: libc("mount", b"none", b"/tmp", b"tmpfs", 0, None))
""",
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_every_escape_is_blocked_by_the_kernel_alone_and_the_parent_is_unaffected(kernel_only, host, name):
    result = kernel_only.run_sync(attack(ATTACKS[name], host))
    assert result.outcome == "ok", result
    results = results_of(result)
    assert results and all(v.startswith("blocked: ") for v in results.values()), results
    assert host["secret"] not in result.output


def test_the_environment_holds_no_secret_of_the_parent(kernel_only, host):
    code = """
found = []
for pid in os.listdir("/proc"):
    for name in ("environ", "cmdline"):
        try:
            if {secret}.encode() in open("/proc/%s/%s" % (pid, name), "rb").read():
                found.append(pid + "/" + name)
        except OSError:
            pass
results["scan"] = found
results["env"] = sorted(os.environ)
results["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
"""
    result = kernel_only.run_sync(attack(code, host))
    results = results_of(result)
    assert results["scan"] == [] and host["secret"] not in result.output
    assert results["env"] == ["HOME", "LANG", "PATH", "PWD", "TMPDIR"]
    assert host["pid"] not in results["pids"] and len(results["pids"]) <= 3  # the sandbox's own PID namespace


def test_a_signal_to_every_process_reaches_only_the_runs_own(kernel_only, host):
    code = """
import os, signal, time
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
os.kill(-1, signal.SIGUSR1)  # every process this one may signal
print("child", os.waitpid(child, 0)[1] & 0x7f)
"""
    result = kernel_only.run_sync(code)
    assert (result.outcome, result.text) == ("ok", f"child {int(signal.SIGUSR1)}"), result  # its own child got it


@pytest.mark.parametrize("trick", [
    "import builtins\nbuiltins.any = lambda it: False",
    "import os.path\nos.path.realpath = lambda p, **k: '/tmp/x'",
    "import sys\nsys.modules['__main__']._inside = lambda *a: True",
    # Walk the frames from a path object's __fspath__, which the check itself calls, to its globals.
    "import os, sys\nclass P:\n    def __fspath__(self):\n        f = sys._getframe(1)\n"
    "        while '_inside' not in f.f_globals:\n            f = f.f_back\n"
    "        f.f_globals['_inside'] = lambda *a: True\n        return '/tmp/nothing'\n"
    "try:\n    os.remove(P())\nexcept OSError:\n    pass",
], ids=["builtins.any", "os.path.realpath", "module-globals", "frame-walk"])
def test_code_that_switches_off_the_in_process_check_still_meets_the_kernel(layered, host, trick):
    """The review's one-liners still disable the audit hook (the write is not reported as a
    violation), and the write fails all the same."""
    for target in (host["canary"], os.path.join(STDLIB, "os.py"), "/fasync/sandbox_child.py"):
        result = layered.run_sync(f"{trick}\nopen({target!r}, 'a').write('x')")
        assert result.outcome == "error", result
        assert re.search(r"error: (FileNotFoundError|OSError|PermissionError): \[Errno (2|13|30)\]", result.text), result


# Processes the in-process check never sees (multiprocessing's spawn primitive) run unchecked, and
# meet the kernel too.
SPAWN = """
import multiprocessing.util, os, sys
def spawn(code, *extra):
    return multiprocessing.util.spawnv_passfds(os.fsencode(sys.executable), [sys.executable, "-c", code, *extra], ())
"""


def test_an_unchecked_child_started_past_the_check_meets_the_kernel(layered, host):
    child = attack(ATTACKS["writes"] + ATTACKS["network"] + ATTACKS["parent"], host)
    code = SPAWN + f"pid = spawn({child!r})\nos.waitpid(pid, 0)"
    result = layered.run_sync(code)
    assert result.outcome == "ok", result
    results = results_of(result)
    assert len(results) > 20 and all(v.startswith("blocked: ") for v in results.values()), results


@pytest.mark.parametrize("layer", ["kernel", "layered"])
def test_a_fork_bomb_is_bounded_by_max_processes_over_the_whole_run(kernel_only, layered, host, layer):
    if layer == "kernel":
        code = PRELUDE + """
n = 0
for _ in range(200):
    try:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
    except OSError:
        break
    n += 1
print("forked", n)
"""
        box = kernel_only
    else:  # the check does not see spawnv_passfds; children that spawn more count too
        code = SPAWN + """
import os
n = 0
for _ in range(200):
    try:
        spawn("import time; time.sleep(5)")
    except OSError:
        break
    n += 1
print("forked", n)
"""
        box = layered
    started = time.monotonic()
    result = box.run_sync(code)
    assert result.outcome == "ok", result
    forked = int(result.output.split()[-1])
    assert 1 <= forked <= LIMITS.max_processes - 1  # the interpreter is one of max_processes
    assert time.monotonic() - started < 3  # the sleeping children did not hold the run
    assert box.running == 0


@pytest.mark.parametrize("how", ["exits", "wall-clock"])
def test_no_process_of_a_run_survives_it_not_even_in_a_session_of_its_own(host, how):
    box = Sandbox(dataclasses.replace(LIMITS, wall_s=1.0))
    try:
        code = SPAWN + f"spawn('import os, time; os.setsid(); time.sleep(30)', {host['marker']!r})\n"
        code += "import time\ntime.sleep(0.3)\nprint('spawned', flush=True)\n"
        code += "time.sleep(60)\n" if how == "wall-clock" else ""
        result = box.run_sync(code)
        assert (result.outcome, result.output.strip()) == (("ok", "spawned") if how == "exits" else ("limit", "spawned"))
        assert processes_with(host["marker"]) == []  # gone when run_sync returns
        assert box.running == 0
    finally:
        box.close()


def test_the_run_dies_with_the_trainer(host):
    """A trainer killed mid-run (SIGKILL: no cleanup of its own) takes the sandbox with it."""
    half = len(host["marker"]) // 2  # joined in the sandbox: the trainer's own command line lacks it
    code = SPAWN + f"spawn('import time; time.sleep(60)', {host['marker'][:half]!r} + {host['marker'][half:]!r})\n"
    code += "import time\ntime.sleep(60)"
    script = ("from lightning_fasync.agents.sandbox import Sandbox, SandboxLimits\n"
              f"Sandbox(SandboxLimits(wall_s=60, cpu_s=60)).run_sync({code!r})")
    trainer = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    try:
        deadline = time.monotonic() + 20
        while not processes_with(host["marker"]):
            assert time.monotonic() < deadline and trainer.poll() is None, "the sandbox never started"
            time.sleep(0.05)
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 5
        while processes_with(host["marker"]):
            assert time.monotonic() < deadline, "a sandbox process outlived its trainer"
            time.sleep(0.05)
    finally:
        trainer.kill()
        trainer.wait()
        for pid in processes_with(host["marker"]):  # only if the test failed
            os.kill(pid, signal.SIGKILL)


def test_the_disk_limit_counts_every_file_of_the_run(kernel_only, layered, host):
    # Five files of 0.9 MiB each: under the 1 MiB per-file limit, over the 2 MiB of the whole run.
    code = "chunk = b'x' * (900 * 1024)\nfor i in range(5):\n    open(f'part{i}.bin', 'wb').write(chunk)"
    for box in (kernel_only, layered):
        result = box.run_sync(code)
        assert (result.outcome, result.message) == ("limit", "disk limit exceeded"), result
    caught = PRELUDE + """
written = 0
for i in range(50):
    try:
        with open("part%d.bin" % i, "wb") as f:
            f.write(b"x" * (900 * 1024))
    except OSError:
        break
written = sum(os.path.getsize(n) for n in os.listdir(".") if n.startswith("part"))
elsewhere = []
for d in ("/dev/shm", "/dev", "/", "/proc", "/fasync"):
    try:
        open(os.path.join(d, "more.bin"), "wb").write(b"x")
        elsewhere.append(d)
    except OSError:
        pass
print("written", written, elsewhere)
"""
    result = kernel_only.run_sync(caught)
    assert result.outcome == "ok", result
    assert int(result.output.split()[-2]) <= LIMITS.disk_mb * 2**20
    assert result.output.split()[-1] == "[]"  # nowhere else to write


@pytest.mark.parametrize("mode", ["bwrap", "process"])
def test_an_exit_status_is_reported_as_it_is(mode):
    box = Sandbox(dataclasses.replace(LIMITS, mode=mode))
    try:
        for status in (90, 93, 96, 97, 98, 99, 3):
            result = box.run_sync(f"import os\nos._exit({status})")
            assert (result.outcome, result.message, result.exit_code) == ("error", f"exit status {status}", status)
        # Past 128 bubblewrap cannot tell an exit status from a signal (it reports signal N as 128 + N).
        result = box.run_sync("import os\nos._exit(137)")
        expected = ("limit", "killed (time or memory limit)", -9) if mode == "bwrap" else ("error", "exit status 137", 137)
        assert (result.outcome, result.message, result.exit_code) == expected
        # Only the in-process check's own report, with the run's token, is a violation.
        forged = box.run_sync("import os, sys\nfor fd in range(3, 64):\n    try:\n"
                              "        os.write(fd, b'V90 0123abcd\\n')\n    except OSError:\n        pass\nos._exit(90)")
        assert (forged.outcome, forged.message) == ("error", "exit status 90")
        real = box.run_sync("import socket\nsocket.socket()")
        assert (real.outcome, real.message, real.exit_code) == ("violation", "network access is not allowed", 90)
    finally:
        box.close()


# ------------------------------------------------------------------------- refusal and the weaker mode

TOOL_FLOW = "lightning_fasync.agents.flow:ToolAgentFlow"
MISSING = ("`agentflow.sandbox.mode` is bwrap but bubblewrap (bwrap) is not installed; install it (Debian: apt-get "
           "install bubblewrap) or set `agentflow.sandbox.mode: process` to accept the weaker in-process check.")


def test_without_bubblewrap_the_bwrap_mode_is_refused_in_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    with pytest.raises(ConfigError) as refused:
        Sandbox(SandboxLimits())
    assert str(refused.value) == MISSING
    with pytest.raises(ConfigError) as refused:
        check_config(AgentFlowConfig(flow=TOOL_FLOW, tools=["calculator", "python"]))
    assert str(refused.value) == MISSING
    # Nothing to refuse where no sandbox is used: no python tool, or a flow that takes no sandbox.
    check_config(AgentFlowConfig(flow=TOOL_FLOW, tools=["calculator"]))
    check_config(AgentFlowConfig())  # SingleTurnFlow
    check_config(AgentFlowConfig(flow=TOOL_FLOW, sandbox=SandboxLimits(mode="process")))


def test_a_bubblewrap_that_cannot_build_the_sandbox_is_refused_naming_why(tmp_path, monkeypatch):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace, likely because the kernel "
                    "does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(ConfigError) as refused:
        Sandbox(SandboxLimits())
    sentence = str(refused.value)
    assert sentence.startswith("`agentflow.sandbox.mode` is bwrap but bubblewrap cannot build the sandbox on this host "
                               "(bwrap: No permissions to create a new namespace, likely because the kernel does not "
                               "allow non-privileged user namespaces); ")
    assert sentence.endswith("or set `agentflow.sandbox.mode: process` to accept the weaker in-process check.")
    assert sentence.count(". ") == 0


def test_the_mode_and_limits_are_checked_with_the_config():
    with pytest.raises(ConfigError, match=r"^`agentflow.sandbox.mode` is 'docker'; it must be one of bwrap, process\.$"):
        AgentFlowConfig(sandbox=SandboxLimits(mode="docker")).check()
    for key in ("disk_mb", "max_processes"):
        with pytest.raises(ConfigError, match=rf"^`agentflow.sandbox.{key}` is 0; it must be > 0\.$"):
            AgentFlowConfig(sandbox=SandboxLimits(**{key: 0})).check()
    with pytest.raises(ValueError, match="audit_hook=False"):
        Sandbox(SandboxLimits(mode="process"), audit_hook=False)


def test_the_process_mode_works_without_bubblewrap_and_stops_only_what_its_check_sees(tmp_path, monkeypatch):
    """The weaker mode, asked for: no bubblewrap needed; the in-process check stops plain calls;
    what the review showed it misses it still misses (docs/agents.md's table says so)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    box = Sandbox(dataclasses.replace(LIMITS, mode="process"))
    try:
        assert box.run_sync("print(6 * 7)").text == "42"
        assert box.run_sync("import socket\nsocket.socket()").outcome == "violation"
        assert box.run_sync(f"open({str(tmp_path / 'plain.txt')!r}, 'w')").outcome == "violation"
        escaped = tmp_path / "via_dir_fd.txt"
        result = box.run_sync(f"import os\nd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
                              "os.close(os.open('via_dir_fd.txt', os.O_CREAT | os.O_WRONLY, dir_fd=d))\nprint('wrote')")
        assert (result.outcome, result.text) == ("ok", "wrote") and escaped.exists()  # not a boundary
    finally:
        box.close()


def test_the_bwrap_mode_and_its_kernel_layer_are_the_default():
    box = Sandbox()
    try:
        result = box.run_sync("import os\nprint(os.getuid(), os.getgid(), os.getcwd())")
        assert (result.outcome, result.output.split(), result.network_isolated) == ("ok", ["65534", "65534", "/tmp"], True)
    finally:
        box.close()
