"""Answer grading: is a final answer right? One module per domain, and the checker registry.

Step-level speculation (SpecReason, Arbitrage, self-consistency votes) and every benchmark need a
cheap, deterministic "is this final answer correct?" that does not call a model:

- `final_answer`: where a text states its final answer and what it says (`has_final_answer`,
  `extract_final_answer`); the step loop's segmentation reads the same module.
- `math`: `MathChecker` and `math_equal`, over `latex` (normalisation, a small LaTeX evaluator,
  optional sympy).
- `exact`: `ExactMatchChecker`.
- `code`: `CodeChecker`, which runs a program and its tests in the code sandbox
  (`thinkahead.verifiers.sandbox`), `extract_code`, `humaneval_tests`.

`CHECKERS` is the one table of checker names (name -> class): `get_checker(name, **options)` builds
one, and the CLI's `--checker` choices and the evaluation suites' checkers
(`thinkahead.evals.checkers`) read it.
"""

from __future__ import annotations

from typing import Any

from thinkahead.verifiers.grading.base import AnswerChecker, require_text
from thinkahead.verifiers.grading.code import (
    CodeChecker,
    CodeResult,
    extract_code,
    humaneval_tests,
)
from thinkahead.verifiers.grading.exact import ExactMatchChecker
from thinkahead.verifiers.grading.final_answer import (
    extract_final_answer,
    has_final_answer,
)
from thinkahead.verifiers.grading.latex import normalize_math, parse_number
from thinkahead.verifiers.grading.math import MathChecker, math_equal

__all__ = [
    "CHECKERS",
    "CHECKER_NAMES",
    "AnswerChecker",
    "CodeChecker",
    "CodeResult",
    "ExactMatchChecker",
    "MathChecker",
    "extract_code",
    "extract_final_answer",
    "get_checker",
    "has_final_answer",
    "humaneval_tests",
    "math_equal",
    "normalize_math",
    "parse_number",
]

CHECKERS: dict[str, type[MathChecker] | type[ExactMatchChecker] | type[CodeChecker]] = {
    MathChecker.name: MathChecker,
    ExactMatchChecker.name: ExactMatchChecker,
    CodeChecker.name: CodeChecker,
}
"""Every answer checker by name; adding a checker is one entry here."""

CHECKER_NAMES: tuple[str, ...] = tuple(CHECKERS)
"""The checker names, in registry order (the CLI's `--checker` choices)."""


def get_checker(name: str, **options: Any) -> AnswerChecker:
    """The checker called `name` (a key of `CHECKERS`: "math", "exact", "code"), built with `options`."""
    require_text(name, "checker name")
    key = name.strip().lower()
    if key not in CHECKERS:
        raise ValueError(f"unknown checker {name!r}; choose one of: {', '.join(sorted(CHECKERS))}")
    return CHECKERS[key](**options)
