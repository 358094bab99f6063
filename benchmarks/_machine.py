"""What the benchmarks record about the machine and the checkout they ran on."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), "")
    except OSError:
        return ""


def git_state() -> tuple[str, bool]:
    """The checkout's commit (full hash, "" outside git) and whether its tree is modified."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True,
                                    timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return "", False
    return commit, dirty


def speed_probe(rounds: int = 5) -> float:
    """Seconds a fixed one-thread loop of small torch ops takes (the median of ``rounds``): the kind
    of work a tiny policy's forward is, mostly per-op overhead. Machines of one kind (a VM's host
    shared with others) differ by tens of percent between days, which their CPU model does not show;
    this says how fast this one ran when the figures beside it were taken."""
    import statistics
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(64, 96, generator=gen), torch.randn(256, 96, generator=gen)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(300):
                h = torch.nn.functional.silu(x @ w.t())
                x = (x + h[:, :96] * 1e-3).contiguous()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def record() -> dict[str, Any]:
    """nproc, CPU model, load average now, :func:`speed_probe`, date and git commit (with -dirty for a
    modified tree)."""
    full, dirty = git_state()
    return {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count() or 1,
        "cpu_model": cpu_model() or "?",
        "load_before": os.getloadavg(),
        "speed_probe_s": round(speed_probe(), 4),
        "commit": (full[:7] or "?") + ("-dirty" if dirty else ""),
    }


def check_load(info: dict[str, Any], limit_per_core: float = 0.5) -> Optional[str]:
    """A warning (also printed to stderr) when the load average before the run exceeded
    ``limit_per_core`` per core; None otherwise."""
    per_core = info["load_before"][0] / info["nproc"]
    if per_core > limit_per_core:
        msg = (f"WARNING: load average {info['load_before'][0]:.2f} on {info['nproc']} cores ({per_core:.2f} per core) "
               "before the benchmark started; wall-clock figures are suspect.")
        print(msg, file=sys.stderr, flush=True)
        return msg
    return None


def header(title: str, info: dict[str, Any], wall_s: float, warning: Optional[str]) -> str:
    """The Markdown head of a results file: command, date, machine, load before and after, commit."""
    la = lambda t: " / ".join(f"{x:.2f}" for x in t)  # noqa: E731
    lines = [
        f"# {title}",
        "",
        f"- command: `{info['command']}`",
        f"- date: {info['date']}",
        f"- machine: {info['nproc']} cores, {info['cpu_model']}",
        f"- load average (1 / 5 / 15 min): before {la(info['load_before'])}, after {la(info['load_after'])}",
        *([f"- speed probe (one thread, a fixed loop of small torch ops; lower is faster): "
           f"{info['speed_probe_s'] * 1000:.1f} ms"] if "speed_probe_s" in info else []),
        f"- git commit: {info['commit']}",
        f"- total wall time: {'?' if wall_s != wall_s else f'{wall_s:.0f} s'}",
    ]
    if warning:
        lines.append(f"- **{warning}**")
    return "\n".join(lines) + "\n"
