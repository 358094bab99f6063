"""The agent's tools and their call format.

Tool calls are written the way Qwen2.5/Qwen3 (Hermes-style function calling, as SGLang's
``qwen25`` tool parser reads them) write them inside an assistant turn::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37*48"}}
    </tool_call>

one block per call, any number per turn. :func:`parse_tool_calls` reads them from a turn's text;
a block that is not a JSON object with a string ``name`` and an object ``arguments`` (or a JSON
string of one) is a malformed call, answered with an error the policy can learn from.

Built-in tools (``agentflow.tools``):

- ``calculator``: ``{"expression": str}``; arithmetic on numbers with ``+ - * / // % **`` and
  parentheses, evaluated from Python's ``ast`` (no names, attributes, calls or other syntax), with
  bounded sizes (expression length, integer bits, exponents). In-process: it is cheap and
  cannot run code.
- ``python``: ``{"code": str}``; runs in the :class:`~lightning_fasync.agents.sandbox.Sandbox`;
  the answer is what it prints.

A tool's answer is text; an error starts with ``error:``.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_fasync.agents.sandbox import Sandbox
from lightning_fasync.config.schema import TOOLS

__all__ = ["TOOLS", "ToolCall", "ToolResult", "ToolBox", "calculate", "format_tool_call", "has_tool_call",
           "parse_tool_calls", "tool_schemas"]


_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"

MAX_CALLS_PER_TURN = 16
"""Tool calls run from one turn; more are answered with one error (the sandbox runs a few at once)."""

MAX_EXPRESSION = 256
"""Longest calculator expression, in characters."""
MAX_BITS = 4096
"""Largest integer the calculator computes with, in bits (about 1,233 digits)."""

_SCHEMAS = {
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
        },
    },
    "python": {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code (standard library only, no network, no files outside its own "
                           "directory, a few seconds); the answer is what it prints.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
}


@dataclass
class ToolCall:
    """One parsed call; ``error`` is set (and name/arguments may be empty) for a malformed block."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


@dataclass
class ToolResult:
    """A tool's answer and how it went: ``ok``, ``error`` (bad call, the tool failed), ``limit``
    (a sandbox limit) or ``violation`` (a sandbox rule)."""

    content: str
    outcome: str = "ok"


def tool_schemas(names: Sequence[str]) -> list[dict[str, Any]]:
    """OpenAI-style function schemas of ``names``, for ``tokenizer.apply_chat_template(tools=...)``."""
    return [_SCHEMAS[n] for n in names]


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call as the policy writes it (Qwen's chat-template format)."""
    return f"{_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def has_tool_call(text: str) -> bool:
    """True when ``text`` opens a tool call (well formed or not)."""
    return _OPEN in text


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text``, in order; an unclosed last block is malformed.

    One pass over the text (a regex's lazy match from each of many unclosed openers is quadratic:
    3 s on 88 KB of them), and at most ``MAX_CALLS_PER_TURN`` calls: the rest are one error."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            break
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:
            calls.append(ToolCall("", error="the <tool_call> block is not closed with </tool_call>"))
            break
        if len(calls) == MAX_CALLS_PER_TURN:
            calls.append(ToolCall("", error=f"more than {MAX_CALLS_PER_TURN} tool calls in one turn; the rest were not run"))
            break
        calls.append(_parse_one(text[start + len(_OPEN) : end]))
        pos = end + len(_CLOSE)
    return calls


def _parse_one(body: str) -> ToolCall:
    try:
        obj = json.loads(body.strip())
    except ValueError as exc:
        return ToolCall("", error=f"the tool call is not valid JSON ({exc.msg})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error='the tool call needs a "name" string')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error='the tool call needs an "arguments" object')
    return ToolCall(obj["name"], args)


# ------------------------------------------------------------------------------------ calculator


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is the tool's answer."""


_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_OP_NAMES = {ast.BitXor: "^ (use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>",
             ast.MatMult: "@", ast.Invert: "~", ast.Not: "not"}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and format the number.

    Integers stay exact; an integral float result prints as an integer (``6/3`` is ``2``).

    Raises:
        CalculatorError: anything but numbers, ``+ - * / // % **`` and parentheses; an expression
            over :data:`MAX_EXPRESSION` characters; a number over :data:`MAX_BITS` bits;
            division by zero; a non-finite result.
    """
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    if len(expression) > MAX_EXPRESSION:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("the expression is not valid arithmetic") from None
    value = _eval(tree.body)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e16:
            return str(int(value))
        return repr(value)
    return str(value)


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp):
        if type(node.op) not in _UNARY:
            raise CalculatorError(f"unsupported operator {_OP_NAMES.get(type(node.op), type(node.op).__name__)}")
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINOPS:
            raise CalculatorError(f"unsupported operator {_OP_NAMES.get(type(node.op), type(node.op).__name__)}")
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    raise CalculatorError(f"unsupported syntax ({type(node).__name__}); only numbers, + - * / // % ** and parentheses")


def _check_power(base: Any, exponent: Any) -> None:
    # The result's size is known before computing it: |base| ** exponent needs about
    # bit_length(base) * exponent bits.
    if isinstance(exponent, float) or isinstance(base, float):
        return  # float powers overflow to OverflowError, which _eval reports
    if exponent < 0:
        if base == 0:
            raise CalculatorError("division by zero")
        return
    if abs(base) > 1 and (abs(base).bit_length() - 1) * exponent > MAX_BITS:
        raise CalculatorError(f"the result would have more than {MAX_BITS} bits")


def _checked(value: Any) -> Any:
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise CalculatorError(f"the result would have more than {MAX_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not finite")
    return value


# --------------------------------------------------------------------------------------- toolbox


class ToolBox:
    """Executes parsed calls against the enabled tools.

    Arguments:
        names: enabled tools (``agentflow.tools``), a subset of :data:`TOOLS`.
        sandbox: where ``python`` runs; required when ``python`` is enabled.
    """

    def __init__(self, names: Sequence[str], sandbox: Optional[Sandbox] = None) -> None:
        unknown = [n for n in names if n not in TOOLS]
        if unknown:
            raise ValueError(f"`agentflow.tools` lists {unknown[0]!r}; the tools are {', '.join(TOOLS)}.")
        if "python" in names and sandbox is None:
            raise ValueError("The python tool needs a sandbox.")
        self.names = tuple(names)
        self.sandbox = sandbox

    async def call(self, call: ToolCall) -> ToolResult:
        """The answer to one call; never raises for the call's own faults (only a broken sandbox does)."""
        if call.error is not None:
            return ToolResult(f"error: malformed tool call: {call.error}", "error")
        if call.name not in self.names:
            return ToolResult(f"error: unknown tool {call.name!r}; the tools are {', '.join(self.names)}", "error")
        if call.name == "calculator":
            expression = call.arguments.get("expression")
            if not isinstance(expression, str):
                return ToolResult('error: calculator needs {"expression": "<arithmetic>"}', "error")
            try:
                return ToolResult(calculate(expression))
            except CalculatorError as exc:
                return ToolResult(f"error: {exc}", "error")
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return ToolResult('error: python needs {"code": "<program>"}', "error")
        assert self.sandbox is not None
        result = await self.sandbox.run(code)
        return ToolResult(result.text, result.outcome)
