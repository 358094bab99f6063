"""A custom sliding-window strategy, registered by name and selected in config.

Run it:  python examples/custom_window.py

``capped-fifo`` dispatches like no-window but never lets more than ``B // 2`` completed groups wait
in the PipelineBuffer (so the trainer always sees fresh data), and collects in windowed-fifo order.
The script registers it, then simulates the spec's experiment with it next to windowed-fifo.
"""

from __future__ import annotations

from lightning_fasync.config import load_config_file
from lightning_fasync.pipeline.window import WindowView, register_window_strategy
from lightning_fasync.simulate import SimConfig, Variant, format_table, run_variants


@register_window_strategy("capped-fifo")
class CappedFifo:
    """Dispatch while R + Q <= C and Q < B // 2; collect seq - min_uncompleted_seq < B."""

    def dispatch_count(self, view: WindowView) -> int:
        by_capacity = view.C - view.R - view.Q
        by_buffer = max(1, view.B // 2) - view.Q
        return max(0, min(by_capacity, by_buffer))

    def can_collect(self, seq: int, view: WindowView) -> bool:
        return seq - view.min_uncompleted_seq < view.B

    def reset(self) -> None:
        pass


def main(steps: int = 12) -> str:
    cfg, sections = load_config_file("configs/sim/dapo_h20.yaml", simulate=SimConfig)
    sim = sections["simulate"]
    sim.steps = steps
    sim.variants = [
        Variant("fully_async (windowed-fifo, stale = 1.0)", {"fully_async.sliding_window": "windowed-fifo"}),
        Variant("fully_async (capped-fifo, stale = 1.0)", {"fully_async.sliding_window": "capped-fifo"}),
    ]
    table = format_table(run_variants(cfg, sim))
    print(table)
    return table


if __name__ == "__main__":
    import os

    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    main()
