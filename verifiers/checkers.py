"""Answer checkers: decide whether a final answer is right, per domain.

Step-level speculation (SpecReason, Arbitrage, self-consistency votes) and every benchmark need a
cheap, deterministic "is this final answer correct?" that does not call a model. This module is
that piece of the `verifiers` package (docs/architecture.md: `AnswerChecker.check(answer, reference) -> bool`):

- `MathChecker`: pulls the final answer out of a chain of thought (`\\boxed{}`, "Answer:",
  GSM8K "#### N", else the last number) and compares it with the reference after normalising the
  usual LaTeX noise (dollars, percent, units, thousands separators, `\\frac`, `\\sqrt`, ...):
  numerically with a relative tolerance when both sides are numbers, symbolically with sympy when
  sympy happens to be installed (it is not a dependency), else by normalised string.
- `ExactMatchChecker`: string match after optional case folding and punctuation stripping.
- `CodeChecker`: runs a program, then its tests, in the code sandbox (`verifiers/sandbox.py`:
  no network, read-only filesystem, resource limits, every process ended, a pass only when the
  tests ran to their end), with a timeout (HumanEval style: `humaneval_tests(test, entry_point)`).

`get_checker(name)` builds one by name ("math", "exact", "code").
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from types import ModuleType
from typing import Any, Protocol, runtime_checkable
import ast
import math
import re
import unicodedata

from thinkahead.verifiers.sandbox import DEFAULT_STDERR_CHARS, DEFAULT_TIMEOUT_S, SandboxLimits, run_sandboxed

__all__ = [
    "AnswerChecker",
    "CodeChecker",
    "CodeResult",
    "ExactMatchChecker",
    "MathChecker",
    "extract_code",
    "extract_final_answer",
    "get_checker",
    "humaneval_tests",
    "math_equal",
    "normalize_math",
    "parse_number",
]

REL_TOL = 1e-6
"""Relative tolerance for numeric comparison of non-integers."""


@runtime_checkable
class AnswerChecker(Protocol):
    """Decides whether `answer` is correct given `reference` (arguments are positional)."""

    name: str

    def check(self, answer: str, reference: str, /) -> bool:
        """True when the answer matches the reference."""
        ...


def _require_text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    return value


def _math_text(value: object, what: str) -> str:
    """A math value as text: str as is, int/float/Fraction converted; anything else is a TypeError."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float, Fraction)) and not isinstance(value, bool):
        return str(value)
    raise TypeError(f"{what} must be a str (or a number), got {type(value).__name__}")


# --------------------------------------------------------------------------- extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_MARKERS = re.compile(
    r"####|\bthe\s+(?:final\s+)?answer\s+is\b\s*:?|\banswer\s*:",
    re.IGNORECASE,
)
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?"
    r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+)?|\.\d+)"
)


def _balanced(text: str, open_at: int) -> int | None:
    """Index of the `}` closing the `{` at `open_at`, or None when unbalanced."""
    depth = 0
    for i in range(open_at, len(text)):
        ch = text[i]
        if ch == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif ch == "}" and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return i
    return None


def _last_boxed(text: str) -> str | None:
    for m in reversed(list(_BOXED.finditer(text))):
        if m.group(1):  # \boxed{...}
            end = _balanced(text, m.end() - 1)
            if end is not None:
                content = text[m.end() : end].strip()
                if content:
                    return content
        else:  # \boxed 5
            token = re.match(r"\s*([^\s$]+)", text[m.end() :])
            if token:
                return token.group(1)
    return None


def _after_marker(text: str) -> str | None:
    markers = list(_MARKERS.finditer(text))
    if not markers:
        return None
    rest = text[markers[-1].end() :]
    line = next((ln for ln in rest.splitlines() if ln.strip(" \t*:")), "")
    line = re.split(r"\.\s", line, maxsplit=1)[0]  # "42. I hope it is correct." -> "42"
    line = line.strip().strip("*").strip()
    return line or None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _extract(text: str) -> tuple[str, str] | None:
    """(answer, how) where how is 'boxed', 'marker' or 'number'."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    marked = _after_marker(text)
    if marked is not None:
        return marked, "marker"
    number = _last_number(text)
    if number is not None:
        return number, "number"
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer in a solution text.

    The content of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces), else the text after the
    last "####" / "Answer:" / "The answer is" marker, else the last number; None if none of these.
    """
    _require_text(text, "text")
    found = _extract(text)
    return found[0] if found else None


# --------------------------------------------------------------------------- normalisation

