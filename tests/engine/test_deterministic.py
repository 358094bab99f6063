"""``--enable-deterministic-inference`` on the embedded engine (``rollout.deterministic_inference``):
a request's tokens and log-probs are the same bits whether it runs alone or among others, in any
slot, admitted with others or after them; and seeded requests (``rollout.sampling_seed``) are then a
function of their prompt alone."""

from __future__ import annotations

import copy

import pytest

from lightning_fasync.engine.engine import Engine
from lightning_fasync.policy import build_policy
from tests.helpers.engine import submit

NEW = 24


@pytest.fixture(scope="module")
def policy():
    return build_policy("tiny")


def _run(model, prompts, seeds, deterministic, slots_taken=0):
    """Generate ``prompts`` together (after ``slots_taken`` long requests that hold the first slots);
    returns each one's (tokens, log-probs)."""
    engine = Engine(copy.deepcopy(model), max_running_requests=16, deterministic=deterministic)
    try:
        blockers = [submit(engine, f"b{i}", [5 + i, 6, 7], max_new_tokens=200, ignore_eos=True)[1]
                    for i in range(slots_taken)]
        runs = [submit(engine, f"r{i}", p, max_new_tokens=NEW, ignore_eos=True, temperature=1.0, sampling_seed=s)
                for i, (p, s) in enumerate(zip(prompts, seeds))]
        for req, done in runs:
            assert done.wait(120) and req.finish_reason["type"] == "length"
        for done in blockers:
            assert done.wait(120)
        return [(list(r.output_ids), list(r.output_logprobs)) for r, _ in runs]
    finally:
        engine.stop()


def test_a_request_is_the_same_bits_alone_and_in_any_batch(policy):
    model, _ = policy
    prompts = [[3 + i % 7, 9, 4 + i % 5, 11][: 2 + i % 3] for i in range(9)]
    seeds = [100 + i for i in range(9)]
    alone = [_run(model, [p], [s], True)[0] for p, s in zip(prompts, seeds)]
    together = _run(model, prompts, seeds, True)
    shifted = _run(model, prompts[::-1], seeds[::-1], True, slots_taken=3)[::-1]
    assert together == alone
    assert shifted == alone  # other slots, other neighbours, admitted in another order
    # The control: the batched engine's numbers move with the batch (by float rounding).
    plain = [_run(model, [p], [s], False)[0] for p, s in zip(prompts, seeds)]
    assert _run(model, prompts[::-1], seeds[::-1], False, slots_taken=3)[::-1] != plain


def test_seeded_sampling_repeats_and_differs_by_seed(policy):
    model, _ = policy
    a = _run(model, [[3, 4, 5]] * 2, [1, 1], True)
    b = _run(model, [[3, 4, 5]], [2], True)
    assert a[0] == a[1]
    assert a[0][0] != b[0][0]
