"""math_reward: the DAPO-style answer check with math-verify (off the event loop and in worker
processes through RewardRunner: tests/pipeline/test_reward_runner.py)."""

import threading
import time

import pytest

from lightning_fasync.data.rewards import extract_final_answer, math_reward
from tests.helpers.rewards import GSM8K, make


@pytest.mark.parametrize(
    "answer, text, expected",
    [
        ("0.5", r"So the probability is \boxed{\frac{1}{2}}", 1.0),
        ("1/2", r"\boxed{\frac{1}{2}}", 1.0),
        (r"\sqrt{8}", r"Simplify: \boxed{2\sqrt{2}}", 1.0),
        (GSM8K, "48 + 24 = 72 clips.\nAnswer: 72", 1.0),
        ("72", r"\boxed{72} clips in total, not 99 as one might think", 1.0),  # trailing text
        ("10", r"Hence $\boxed{10}$.", 1.0),
        ("3", "The answer is 3", 1.0),  # no box, no Answer: line: the whole text
        (r"\frac{3\sqrt{2}}{2}", r"\boxed{\frac{3}{\sqrt{2}}}", 1.0),  # nested braces
        ("18", r"Answer: \$18", 1.0),
        ("18", "Answer: 18 dollars", 1.0),
        ("72", "\\boxed{72}\nWait, let me redo: \\boxed{7", 1.0),  # a truncated last box is ignored
        ("2", r"\boxed{2\sqrt{2}}", 0.0),  # 2\sqrt{2} is not 2 (read as plain text it would be)
        ("0.5", r"\boxed{\frac{1}{3}}", 0.0),
        (GSM8K, "Answer: 71", 0.0),
        ("72", r"\boxed{71} (not 72)", 0.0),  # the box wins over other numbers
        ("5", "asdf }{ $$ \\boxed{ ###", 0.0),
        ("5", "", 0.0),
        ("3628800", r"\boxed{10!}", 1.0),
        ("256", r"\boxed{2^{2^{3}}}", 1.0),
        (r"2^{2023}", r"\boxed{2^{2023}}", 1.0),
    ],
)
def test_math_reward_table(answer, text, expected):
    sample, traj = make(answer, text)
    assert math_reward(sample, traj) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"x \boxed{\frac{3}{\sqrt{2}}} y", r"\frac{3}{\sqrt{2}}"),
        (r"\boxed{1} then \boxed {2}", "2"),
        ("blah\nAnswer: 72\n", "72"),
        ("answer:\n\n  $5$ \nmore", "$5$"),
        ("The answer is 3", None),
        (r"\boxed{unclosed", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    "text",
    [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{10^{10^{7}}}", r"\boxed{(x+1)^{5000}}", r"\boxed{(10^{9})!}", r"\boxed{\Gamma(10^{9})}"],
)
def test_math_reward_does_not_evaluate_huge_answers(text):
    # Unguarded, SymPy would compute for minutes holding the GIL (no math-verify timeout here).
    t0 = time.monotonic()
    assert math_reward(*make("1", text)) == 0.0
    assert math_reward(*make(text[len(r"\boxed{") : -1], text)) == 1.0  # literally the ground truth
    assert time.monotonic() - t0 < 5


def test_math_reward_needs_its_inputs():
    sample, traj = make(None, "Answer: 1")
    with pytest.raises(ValueError, match=r"metadata\['answer'\]"):
        math_reward(sample, traj)
    sample, traj = make("1")
    with pytest.raises(ValueError, match="response_text"):
        math_reward(sample, traj)


def test_math_reward_works_in_a_worker_thread():
    # math-verify's default signal-based timeouts raise in any thread but the main one.
    results = []
    worker = threading.Thread(target=lambda: results.append(math_reward(*make("0.5", r"\boxed{\frac12}"))))
    worker.start()
    worker.join(60)
    assert results == [1.0]
