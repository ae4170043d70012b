"""Math answers: equality of two answers (`math_equal`) and the final-answer checker (`MathChecker`).

`MathChecker` pulls the final answer out of a chain of thought (`final_answer.find_final_answer`:
`\\boxed{}`, "Answer:", GSM8K "#### N", else the last number) and compares it with the reference
after normalising the usual LaTeX noise (`latex.normalize_math`): numerically with a relative
tolerance when both sides are numbers, symbolically with sympy when sympy is installed, else by
normalised string.
"""

from __future__ import annotations

import math
from fractions import Fraction

from thinkahead.verifiers.grading.base import math_text
from thinkahead.verifiers.grading.final_answer import find_final_answer, last_boxed
from thinkahead.verifiers.grading.latex import (
    bracketed,
    normalize_math,
    parse_number,
    sympy_equal,
)

__all__ = ["REL_TOL", "MathChecker", "math_equal"]

REL_TOL = 1e-6
"""Relative tolerance for numeric comparison of non-integers."""


def _numbers_equal(a: Fraction | float, b: Fraction | float) -> bool:
    if isinstance(a, Fraction) and isinstance(b, Fraction) and a.denominator == 1 and b.denominator == 1:
        return a == b  # integers: exact (1000001 != 1000000)
    if a == b:
        return True
    return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=1e-12)


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
    if bracketed(s):
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
    return sympy_equal(a, b)


def math_equal(a: str, b: str) -> bool:
    """True when two math answers are the same value.

    Both are normalised (`normalize_math`); numbers compare exactly when both are integers, else with
    relative tolerance 1e-6; tuples, intervals and comma lists compare element-wise; anything else
    compares symbolically with sympy when it is installed, else as normalised strings.
    """
    na, nb = normalize_math(math_text(a, "a")), normalize_math(math_text(b, "b"))
    return _equal_normalized(na, nb)


class MathChecker:
    """Final-answer check for math: extracts from the answer, compares with `math_equal`.

    The reference may be a bare value ("\\frac{1}{2}", "72"), a solution ending in "#### 72"
    (GSM8K) or one with a `\\boxed{}` answer (MATH).
    """

    name = "math"

    @staticmethod
    def reference_value(reference: str) -> str:
        """The value a reference stands for (after the last '####', else its last box, else itself)."""
        reference = math_text(reference, "reference")
        if "####" in reference:
            return reference.rsplit("####", 1)[1].strip()
        boxed = last_boxed(reference)
        return boxed if boxed is not None else reference.strip()

    def check(self, answer: str, reference: str, /) -> bool:
        """True when the final answer in `answer` equals the reference value."""
        answer = math_text(answer, "answer")
        target = self.reference_value(reference)
        found = find_final_answer(answer)
        candidates = [found[0]] if found else []
        # A short one-line answer with no box or marker may be the bare value itself ("\frac{1}{2}").
        if (found is None or found[1] == "number") and "\n" not in answer.strip() and len(answer) <= 100:
            candidates.insert(0, answer)
        return any(math_equal(c, target) for c in candidates)
