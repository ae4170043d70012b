"""Math answers as text and as values: LaTeX normalisation, a small LaTeX evaluator, sympy (optional).

- `normalize_math`: a canonical text form (dollars, `\\left`/`\\right`, spacing, `\\text{}` wrappers,
  units after a number, degrees, percent signs, thousands separators, ... dropped).
- `parse_number`: the exact value (a `Fraction`, or a float when `\\sqrt` of a non-square or `\\pi`
  is involved) of simple LaTeX arithmetic, evaluated over a Python AST of whitelisted nodes.
- `sympy_equal`: symbolic equality when sympy is installed, over a whitelisted expression text.
"""

from __future__ import annotations

import ast
import math
import re
from fractions import Fraction
from functools import lru_cache
from types import ModuleType

from thinkahead.verifiers.grading.base import math_text
from thinkahead.verifiers.grading.final_answer import balanced_end

__all__ = ["bracketed", "normalize_math", "parse_number", "sympy_equal"]


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
        end = balanced_end(s, m.end() - 1)
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


def bracketed(s: str) -> bool:
    """Whether `s` opens with `(` or `[` and closes with `)` or `]` (a tuple or an interval)."""
    return len(s) >= 2 and s[0] in "([" and s[-1] in ")]"


def _strip_outer_braces(s: str) -> str:
    while len(s) >= 2 and s[0] == "{" and balanced_end(s, 0) == len(s) - 1:
        s = s[1:-1].strip()
    return s


def normalize_math(s: str) -> str:
    """A canonical text form of a math answer, for comparison.

    Drops `$`, `\\(`/`\\)`, `\\left`/`\\right`, LaTeX spacing, `\\text{}`-style wrappers, units after a
    number, degrees, percent signs, thousands separators (not inside tuples), a trailing period and
    all whitespace; rewrites `\\dfrac`/`\\tfrac` to `\\frac` and `\\frac12` / `\\sqrt2` to braced forms.
    """
    s = math_text(s, "answer").strip()
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
    if not bracketed(s):
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
        end = balanced_end(s, i)
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


def sympy_equal(a: str, b: str) -> bool:
    """True when sympy (if installed) shows two normalised answers equal; False when it cannot."""
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
        from sympy.parsing.sympy_parser import (
            implicit_multiplication,
            parse_expr,
            standard_transformations,
        )

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
