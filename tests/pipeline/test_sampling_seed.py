"""``rollout.sampling_seed``: each request's seed is a function of the trajectory, not of when or
with whom it was sent; a resumed trajectory gets a new seed for its new tokens."""

from __future__ import annotations

from lightning_fasync.pipeline.engine_client import SamplingParams
from lightning_fasync.pipeline.flow import request_seed, resume_request
from lightning_fasync.types import PromptId, Trajectory


def _traj(epoch=0, index=3, sample=1, tokens=0):
    t = Trajectory.fresh(PromptId(epoch, index), sample, [5, 6, 7], seq=9)
    t.extend(list(range(tokens)), [-0.5] * tokens, [0] * tokens)
    return t


def test_the_seed_follows_the_trajectory():
    seeded = SamplingParams(sampling_seed=42)
    a = resume_request(_traj(), seeded, 16, "x").sampling_params.sampling_seed
    assert a == resume_request(_traj(), seeded, 16, "another-rid").sampling_params.sampling_seed == request_seed(42, _traj())
    others = {request_seed(42, t) for t in (_traj(epoch=1), _traj(index=4), _traj(sample=2), _traj(tokens=3))}
    assert a not in others and len(others) == 4
    assert request_seed(43, _traj()) != a
    assert all(0 <= s < 2**31 for s in others | {a})
    assert resume_request(_traj(), SamplingParams(), 16, "x").sampling_params.sampling_seed is None
    assert seeded.sampling_seed == 42  # the flow's own parameters are not changed
