"""Step-end aggregation of per-mini-batch metrics, and the step timer (docs/contract.md §4).

In fully-async mode one outer step trains several mini-batches; each reported value is cached and
aggregated at step end purely by name: ``timing/*`` summed, keys ending in ``_max`` take the max,
keys ending in ``_min`` the min, everything else the mean.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping


def aggregation_rule(name: str) -> str:
    """``sum``, ``max``, ``min`` or ``mean`` for a metric name (the spec's naming rule)."""
    if name.startswith("timing/"):
        return "sum"
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


def aggregate_metrics(records: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Aggregate a step's cached metric dicts by the naming rule. Non-finite values are skipped."""
    values: dict[str, list[float]] = defaultdict(list)
    for record in records:
        for key, value in record.items():
            v = float(value)
            if math.isfinite(v):
                values[key].append(v)
    out: dict[str, float] = {}
    for key, vs in values.items():
        rule = aggregation_rule(key)
        if rule == "sum":
            out[key] = sum(vs)
        elif rule == "max":
            out[key] = max(vs)
        elif rule == "min":
            out[key] = min(vs)
        else:
            out[key] = sum(vs) / len(vs)
    return out


class StepTimer:
    """Named ``timing/*`` accumulators plus the inverse timer behind ``perf/wait_ratio``.

    ``train()`` marks the training blocks; everything between them (data fetch, trajectory
    processing, pause, checkpoint, weight sync) is wait. ``perf/wait_ratio = wait / (wait + train)``
    over the window from the previous step's end to this one's; wait itself is not reported.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._totals: dict[str, float] = defaultdict(float)
        self._mark = clock()

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Accumulate wall time under ``timing/{name}``."""
        t0 = self.clock()
        try:
            yield
        finally:
            self._totals[name] += self.clock() - t0

    def add(self, name: str, seconds: float) -> None:
        self._totals[name] += seconds

    @contextmanager
    def train(self) -> Iterator[None]:
        """A training block (``timing/train``)."""
        with self.time("train"):
            yield

    def restart(self) -> None:
        """Start the window now (at train start, after any restore)."""
        self._totals.clear()
        self._mark = self.clock()

    def finish_step(self) -> dict[str, float]:
        """Close the window: ``timing/*`` totals, ``timing/step`` and ``perf/wait_ratio``; reset."""
        now = self.clock()
        step = max(now - self._mark, 0.0)
        train = self._totals.get("train", 0.0)
        wait = max(step - train, 0.0)
        out = {f"timing/{k}": v for k, v in self._totals.items()}
        out["timing/step"] = step
        out["timing/train"] = train
        out["perf/wait_ratio"] = wait / (wait + train) if (wait + train) > 0 else 0.0
        self._totals.clear()
        self._mark = now
        return out
