"""Fully-async against colocate, side by side on the same work (the spec's tables 5.2–5.4).

Runs the embedded default (`configs/tiny_cpu.yaml`: same seed, same prompts, same number of outer
steps) through `lightning-fasync fit` in five modes, back to back in one invocation so the ratios
come from one machine at one time:

- colocate; colocate + partial (over-dispatch B/4 groups, abort the tail, resume it next step):
  rollout, then training, each phase using every core;
- fully-async no-window stale 1.0, windowed-fifo stale 1.0, windowed-fifo stale 2.0: trainer and
  engine on disjoint cores (1 : 1 on a 2-core machine; `--trainer-cores` to change).

It prints and writes (Markdown and CSV) the spec-shaped table plus two columns the spec lacks: the
ideal overlap bound from colocate's measured phase times, (rollout + train) / max(rollout, train),
and each mode's final mean reward. Each mode's timeline (PNG from its event log) is written next to
the table and logged to its TensorBoard run as an image.

    python benchmarks/speedup.py --quick          # smoke check, ~2-3 minutes on 2 cores
    python benchmarks/speedup.py                  # the full run (see the README for its duration)
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from lightning_fasync.plots import log_image_to_tensorboard, plot_timeline, read_scalars  # noqa: E402

B, N, M = 16, 8, 32
CALLS = B * N // M
MODES: list[tuple[str, list[str]]] = [
    ("colocate", ["--colocate=true", "--fully_async.enable=false", "--rollout.partial=false"]),
    ("colocate + partial", ["--colocate=true", "--fully_async.enable=false", "--rollout.partial=true",
                            f"--rollout.sampler.num_oversample={B // 4}"]),
    ("fully_async (no-window, stale = 1.0)", ["--fully_async.sliding_window=no-window", "--fully_async.stale_steps=1.0"]),
    ("fully_async (windowed-fifo, stale = 1.0)", ["--fully_async.sliding_window=windowed-fifo", "--fully_async.stale_steps=1.0"]),
    ("fully_async (windowed-fifo, stale = 2.0)", ["--fully_async.sliding_window=windowed-fifo", "--fully_async.stale_steps=2.0"]),
]


def slug(name: str) -> str:
    return re.sub(r"-+", "-", "".join(c if c.isalnum() else "-" for c in name)).strip("-").lower()


def run_mode(name: str, overrides: list[str], steps: int, out: str, extra: list[str]) -> dict[str, Any]:
    root = os.path.join(out, slug(name))
    cmd = [sys.executable, "-m", "lightning_fasync.cli", "fit", "--config", os.path.join(REPO, "configs", "tiny_cpu.yaml"),
           f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false", "--trainer.save_freq=0",
           f"--trainer.rollout_steps={steps}", *overrides, *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    log_dir = sorted(glob.glob(os.path.join(root, "lightning_logs", "version_*")))[-1]
    tb = read_scalars(log_dir)
    col = lambda tag: [v for _, v in tb.get(tag, [])]  # noqa: E731
    step_times = col("timing/step")
    fa = "--colocate=true" not in overrides
    png = os.path.join(out, f"timeline-{slug(name)}.png")
    plot_timeline(os.path.join(log_dir, "events.jsonl"), png, title=name)
    log_image_to_tensorboard(png, log_dir, "timeline")
    rewards = col("rollout/reward_mean")
    return {
        "config": name,
        "resource": "2 cores, time-shared" if not fa else "1 : 1 cores",
        "avg_step": statistics.mean(step_times),
        "avg_step_excl0": statistics.mean(step_times[1:]),
        "pipeline_buf_size": statistics.mean(col("rollout/pipeline_buf_size")) if fa else None,
        "partial_ratio": statistics.mean(col("rollout/partial_ratio")),
        "partial_restored_count": statistics.mean(col("rollout/partial_restored_count") or [0.0]),
        # Phase times: in colocate, timing/rollout is the rollout phase (waiting for the batch);
        # training is the training calls plus turning trajectories into tensors.
        "rollout_s": statistics.mean(col("timing/rollout")),
        "train_s": statistics.mean(a + b for a, b in zip(col("timing/train"), col("timing/process_traj") or [0.0] * len(step_times))),
        "wait_ratio": statistics.mean(col("perf/wait_ratio")),
        "final_reward": statistics.mean(rewards[-3:]),
        "wall_s": wall,
        "timeline": png,
    }


def table(rows: list[dict[str, Any]], bound: float) -> str:
    base = [r for r in rows if r["config"] == "colocate"]
    b_all = statistics.mean(r["avg_step"] for r in base)
    b_ss = statistics.mean(r["avg_step_excl0"] for r in base)
    head = ("| config | resource | avg step (s) | speedup | avg step excl. step 0 (s) | speedup excl. step 0 | "
            "pipeline_buf_size | partial_ratio | partial_restored_count | ideal overlap bound | share of bound | final reward |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        sp, ss = b_all / r["avg_step"], b_ss / r["avg_step_excl0"]
        r["speedup"], r["speedup_excl0"], r["bound"], r["share_of_bound"] = sp, ss, bound, ss / bound
        buf = "-" if r["pipeline_buf_size"] is None else f"{r['pipeline_buf_size']:.1f}"
        lines.append(
            f"| {r['config']} | {r['resource']} | {r['avg_step']:.2f} | {sp:.2f}x | {r['avg_step_excl0']:.2f} | {ss:.2f}x | "
            f"{buf} | {r['partial_ratio']:.3f} | {r['partial_restored_count']:.0f} | {bound:.2f}x | {ss / bound:.0%} | "
            f"{r['final_reward']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="6 steps per mode, one round: a smoke check")
    parser.add_argument("--steps", type=int, default=16, help="outer steps per mode (at least 12 for the full run)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of all modes, interleaved")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "speedup"))
    parser.add_argument("--trainer-cores", default=None, help="e.g. 0 (the rest go to the engine)")
    args, extra = parser.parse_known_args()
    steps, repeats = (6, 1) if args.quick else (args.steps, args.repeats)
    if args.trainer_cores:
        extra.append(f"--trainer.strategy.init_args.trainer_cores=[{args.trainer_cores}]")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        for name, overrides in MODES:
            print(f"[round {rep + 1}/{repeats}] {name} ...", flush=True)
            runs.append(run_mode(name, overrides, steps, os.path.join(args.out, f"round{rep}"), extra))
    # One row per mode: the mean over rounds; the spread of colocate's reward over rounds is the
    # yardstick for "learning held".
    rows = []
    for name, _ in MODES:
        rs = [r for r in runs if r["config"] == name]
        row = {k: (statistics.mean(r[k] for r in rs) if isinstance(rs[0][k], float) else rs[0][k]) for k in rs[0]}
        row["reward_spread"] = (min(r["final_reward"] for r in rs), max(r["final_reward"] for r in rs))
        rows.append(row)
    colo = rows[0]
    bound = (colo["rollout_s"] + colo["train_s"]) / max(colo["rollout_s"], colo["train_s"])
    text = table(rows, bound)
    summary = (
        f"\n{steps} outer steps per mode, {repeats} round(s), {time.perf_counter() - t0:.0f} s in all. "
        f"Colocate phase times per step: rollout {colo['rollout_s']:.2f} s, train {colo['train_s']:.2f} s "
        f"(ideal overlap bound {bound:.2f}x). Colocate final reward over rounds: "
        f"{colo['reward_spread'][0]:.3f}..{colo['reward_spread'][1]:.3f}."
    )
    print(text + summary)
    with open(os.path.join(args.out, "speedup.md"), "w") as fh:
        fh.write(text + "\n" + summary + "\n")
    with open(os.path.join(args.out, "speedup.csv"), "w", newline="") as fh:
        keys = [k for k in rows[0] if k not in ("reward_spread",)]
        writer = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(args.out, "runs.json"), "w") as fh:
        json.dump(runs, fh, indent=1)


if __name__ == "__main__":
    main()