_WRAPPERS = re.compile(
    r"\\(?:text|textbf|textit|textrm|texttt|mathrm|mathbf|mathit|mbox|operatorname|boxed|fbox)\s*\{"
)
_SPACING = re.compile(r"\\(?:displaystyle|!|,|;|:|quad|qquad|\s)|~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])")
_ASSIGNMENT = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*(?P<rhs>[^=]+)$")
_THOUSANDS = re.compile(r"(?<![\d,.])(\d{1,3})((?:,\d{3})+)(?![\d,])")
_UNIT_NAMES = (
    "cm|mm|km|m|kg|mg|g|lbs|lb|oz|ft|feet|in|inches|yd|yards|mi|miles|sec|s|min|mins|hrs|hr|h"
    "|mph|ml|mL|l|L|cents|dollars|units|degrees|deg"
)
_UNITS = re.compile(
    r"^(?P<value>.*?[\d}])"
    r"(?:\s+(?P<words>[A-Za-z]{2,}\.?(?:[\s-]+[A-Za-z]{2,}\.?)*)|\s*(?P<unit>(?:" + _UNIT_NAMES + r")\b))"
    r"(?:\s*\^\s*\{?[23]\}?)?\s*$"
)
_NOT_UNITS = {"pi", "sqrt", "and", "or", "hundred", "thousand", "million", "billion", "trillion", "infty", "sin", "cos", "tan", "log", "ln", "exp"}


def _unwrap(s: str) -> str:
    """Replace `\\text{X}`-style wrappers (balanced) with X."""
    while True:
        m = _WRAPPERS.search(s)
        if not m:
            return s
        end = _balanced(s, m.end() - 1)
        if end is None:
            return s[: m.start()] + s[m.end() :]
        s = s[: m.start()] + s[m.end() : end] + s[end + 1 :]


def _strip_units(s: str) -> str:
    m = _UNITS.match(s)
    if not m:
        return s
    words = (m.group("words") or "").lower().replace("-", " ").replace(".", " ").split()
    if any(w in _NOT_UNITS for w in words):
        return s
    return m.group("value")


def _bracketed(s: str) -> bool:
    return len(s) >= 2 and s[0] in "([" and s[-1] in ")]"


def _strip_outer_braces(s: str) -> str:
    while len(s) >= 2 and s[0] == "{" and _balanced(s, 0) == len(s) - 1:
        s = s[1:-1].strip()
    return s


