"""math_reward: the DAPO-style answer check with math-verify (off the event loop and in worker
processes through RewardRunner: tests/pipeline/test_reward_runner.py)."""

import asyncio
import logging
import os
import sys
import threading
import time

import pytest

from lightning_fasync.config import DataSourceConfig
from lightning_fasync.data import rewards
from lightning_fasync.data.rewards import MAX_ANSWER_CHARS, MAX_PARSE_CHARS, extract_final_answer, math_reward
from lightning_fasync.pipeline.reward_runner import RewardError, RewardRunner, auto_processes
from tests.data.hanging_reward import hang
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


# ---------------------------------------------------------------------------- agreement with math-verify


def _box(answer):
    return "\\boxed{" + answer + "}"


# A policy could collect these by boxing the leading coefficient (read as plain text, "2x+1" is 2):
# each must score 0.
GAMING = [
    ("2x+1", _box("2")), ("2x+1", _box("2x-1")), ("2x+1", _box("2x+7")), ("2x+1", _box("2y")),
    ("2", _box("2x+1")), ("(0, 1]", _box("1")),
]
# Correct but written in another order: each must score 1 (math-verify says equal).
REORDERED = [("2x+1", _box("1+2x")), ("1, 2", _box("2, 1"))]
# (ground truth, response): the final answer is the box's content or the Answer: line.
AGREEMENT = GAMING + REORDERED + [
    # expressions
    ("2x+1", _box("2x+1")), ("2x+1", _box("2 x + 1")), ("2x+1", _box("1 + 2x")), ("2x+1", _box("x")),
    ("2x+1", _box("2x")), ("-2x+1", _box("1-2x")), ("-2x+1", _box("-2")), ("3x", _box("3")), ("3x", _box("3x")),
    ("a+b", _box("b+a")), ("a+b", _box("a")), ("x^2 - 1", _box("(x-1)(x+1)")), ("x^2-1", _box("x^2")),
    ("x^2+2x+1", _box("(x+1)^2")), ("x^2+2x+1", _box("x^2")), ("x^2+2x+1", _box("1")), ("\\frac{x}{2}", _box("0.5x")),
    ("\\frac{x}{2}", _box("x")), ("\\sin x", _box("\\sin(x)")), ("e^{2}", _box("e^2")), ("2^{10}", _box("1024")),
    ("2", _box("2x")), ("2", _box("2y")), ("2", _box("2^x")), ("5", _box("5a+b")),
    # intervals
    ("(0, 1]", _box("(0, 1]")), ("(0, 1]", _box("(0,1]")), ("(0, 1]", _box("[0, 1]")), ("(0, 1]", _box("(0, 1)")),
    ("(0, 1]", _box("0")), ("[2, 5)", _box("[2,5)")), ("[2, 5)", _box("2")), ("[2, 5)", _box("5")),
    ("(-\\infty, 3)", _box("(-\\infty,3)")), ("(-\\infty, 3)", _box("3")), ("(-\\infty, 3)", _box("-\\infty")),
    ("[1, 2]", _box("[1,2]")), ("[1, 2]", _box("1")),
    # sets and tuples
    ("1, 2", _box("1, 2")), ("1, 2", _box("\\{1, 2\\}")), ("1, 2", _box("1")), ("1, 2", _box("2")),
    ("1, 2", _box("1, 2, 3")), ("\\{1, 2\\}", _box("2, 1")), ("\\{1, 2, 3\\}", _box("3, 2, 1")),
    ("\\{1, 2, 3\\}", _box("1, 2")), ("(1, 2)", _box("(1,2)")), ("-1, 3", _box("3, -1")), ("-1, 3", _box("3")),
    # fractions, roots, constants
    ("\\frac{1}{2}", _box("0.5")), ("\\frac{1}{2}", _box("1/2")), ("\\frac{1}{2}", _box("\\frac{2}{4}")),
    ("\\frac{1}{2}", _box("\\dfrac{1}{2}")), ("\\frac{1}{2}", _box("\\frac{1}{3}")), ("\\frac{1}{2}", _box("1")),
    ("\\frac{1}{2}", _box("2")), ("3/4", _box("\\frac34")), ("3/4", _box("0.75")), ("3/4", _box("3")), ("3/4", _box("4")),
    ("\\frac{\\sqrt{3}}{2}", _box("\\frac{\\sqrt3}{2}")), ("\\frac{\\sqrt{3}}{2}", _box("3")),
    ("\\sqrt{8}", _box("2\\sqrt{2}")), ("2\\sqrt{2}", _box("2")), ("2\\pi", _box("2")), ("2\\pi", _box("2\\pi")),
    ("\\infty", _box("\\infty")),
    # integers (DAPO-Math-17k, GSM8K)
    ("72", _box("72")), ("72", _box("72.0")), ("72", _box("71")), ("72", _box("720")), ("72", _box("7")),
    ("72", _box("72x")), ("72", _box("72^2")), ("1000", _box("1,000")), ("1,000", _box("1000")), ("0", _box("0")),
    ("100", _box("10^2")), ("3628800", _box("10!")), ("34", "So the total is 34.\nAnswer: 34"), ("34", "Answer: 43"),
    ("5", _box("5") + " and also " + _box("6")), ("5", _box("6") + " no wait " + _box("5")),
    ("10", "Hence $" + _box("10") + "$."), ("12", _box("12\\%")), ("50\\%", _box("50\\%")), ("24", "Answer: $24$"),
    # negative numbers
    ("-3", _box("-3")), ("-3", _box("3")), ("-3", _box("- 3")), ("3", _box("-3")), ("-1", _box("-1")),
    ("-0.5", _box("-\\frac{1}{2}")), ("-7", "Answer: -7"), ("-7", "Answer: 7"),
    # Answer: lines that hold math, not prose
    ("2x+1", "Answer: 2x+1"), ("2x+1", "Answer: 2"), ("2", "Answer: 2x+1"), ("(0, 1]", "Answer: (0, 1]"),
    ("(0, 1]", "Answer: 1"), ("1, 2", "Answer: 2, 1"),
]


