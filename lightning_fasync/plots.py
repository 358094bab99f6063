"""Pictures of a run: a scalar curve from TensorBoard event files, a timeline from the event log.

    python -m lightning_fasync.plots reward runs/tiny_cpu/lightning_logs/version_0 reward.png
    python -m lightning_fasync.plots timeline runs/tiny_cpu/lightning_logs/version_0/events.jsonl timeline.png
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Optional, Sequence


def read_scalars(log_dir: str, with_wall_time: bool = False) -> dict[str, list[tuple]]:
    """Every scalar in a run's TensorBoard event files, read with TensorBoard's own reader:
    ``(step, value)`` pairs, or ``(step, value, wall_time)`` with ``with_wall_time``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*")))
    if not files:
        raise FileNotFoundError(f"No TensorBoard event file in {log_dir!r}.")
    out: dict[str, list[tuple]] = {}
    for f in files:
        acc = EventAccumulator(f, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend(
                (e.step, e.value, e.wall_time) if with_wall_time else (e.step, e.value) for e in acc.Scalars(tag))
    return {k: sorted(v) for k, v in out.items()}


def plot_reward(log_dir: str, out_png: str, tag: str = "rollout/reward_mean", title: Optional[str] = None) -> str:
    """Plot ``tag`` against the rollout step, with a 5-step moving average, to ``out_png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_scalars(log_dir).get(tag)
    if not series:
        raise KeyError(f"{log_dir!r} has no scalar {tag!r}.")
    steps = [s for s, _ in series]
    values = [v for _, v in series]
    k = 5
    smooth = [sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    ax.plot(steps, values, color="#9ecae1", linewidth=1, label=tag)
    ax.plot(steps, smooth, color="#08519c", linewidth=2, label=f"{k}-step mean")
    ax.set_xlabel("rollout step")
    ax.set_ylabel(tag)
    ax.set_title(title or tag)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def plot_timeline(events_path: str, out_png: str, title: Optional[str] = None, t_max: Optional[float] = None) -> str:
    """A run's timeline from its event log: lanes for rollout (groups in flight, completions),
    training calls, pauses (pause → resume, including checkpoint and sync) and weight syncs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lightning_fasync.pipeline.events import read_jsonl

    events = read_jsonl(events_path)
    if not events:
        raise ValueError(f"{events_path!r} holds no events.")
    if t_max is not None:
        events = [e for e in events if e["t"] <= t_max]
    t0 = events[0]["t"]
    t = lambda e: e["t"] - t0  # noqa: E731

    fig, ax = plt.subplots(figsize=(10, 3.2), dpi=120)
    lanes = {"sync": 0, "pause": 1, "train": 2, "rollout": 3}
    # Rollout: groups dispatched and not yet collected (R), scaled into its lane, plus completions.
    r_events = [e for e in events if e["event"] in ("dispatch", "complete", "collect", "pause", "resume")]
    r_max = max((e["R"] for e in r_events), default=1) or 1
    xs = [t(e) for e in r_events]
    ys = [lanes["rollout"] - 0.4 + 0.8 * e["R"] / r_max for e in r_events]
    ax.fill_between(xs, lanes["rollout"] - 0.4, ys, step="post", color="#9ecae1", label=f"groups in flight (max {r_max})")
    done = [t(e) for e in events if e["event"] == "complete"]
    ax.plot(done, [lanes["rollout"] + 0.42] * len(done), "|", color="#08519c", markersize=6, label="group completed")
    colors = {"train": "#31a354", "sync": "#de2d26", "eval": "#756bb1"}
    for e in events:
        if e["event"] in colors:  # evaluations (eval.*) follow the sync in its lane
            lane = lanes["sync" if e["event"] == "eval" else e["event"]]
            ax.broken_barh([(t(e) - e.get("dur", 0.0), e.get("dur", 0.0))], (lane - 0.35, 0.7), color=colors[e["event"]])
    pause_start = None
    for e in events:
        if e["event"] == "pause":
            pause_start = t(e)
        elif e["event"] == "resume" and pause_start is not None:
            ax.broken_barh([(pause_start, t(e) - pause_start)], (lanes["pause"] - 0.35, 0.7), color="#fd8d3c")
            pause_start = None
    ax.set_yticks(list(lanes.values()))
    evaluated = any(e["event"] == "eval" for e in events)
    ax.set_yticklabels(["weight sync, eval" if evaluated else "weight sync", "paused", "training call", "rollout"])
    ax.set_xlabel("seconds")
    ax.set_ylim(-0.6, 3.6)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or os.path.basename(os.path.dirname(os.path.abspath(events_path))))
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def log_image_to_tensorboard(png: str, log_dir: str, tag: str, step: int = 0) -> None:
    """Add a PNG to a run's TensorBoard as an image (next to its scalars)."""
    import matplotlib.image as mpimg
    import numpy as np
    from torch.utils.tensorboard import SummaryWriter

    img = mpimg.imread(png)[..., :3]
    writer = SummaryWriter(log_dir)
    try:
        writer.add_image(tag, (np.asarray(img) * 255).astype("uint8"), step, dataformats="HWC")
    finally:
        writer.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Plot a run's reward curve from its TensorBoard events.")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("reward")
    p.add_argument("log_dir")
    p.add_argument("out_png")
    p.add_argument("--tag", default="rollout/reward_mean")
    p = sub.add_parser("timeline")
    p.add_argument("events")
    p.add_argument("out_png")
    p.add_argument("--seconds", type=float, help="Draw only the first this many seconds.")
    args = parser.parse_args(argv)
    if args.what == "reward":
        plot_reward(args.log_dir, args.out_png, args.tag)
    else:
        plot_timeline(args.events, args.out_png, t_max=args.seconds)
    print(args.out_png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
