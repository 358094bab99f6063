"""Unit tests of the synthetic verifiable tasks (lightning_fasync.data.tasks)."""

from __future__ import annotations

import random
import statistics

import pytest

from lightning_fasync.data import RepeatTask, Task, make_task
from lightning_fasync.policy import build_char_tokenizer
from lightning_fasync.types import PromptId, PromptSample, Trajectory, TrajectoryStatus


@pytest.fixture(scope="module")
def task() -> RepeatTask:
    return make_task("repeat", tokenizer=build_char_tokenizer())


def _score(task: RepeatTask, meta: dict, response_ids: list[int], status=TrajectoryStatus.COMPLETED) -> float:
    sample = PromptSample(PromptId(0, 0), [], meta)
    traj = Trajectory(PromptId(0, 0), 0, [], response_ids=list(response_ids), status=status)
    return task.reward(sample, traj)


def _letter_ids(task: RepeatTask) -> list[int]:
    return task.tokenizer.convert_tokens_to_ids(task.letters)


def test_protocol_and_registry(task):
    assert isinstance(task, Task)
    assert task.name == "repeat"
    assert task.stop_token_ids == [task.tokenizer.eos_token_id]
    assert task.max_new_tokens == task.max_len + 1
    with pytest.raises(ValueError, match="`data_source.task` is .*, which is not a registered task"):
        make_task("nope")
    with pytest.raises(ValueError, match="`max_len` is 1000"):
        make_task("repeat", max_len=1000)
    with pytest.raises(ValueError, match="`length_law` is 'zipf'"):
        make_task("repeat", length_law="zipf")


def test_the_pareto_law_has_a_heavy_tail_and_three_digit_prompts():
    task = make_task("repeat", max_len=400, length_law="pareto", min_len=4, tail_index=0.8)
    prompts = task.make_prompts(4000, seed=0)
    lengths = sorted(meta["length"] for _, meta in prompts)
    assert lengths[0] >= 4 and lengths[-1] == 400
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert median < 20 and p99 >= 300  # tens at the median, hundreds at the tail
    ids, meta = prompts[0]
    text = task.tokenizer.decode(ids[1:])
    assert len(ids) == 7 and text == f"{task.tokenizer.decode([meta['letter_id']])}*{meta['length']:03d}="
    assert task.score(task.answer_ids(meta), meta) == 1.0


def test_prompts_deterministic_for_a_seed(task):
    assert task.make_prompts(50, seed=3) == task.make_prompts(50, seed=3)
    assert task.make_prompts(50, seed=3) != task.make_prompts(50, seed=4)
    state = random.getstate()
    task.make_prompts(10, seed=0)
    assert random.getstate() == state  # the global RNG is untouched


def test_prompt_format_round_trips_through_the_tokenizer(task):
    tok = task.tokenizer
    for ids, meta in task.make_prompts(200, seed=1):
        assert len(ids) == 6 and ids[0] == tok.bos_token_id
        text = tok.decode(ids[1:])
        letter = tok.convert_ids_to_tokens(meta["letter_id"])
        assert text == f"{letter}*{meta['length']:02d}="
        assert tok(text, add_special_tokens=False)["input_ids"] == ids[1:]
        answer = task.answer_ids(meta)
        assert tok.decode(answer[:-1]) == letter * meta["length"] and answer[-1] == tok.eos_token_id


def test_lengths_are_long_tailed(task):
    lengths = [m["length"] for _, m in task.make_prompts(1000, seed=0)]
    assert min(lengths) >= 1 and max(lengths) <= task.max_len
    median = statistics.median(lengths)
    assert median <= 8
    assert max(lengths) >= 4 * median
    assert sum(n >= 3 * median for n in lengths) >= 10  # a few long ones, not one outlier
    assert len(set(lengths)) >= 20


def test_exact_answer_scores_one(task):
    for _, meta in task.make_prompts(100, seed=2):
        assert _score(task, meta, task.answer_ids(meta)) == 1.0


def test_eos_only_empty_and_garbage_score_low(task):
    eos = task.tokenizer.eos_token_id
    rng = random.Random(0)
    wrong_ids = task.tokenizer.convert_tokens_to_ids(list("0123456789!?XYZ"))
    for _, meta in task.make_prompts(100, seed=5):
        assert _score(task, meta, [eos]) == 0.0
        assert _score(task, meta, [], TrajectoryStatus.TRUNCATED) == 0.0
        garbage = [rng.choice(wrong_ids) for _ in range(meta["length"])] + [eos]
        assert _score(task, meta, garbage) == 0.0
        # Running on to the length budget with the right letter is not rewarded like the answer.
        runaway = [meta["letter_id"]] * task.max_len
        if meta["length"] <= task.max_len // 4:
            assert _score(task, meta, runaway, TrajectoryStatus.TRUNCATED) <= 0.25


def test_partial_credit_is_monotone_in_correctness(task):
    eos = task.tokenizer.eos_token_id
    meta = {"letter_id": _letter_ids(task)[0], "length": 20}
    wrong = _letter_ids(task)[1]
    scores = []
    for k in range(21):  # k right letters out of 20, exact length with EOS
        scores.append(_score(task, meta, [meta["letter_id"]] * k + [wrong] * (20 - k) + [eos]))
    assert scores == sorted(scores) and len(set(scores)) == 21
    assert scores[0] == 0.0 and scores[-1] == 1.0 and 0.3 < scores[10] < 0.7
    # Length: too short and too long both lose credit, more so the further off.
    short = [_score(task, meta, [meta["letter_id"]] * n + [eos]) for n in (5, 10, 15, 19)]
    long = [_score(task, meta, [meta["letter_id"]] * n + [eos]) for n in (40, 30, 25, 21)]
    assert short == sorted(short) and long == sorted(long)
    assert max(short + long) < 1.0
    # The stop bonus needs EOS after exactly `length` letters, not just any EOS.
    assert max(short + long) <= 1.0 - task.eos_weight
    # The stop bonus: the right letters without EOS score less than with it.
    assert _score(task, meta, [meta["letter_id"]] * 20, TrajectoryStatus.TRUNCATED) < 1.0
    # Tokens after the first EOS are ignored.
    assert _score(task, meta, task.answer_ids(meta) + [wrong] * 5) == 1.0


def test_reward_in_unit_interval_on_random_responses(task):
    rng = random.Random(7)
    vocab = len(task.tokenizer)
    for ids, meta in task.make_prompts(200, seed=7):
        resp = [rng.randrange(vocab) for _ in range(rng.randrange(task.max_new_tokens + 1))]
        assert 0.0 <= _score(task, meta, resp) <= 1.0


def test_noisy_demonstrations_score_moderately(task):
    rng = random.Random(0)
    scores = [_score(task, m, task.demonstrate(m, 0.5, rng)) for _, m in task.make_prompts(300, seed=9)]
    assert 0.2 < statistics.mean(scores) < 0.8
    clean = [_score(task, m, task.demonstrate(m, 0.0, rng)) for _, m in task.make_prompts(50, seed=9)]
    assert clean == [1.0] * 50
