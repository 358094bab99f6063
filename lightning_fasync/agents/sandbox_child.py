"""The sandbox's child process: ``python -I -S -B sandbox_child.py WORKDIR LIMITS_JSON STATUS_FD SETUP HOOK``.

Standard library only, and nothing here is imported by the package: the parent
(:mod:`lightning_fasync.agents.sandbox`) runs this file in a fresh interpreter (inside bubblewrap,
or as a plain subprocess in the weaker ``process`` mode), writes a per-run token line and then the
untrusted code to its stdin, and reads its merged stdout/stderr. Before the code runs, this process

1. finishes the isolation (``SETUP``): ``drop`` (bubblewrap started by root: this process starts as
   uid 0 of the sandbox's own user namespace, which maps uid 0 and 65534 only; it forbids further
   user namespaces in it, then drops to uid/gid 65534 for good, which clears every capability);
   ``none`` (bubblewrap started by another user already made it uid 65534 without capabilities);
   ``unshare`` (``process`` mode: new user and network namespaces where the kernel allows them, so
   no network interface but a downed loopback);
2. reads the token and the code, then points stdin at ``/dev/null``;
3. sets its own hard limits: CPU seconds, address space, file size, open files, no core dumps and
   processes (``RLIMIT_NPROC``; binding because the uid is not root, except in ``process`` mode
   under a root trainer);
4. says ``ready`` on ``STATUS_FD`` (the parent refuses a run whose child never said it);
5. unless ``HOOK`` is ``0``, installs an audit hook (PEP 578) that ends the process the moment the
   code opens a socket, starts a process, sends a signal, loads ``ctypes``, writes outside
   ``WORKDIR`` or walks the interpreter's objects.

A violation (the hook) or a limit (an exception this file catches after the code) is reported as a
line ``V<code> <token>`` or ``L<code> <token>`` on ``STATUS_FD`` before the process ends with that
code; the parent counts only reports with the run's token, so a plain ``os._exit(90)`` is an exit
status, not a violation. The hook and these reports live in the process the code runs in: code that
defeats them (PEP 578 says an audit hook is no security boundary) can also suppress or fake them.
Under bubblewrap the isolation that matters is the kernel's, set up before any of the code runs.
"""

import json
import os
import sys

# Exit codes; the parent maps reported ones to messages (sandbox.py, _REPORTS).
EXIT_NETWORK = 90
EXIT_PROCESS = 91
EXIT_NATIVE = 92
EXIT_WRITE = 93
EXIT_SIGNAL = 94
EXIT_INTROSPECTION = 95
EXIT_MEMORY = 96
EXIT_FILE_SIZE = 97
EXIT_DISK = 98
EXIT_SETUP = 99  # the isolation could not be finished: the code never runs

SANDBOX_ID = 65534  # the uid and gid the code runs as under bubblewrap

_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000

_PROCESS_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "pty.spawn", "os.startfile")
_SIGNAL_EVENTS = ("os.kill", "os.killpg", "signal.pthread_kill")
_INTROSPECTION_EVENTS = ("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames")
# Events whose first argument is a path the call creates, changes or removes.
_PATH_EVENTS = ("os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime",
                "os.chflags", "os.lchflags", "os.setxattr", "os.removexattr", "shutil.rmtree")
