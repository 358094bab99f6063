"""Run the real sglang-router under a small supervisor that dies with its parent.

``python -m lightning_fasync.rollout.router --parent-pid PID <sglang-router flags>`` starts
``python -m sglang_router.launch_router <flags>`` as its child and watches both: when ``PID`` (the
trainer) is gone it stops the router (SIGTERM, then SIGKILL after a grace period); SIGTERM/SIGINT to
the supervisor are forwarded; if the supervisor itself is killed, the kernel sends the router
SIGTERM (``PR_SET_PDEATHSIG``). The router has no parent watch of its own, and its Rust server
holds the GIL, so an in-process watchdog thread would never run.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
from typing import Optional

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


def _die_with_supervisor() -> None:  # runs in the router child, between fork and exec
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


def main(argv: Optional[list[str]] = None) -> int:
    """Supervise one sglang-router; returns its exit status (0 when stopped for a dead parent)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--parent-pid", type=int, default=None)
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    child = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", *rest],
                             preexec_fn=_die_with_supervisor if sys.platform == "linux" else None)

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
        if ours.parent_pid and not _parent_alive(ours.parent_pid):
            print(f"Parent process {ours.parent_pid} is gone; stopping the router.", file=sys.stderr, flush=True)
            _stop(child)
            return 0


if __name__ == "__main__":
    sys.exit(main())