def normalize_math(s: str) -> str:
    """A canonical text form of a math answer, for comparison.

    Drops `$`, `\\(`/`\\)`, `\\left`/`\\right`, LaTeX spacing, `\\text{}`-style wrappers, units after a
    number, degrees, percent signs, thousands separators (not inside tuples), a trailing period and
    all whitespace; rewrites `\\dfrac`/`\\tfrac` to `\\frac` and `\\frac12` / `\\sqrt2` to braced forms.
    """
    s = _math_text(s, "answer").strip()
    s = s.replace("\u2212", "-").replace("\u2013", "-").replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[()\[\]]", "", s)
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub(" ", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("{,}", ",")
    s = _unwrap(s).strip()
    s = s.rstrip(".").strip()
    m = _ASSIGNMENT.match(s)
    if m:
        s = m.group("rhs").strip()
    s = _strip_units(s).strip()
    if not _bracketed(s):
        s = _THOUSANDS.sub(lambda m: m.group(1) + m.group(2).replace(",", ""), s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    s = s.rstrip(".")
    s = _strip_outer_braces(s)
    if s.startswith("+"):
        s = s[1:]
    return s


# --------------------------------------------------------------------------- numbers

_FUNCS = {"sqrt", "sin", "cos", "tan", "log", "ln", "exp"}
_SIMPLE_CMDS = {
    "pi": "pi",
    "cdot": "*",
    "times": "*",
    "div": "/",
    "infty": "oo",
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "log": "log",
    "ln": "ln",
    "exp": "exp",
}


def _group(s: str, i: int) -> tuple[str, int] | None:
    """The argument starting at `i`: a `{...}` group or one character; (text, next index)."""
    if i >= len(s):
        return None
    if s[i] == "{":
        end = _balanced(s, i)
        if end is None:
            return None
        return s[i + 1 : end], end + 1
    return s[i], i + 1


def _latex_to_expr(s: str) -> str | None:
    """A Python-syntax expression for simple LaTeX math (normalised, no spaces); None if unsupported."""
    out: list[str] = []
    i = 0
    while i < len(s):
        ch = s[i]
        if ch == "\\":
            m = re.match(r"\\([A-Za-z]+)", s[i:])
            if not m:
                return None
            cmd, i = m.group(1), i + m.end()
            if cmd == "frac":
                num = _group(s, i)
                den = _group(s, num[1]) if num else None
                if not num or not den:
                    return None
                a, b = _latex_to_expr(num[0]), _latex_to_expr(den[0])
                if a is None or b is None:
                    return None
                out.append(f"(({a})/({b}))")
                i = den[1]
            elif cmd == "sqrt":
                index = None
                if i < len(s) and s[i] == "[":
                    close = s.find("]", i)
                    if close < 0:
                        return None
                    index, i = _latex_to_expr(s[i + 1 : close]), close + 1
                    if index is None:
                        return None
                arg = _group(s, i)
                if not arg:
                    return None
                inner = _latex_to_expr(arg[0])
                if inner is None:
                    return None
                out.append(f"sqrt({inner})" if index is None else f"(({inner})**(1/({index})))")
                i = arg[1]
            elif cmd in _SIMPLE_CMDS:
                out.append(_SIMPLE_CMDS[cmd] if cmd not in _FUNCS else f"{cmd} ")
            else:
                return None
        elif ch == "{":
            out.append("(")
            i += 1
        elif ch == "}":
            out.append(")")
            i += 1
        elif ch == "^":
            out.append("**")
            i += 1
        elif ch.isalnum() or ch in "+-*/().,_ ":
            out.append(ch)
            i += 1
        else:
            return None
    expr = "".join(out)
    # implicit multiplication: 3sqrt(2), 2pi, 2(x+1), (a)(b), )2
    expr = re.sub(r"(?<=[\d)])(?=[A-Za-z(])", "*", expr)
    expr = re.sub(r"(?<=\))(?=\d)", "*", expr)
    expr = re.sub(r"(sin|cos|tan|log|ln|exp)\s+(?=[\w(])", r"\1*", expr)
    expr = expr.replace(" ", "")
    return expr


_Num = Fraction | float


def _pow(base: _Num, exp: _Num) -> _Num | None:
    if isinstance(exp, Fraction) and exp.denominator == 1 and isinstance(base, Fraction):
        if abs(exp) > 1000 or (abs(base.numerator) > 2 and abs(exp) * math.log2(abs(base.numerator)) > 10_000):
            return None
        if base == 0 and exp < 0:
            return None
        return base**exp.numerator
    try:
        value = float(base) ** float(exp)
    except (OverflowError, ZeroDivisionError):
        return None
    return value if isinstance(value, float) and math.isfinite(value) else None


def _eval(node: ast.AST) -> _Num | None:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return None if v is None else (-v if isinstance(node.op, ast.USub) else v)
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left), _eval(node.right)
        if a is None or b is None:
            return None
        try:
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if isinstance(node.op, ast.Div):
                return a / b
        except (ZeroDivisionError, OverflowError):
            return None
        if isinstance(node.op, ast.Pow):
            return _pow(a, b)
        return None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sqrt"
        and len(node.args) == 1
        and not node.keywords
    ):
        v = _eval(node.args[0])
        if v is None or v < 0:
            return None
        if isinstance(v, Fraction):
            n, d = math.isqrt(v.numerator), math.isqrt(v.denominator)
            if n * n == v.numerator and d * d == v.denominator:
                return Fraction(n, d)
        return math.sqrt(v)
    return None


def parse_number(s: str) -> Fraction | float | None:
    """The value of a numeric answer ("1,234", "50%", "\\frac{\\sqrt{3}}{2}", "-0.5", "2\\pi"), else None.

    Exact values are Fractions; values involving `\\sqrt` of a non-square or `\\pi` are floats.
    """
    expr = _latex_to_expr(normalize_math(s))
    if not expr or len(expr) > 200 or "," in expr:
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return None
    value = _eval(tree)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _numbers_equal(a: Fraction | float, b: Fraction | float) -> bool:
    if isinstance(a, Fraction) and isinstance(b, Fraction) and a.denominator == 1 and b.denominator == 1:
        return a == b  # integers: exact (1000001 != 1000000)
    if a == b:
        return True
    return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=1e-12)


# --------------------------------------------------------------------------- symbolic (optional sympy)


@lru_cache(maxsize=1)
def _sympy() -> ModuleType | None:
    try:
        import sympy
    except Exception:  # not installed, or broken: fall back to string equality
        return None
    return sympy


