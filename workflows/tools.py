"""Python tools for agent workflows: each takes the argument text and returns the observation.

Tools never block the event loop. `call_tool` runs a synchronous tool in a thread of its own with a
time limit (`TOOL_TIMEOUT_S` by default; react's `tool_timeout_s`) and turns a failure or a
timeout into an "error: ..." observation. A thread frees the loop only while the tool runs
Python code or waits, though: one huge C-level operation (a big-int power) holds the GIL for its
whole length, and a thread cannot be killed. So tools bound their own work before doing it: the
calculator estimates the size of every intermediate result before computing it and rejects
anything over `MAX_DIGITS` digits (`check_power`, `check_product`, `check_result`), and BFCL's
math functions (thinkahead/evals/bfcl.py) use the same checks (`check_power`, `check_digits_argument`).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import math
import operator
import re
from collections.abc import Callable
from typing import Any

from thinkahead.orchestrator.threads import ToolTimeoutError, call_in_thread

TOOL_TIMEOUT_S = 30.0
"""Default seconds one tool call may run before its observation becomes a timeout error."""

MAX_DIGITS = 4000
"""The most decimal digits an integer result (or intermediate) may have: below Python's 4,300-digit
int->str limit, and far more than an agent can use."""
MAX_EXPRESSION_CHARS = 2000
"""The longest expression the calculator parses (deeper nesting than this could exhaust the parser)."""


def check_timeout(timeout_s: Any, what: str = "tool_timeout_s") -> float:
    """`timeout_s` as a float; ValueError unless it is a finite number of seconds above 0."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"{what} must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


# --------------------------------------------------------------------------- bounds


def check_digits(log10_magnitude: float, what: str = "the result") -> None:
    """ValueError when a number of magnitude 10**log10_magnitude would have more than MAX_DIGITS digits."""
    if log10_magnitude >= MAX_DIGITS:
        size = f"about {int(log10_magnitude) + 1:,}" if math.isfinite(log10_magnitude) else "astronomically many"
        raise ValueError(f"{what} would have {size} digits; the limit is {MAX_DIGITS:,}")


def check_power(base: Any, exponent: Any) -> None:
    """ValueError when the integer power base ** exponent would be too large (checked before computing it).

    Only int ** non-negative int grows without bound; float powers overflow (OverflowError) at once.
    """
    if not _is_int(base) or not _is_int(exponent) or exponent <= 0 or abs(base) <= 1:
        return
    # |base| >= 2 adds at least log10(2) digits per factor: a huge exponent needs no float arithmetic
    check_digits(math.inf if exponent > 4 * MAX_DIGITS else exponent * math.log10(abs(base)), "a power")


def check_product(left: Any, right: Any) -> None:
    """ValueError when the integer product left * right would be too large (checked before computing it)."""
    if _is_int(left) and _is_int(right) and left and right:
        check_digits(math.log10(abs(left)) + math.log10(abs(right)), "a product")


def check_digits_argument(value: Any, what: str) -> None:
    """ValueError when an int argument that sets a size in digits (a precision, round's ndigits) is over MAX_DIGITS."""
    if _is_int(value) and abs(value) > MAX_DIGITS:
        raise ValueError(f"{what} {value} is beyond the limit of {MAX_DIGITS:,} digits")


def check_result(value: Any) -> int | float:
    """`value` when it is a bounded int or a finite float; ValueError otherwise."""
    if _is_int(value):
        if value:
            check_digits(math.log10(abs(value)))
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result overflows a float")
        return value
    if isinstance(value, complex):
        raise ValueError("the result is a complex number")
    raise ValueError(f"unsupported result type {type(value).__name__}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- calculator

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max}
_BEFORE = {ast.Pow: check_power, ast.Mult: check_product}
_THOUSANDS = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?![\w,])")


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return check_result(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if type(node.op) in _BEFORE:
            _BEFORE[type(node.op)](left, right)
        return check_result(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return check_result(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS and not node.keywords:
        args = [_eval(a) for a in node.args]
        if node.func.id == "round" and len(args) == 2:
            check_digits_argument(args[1], "round's ndigits")  # round(int, -n) computes 10**n
        return check_result(_FUNCTIONS[node.func.id](*args))
    raise ValueError(f"unsupported expression: {ast.unparse(node)}")


def _call_parens(text: str) -> list[bool]:
    """For each character: is its innermost enclosing parenthesis a call's (`max(`), not a grouping one?"""
    inside: list[bool] = []
    stack: list[bool] = []
    in_word = word_is_name = after_name = False  # after_name: the last non-space text was a name
    for ch in text:
        inside.append(bool(stack) and stack[-1])
        if ch.isalnum() or ch == "_":
            if not in_word:
                word_is_name = ch.isalpha() or ch == "_"
            in_word, after_name = True, word_is_name
            continue
        in_word = False
        if ch == "(":
            stack.append(after_name)
        elif ch == ")" and stack:
            stack.pop()
        if not ch.isspace():
            after_name = False
    return inside


def normalize(expression: str) -> str:
    """The expression as Python: `^` is a power, and thousands groups (1,234,567) lose their commas.

    Commas are ambiguous: `1,234` is a number, `max(1, 234)` a call. Rule: a comma is a thousands
    separator when it sits in a digit group (1 to 3 digits, then groups of exactly 3) that is not
    inside a call's parentheses (top level or grouping parentheses: `(1,234 + 1) * 2`). Inside a
    call's parentheses commas always separate arguments, so `max(1,234)` is max(1, 234) = 234;
    write `max(1234, 5)` for a thousand there.
    """
    text = expression.strip().strip("`").replace("^", "**")
    inside = _call_parens(text)
    return _THOUSANDS.sub(lambda m: m.group() if inside[m.start()] else m.group().replace(",", ""), text)


def calculator(expression: str) -> str:
    """Evaluate arithmetic (+ - * / // % **, sqrt, abs, round, min, max) safely; errors are observations."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: the expression is longer than {MAX_EXPRESSION_CHARS:,} characters"
    try:
        value = _eval(ast.parse(normalize(expression), mode="eval"))
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as exc:
        return f"error: {exc}"
    except (RecursionError, MemoryError):
        return "error: the expression is nested too deeply"


DEFAULT_TOOLS = {"calculator": calculator}


# --------------------------------------------------------------------------- running a tool


async def call_tool(name: str, fn: Callable[[str], Any], argument: str, *, timeout_s: float = TOOL_TIMEOUT_S) -> str:
    """The observation of one tool call: `str(fn(argument))`, or "error: ..." for a failure or a timeout.

    A synchronous tool runs in a thread of its own (`call_in_thread`), so the event loop serves
    other runs meanwhile; past `timeout_s` the run gets a timeout observation at once and the
    thread is left to finish in the background (logged). An async tool is awaited under the same limit.
    """
    try:
        if inspect.iscoroutinefunction(fn):
            async with asyncio.timeout(timeout_s):
                return str(await fn(argument))
        return await call_in_thread(lambda: str(fn(argument)), timeout_s=timeout_s, name=f"tool {name!r}")
    except (ToolTimeoutError, TimeoutError):
        return f"error: tool {name!r} did not finish within {timeout_s:g} s"
    except Exception as exc:  # noqa: BLE001 - a tool failure is an observation for the agent
        return f"error: {type(exc).__name__}: {exc}"
