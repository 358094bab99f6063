"""Control-plane benchmark: producer + collector + PipelineBuffer with an instant in-process engine.

Measures (1) trajectories per second through the whole pipeline (dispatch, agent flow, TrajQueue,
collector, buffer, trainer fetch, and the step protocol at every boundary) on one core, and (2) how
long ``pause()`` takes to cancel 4,096 in-flight requests and clean up.

    python benchmarks/control_plane.py [--steps 10] [--cores 1] [--repeats 5]

Targets: >= 50,000 trajectories/s; pause with 4,096 in flight <= 50 ms. Figures vary with the
machine; they are printed, not asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from lightning_fasync.config import load_config, validate
from lightning_fasync.pipeline.controller import FullyAsyncController
from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.pipeline.engine_client import SamplingParams
from lightning_fasync.pipeline.flow import SingleTurnFlow
from lightning_fasync.testing.instant_engine import InstantEngine


class _Hooks:
    def save_checkpoint(self, step: int) -> None:
        pass

    def sync_weights(self, version: int) -> None:
        pass


def _cfg(B: int, N: int, M: int, stale: float, window: str, event_log: bool):
    return validate(
        load_config(
            {
                "colocate": False,
                "fully_async": {"enable": True, "sliding_window": window, "stale_steps": stale, "event_log": event_log},
                "data_source": {"num_prompts_per_step": B, "num_trajectories_per_prompt": N},
                "trainer": {"mini_batch_size": M},
                "rollout": {"partial": True, "max_response_length": 16},
                "agentflow": {"router": {"max_connections": 1 << 20}},
            }
        )
    )


def throughput(steps: int, window: str, event_log: bool, log_dir: str) -> float:
    cfg = _cfg(B=512, N=8, M=1024, stale=1.0, window=window, event_log=event_log)
    ds = ListDataSource([([1, 2, 3], {}) for _ in range(100_000)], seed=0)
    engine = InstantEngine()
    flow = SingleTurnFlow(engine, SamplingParams(), 16, reward_fn=lambda s, t: 1.0)
    ctl = FullyAsyncController(cfg, ds, flow, engine, log_dir=log_dir)
    ctl.start()
    hooks = _Hooks()
    n = 0
    try:
        # one warm-up step
        for step in range(steps + 1):
            if step == 1:
                t0 = time.perf_counter()
                n = 0
            ctl.run_step(lambda groups: {"trajectories": float(sum(len(g.trajectories) for g in groups))}, hooks)
            n += cfg.B * cfg.N
        dt = time.perf_counter() - t0
    finally:
        ctl.shutdown()
    return n / dt


def pause_latency(in_flight_requests: int, repeats: int, log_dir: str) -> list[float]:
    N = 8
    B = in_flight_requests // N
    cfg = _cfg(B=B, N=N, M=N * 8, stale=0.0, window="no-window", event_log=True)
    out = []
    for _ in range(repeats):
        ds = ListDataSource([([1, 2, 3], {}) for _ in range(B * 4)], seed=0)
        engine = InstantEngine(hold=True)
        flow = SingleTurnFlow(engine, SamplingParams(), 16)
        ctl = FullyAsyncController(cfg, ds, flow, engine, log_dir=log_dir)
        ctl.start()
        try:
            deadline = time.monotonic() + 30
            while ctl.state.in_flight < in_flight_requests:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {ctl.state.in_flight} requests in flight")
                time.sleep(0.005)
            while len(engine._held) < in_flight_requests:
                time.sleep(0.005)
            t0 = time.perf_counter()
            ctl.pause()
            out.append(time.perf_counter() - t0)
            assert ctl.state.in_flight == 0 and ctl.state.R == 0
        finally:
            ctl.shutdown()
    return out


def _one(kind: str, arg: str, steps: int) -> float:
    """One measurement in this (fresh) process."""
    with tempfile.TemporaryDirectory() as d:
        if kind == "throughput":
            window, log = arg.split(",")
            return throughput(steps, window, log == "on", d)
        return pause_latency(int(arg), 1, d)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cores", type=int, default=1, help="pin each measurement to this many cores")
    parser.add_argument("--in-flight", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per measurement")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "ARG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        # The last cores: on a shared machine the first one tends to carry the system's own work.
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[-args.cores :]))
    if args.one:
        print(_one(args.one[0], args.one[1], args.steps))
        return

    def measure(kind: str, arg: str) -> list[float]:
        # Each repeat in a fresh process: no threads, loops or garbage left over from the last one.
        cmd = [sys.executable, __file__, "--steps", str(args.steps), "--cores", str(args.cores), "--one", kind, arg]
        return [float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[-1]) for _ in range(args.repeats)]

    rows = []
    for window in ("no-window", "windowed-fifo"):
        for log in ("off", "on"):
            tps = measure("throughput", f"{window},{log}")
            rows.append((f"throughput {window}, event log {log}", f"median {statistics.median(tps):,.0f}  best {max(tps):,.0f} trajectories/s", "target >= 50,000"))
    lat = [x * 1000 for x in measure("pause", str(args.in_flight))]
    rows.append((f"pause() with {args.in_flight} in flight", f"median {statistics.median(lat):.1f}  best {min(lat):.1f} ms", "target <= 50 ms"))
    width = max(len(r[0]) for r in rows)
    print(f"control plane on {args.cores} core(s), {args.repeats} fresh processes per figure")
    for name, value, target in rows:
        print(f"  {name:<{width}}  {value:>46}  {target}")


if __name__ == "__main__":
    main()
