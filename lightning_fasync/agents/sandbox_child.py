"""The sandbox's child process: ``python -I -S -B sandbox_child.py WORKDIR LIMITS_JSON STATUS_FD [NAMESPACES]``.

Standard library only, and nothing here is imported by the package: the parent
(:mod:`lightning_fasync.agents.sandbox`) runs this file in a fresh interpreter, writes the untrusted
code to its stdin and reads its merged stdout/stderr. Before the code runs, this process

1. reads the code, then points stdin at ``/dev/null``;
2. moves into new user and network namespaces when the kernel allows it (no network interface
   but a downed loopback: every connection fails) unless ``NAMESPACES`` is ``0``, and says on
   ``STATUS_FD`` whether it did;
3. sets its own hard limits: CPU seconds, address space, file size, open files, no core dumps and
   (honoured for non-root users only) no new processes;
4. installs an audit hook (PEP 578) that ends the process with a violation's exit code the
   moment the code opens a socket, starts a process, sends a signal, loads ``ctypes``, writes
   outside ``WORKDIR`` or walks the interpreter's objects to reach the hook.

A violation ends the process at once (``os._exit``), so the code cannot catch it and carry on.
"""

import json
import os
import sys

# Exit codes the parent maps to messages (sandbox.py, _EXIT_MESSAGES).
EXIT_NETWORK = 90
EXIT_PROCESS = 91
EXIT_NATIVE = 92
EXIT_WRITE = 93
EXIT_SIGNAL = 94
EXIT_INTROSPECTION = 95
EXIT_MEMORY = 96
EXIT_FILE_SIZE = 97

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
        # Binding for non-root users; root (and CAP_SYS_RESOURCE) ignores it, so the audit hook is
        # what stops process creation there.
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
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


def _make_hook(root: str):
    exit_now = os._exit

    def stop(code: int) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - the process ends either way
                pass
        exit_now(code)

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
    namespaces = sys.argv[4:5] != ["0"]
    code = sys.stdin.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    isolated = _unshare_network() if namespaces else False
    os.write(status_fd, b"N" if isolated else b"A")
    os.close(status_fd)  # before the code runs: it cannot write a status of its own
    os.chdir(workdir)
    _set_limits(limits)
    import traceback  # imported before the hook: its lazy imports must not count against the code

    sys.addaudithook(_make_hook(os.path.realpath(workdir)))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<tool>", "exec"), namespace)
    except MemoryError:
        os._exit(EXIT_MEMORY)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    except BaseException as exc:  # noqa: BLE001 - the code's own error is its result
        if isinstance(exc, OSError) and exc.errno == 27:  # EFBIG: past RLIMIT_FSIZE
            os._exit(EXIT_FILE_SIZE)
        sys.stdout.flush()
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
