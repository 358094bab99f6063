"""Sliding-window strategies (docs/contract.md §3) and their registry.

A strategy answers two questions, both counted in prompt groups:

- ``dispatch_count(view)``: how many new groups may be dispatched now;
- ``can_collect(seq, view)``: may the completed group with dispatch number ``seq`` leave TrajQueue
  for the PipelineBuffer now.

``view`` is a :class:`WindowView`, a snapshot of R, Q, C, B and the sequence numbers the spec
defines. Strategies are small objects registered by name; a user adds one with
:func:`register_window_strategy` from their own module and selects it with
``fully_async.sliding_window`` (listing the module in ``fully_async.plugins``). See
``docs/custom_window.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

from lightning_fasync.registry import WINDOWS


@dataclass(frozen=True)
class WindowView:
    """What a strategy may look at (docs/contract.md §3).

    Attributes:
        B: prompt groups per training step (``data_source.num_prompts_per_step``).
        C: capacity, ``int(B * (1 + stale_steps))``.
        R: groups dispatched but not yet collected by the collector (in flight, or complete and
            waiting in TrajQueue).
        Q: completed groups in the PipelineBuffer not yet consumed by the trainer.
        next_seq: the sequence number the next dispatched group will get.
        oldest_uncollected_seq: smallest seq among dispatched, not yet collected groups
            (``next_seq`` when there is none).
        min_uncompleted_seq: smallest seq among dispatched groups whose N trajectories have not
            all arrived (``next_seq`` when there is none).
        consumed: groups the trainer consumed since this rollout step began (not a spec symbol;
            what ``staleness-bounded`` counts).
    """

    B: int
    C: int
    R: int
    Q: int
    next_seq: int
    oldest_uncollected_seq: int
    min_uncompleted_seq: int
    consumed: int = 0


@runtime_checkable
class WindowStrategy(Protocol):
    """The two questions a sliding-window strategy answers (docs/contract.md §3)."""

    def dispatch_count(self, view: WindowView) -> int:
        """Number of groups that may be dispatched now (>= 0)."""
        ...

    def can_collect(self, seq: int, view: WindowView) -> bool:
        """Whether the completed group ``seq`` may enter the PipelineBuffer now."""
        ...

    def reset(self) -> None:
        """Forget per-step state; called by ``pause()`` after TrajQueue is cleared."""
        ...

    # Optional: ``collect_horizon(view) -> int``, a seq from which ``can_collect`` is False for
    # every later seq too; the collector then stops its scan there instead of asking for each
    # waiting group.


class NoWindow:
    """``no-window``: only total capacity, ``dispatch_count = max(0, C - R - Q)``; any completed
    group is collected (spec 3.1)."""

    def dispatch_count(self, view: WindowView) -> int:
        return max(0, view.C - view.R - view.Q)

    def can_collect(self, seq: int, view: WindowView) -> bool:
        return True

    def reset(self) -> None:
        pass


class WindowGated:
    """``window-gated``: ``R + Q <= C`` and ``next_seq - oldest_uncollected_seq < C`` for every
    dispatched group; any completed group is collected (spec 3.2)."""

    def dispatch_count(self, view: WindowView) -> int:
        by_capacity = view.C - view.R - view.Q
        # Dispatching k groups uses seqs next_seq .. next_seq + k - 1; the oldest uncollected seq
        # does not move while we dispatch, so the last one must satisfy
        # next_seq + k - 1 - oldest < C.
        by_window = view.oldest_uncollected_seq + view.C - view.next_seq
        return max(0, min(by_capacity, by_window))

    def can_collect(self, seq: int, view: WindowView) -> bool:
        return True

    def reset(self) -> None:
        pass


class WindowedFifo:
    """``windowed-fifo``: dispatch like no-window; collect only ``seq - min_seq < B`` where
    ``min_seq`` is the oldest uncompleted sequence number (spec 3.3). The collection window is B
    and does not grow with stale_steps."""

    def dispatch_count(self, view: WindowView) -> int:
        return max(0, view.C - view.R - view.Q)

    def can_collect(self, seq: int, view: WindowView) -> bool:
        return seq - view.min_uncompleted_seq < view.B

    def collect_horizon(self, view: WindowView) -> int:
        """No seq at or past this can be collected now (lets the collector stop scanning early)."""
        return view.min_uncompleted_seq + view.B

    def reset(self) -> None:
        pass


class StalenessBounded:
    """``staleness-bounded`` (not one of the spec's three): staleness bounded in weight versions, and
    the training order the dataset's.

    Dispatch: ``R + Q + consumed <= C``, where ``consumed`` counts the groups the trainer took in
    this rollout step. The spec's rule ``R + Q <= C`` bounds how many groups wait, not how old they
    get: a group the trainer takes frees room at once, so a group dispatched late in step k under
    weights k can be trained in step k + 1 even at ``stale_steps: 0``. Counting this step's
    consumption against the capacity (AReaL's rule: at most ``(version + 1 + stale) x B`` groups
    dispatched by weights ``version``) bounds the age instead: with a whole ``stale_steps`` and B
    groups trained per step, a group dispatched under weights k is trained by step k + stale_steps.
    A prompt recycled at a boundary is dispatched again under the weights then in force (its tokens
    so far keep their own versions).

    Collection: in dispatch order (a group leaves TrajQueue once every earlier group has completed,
    ``seq < min_uncompleted_seq``), so the trainer takes the groups in the order colocate does.

    ``stale_steps: 0`` is then synchronous training on separate resources: the engines generate the
    step's B groups under its weights and wait, the trainer trains on exactly them and the engines
    get the new weights; with seeded sampling (``rollout.sampling_seed``) a run trains
    bit-identically to colocate (docs/overview.md, "Staleness bounded in versions")."""

    def dispatch_count(self, view: WindowView) -> int:
        return max(0, view.C - view.R - view.Q - view.consumed)

    def can_collect(self, seq: int, view: WindowView) -> bool:
        return seq < view.min_uncompleted_seq

    def collect_horizon(self, view: WindowView) -> int:
        return view.min_uncompleted_seq

    def reset(self) -> None:
        pass


StrategyFactory = Callable[[], WindowStrategy]


def register_window_strategy(name: str, factory: StrategyFactory | None = None):
    """Register a strategy factory under ``name`` in :data:`lightning_fasync.registry.WINDOWS`;
    usable as a decorator on a class.

    Example::

        @register_window_strategy("my-window")
        class MyWindow:
            def dispatch_count(self, view): ...
            def can_collect(self, seq, view): ...
            def reset(self): ...

    Raises:
        ValueError: when ``name`` is already registered to another factory.
    """
    return WINDOWS.register(name, factory)


def available_strategies() -> list[str]:
    """Names usable in ``fully_async.sliding_window``."""
    return WINDOWS.names()


def make_window_strategy(name: str) -> WindowStrategy:
    """Instantiate the strategy registered under ``name``.

    Raises:
        ConfigError: ``name`` is not registered (naming ``fully_async.sliding_window``).
        TypeError: what it builds lacks one of the three methods.
    """
    strategy = WINDOWS.get(name)()
    missing = [m for m in ("dispatch_count", "can_collect", "reset") if not callable(getattr(strategy, m, None))]
    if missing:
        raise TypeError(
            f"The sliding-window strategy {name!r} lacks {', '.join(missing)}; a strategy needs "
            "dispatch_count(view), can_collect(seq, view) and reset()."
        )
    return strategy
