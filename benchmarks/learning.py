"""Learning against wall-clock: a fully-async mode given the same wall-clock as colocate's run.

`benchmarks/speedup.py` runs every mode for the same number of steps, so a mode twice as fast stops
at half colocate's wall-clock. Here a fully-async mode runs `--steps` rollout steps (more than
colocate's) once per seed, and its reward is set against colocate's runs of the same seeds, read
from a speedup table's raw output (`--baseline`): the wall-clock (from step 0's start) at which the
5-step running mean of the reward first reaches colocate's median final reward (the mean of its
last 10 steps), per seed, and the median.

    python benchmarks/learning.py --config configs/tiny_cpu_longtail.yaml --mode "fully-async, in-flight updates" \
        --steps 160 --baseline benchmarks/results/speedup_longtail --out benchmarks/results/learning_longtail

Written to `--out`: `learning.md` (machine record, table), `raw/<seed>.json` and `reward.png`
(reward against wall-clock, colocate and the mode, every seed).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _machine import check_load, header, record  # noqa: E402
from speedup import MODES, run_one, wall_to_reward  # noqa: E402


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--mode", required=True, help="a mode of benchmarks/speedup.py, by name")
    parser.add_argument("--steps", type=int, required=True)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--baseline", help="a speedup.py output directory with colocate's raw runs")
    source.add_argument("--colocate-steps", type=int,
                        help="run colocate here too, this many steps per seed, each seed's two runs back to back")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="with --colocate-steps")
    parser.add_argument("--out", required=True)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="everything after it goes to the mode's fit commands (not colocate's)")
    args = parser.parse_args(argv)
    overrides = [*dict(MODES)[args.mode], *args.extra]
    if args.baseline:
        base = [r for r in (json.load(open(p)) for p in sorted(glob.glob(os.path.join(args.baseline, "raw", "*.json"))))
                if r["mode"] == "colocate"]
        if not base or any(b.get("seed") is None for b in base):
            raise SystemExit(f"{args.baseline}: no colocate runs with their own seeds (run speedup.py with --seed-per-round).")
    info = {**record(), "command": "python benchmarks/learning.py " + shlex.join(argv)}
    warning = check_load(info)
    os.makedirs(os.path.join(args.out, "raw"), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="learning-")
    t0 = time.perf_counter()
    rows = []
    config = os.path.abspath(args.config)
    try:
        runs = []
        for rnd, seed in enumerate([b["seed"] for b in base] if args.baseline else args.seeds):
            if args.baseline:
                b = base[rnd]
            else:
                b = run_one("colocate", dict(MODES)["colocate"], rnd, args.colocate_steps, tmp, [], config=config, seed=seed)
                with open(os.path.join(args.out, "raw", f"colocate-{seed}.json"), "w") as fh:
                    json.dump(b, fh)
            run = run_one(args.mode, overrides, rnd, args.steps, tmp, [], config=config, seed=seed)
            with open(os.path.join(args.out, "raw", f"{seed}.json"), "w") as fh:
                json.dump(run, fh)
            runs.append((b, run))
            print(f"seed {seed}: colocate and {args.mode} done", flush=True)
        base = [b for b, _ in runs]
        target = statistics.median(statistics.fmean(b["reward"][-10:]) for b in base)
        for b, run in runs:
            col = wall_to_reward(b["reward"], b["step_end_s"], target)
            mode = wall_to_reward(run["reward"], run["step_end_s"], target)
            rows.append({"seed": b["seed"], "colocate_s": col, "mode_s": mode, "colocate_end_s": b["step_end_s"][-1],
                         "mode_end_s": run["step_end_s"][-1], "colocate_final": statistics.fmean(b["reward"][-10:]),
                         "mode_final": statistics.fmean(run["reward"][-10:]), "run": run, "base": b})
            print(f"seed {b['seed']}: colocate {col} s, {args.mode} {mode} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    info["load_after"] = os.getloadavg()
    fmt = lambda x: "not reached" if x is None else f"{x:.0f} s"  # noqa: E731
    lines = [f"Target: colocate's median final reward {target:.3f} (mean of its last 10 steps, over seeds "
             f"{', '.join(str(r['seed']) for r in rows)}). Colocate: {base[0]['steps']} steps "
             f"({'from ' + args.baseline if args.baseline else 'run here, before the mode, per seed'}); "
             f"{args.mode}: {args.steps} steps{(' (' + shlex.join(args.extra) + ')') if args.extra else ''}.", "",
             "| seed | colocate: wall-clock to target | its run | " + args.mode + ": wall-clock to target | its run | "
             "final reward: colocate / mode |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {fmt(r['colocate_s'])} | {r['colocate_end_s']:.0f} s | {fmt(r['mode_s'])} | "
                     f"{r['mode_end_s']:.0f} s | {r['colocate_final']:.3f} / {r['mode_final']:.3f} |")
    lines += ["", f"Reached the target: colocate in {sum(r['colocate_s'] is not None for r in rows)} of {len(rows)} seeds, "
                  f"{args.mode} in {sum(r['mode_s'] is not None for r in rows)} of {len(rows)}; sooner than colocate's "
                  f"run (a run that never reaches it counts as never): {args.mode} in "
                  f"{sum(_sooner(r['mode_s'], r['colocate_s']) for r in rows)} of {len(rows)} seeds."]
    reached = [r for r in rows if r["colocate_s"] is not None and r["mode_s"] is not None]
    if reached:
        med_c = statistics.median(r["colocate_s"] for r in reached)
        med_m = statistics.median(r["mode_s"] for r in reached)
        lines += ["", f"Median over the seeds where both reached it ({len(reached)} of {len(rows)}): colocate {med_c:.0f} s, "
                      f"{args.mode} {med_m:.0f} s ({med_c / med_m:.2f}x less wall-clock)."]
    text = header("Learning against wall-clock", info, time.perf_counter() - t0, warning) + "\n" + "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "learning.md"), "w") as fh:
        fh.write(text)
    _plot(rows, args.mode, target, os.path.join(args.out, "reward.png"))
    print(text)


def _sooner(a: Optional[float], b: Optional[float]) -> bool:
    """Whether a wall-clock ``a`` comes before ``b`` (None: never)."""
    return a is not None and (b is None or a < b)


def _plot(rows: list[dict[str, Any]], mode: str, target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, r in enumerate(rows):
        for run, color, name in ((r["base"], "tab:blue", "colocate"), (r["run"], "tab:red", mode)):
            rew = run["reward"]
            smooth = [statistics.fmean(rew[max(0, j - 4): j + 1]) for j in range(len(rew))]
            ax.plot(run["step_end_s"], smooth, color=color, alpha=0.8, label=name if i == 0 else None)
    ax.axhline(target, color="gray", linestyle="--", label="colocate's median final reward")
    ax.set_xlabel("wall-clock from step 0 (s)")
    ax.set_ylabel("reward (5-step running mean)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
