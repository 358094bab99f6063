"""Rule-based rewards for real math datasets: DAPO-style answer checking with math-verify.

:func:`math_reward` scores a response 1.0 when its final answer is mathematically equivalent to
the ground truth and 0.0 otherwise (a wrong, missing or malformed answer is 0.0; only a missing
ground truth raises). The final answer is the last ``\\boxed{...}`` (nested braces allowed),
else the text after the last ``Answer:`` (DAPO's prompt format), else the whole response; the
equivalence check is math-verify's (``parse`` to SymPy, then ``verify``), so ``\\frac{1}{2}``,
``0.5`` and ``1/2`` agree, as do ``2\\sqrt{2}`` and ``\\sqrt{8}``.

The reward reads the response as text from ``trajectory.metadata["response_text"]``, which
:class:`~lightning_fasync.pipeline.reward_runner.RewardRunner` sets (it decodes
``response_ids`` with the tokenizer) before it calls the reward.

Threads and timeouts: math-verify bounds each ``parse``/``verify`` with ``signal.alarm``, which
only works in the main thread (in any other thread ``parse`` and ``verify`` raise a
``ValueError`` at every call), and an alarm in the main thread of the trainer would also clobber
other SIGALRM users (pytest-timeout's signal method, for one). So those timeouts are used only
where they can work, in a main thread whose SIGALRM is unclaimed (a RewardRunner worker process):
an answer SymPy cannot settle in time then scores 0.0. Everywhere else they are disabled, and
the bound is the RewardRunner's ``data_source.reward_timeout`` (a call past it fails the
trajectory). math-verify's one-time "timeout is disabled" warning is silenced, since it would
be logged from a rollout thread.

Costly answers. ``parse`` leaves ``9^{9^{9^{9}}}``, ``(10^{9})!`` or ``(x+1)^{5000}`` unevaluated,
and ``verify`` would then compute for minutes inside SymPy, partly in big-integer C code that
does not release the GIL: in a thread nothing can stop it (the event loop, and the RewardRunner timeout with it, stall too).
Such answers (exact numbers over 10,000 digits, powers of a symbolic or irrational base over
200, factorials, binomials or gammas of arguments over 10,000) are not compared symbolically:
only their extracted strings are, so they score 0.0 unless they are literally the ground truth.
Other slow cases remain possible; run this reward in worker processes
(``data_source.reward_processes``), where a stuck call is killed.
"""

from __future__ import annotations

import math
import re
import signal
import threading
from typing import Any, Optional

from lightning_fasync.types import PromptSample, Trajectory

__all__ = ["extract_final_answer", "math_reward", "MATH_VERIFY_TIMEOUT_S"]

# Seconds for each math-verify parse/compare, where signal timeouts can work (see the module doc).
MATH_VERIFY_TIMEOUT_S = 3
# Answers whose verification would build huge numbers or expansions are compared as strings only
# (see _costly): exact numbers beyond this many digits...
_MAX_DIGITS = 10_000
# ...powers of a symbolic or irrational base ((x+1)^{1000} takes ~10 s to compare, holding the GIL)...
_MAX_SYMBOLIC_EXPONENT = 200
# ...and factorials, binomials and gammas of larger arguments.
_MAX_COMBINATORIAL_ARG = 10_000

_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
# An answer that contains one of these is LaTeX and is parsed inside $...$ ("2\sqrt{2}" read as
# plain text parses as 2); anything else is parsed as text first ("18 dollars" inside $...$ reads
# as a product of symbols). In a box, "!" is a factorial too (on an "Answer:" line it may be
# an exclamation).
_LATEX_MARKERS = ("\\", "{", "^", "_")
_BOXED_LATEX_MARKERS = _LATEX_MARKERS + ("!",)

_mv: Any = None  # (parse, verify, extraction configs), imported on first use: sympy is slow to import


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
    """The content of the last complete ``\\boxed{...}``, braces balanced; None if there is none."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for i in range(match.end(), len(text)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    return text[match.end() : i].strip()
        # unbalanced (a truncated response): try the box before it
    return None


def _final_answer(text: str) -> tuple[Optional[str], bool]:
    """:func:`extract_final_answer`, and whether the answer came from a box."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed, True
    matches = list(_ANSWER.finditer(text))
    if matches:
        for line in text[matches[-1].end() :].splitlines():
            if line.strip():
                return line.strip(), False
    return None, False


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


def _parse_answer(answer: str, timeout: Optional[int], boxed: bool = False) -> list[Any]:
    """math-verify's parse of a bare answer string (no surrounding prose expected).

    LaTeX-looking answers are parsed inside ``$...$`` and everything else as text; if that
    finds nothing the other way is tried.
    """
    parse, _, config = _math_verify()
    wrapped = f"${answer.strip().strip('$')}$"
    attempts = [answer, wrapped]
    if "$" not in answer and any(m in answer for m in (_BOXED_LATEX_MARKERS if boxed else _LATEX_MARKERS)):
        attempts.reverse()
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
        gold = _parse_answer(gold_text, timeout) or [gold_text]
        final, boxed = _final_answer(response)
        if final is not None:
            predicted = _parse_answer(final, timeout, boxed)
        else:
            predicted = parse(response, extraction_config=config, parsing_timeout=timeout)
        if not predicted:
            return 0.0
        if _too_costly(predicted) or _too_costly(gold):  # compare the extracted strings only
            gold = [g for g in gold if isinstance(g, str)]
            predicted = [p for p in predicted if isinstance(p, str)]
        return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0
    except Exception:  # math-verify catches its own errors; anything left is a malformed answer
        return 0.0