def _math_verify_says(gold: str, response: str) -> float:
    """math-verify's own verdict under the convention docs/tasks.md states: the final answer (last
    box, else the Answer: line) and the ground truth, each parsed as math (inside $...$)."""
    from math_verify import parse, verify

    final = extract_final_answer(response)
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    answer_parsed = parse(f"${final}$", parsing_timeout=None)
    return 1.0 if verify(gold_parsed, answer_parsed, timeout_seconds=None) else 0.0


def test_agreement_table_is_large():
    assert len(AGREEMENT) >= 81 and len(set(AGREEMENT)) == len(AGREEMENT)


@pytest.mark.parametrize("gold, response", AGREEMENT)
def test_math_reward_agrees_with_math_verify(gold, response):
    expected = _math_verify_says(gold, response)
    if (gold, response) in GAMING:
        assert expected == 0.0
    if (gold, response) in REORDERED:
        assert expected == 1.0
    assert math_reward(*make(gold, response)) == expected


@pytest.mark.parametrize(
    "gold, response, expected",
    [
        ("18", "Answer: 18 dollars", 1.0),  # prose on an Answer: line: the number in it
        ("18", "Answer: 19 dollars", 0.0),
        ("72", "Answer: The total is 72 clips.", 1.0),
        ("2", "Answer: 2xyz+1", 0.0),  # letters glued to the number are math, not a word
        ("10", "Answer: 10!", 1.0),  # an exclamation on an Answer: line; in a box, 10! is a factorial
        ("18 dollars", _box("18"), 1.0),  # a ground truth in words is read as prose too
        ("#### 42", _box("42"), 1.0),  # a bare GSM8K answer
        ("42", _box("42") + " clips", 1.0),
    ],
)
def test_prose_answers(gold, response, expected):
    assert math_reward(*make(gold, response)) == expected


# ---------------------------------------------------------------------------- long and hostile responses


