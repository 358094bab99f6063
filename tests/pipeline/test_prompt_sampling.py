"""A prompt's own sampling (``metadata["sampling"]``): its response budget and ``ignore_eos``, honoured
by the single-turn flow on the embedded engine through SGLang's HTTP API, a resumed trajectory
getting what remains of that budget; the ``repeat`` task's ``stop: length``, whose responses then
follow the length law exactly whatever the policy writes; keys a prompt may not set refused by name."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from lightning_fasync.agents.flow import ToolAgentFlow
from lightning_fasync.data.tasks import make_task
from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.pipeline.engine_client import SamplingParams
from lightning_fasync.pipeline.flow import SingleTurnFlow, prompt_sampling
from lightning_fasync.policy import build_policy
from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryStatus
from tests.helpers.engine import serve

MAX_LEN = 60


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


def _samples(task, num, seed=3):
    return [PromptSample(PromptId(0, i), ids, meta) for i, (ids, meta) in enumerate(task.make_prompts(num, seed))]


def test_stop_length_responses_are_exactly_the_prompts_lengths_on_the_embedded_engine(policy):
    task = make_task("repeat", max_len=40, length_law="pareto", min_len=4, tail_index=0.8, stop="length")
    samples = _samples(task, 6)
    lengths = [s.metadata["length"] for s in samples]
    assert len(set(lengths)) > 1  # the law gives them different lengths
    # A trajectory aborted at a boundary after 3 tokens: resumed, it gets what remains of its budget.
    first = samples[0]
    partial = Trajectory.fresh(first.prompt_id, 0, list(first.input_ids), seq=1)
    partial.extend([first.metadata["letter_id"]] * 3, [-0.1] * 3, [0] * 3)
    resumed = PromptSample(first.prompt_id, first.input_ids, first.metadata, resume=[partial])

    async def body(session, url, engine):
        client = SGLangClient([url])
        try:
            flow = SingleTurnFlow(client, SamplingParams(temperature=1.0), MAX_LEN, reward_fn=task.reward)
            groups = [await flow.run_group(s, seq=10 + i, n=4) for i, s in enumerate(samples)]
            again = await flow.run_group(resumed, seq=99, n=2)
            return groups, again
        finally:
            await client.close()

    groups, again = serve(policy, body)
    for n, group in zip(lengths, groups):
        for traj in group:  # an untrained policy writes EOS anywhere; the engine ignores it
            assert len(traj.response_ids) == n and traj.status is TrajectoryStatus.TRUNCATED, (n, traj.status)
            assert 0.0 <= traj.reward <= 1.0
    assert len(again[0].response_ids) == lengths[0] and again[0].response_ids[:3] == partial.response_ids
    assert len(again[1].response_ids) == lengths[0]  # a fresh one beside it


def test_the_rollout_budget_caps_a_prompts_own_and_the_flows_parameters_are_not_changed():
    base = SamplingParams(max_new_tokens=7, temperature=0.5)
    sample = PromptSample(PromptId(0, 0), [1, 2], {"sampling": {"max_new_tokens": 500, "ignore_eos": True}})
    params, budget = prompt_sampling(sample, base, 64)
    assert budget == 64 and params.ignore_eos and params.temperature == 0.5
    assert base.ignore_eos is False
    params, budget = prompt_sampling(PromptSample(PromptId(0, 1), [1, 2], {"length": 3}), base, 64)
    assert params is base and budget == 64


@pytest.mark.parametrize("own, key", [({"temperature": 0.1}, "temperature"), ({"max_new_tokens": 0}, "max_new_tokens"),
                                      ({"max_new_tokens": True}, "max_new_tokens"), ({"ignore_eos": "yes"}, "ignore_eos")])
def test_what_a_prompt_may_not_set_fails_its_group_naming_the_key(own, key):
    sample = PromptSample(PromptId(0, 0), [1, 2], {"sampling": own})
    with pytest.raises(ValueError, match=key):
        prompt_sampling(sample, SamplingParams(), 64)

    class NoEngine:
        async def generate_batch(self, requests):
            raise AssertionError("nothing is sent for a refused prompt")

    group = asyncio.run(SingleTurnFlow(NoEngine(), SamplingParams(), 64).run_group(sample, seq=1, n=2))
    assert all(t.status is TrajectoryStatus.FAILED and key in t.error for t in group)


def test_the_tool_agent_flow_refuses_a_prompts_own_budget():
    class NoEngine:
        async def generate(self, request):
            raise AssertionError("nothing is sent")

    flow = ToolAgentFlow(NoEngine(), SamplingParams(), 64, tokenizer=SimpleNamespace(chat_template="{{ x }}"), tools=())
    sample = PromptSample(PromptId(0, 0), [1, 2], {"sampling": {"max_new_tokens": 4}})
    traj = asyncio.run(flow.run(sample, 0, seq=1))
    assert traj.status is TrajectoryStatus.FAILED and "single-turn flow" in traj.error


def test_stop_length_scores_the_full_budget_without_eos_as_exact():
    task = make_task("repeat", max_len=40, stop="length")
    meta = {"letter_id": task._ids["c"], "length": 5, "sampling": {"max_new_tokens": 5, "ignore_eos": True}}
    c = task._ids["c"]
    assert task.score([c] * 5, meta) == 1.0
    assert task.score([c] * 4 + [task.eos_id], meta) == pytest.approx(0.8 * 0.8)  # 4 of 5 letters, no stop bonus
    eos_task = make_task("repeat", max_len=40)
    assert eos_task.score([c] * 5, meta) == pytest.approx(0.8)  # stop: eos wants the EOS
    with pytest.raises(ValueError, match="`stop`"):
        make_task("repeat", stop="never")
    assert "sampling" not in eos_task.make_prompts(3, 1)[0][1]
