"""Property-based tests of the scheduler's invariants (spec section 3) over random completion orders.

A deterministic driver plays random operations on the real PipelineState: dispatch, complete one
in-flight trajectory, run the collector, let the trainer fetch, and step boundaries with partial
(cancel) or non-partial (await) cleanup.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_fasync.pipeline.datasource import ListDataSource
from lightning_fasync.pipeline.state import PipelineState
from lightning_fasync.pipeline.window import make_window_strategy
from lightning_fasync.pipeline.flow import continuation
from lightning_fasync.types import TrajectoryStatus

STRATEGIES = ["no-window", "window-gated", "windowed-fifo", "staleness-bounded"]


class Driver:
    def __init__(self, strategy, B, N, stale, seed, partial, k):
        self.ds = ListDataSource([([i], {}) for i in range(10_000)], shuffle=False)
        self.state = PipelineState(
            num_prompts_per_step=B, num_trajectories_per_prompt=N, stale_steps=stale,
            strategy=make_window_strategy(strategy), datasource=self.ds,
        )
        self.name, self.B, self.N, self.partial, self.k = strategy, B, N, partial, k
        self.rng = random.Random(seed)
        self.inflight = []  # (sample, index, seq)
        self.consumed = []
        self.served_new = set()
        self.put_back = set()  # prompts recycled at a boundary, not yet dispatched again
        self.expect_first = []  # prompt ids that must be dispatched before any other after resume

    def check(self):
        s = self.state
        assert s.R + s.Q <= s.C, f"R + Q = {s.R} + {s.Q} exceeds C = {s.C}"

    def dispatch(self, limit=None):
        view = self.state.view()
        planned = self.state.plan_dispatch(limit)
        for seq, sample in planned:
            if self.name == "window-gated":
                assert seq - view.oldest_uncollected_seq < view.C
            if sample.prompt_id in self.put_back:
                self.put_back.remove(sample.prompt_id)
            else:
                # A new prompt: never handed out before, and nothing to resume.
                assert sample.prompt_id not in self.served_new, "a prompt was dispatched twice without being recycled"
                assert sample.resume is None
                self.served_new.add(sample.prompt_id)
            for i in range(self.N):
                self.inflight.append((sample, i, seq))
        if self.expect_first and planned:
            got = [smp.prompt_id for _, smp in planned][: len(self.expect_first)]
            assert got == self.expect_first[: len(got)], "recycled prompts must be dispatched before new ones"
            self.expect_first = self.expect_first[len(got):]

    def complete_one(self, pick):
        if not self.inflight:
            return
        sample, i, seq = self.inflight.pop(pick % len(self.inflight))
        traj = continuation(sample, i, seq)
        if not traj.status.finished:
            traj.extend([1, 2], [-0.1, -0.2], [self.state.weight_version] * 2)
            traj.status = TrajectoryStatus.COMPLETED
        self.state.add_trajectory(traj)

    def collect(self):
        view = self.state.view()
        before = {g.seq for g in self.state.buffer.peek_all()}
        self.state.collect_once()
        after = {g.seq for g in self.state.buffer.peek_all()}
        if self.name == "windowed-fifo":
            for seq in after - before:
                assert seq - view.min_uncompleted_seq < view.B, "windowed-fifo collected outside the window"

    def fetch(self):
        groups = self.state.try_fetch(self.k)
        if groups:
            self.consumed.extend(g.prompt_id for g in groups)

    def boundary(self):
        s = self.state
        s.begin_pause()
        assert s.plan_dispatch() == [], "no dispatch while paused"
        if self.partial:
            for sample, i, seq in self.inflight:
                traj = continuation(sample, i, seq)
                if not traj.status.finished:
                    traj.extend([3], [-0.3], [s.weight_version])
                    traj.status = TrajectoryStatus.CANCELLED
                s.add_trajectory(traj)
            self.inflight.clear()
        else:
            while self.inflight:
                self.complete_one(self.rng.randrange(1 << 30))
        s.drain_collect(1.0)
        recycled_before = self.ds.num_recycled
        s.cleanup_after_pause()
        assert s.in_flight == 0 and len(s.queue) == 0, "after pause() nothing is in flight"
        assert s.R == 0
        self.expect_first = [smp.prompt_id for smp in list(self.ds._recycled)][: self.ds.num_recycled]
        self.put_back = set(self.expect_first)
        assert self.put_back <= self.served_new and not (self.put_back & set(self.consumed)), "only dispatched, unconsumed prompts are recycled"
        assert self.ds.num_recycled >= recycled_before
        s.step_metrics()
        s.resume()
        self.check()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    strategy=st.sampled_from(STRATEGIES),
    B=st.integers(1, 6),
    N=st.integers(1, 3),
    stale=st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.7]),
    partial=st.booleans(),
    ops=st.lists(st.integers(0, 1 << 20), min_size=20, max_size=300),
    seed=st.integers(0, 1000),
)
def test_scheduler_invariants(strategy, B, N, stale, partial, ops, seed):
    k = max(1, B // 2)
    d = Driver(strategy, B, N, stale, seed, partial, k)
    for op in ops:
        kind = op % 11
        if kind < 3:
            d.dispatch()
        elif kind < 7:
            d.complete_one(op >> 4)
        elif kind < 9:
            d.collect()
        elif kind < 10:
            d.fetch()
        else:
            d.boundary()
        d.check()
    # Finish: a non-partial boundary, then drain everything to the trainer.
    d.partial = False
    d.boundary()
    for _ in range(1000):
        if d.state.Q == 0 and d.ds.num_recycled == 0 and d.state.R == 0:
            break
        d.dispatch(limit=d.ds.num_recycled)  # recycled prompts only: no new ones
        while d.inflight:
            d.complete_one(d.rng.randrange(1 << 30))
            d.check()
        d.collect()
        groups = d.state.try_fetch(min(d.state.Q, k)) if d.state.Q else None
        if groups:
            d.consumed.extend(g.prompt_id for g in groups)
    else:
        raise AssertionError("the pipeline did not drain")
    # Exactly once: every prompt handed out was consumed once, none twice, none lost.
    assert len(d.consumed) == len(set(d.consumed)), "a prompt group was consumed twice"
    assert d.served_new == set(d.consumed)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_long_straggler_behaviour(strategy):
    """One very slow group: no-window and windowed-fifo keep dispatching; window-gated stops at C, and so
    does staleness-bounded (it collects in dispatch order, so every later group waits behind it)."""
    B, N, stale = 4, 1, 1.0
    d = Driver(strategy, B, N, stale, 0, False, k=1)
    d.dispatch()  # C = 8 groups dispatched
    assert d.state.next_seq == 8
    straggler = d.inflight.pop(0)  # seq 0 never finishes
    for _ in range(30):
        while d.inflight:
            d.complete_one(0)
        d.collect()
        while d.state.try_fetch(1):
            pass
        d.dispatch()
        d.check()
    if strategy in ("window-gated", "staleness-bounded"):
        assert d.state.next_seq == 8, f"{strategy} must not cross the straggler by C or more"
    else:
        assert d.state.next_seq > 8
    if strategy == "windowed-fifo":
        # Completed groups beyond seq 0 + B wait in TrajQueue and hold capacity.
        # Only seqs 1 .. B - 1 were collected (and their capacity refilled); every later group is
        # complete but waits, so the straggler and C - 1 waiting groups fill the whole capacity.
        assert d.state.Q == 0 and d.state.R == d.state.C
        assert d.state.queue.num_ready == d.state.C - 1
        assert d.state.next_seq == d.state.C + B - 1
    d.inflight.append(straggler)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 6),
    N=st.integers(1, 3),
    stale=st.sampled_from([0, 1, 2]),
    calls=st.sampled_from([1, 2, 3]),
    partial=st.booleans(),
    seed=st.integers(0, 1000),
    steps=st.integers(1, 8),
)
def test_staleness_bounded_trains_nothing_older_than_stale_steps_in_dispatch_order(B, N, stale, calls, partial, seed, steps):
    """``staleness-bounded``: with B groups trained per step (in ``calls`` fetches), a group dispatched
    at step j is trained by step j + stale_steps, and the trainer gets groups in dispatch order; at
    stale 0 every group is trained in the step that dispatched it and nothing is in flight at a boundary."""
    d = Driver("staleness-bounded", B, N, float(stale), seed, partial, k=1)
    dispatched_at: dict = {}
    taken: list = []
    for step in range(steps):
        got = 0
        while got < B:
            before = d.state.next_seq
            d.dispatch()
            for seq in range(before, d.state.next_seq):
                dispatched_at[seq] = step
            assert d.state.R + d.state.Q + d.state.consumed_this_step <= d.state.C
            if d.inflight:
                d.complete_one(d.rng.randrange(1 << 30))
            d.collect()
            want = min(B - got, max(1, B // calls))
            groups = d.state.try_fetch(want)
            if groups:
                for g in groups:
                    assert step - dispatched_at[g.seq] <= stale, (g.seq, dispatched_at[g.seq], step)
                    taken.append(g.seq)
                got += len(groups)
        if stale == 0:
            assert d.state.in_flight == 0 and d.state.R == 0 and d.state.Q == 0
        d.boundary()
    assert taken == sorted(taken), "the trainer got the groups out of dispatch order"