def _lines_run(fn, *args) -> int:
    """Python lines executed by ``fn(*args)`` and what it calls (a deterministic count of work)."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(previous)
    return count


def test_box_search_is_linear_in_the_text():
    # Each unclosed \boxed{ once made the search rescan to the end: 40 KB took 7 s, 1 MB over 35 s.
    unit = "\\boxed{"
    small = _lines_run(rewards._last_boxed, unit * 2_000)
    double = _lines_run(rewards._last_boxed, unit * 4_000)
    assert double <= 2.1 * small
    assert small <= 10 * 2_000  # a few lines per box, not a scan per box
    closed = "\\boxed{1} {x} " * 2_000 + "\\boxed{2"
    assert _lines_run(rewards._last_boxed, closed) <= 2.1 * _lines_run(rewards._last_boxed, "\\boxed{1} {x} " * 1_000)
    assert rewards._last_boxed(closed) == "1"
    megabyte = unit * (1_000_000 // len(unit))
    assert extract_final_answer(megabyte) is None
    assert math_reward(*make("1", megabyte)) == 0.0


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"\boxed{a} \boxed{b}", "b"),
        (r"\boxed{a \boxed{b}}", "b"),  # nested: the inner box starts last
        (r"\boxed{a \boxed{b}", "b"),  # the outer never closes
        (r"\boxed{a} \boxed{b", "a"),
        (r"} } \boxed{c}", "c"),  # stray closing braces before
        (r"\boxed{ {x} {y} }", "{x} {y}"),
        (r"\boxed  {7}", "7"),
        (r"\boxed{", None),
        (r"\boxed", None),
    ],
)
def test_box_search_cases(text, expected):
    assert extract_final_answer(text) == expected


@pytest.fixture
def parse_spy(monkeypatch):
    """The lengths of the texts math_reward hands to math-verify's parse."""
    parse, verify, config = rewards._math_verify()
    seen: list[int] = []

    def spy(text, *args, **kwargs):
        seen.append(len(text))
        return parse(text, *args, **kwargs)

    monkeypatch.setattr(rewards, "_mv", (spy, verify, config))
    return seen


# A box-less response on which math-verify's regexes take quadratic time (unclosed "\("): before
# the cap, 229 KB of it held the GIL for over a minute (the event loop stalled 36 s in thread mode).
BOXLESS = ("We have \\( x and then some words here. " * 6_000)[:229_000]


def test_math_verify_sees_at_most_max_parse_chars(parse_spy):
    assert math_reward(*make("42", BOXLESS)) == 0.0
    assert math_reward(*make("42", BOXLESS + " so 42")) == 1.0  # the tail is still read
    long_box = _box("1+" * 30_000 + "1")
    assert math_reward(*make("42", long_box)) == 0.0
    assert math_reward(*make("1+" * 30_000 + "1", long_box)) == 1.0  # literally the ground truth
    assert math_reward(*make("42", "Answer: " + "4" * 5_000 + "2")) == 0.0
    assert math_reward(*make("42", "\\boxed{" * 150_000)) == 0.0
    assert parse_spy and max(parse_spy) <= MAX_PARSE_CHARS
    assert MAX_ANSWER_CHARS < MAX_PARSE_CHARS


def test_the_event_loop_scores_a_long_response_in_threads_on_a_capped_text(parse_spy):
    # In thread mode the parse holds the GIL; what bounds the stall is the length it is given.
    async def score():
        runner = RewardRunner(math_reward, timeout_s=60, processes=0)
        try:
            return await runner(*make("42", BOXLESS))
        finally:
            runner.close()

    assert asyncio.run(score()) == 0.0
    assert parse_spy and max(parse_spy) <= MAX_PARSE_CHARS


def test_math_verify_logs_are_cut(caplog, capsys):
    rewards._math_verify()
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("math_verify.parser").warning("Timeout during parsing: %s", BOXLESS)
        math_reward(*make("42", BOXLESS))
        math_reward(*make("42", "\\boxed{" * 150_000))
    captured = capsys.readouterr()
    logged = sum(len(r.getMessage()) for r in caplog.records)
    assert logged + len(captured.err) + len(captured.out) < 4_000
    assert any(r.getMessage().startswith("Timeout during parsing") for r in caplog.records)


# ---------------------------------------------------------------------------- default mode: processes


def test_math_reward_runs_in_worker_processes_by_default():
    assert DataSourceConfig().reward_processes is None
    assert auto_processes(math_reward) >= 1
    assert auto_processes(lambda s, t: 1.0) == 0  # a reward not marked cpu_bound stays in threads
    runner = RewardRunner(math_reward, processes=DataSourceConfig().reward_processes)
    try:
        assert runner.processes == auto_processes(math_reward)
        sample, traj = make("0.5", r"So \boxed{\frac{1}{2}}.")
        assert asyncio.run(runner(sample, traj)) == 1.0
        assert runner.worker_pids()
    finally:
        runner.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_reward_past_its_timeout_in_the_default_mode_is_killed(tmp_path):
    pid_file = tmp_path / "pid"
    runner = RewardRunner(hang, timeout_s=2, processes=None)
    assert runner.processes >= 1
    try:
        with pytest.raises(RewardError, match="data_source.reward_timeout"):
            asyncio.run(runner(*make("1", "x", pid_file=str(pid_file))))
        pid = int(pid_file.read_text())
        assert not _alive(pid)  # killed and reaped, not left running
        assert runner.timeouts == 1 and runner.stuck_threads == 0
    finally:
        runner.close()
