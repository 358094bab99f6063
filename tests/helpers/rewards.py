"""A prompt and its trajectory for reward tests, shared by tests/data/test_rewards.py (math_reward)
and tests/pipeline/test_reward_runner.py (RewardRunner)."""

from __future__ import annotations

from lightning_fasync.types import PromptId, PromptSample, Trajectory

GSM8K = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def make(answer, text=None, **metadata):
    sample = PromptSample(PromptId(0, 0), [1, 2, 3], {"answer": answer, **metadata} if answer is not None else dict(metadata))
    traj = Trajectory.fresh(sample.prompt_id, 0, list(sample.input_ids), seq=0)
    if text is not None:
        traj.metadata["response_text"] = text
    return sample, traj
