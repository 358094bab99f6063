"""Run the real sglang-router under a small supervisor that dies with its parent.

``python -m lightning_fasync.fleet.router --parent-pid PID <sglang-router flags>`` starts
``python -m sglang_router.launch_router <flags>`` as its child and watches both: when ``PID`` (the
trainer) is gone it stops the router (SIGTERM, then SIGKILL after a grace period); SIGTERM/SIGINT to
the supervisor are forwarded; if the supervisor itself is killed, the kernel sends the router
SIGTERM (``PR_SET_PDEATHSIG``). The router has no parent watch of its own, and its Rust server
holds the GIL, so an in-process watchdog thread would never run. The supervisor is
:mod:`~lightning_fasync.fleet.watchdog`'s, shared with the ``sglang`` backend's servers.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from lightning_fasync.fleet.watchdog import supervise


def main(argv: Optional[list[str]] = None) -> int:
    """Supervise one sglang-router; returns its exit status (0 when stopped for a dead parent)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--parent-pid", type=int, default=None)
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return supervise([sys.executable, "-m", "sglang_router.launch_router", *rest], ours.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
