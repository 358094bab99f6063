"""Run a server process under a small supervisor that stops it when the trainer dies.

``python -m lightning_fasync.fleet.watchdog --parent-pid PID [--cpu-affinity 0,1] -- CMD ...`` starts
``CMD`` as its child (on those cores, when given) and watches both: when ``PID`` (the trainer) is gone it stops the child (SIGTERM, then SIGKILL
after a grace period) and then SIGKILLs whatever is left of its own process group (a server's own
workers, e.g. SGLang's scheduler and detokenizer processes); SIGTERM/SIGINT to the supervisor are
forwarded; if the supervisor itself is killed, the kernel sends the child SIGTERM
(``PR_SET_PDEATHSIG``). It serves servers that have no parent watch of their own: sglang-router
(whose Rust server holds the GIL, so an in-process watchdog thread would never run, see
:mod:`~lightning_fasync.fleet.router`) and ``sglang.launch_server`` (``rollout.backend: sglang``).

The launcher starts the supervisor in a session of its own, so the supervisor, the server and the
server's workers share one process group that teardown can signal as a whole.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
from typing import Optional, Sequence

GRACE_S = 5.0
POLL_S = 0.5
PR_SET_PDEATHSIG = 1


def _parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return os.getppid() == pid or os.getppid() != 1


def _die_with_supervisor() -> None:  # runs in the child, between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop(child: subprocess.Popen) -> int:
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(GRACE_S)
    return child.returncode


def supervise(cmd: Sequence[str], parent_pid: Optional[int]) -> int:
    """Run ``cmd`` until it exits (its status is returned) or ``parent_pid`` dies (0).

    Arguments:
        cmd: the server's command line.
        parent_pid: the process whose death stops the server; None: no watch.
    """
    child = subprocess.Popen(list(cmd), preexec_fn=_die_with_supervisor if sys.platform == "linux" else None)

    def forward(signum: int, frame: object) -> None:
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        try:
            return child.wait(POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if parent_pid and not _parent_alive(parent_pid):
            print(f"Parent process {parent_pid} is gone; stopping {os.path.basename(cmd[0])} "
                  f"{' '.join(cmd[1:3])}.", file=sys.stderr, flush=True)
            _stop(child)
            if os.getpgrp() == os.getpid():
                # The server's own workers may outlive it; nobody is left to reap or stop them.
                os.killpg(os.getpgrp(), signal.SIGKILL)
            return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``--parent-pid PID -- CMD ...``: supervise ``CMD``; returns its exit status."""
    args = sys.argv[1:] if argv is None else argv
    if "--" not in args:
        print("usage: python -m lightning_fasync.fleet.watchdog --parent-pid PID -- CMD ...", file=sys.stderr)
        return 2
    split = args.index("--")
    parser = argparse.ArgumentParser(prog="lightning_fasync.fleet.watchdog")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--cpu-affinity", default=None, help="comma-separated cores the command runs on (inherited "
                                                             "by it and its workers); default: the supervisor's")
    ours = parser.parse_args(args[:split])
    if not args[split + 1:]:
        print("lightning_fasync.fleet.watchdog: no command after --", file=sys.stderr)
        return 2
    if ours.cpu_affinity:
        os.sched_setaffinity(0, {int(c) for c in ours.cpu_affinity.split(",")})
    return supervise(args[split + 1:], ours.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
