"""TrajQueue: trajectories in, complete groups out (docs/contract.md §2).

Trajectories arrive one by one, in any order, from the agent flow. They are assembled by prompt
id; a group leaves only once all N of its trajectories have arrived. The queue also answers the
sequence-number questions the window strategies ask (oldest uncollected, oldest uncompleted).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from lightning_fasync.types import PromptSample, Trajectory, TrajectoryGroup, TrajectoryStatus


@dataclass
class PendingGroup:
    """A dispatched group that has not left TrajQueue yet."""

    sample: PromptSample
    seq: int
    n: int
    trajectories: dict[int, Trajectory] = field(default_factory=dict)

    @property
    def assembled(self) -> bool:
        return len(self.trajectories) == self.n

    @property
    def has_failed(self) -> bool:
        return any(t.status is TrajectoryStatus.FAILED for t in self.trajectories.values())

    @property
    def has_cancelled(self) -> bool:
        return any(t.status is TrajectoryStatus.CANCELLED for t in self.trajectories.values())

    def to_group(self) -> TrajectoryGroup:
        return TrajectoryGroup(
            sample=self.sample, seq=self.seq, trajectories=[self.trajectories[i] for i in sorted(self.trajectories)]
        )


class TrajQueue:
    """Groups by dispatch sequence number; only assembled groups leave.

    "Completed" in the spec's sense (windowed-fifo's ``min_seq``) means all N trajectories have
    arrived; a group with a cancelled trajectory is assembled but not completed, since it still
    needs generation.
    """

    def __init__(self, n: int) -> None:
        if n <= 0:
            raise ValueError(f"TrajQueue needs N >= 1 trajectories per group, got {n}.")
        self.n = n
        # Insertion order is dispatch order, so the first key is the oldest seq.
        self._uncollected: OrderedDict[int, PendingGroup] = OrderedDict()
        self._uncompleted: OrderedDict[int, None] = OrderedDict()
        # Completed groups waiting for the collector, as a sorted list of seqs: the collector walks
        # it in seq order and can stop at a strategy's horizon (windowed-fifo).
        self._ready: list[int] = []

    def __len__(self) -> int:
        return len(self._uncollected)

    def register(self, sample: PromptSample, seq: int) -> None:
        """Record a dispatched group (before any of its trajectories can arrive)."""
        if self._uncollected and seq <= next(reversed(self._uncollected)):
            raise ValueError(f"Dispatch sequence numbers must increase; got {seq} after {next(reversed(self._uncollected))}.")
        self._uncollected[seq] = PendingGroup(sample=sample, seq=seq, n=self.n)
        self._uncompleted[seq] = None

    def add(self, traj: Trajectory) -> Optional[PendingGroup]:
        """Add a terminal trajectory; return its group once all N have arrived, else None."""
        group = self._uncollected.get(traj.seq)
        if group is None:
            raise KeyError(f"Trajectory for seq {traj.seq} (prompt {traj.prompt_id}) arrived, but that group is not in flight.")
        if traj.sample_index in group.trajectories:
            raise ValueError(
                f"Trajectory {traj.sample_index} of prompt {traj.prompt_id} (seq {traj.seq}) arrived twice."
            )
        group.trajectories[traj.sample_index] = traj
        if not group.assembled:
            return None
        if not group.has_cancelled or group.has_failed:
            # Ready for the collector: finished, or failed (the group policy drops those).
            self._uncompleted.pop(traj.seq, None)
            bisect.insort(self._ready, traj.seq)
        return group

    def ready(self, before: Optional[int] = None) -> list[PendingGroup]:
        """Completed groups waiting for collection, in seq order (only seq < ``before``)."""
        end = len(self._ready) if before is None else bisect.bisect_left(self._ready, before)
        return [self._uncollected[seq] for seq in self._ready[:end]]

    def pop(self, seq: int) -> PendingGroup:
        """Remove a group (collected, recycled or dropped)."""
        group = self._uncollected.pop(seq)
        self._uncompleted.pop(seq, None)
        i = bisect.bisect_left(self._ready, seq)
        if i < len(self._ready) and self._ready[i] == seq:
            del self._ready[i]
        return group

    @property
    def num_ready(self) -> int:
        return len(self._ready)

    def oldest_uncollected_seq(self, default: int) -> int:
        return next(iter(self._uncollected), default)

    def min_uncompleted_seq(self, default: int) -> int:
        return next(iter(self._uncompleted), default)

    def drain(self) -> list[PendingGroup]:
        """Remove and return every group, oldest first (``pause()`` cleanup)."""
        groups = list(self._uncollected.values())
        self._uncollected.clear()
        self._uncompleted.clear()
        self._ready.clear()
        return groups