# Events with two paths, both of which must stay inside the working directory (a link or a move
# out of it, or a link that points out of it).
_TWO_PATH_EVENTS = ("os.rename", "os.link", "os.symlink", "shutil.move")
# Copies: only the destination is written.
_COPY_EVENTS = ("shutil.copyfile", "shutil.copytree")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _unshare_network() -> bool:
    """New user + network namespaces for this (single-threaded) process; False where refused."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0
    except (OSError, AttributeError):
        ok = False
    # ctypes stays unreachable for the code: the hook refuses its import and every ctypes event.
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith(("ctypes.", "_ctypes"))]:
        del sys.modules[name]
    return ok


def _drop_to_sandbox_user() -> None:
    """Uid 0 of the sandbox's user namespace -> uid/gid 65534 there, no capabilities, no way back.

    First ``user.max_user_namespaces`` of this namespace goes to 0 (it needs ``CAP_SYS_RESOURCE``
    here, which only this step has): the code can then create no user namespace of its own, so no
    capabilities anywhere and no file system of its own (an unbounded tmpfs) to mount.
    """
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    os.setgroups([])
    os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
    os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)


def _check_unprivileged() -> None:
    """Refuse to go on unless this process is uid/gid 65534 with no capabilities at all."""
    with open("/proc/self/status") as f:
        caps = [line.split()[1] for line in f if line.startswith(("CapPrm:", "CapEff:", "CapAmb:"))]
    if os.getresuid() != (SANDBOX_ID,) * 3 or os.getresgid() != (SANDBOX_ID,) * 3 or any(int(c, 16) for c in caps):
        raise OSError(f"the sandbox process is uid {os.getresuid()}, gid {os.getresgid()}, capabilities {caps}")


def _set_limits(limits: dict) -> None:
    import resource

    cpu = max(1, int(limits["cpu_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL a second later
    memory = int(limits["memory_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    size = int(limits["file_mb"]) * 2**20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    try:
        # Counted per uid in the run's own user namespace under bubblewrap (the sandbox's init
        # included where it runs as the same uid; the parent says how many that makes). Root and
        # CAP_SYS_RESOURCE ignore it: only the process mode under a root trainer has neither.
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"], limits["nproc"]))
    except (ValueError, OSError):
        pass


def _inside(path, root: str) -> bool:
    if isinstance(path, int):  # an already open descriptor (stdout, a file opened inside)
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return False
    return real == root or real.startswith(root + os.sep)


def _reporter(status_fd: int, token: str):
    """``report(kind, code)``: write ``<kind><code> <token>`` on the status pipe, flush, end the process."""
    write, exit_now = os.write, os._exit  # bound now: the code may replace the os module's names

    def report(kind: str, code: int) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - the process ends either way
                pass
        try:
            write(status_fd, f"{kind}{code} {token}\n".encode())
        except OSError:
            pass
        exit_now(code)

    return report


def _make_hook(root: str, report):
    def stop(code: int) -> None:
        report("V", code)

    def hook(event: str, args: tuple) -> None:
        if event.startswith("socket."):
            stop(EXIT_NETWORK)
        elif event.startswith(_PROCESS_EVENTS):
            stop(EXIT_PROCESS)
        elif event.startswith("ctypes.") or (event == "import" and args and str(args[0]).split(".")[0] in ("ctypes", "_ctypes")):
            stop(EXIT_NATIVE)
        elif event in _SIGNAL_EVENTS:
            stop(EXIT_SIGNAL)
        elif event in _INTROSPECTION_EVENTS:
            stop(EXIT_INTROSPECTION)
        elif event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
            if writes and not _inside(path, root):
                stop(EXIT_WRITE)
        elif event in _PATH_EVENTS:
            if args and not _inside(args[0], root):
                stop(EXIT_WRITE)
        elif event in _TWO_PATH_EVENTS:
            if not all(_inside(p, root) for p in args[:2]):
                stop(EXIT_WRITE)
        elif event in _COPY_EVENTS:
            if len(args) > 1 and not _inside(args[1], root):
                stop(EXIT_WRITE)

    return hook


def main() -> None:
    workdir, limits, status_fd = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    setup, use_hook = sys.argv[4], sys.argv[5] != "0"
    exit_now = os._exit
    isolated = setup != "unshare"  # bubblewrap gave the run its own network namespace
    try:
        if setup == "drop":
            _drop_to_sandbox_user()
        if setup in ("drop", "none"):
            _check_unprivileged()
    except OSError as exc:
        sys.stderr.write(f"sandbox setup failed: {exc}\n")
        sys.stderr.flush()
        exit_now(EXIT_SETUP)
    token, _, code = sys.stdin.read().partition("\n")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if setup == "unshare":
        isolated = _unshare_network()
    os.chdir(workdir)
    _set_limits(limits)
    import traceback  # imported before the hook: its lazy imports must not count against the code

    report = _reporter(status_fd, token)
    os.write(status_fd, b"ready N\n" if isolated else b"ready A\n")
    if use_hook:
        sys.addaudithook(_make_hook(os.path.realpath(workdir), report))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    flush_out, flush_err, write_err = sys.stdout.flush, sys.stderr.flush, sys.stderr.write
    try:
        exec(compile(code, "<tool>", "exec"), namespace)
    except MemoryError:
        report("L", EXIT_MEMORY)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            write_err(exc.code + "\n")
        flush_out()
        flush_err()
        exit_now(status)
    except BaseException as exc:  # noqa: BLE001 - the code's own error is its result
        if isinstance(exc, OSError) and exc.errno == 27:  # EFBIG: past RLIMIT_FSIZE
            report("L", EXIT_FILE_SIZE)
        if isinstance(exc, OSError) and exc.errno == 28:  # ENOSPC: the run's file system is full
            report("L", EXIT_DISK)
        flush_out()
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        write_err(f"error: {line}\n")
        flush_err()
        exit_now(1)
    flush_out()
    flush_err()
    exit_now(0)


if __name__ == "__main__":
    main()
