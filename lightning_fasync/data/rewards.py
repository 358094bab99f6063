"""Rule-based rewards for real math datasets: DAPO-style answer checking with math-verify.

:func:`math_reward` scores a response 1.0 when its final answer is mathematically equivalent to
the ground truth and 0.0 otherwise (a wrong, missing or malformed answer is 0.0; only a missing
ground truth raises). The final answer is the last ``\\boxed{...}`` (nested braces allowed),
else the text after the last ``Answer:`` (DAPO's prompt format), else the whole response; the
equivalence check is math-verify's (``parse`` to SymPy, then ``verify``), so ``\\frac{1}{2}``,
``0.5`` and ``1/2`` agree, as do ``2\\sqrt{2}`` and ``\\sqrt{8}``, ``1+2x`` and ``2x+1``, or the
sets ``\\{1, 2\\}`` and ``2, 1``.

How answers are read. The ground truth and a boxed answer are read as math-verify reads
``$...$``: ``2x+1`` is an expression, ``(0, 1]`` an interval, ``1, 2`` a set. Only an answer that is
a plain number (``72``, ``-3``, ``1,000``, ``0.5``, ``25%``) is read as text first, exactly as
math-verify reads numbers in prose. An ``Answer:`` line is read the same way, except that a line
of words (``18 dollars``) is read as prose, where math-verify finds the number. So a boxed answer is
never shortened to its leading number (``\\boxed{2x+1}`` is not ``2``) and a ground truth is
never shortened either.

The reward reads the response as text from ``trajectory.metadata["response_text"]``, which
:class:`~lightning_fasync.pipeline.reward_runner.RewardRunner` sets (it decodes
``response_ids`` with the tokenizer) before it calls the reward.

Long responses. The final answer is found in one pass over the response (linear in its length,
however many unclosed boxes it has), and math-verify never sees more than
:data:`MAX_PARSE_CHARS` characters of it: an answer longer than :data:`MAX_ANSWER_CHARS` is not
parsed (it scores 1.0 only when it is literally the ground truth), and a response with neither a
box nor an ``Answer:`` line is parsed on its last :data:`MAX_PARSE_CHARS` characters. math-verify's
extraction regexes take time quadratic in their input on some text (unclosed ``\\(``), so
unbounded, a 229 KB response held the GIL for a minute. Its log lines are cut to a few hundred
characters (it would log a whole response on a timeout).

Threads, processes and timeouts: math-verify bounds each ``parse``/``verify`` with
``signal.alarm``, which only works in the main thread (in any other thread ``parse`` and
``verify`` raise a ``ValueError`` at every call), and an alarm in the main thread of the trainer
would also clobber other SIGALRM users (pytest-timeout's signal method, for one). So those
timeouts are used only where they can work, in a main thread whose SIGALRM is unclaimed (a
RewardRunner worker process): an answer SymPy cannot settle in time then scores 0.0. Everywhere
else they are disabled, and the bound is the RewardRunner's ``data_source.reward_timeout``.
:func:`math_reward` is marked ``cpu_bound``, so with ``data_source.reward_processes`` unset it runs in
worker processes, where that timeout kills a stuck call; in threads (``reward_processes: 0``) a
call past it fails the trajectory but its thread runs on. math-verify's one-time "timeout is
disabled" warning is silenced, since it would be logged from a rollout thread.

Costly answers. ``parse`` leaves ``9^{9^{9^{9}}}``, ``(10^{9})!`` or ``(x+1)^{5000}`` unevaluated,
and ``verify`` would then compute for minutes inside SymPy, partly in big-integer C code that
does not release the GIL: in a thread nothing can stop it (the event loop, and the RewardRunner timeout with it, stall too).
Such answers (exact numbers over 10,000 digits, powers of a symbolic or irrational base over
200, factorials, binomials or gammas of arguments over 10,000) are not compared symbolically:
only their extracted strings are, so they score 0.0 unless they are literally the ground truth.
Other slow cases remain possible, which is why the reward runs in worker processes by default.
"""

