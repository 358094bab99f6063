"""Pictures of a run: a scalar curve from TensorBoard event files.

    python -m lightning_fasync.plots reward runs/tiny_cpu/lightning_logs/version_0 docs/tiny_cpu_reward.png
"""

from __future__ import annotations

import argparse
import glob
import os
from typing import Optional, Sequence


def read_scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a run's TensorBoard event files, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*")))
    if not files:
        raise FileNotFoundError(f"No TensorBoard event file in {log_dir!r}.")
    out: dict[str, list[tuple[int, float]]] = {}
    for f in files:
        acc = EventAccumulator(f, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Plot a run's reward curve from its TensorBoard events.")
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("reward")
    p.add_argument("log_dir")
    p.add_argument("out_png")
    p.add_argument("--tag", default="rollout/reward_mean")
    args = parser.parse_args(argv)
    plot_reward(args.log_dir, args.out_png, args.tag)
    print(args.out_png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