_SAFE_EXPR = re.compile(r"^[0-9A-Za-z_+\-*/().]*$")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_SAFE_NAMES = _FUNCS | {"pi", "oo"}


def _sympy_equal(a: str, b: str) -> bool:
    sympy = _sympy()
    if sympy is None:
        return False
    ea, eb = _latex_to_expr(a), _latex_to_expr(b)
    exprs = []
    for e in (ea, eb):
        # parse_expr evaluates Python: only let through arithmetic over short names and known functions
        if not e or len(e) > 300 or not _SAFE_EXPR.match(e) or "__" in e or re.search(r"\.[A-Za-z_]", e):
            return False
        if any(len(name) > 2 and name not in _SAFE_NAMES for name in _IDENT.findall(e)):
            return False
        if e.count("**") > 5 or any(int(p) > 1000 for p in re.findall(r"\*\*\(?(\d+)", e)):
            return False
        exprs.append(e)
    try:
        from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations

        names = {name: sympy.Symbol(name) for e in exprs for name in _IDENT.findall(e) if name not in _SAFE_NAMES}
        local = {**names, "pi": sympy.pi, "oo": sympy.oo, "sqrt": sympy.sqrt, "ln": sympy.log, "log": sympy.log,
                 "exp": sympy.exp, "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan}
        transformations = standard_transformations + (implicit_multiplication,)
        # every identifier is bound in `local`, so no builtin or sympy name is reachable from the text
        sa, sb = (parse_expr(e, local_dict=local, transformations=transformations) for e in exprs)
        if sa == sb:
            return True
        return bool(sympy.simplify(sa - sb) == 0)
    except Exception:  # any parse or simplification failure means "not shown equal"
        return False


# --------------------------------------------------------------------------- comparison


def _split_top(s: str) -> list[str]:
    """`s` split on commas outside any brackets or braces."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _sequence(s: str) -> tuple[str, list[str], str] | None:
    """(open, items, close) for "(1,2)", "[0,1)" or a bare "1,-2"; None for a single value."""
    if _bracketed(s):
        depth = 0
        for i, ch in enumerate(s):
            depth += ch in "(["
            depth -= ch in ")]"
            if depth == 0 and i < len(s) - 1:
                break  # "(a)+(b)": the first bracket closes early, not a tuple
        else:
            items = _split_top(s[1:-1])
            if len(items) > 1:
                return s[0], items, s[-1]
            return None
    items = _split_top(s)
    return ("", items, "") if len(items) > 1 else None


def _equal_normalized(a: str, b: str) -> bool:
    if a == b:
        return True
    if not a or not b:
        return False
    sa, sb = _sequence(a), _sequence(b)
    if sa or sb:
        if not (sa and sb) or len(sa[1]) != len(sb[1]):
            return False
        if (sa[0], sa[2]) != (sb[0], sb[2]):
            return False
        if sa[0]:  # tuples and intervals: ordered
            return all(math_equal(x, y) for x, y in zip(sa[1], sb[1]))
        remaining = list(sb[1])  # bare lists of solutions: any order
        for x in sa[1]:
            hit = next((k for k, y in enumerate(remaining) if math_equal(x, y)), None)
            if hit is None:
                return False
            remaining.pop(hit)
        return True
    va, vb = parse_number(a), parse_number(b)
    if va is not None and vb is not None:
        return _numbers_equal(va, vb)
    return _sympy_equal(a, b)


def math_equal(a: str, b: str) -> bool:
    """True when two math answers are the same value.

    Both are normalised (`normalize_math`); numbers compare exactly when both are integers, else with
    relative tolerance 1e-6; tuples, intervals and comma lists compare element-wise; anything else
    compares symbolically with sympy when it is installed, else as normalised strings.
    """
    na, nb = normalize_math(_math_text(a, "a")), normalize_math(_math_text(b, "b"))
    return _equal_normalized(na, nb)


# --------------------------------------------------------------------------- checkers


class MathChecker:
    """Final-answer check for math: extracts from the answer, compares with `math_equal`.

    The reference may be a bare value ("\\frac{1}{2}", "72"), a solution ending in "#### 72"
    (GSM8K) or one with a `\\boxed{}` answer (MATH).
    """

    name = "math"

    @staticmethod
    def reference_value(reference: str) -> str:
        """The value a reference stands for (after the last '####', else its last box, else itself)."""
        reference = _math_text(reference, "reference")
        if "####" in reference:
            return reference.rsplit("####", 1)[1].strip()
        boxed = _last_boxed(reference)
        return boxed if boxed is not None else reference.strip()

    def check(self, answer: str, reference: str, /) -> bool:
        """True when the final answer in `answer` equals the reference value."""
        answer = _math_text(answer, "answer")
        target = self.reference_value(reference)
        found = _extract(answer)
        candidates = [found[0]] if found else []
        # A short one-line answer with no box or marker may be the bare value itself ("\frac{1}{2}").
        if (found is None or found[1] == "number") and "\n" not in answer.strip() and len(answer) <= 100:
            candidates.insert(0, answer)
        return any(math_equal(c, target) for c in candidates)


class ExactMatchChecker:
    """String equality after whitespace collapsing and, optionally, case folding and punctuation removal."""

    name = "exact"

    def __init__(self, case_sensitive: bool = False, strip_punctuation: bool = True) -> None:
        if not isinstance(case_sensitive, bool) or not isinstance(strip_punctuation, bool):
            raise TypeError("case_sensitive and strip_punctuation must be bools")
        self.case_sensitive = case_sensitive
        self.strip_punctuation = strip_punctuation

    def normalize(self, text: str) -> str:
        """The form that is compared."""
        text = _require_text(text, "text")
        if self.strip_punctuation:
            text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
        if not self.case_sensitive:
            text = text.casefold()
        return " ".join(text.split())

    def check(self, answer: str, reference: str, /) -> bool:
        """True when both normalise to the same string."""
        return self.normalize(_require_text(answer, "answer")) == self.normalize(_require_text(reference, "reference"))


@dataclass(slots=True, frozen=True)
class CodeResult:
    """Outcome of running a program with its tests."""

    passed: bool
    returncode: int | None
    timed_out: bool
    stderr_tail: str


_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str:
    """The code in a markdown answer: the (longest) ```python fence, else the longest bare fence, else `text`."""
    _require_text(text, "text")
    blocks = [(m.group(1).strip().lower(), m.group(2)) for m in _FENCE.finditer(text)]
    python = [body for lang, body in blocks if lang in ("python", "python3", "py")]
    bare = [body for lang, body in blocks if not lang]
    chosen = python or bare
    return max(chosen, key=len) if chosen else text


def humaneval_tests(test: str, entry_point: str) -> str:
    """The tests string for a HumanEval task: its `check` function, then `check(entry_point)`."""
    _require_text(test, "test")
    _require_text(entry_point, "entry_point")
    if not entry_point.isidentifier():
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    return f"{test}\ncheck({entry_point})\n"


class CodeChecker:
    """Runs a program, then its tests, in the code sandbox (`thinkahead.verifiers.sandbox`).

    The program may be a markdown answer: a ```python fence is extracted first. A run passes only
    when the tests ran to their end within the timeout (exiting early with status 0 fails). The
    sandbox has no network, a read-only filesystem but its temp working directory, resource
    limits (`limits`, default `SandboxLimits()`), and ends every process the program started; its
    module docstring says what it does not stop.
    """

    name = "code"

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, stderr_chars: int = DEFAULT_STDERR_CHARS,
                 limits: SandboxLimits | None = None) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number, got {type(timeout_s).__name__}")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s}")
        if limits is not None and not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        self.timeout_s = float(timeout_s)
        self.stderr_chars = int(stderr_chars)
        self.limits = SandboxLimits() if limits is None else limits

    def run(self, program: str, tests: str) -> CodeResult:
        """Run the program with its tests and report how it ended."""
        code = extract_code(_require_text(program, "program"))
        result = run_sandboxed(code, _require_text(tests, "tests"), timeout_s=self.timeout_s, limits=self.limits,
                               stderr_chars=self.stderr_chars)
        return CodeResult(passed=result.passed, returncode=result.returncode, timed_out=result.timed_out,
                          stderr_tail=result.stderr)

    def check(self, program: str, tests: str, /) -> bool:
        """True when the program passes its tests within the timeout."""
        return self.run(program, tests).passed


_CHECKERS: dict[str, type[MathChecker] | type[ExactMatchChecker] | type[CodeChecker]] = {
    "math": MathChecker,
    "exact": ExactMatchChecker,
    "code": CodeChecker,
}


def get_checker(name: str, **options: Any) -> AnswerChecker:
    """The checker called `name` ("math", "exact", "code"), built with `options`."""
    _require_text(name, "checker name")
    key = name.strip().lower()
    if key not in _CHECKERS:
        raise ValueError(f"unknown checker {name!r}; choose one of: {', '.join(sorted(_CHECKERS))}")
    return _CHECKERS[key](**options)