from __future__ import annotations

import logging
import math
import re
import signal
import threading
from typing import Any, Optional

from lightning_fasync.types import PromptSample, Trajectory

__all__ = ["extract_final_answer", "math_reward", "MATH_VERIFY_TIMEOUT_S", "MAX_ANSWER_CHARS", "MAX_PARSE_CHARS"]

# Seconds for each math-verify parse/compare, where signal timeouts can work (see the module doc).
MATH_VERIFY_TIMEOUT_S = 3
# An extracted answer (a box's content, an Answer: line) longer than this is compared as a string
# only, never parsed.
MAX_ANSWER_CHARS = 1_000
# The most characters of a response math-verify is given: a response with neither a box nor an
# Answer: line is parsed on its last this many characters.
MAX_PARSE_CHARS = 2_000
# math-verify's log lines (it logs a whole response on a parse timeout) are cut to this length.
_MAX_LOG_CHARS = 300
# Answers whose verification would build huge numbers or expansions are compared as strings only
# (see _costly): exact numbers beyond this many digits...
_MAX_DIGITS = 10_000
# ...powers of a symbolic or irrational base ((x+1)^{1000} takes ~10 s to compare, holding the GIL)...
_MAX_SYMBOLIC_EXPONENT = 200
# ...and factorials, binomials and gammas of larger arguments.
_MAX_COMBINATORIAL_ARG = 10_000

# One token of the box search: a box's opening (``\boxed{``, spaces allowed before the brace) or a brace.
_BOX_TOKEN = re.compile(r"\\boxed\s*\{|[{}]")
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
# A plain number, the one kind of answer read as text first: an optional sign, digits (thousands
# separated by commas or not), an optional decimal part, an optional percent sign.
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?%?")
# An Answer: line (or a ground truth) without LaTeX and with a word of three or more letters is
# prose ("18 dollars"), read as text; "2x+1", "(0, 1]" or "1, 2" are math.
_LATEX_MARKERS = ("\\", "{", "^", "_")
_WORD = re.compile(r"\b[A-Za-z]{3,}\b")  # a word: "2xyz+1" has none

_mv: Any = None  # (parse, verify, extraction configs), imported on first use: sympy is slow to import


class _ShortLogs(logging.Filter):
    """Cuts math-verify's log messages (a parse timeout logs the whole input) to a few hundred characters."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > _MAX_LOG_CHARS:
            record.msg = f"{message[:_MAX_LOG_CHARS]}... ({len(message)} characters)"
            record.args = None
        return True


def _math_verify() -> Any:
    global _mv
    if _mv is None:
        import math_verify.grader
        import math_verify.parser
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        # The warning is printed once per process when a timeout is disabled; we disable them on
        # purpose (module docstring), and it would be logged from a worker thread.
        math_verify.parser.TIMEOUT_WARNING_SHOWN = True
        math_verify.grader.TIMEOUT_WARNING_SHOWN = True
        for module in (math_verify.parser, math_verify.grader):
            log = logging.getLogger(module.__name__)
            if not any(isinstance(f, _ShortLogs) for f in log.filters):
                log.addFilter(_ShortLogs())
        _mv = (parse, verify, [LatexExtractionConfig(), ExprExtractionConfig()])
    return _mv


def _signal_timeout() -> Optional[int]:
    """math-verify's per-operation timeout here: :data:`MATH_VERIFY_TIMEOUT_S` in a main thread
    whose SIGALRM nobody else handles, else None (disabled)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    try:
        if signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL:
            return None
    except (AttributeError, ValueError):  # no SIGALRM (Windows)
        return None
    return MATH_VERIFY_TIMEOUT_S


def _magnitude(expr: Any) -> Optional[float]:
    """``|expr|`` for a numeric SymPy expression, or None when it is too costly or not a number."""
    try:
        if expr.is_Number:
            return abs(float(expr))
        if _costly(expr):
            return None
        return abs(complex(expr.evalf(15)))
    except (TypeError, ValueError, OverflowError, ArithmeticError):
        return None


def _costly(expr: Any) -> bool:
    """Whether comparing ``expr`` could make SymPy compute for minutes (see the module doc).

    ``parse`` leaves ``9^{9^{9^{9}}}`` or ``(10^{9})!`` unevaluated; ``verify`` would evaluate it
    without ever returning, and in a thread (no math-verify timeout) that holds the GIL, freezing
    the event loop and with it the RewardRunner timeout meant to stop it.
    """
    from sympy import Pow, preorder_traversal
    from sympy.functions.combinatorial.factorials import CombinatorialFunction
    from sympy.functions.special.gamma_functions import gamma

    for node in preorder_traversal(expr):
        if isinstance(node, Pow):
            base, exp = node.args
            if not exp.is_number:
                continue
            size = _magnitude(exp)
            if size is None:
                return True
            if base.is_Rational:
                digits = max(abs(base.p), abs(base.q))
                if digits > 1 and size * math.log10(digits) > _MAX_DIGITS:
                    return True
            elif size > _MAX_SYMBOLIC_EXPONENT:
                return True
        elif isinstance(node, (CombinatorialFunction, gamma)):
            for arg in node.args:
                if arg.is_number:
                    size = _magnitude(arg)
                    if size is None or size > _MAX_COMBINATORIAL_ARG:
                        return True
    return False


def _too_costly(parsed: list[Any]) -> bool:
    from sympy import Basic

    return any(isinstance(item, Basic) and _costly(item) for item in parsed)


def _last_boxed(text: str) -> Optional[str]:
    """The content of the last complete ``\\boxed{...}``, braces balanced; None if there is none.

    One pass over the braces: each open box remembers the depth its brace opened, and the ``}``
    that brings the depth back below it closes it (a box never closed, as in a truncated
    response, is skipped: the box before it counts). Of the boxes closed, the one that starts
    last wins (the inner one of nested boxes).
    """
    depth = 0
    open_boxes: list[tuple[int, int]] = []  # (start of the content, depth inside the box), innermost last
    last: Optional[tuple[int, int]] = None  # (start, end) of the complete box that starts last
    for token in _BOX_TOKEN.finditer(text):
        if token.group() == "}":
            if open_boxes and open_boxes[-1][1] == depth:
                start = open_boxes.pop()[0]
                if last is None or start > last[0]:
                    last = (start, token.start())
            depth -= 1
        else:
            depth += 1
            if token.group() != "{":
                open_boxes.append((token.end(), depth))
    return None if last is None else text[last[0] : last[1]].strip()


def _answer_line(text: str) -> Optional[str]:
    """The first non-empty line after the last ``Answer:``, or None."""
    last = None
    for last in _ANSWER.finditer(text):
        pass
    if last is None:
        return None
    pos = last.end()
    while pos < len(text):
        end = text.find("\n", pos)
        end = len(text) if end < 0 else end
        line = text[pos:end].strip()
        if line:
            return line
        pos = end + 1
    return None


def _final_answer(text: str) -> tuple[Optional[str], bool]:
    """:func:`extract_final_answer`, and whether the answer came from a box."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed, True
    return _answer_line(text), False


def extract_final_answer(text: str) -> Optional[str]:
    """The model's final answer in ``text``, or None when it states none explicitly.

    The content of the last ``\\boxed{...}`` (nested braces allowed) if there is one, else the
    first non-empty line after the last ``Answer:`` (case-insensitive; DAPO's format).

    Args:
        text: The decoded response.

    Returns:
        The answer string (stripped), or None.
    """
    return _final_answer(text)[0]


def _is_number(answer: str) -> bool:
    text = answer.strip()
    return any(c.isdigit() for c in text) and _NUMBER.fullmatch(text) is not None


def _parse_answer(answer: str, timeout: Optional[int], kind: str) -> list[Any]:
    """math-verify's parse of a bare answer string: ``kind`` is ``box`` (a box's content),
    ``line`` (an ``Answer:`` line) or ``truth`` (the ground truth).

    A plain number is parsed as text, then inside ``$...$`` (on an ``Answer:`` line, a number
    followed by ``!`` too: an exclamation). A line or a ground truth that is prose (``$...$`` in
    it, or words and no LaTeX) is parsed as text as well: math-verify finds the number in it.
    Anything else is math: parsed inside ``$...$`` (math-verify's inline math), or, for an answer
    that inline math cannot hold (a line break), inside ``\\boxed{...}``; never as text, which
    would read ``2x+1`` as its leading ``2`` (see the module doc).
    """
    parse, _, config = _math_verify()
    bare = answer.strip()
    inline = f"${bare.strip('$')}$"
    prose = kind != "box" and ("$" in bare or (not any(m in bare for m in _LATEX_MARKERS) and _WORD.search(bare)))
    if _is_number(bare) or (kind == "line" and _is_number(bare.rstrip("!"))) or prose:
        attempts = [bare, inline]
    else:
        attempts = [inline, f"\\boxed{{{bare}}}"]
    for attempt in attempts:
        parsed = parse(attempt, extraction_config=config, parsing_timeout=timeout)
        if parsed:
            return parsed
    return []


def _ground_truth(sample: PromptSample) -> str:
    answer = sample.metadata.get("answer")
    if answer is None or not str(answer).strip():
        raise ValueError(
            f"math_reward needs the ground truth in sample.metadata['answer'] (prompt {sample.prompt_id}); "
            f"the sample's metadata has keys {sorted(sample.metadata)}."
        )
    text = str(answer)
    if "####" in text:  # a GSM8K solution: the final answer follows the last ####
        text = text.rsplit("####", 1)[1]
        if not text.strip():
            raise ValueError(f"The ground truth of prompt {sample.prompt_id} ends with '####' and no answer after it.")
    return text.strip()


def _same_string(gold: str, answer: str) -> float:
    return 1.0 if "".join(gold.split()) == "".join(answer.split()) else 0.0


def math_reward(sample: PromptSample, trajectory: Trajectory) -> float:
    """1.0 when the response's final answer equals the ground truth (math-verify), else 0.0.

    Args:
        sample: The prompt; ``sample.metadata["answer"]`` is the ground truth (a GSM8K solution
            ending in ``#### 72`` is reduced to what follows the last ``####``).
        trajectory: The response; its text is ``trajectory.metadata["response_text"]``.

    Returns:
        1.0 or 0.0. A wrong, missing, malformed or unparseable answer is 0.0.

    Raises:
        ValueError: The ground truth or the response text is missing (a wiring error, not a
            model error).
    """
    gold_text = _ground_truth(sample)
    response = trajectory.metadata.get("response_text")
    if response is None:
        raise ValueError(
            "math_reward reads the response text from trajectory.metadata['response_text'], which is "
            "not set: run the reward through RewardRunner with a tokenizer (it decodes response_ids)."
        )
    parse, verify, config = _math_verify()
    timeout = _signal_timeout()
    try:
        final, boxed = _final_answer(response)
        if final is not None and len(final) > MAX_ANSWER_CHARS:
            return _same_string(gold_text, final)
        gold = _parse_answer(gold_text, timeout, "truth") or [gold_text]
        if final is not None:
            predicted = _parse_answer(final, timeout, "box" if boxed else "line")
        else:
            predicted = parse(response[-MAX_PARSE_CHARS:], extraction_config=config, parsing_timeout=timeout)
        if not predicted:
            return 0.0
        if _too_costly(predicted) or _too_costly(gold):  # compare the extracted strings only
            gold = [g for g in gold if isinstance(g, str)]
            predicted = [p for p in predicted if isinstance(p, str)]
        return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0
    except Exception:  # math-verify catches its own errors; anything left is a malformed answer
        return 0.0


# RewardRunner runs a reward marked cpu_bound in worker processes unless data_source.reward_processes says otherwise.
math_reward.cpu_bound = True  # type: ignore[attr-defined]
