"""Answer checkers for the evaluation suites, by name, on top of `thinkahead.verifiers.grading`.

`get_eval_checker(name)` knows the grading registry's checkers (`thinkahead.verifiers.grading.CHECKERS`:
"math", "exact", "code") and adds the ones the benchmark data needs:
- "humaneval": `HumanEvalChecker`, a HumanEval completion or whole function run against the
  task's tests (the reference carries prompt, tests and entry point, so one string grades it);
- "sql": `SqlChecker`, normalised exact match of a query (Spider ships no databases here, so
  execution accuracy cannot be measured);
- "countdown": `thinkahead.evals.puzzles.PuzzleChecker` (countdown and game of 24);
- "bfcl": `thinkahead.evals.bfcl.BfclChecker` (multi-turn tool use, replayed on BFCL's own
  Python tool environments).
Every checker has `name` and `check(answer, reference) -> bool` (the `AnswerChecker` protocol).
"""

from __future__ import annotations

import json
import re
from importlib import import_module
from typing import Any

from thinkahead.verifiers.grading import (
    CHECKERS as GRADING_CHECKERS,
    AnswerChecker,
    CodeChecker,
    CodeResult,
    extract_code,
    get_checker,
    humaneval_tests,
)
from thinkahead.verifiers.grading.base import require_text as _text

__all__ = ["CHECKERS", "HumanEvalChecker", "SqlChecker", "extract_sql", "get_eval_checker", "sql_tokens"]


class HumanEvalChecker:
    """Runs a HumanEval answer with the task's tests in an isolated subprocess (`CodeChecker`).

    The answer may be a markdown reply: its ```python block is used. When that code defines the
    entry point at top level it is a whole function and runs after the task prompt (which brings
    the imports and helper functions the tests expect; the prompt's own stub is then redefined);
    otherwise it is a body completion and is appended to the prompt, as HumanEval does.
    """

    name = "humaneval"

    def __init__(self, timeout_s: float = 10.0) -> None:
        self._code = CodeChecker(timeout_s=timeout_s)

    @staticmethod
    def reference(record: dict[str, Any]) -> str:
        """The reference string for a HumanEval record: JSON of prompt, test and entry_point."""
        return json.dumps({k: record[k] for k in ("prompt", "test", "entry_point")}, sort_keys=True)

    @staticmethod
    def _parse_reference(reference: str) -> tuple[str, str, str]:
        try:
            ref = json.loads(_text(reference, "reference"))
            prompt, test, entry = ref["prompt"], ref["test"], ref["entry_point"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"a humaneval reference must be JSON with prompt, test and entry_point ({exc})") from exc
        return prompt, test, entry

    def program(self, answer: str, reference: str) -> tuple[str, str]:
        """(program, tests) that `check` runs."""
        prompt, test, entry = self._parse_reference(reference)
        code = extract_code(_text(answer, "answer"))
        if re.search(rf"^(?:async\s+)?def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
            program = prompt + "\n\n" + code
        else:
            program = prompt + code
        return program, humaneval_tests(test, entry)

    def run(self, answer: str, reference: str) -> CodeResult:
        """How the answer's run with the tests ended (passed, return code, timeout, stderr tail)."""
        return self._code.run(*self.program(answer, reference))

    def check(self, answer: str, reference: str, /) -> bool:
        """True when the answer passes the task's tests within the timeout."""
        return self.run(answer, reference).passed


_SQL_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)
_SQL_TOKEN = re.compile(r"'(?:[^']|'')*'|\"[^\"]*\"|`[^`]*`|\d+(?:\.\d+)?|\w+|<>|!=|<=|>=|\|\||\S")


def extract_sql(text: str) -> str:
    """The query in an answer: the last ```sql block, else the last bare block, else the text."""
    blocks = [(m.group(1).strip().lower(), m.group(2)) for m in _SQL_FENCE.finditer(_text(text, "answer"))]
    for wanted in (("sql", "sqlite"), ("",)):
        chosen = [body for lang, body in blocks if lang in wanted]
        if chosen:
            return chosen[-1].strip()
    return text.strip()


def sql_tokens(query: str) -> list[str]:
    """The tokens of a query, normalised: keywords and names case-folded, string quotes unified,
    `<>` as `!=`, a trailing semicolon dropped. String literals keep their case."""
    out = []
    for tok in _SQL_TOKEN.findall(_text(query, "query").strip().rstrip(";").strip()):
        if tok[0] in "'\"":
            out.append("'" + tok[1:-1] + "'")
        elif tok[0] == "`":
            out.append(tok[1:-1].lower())
        elif tok == "<>":
            out.append("!=")
        else:
            out.append(tok.lower())
    return out


class SqlChecker:
    """Exact match of SQL after normalisation (`sql_tokens`): a lower bound on correctness.

    Equivalent queries written differently (other aliases, join order) count as wrong: without the
    Spider databases nothing can be executed, and Spider's exact-set-match needs its SQL parser.
    """

    name = "sql"

    def check(self, answer: str, reference: str, /) -> bool:
        """True when the answer's query has the same normalised tokens as the reference query."""
        return sql_tokens(extract_sql(answer)) == sql_tokens(_text(reference, "reference"))


CHECKERS: dict[str, str] = {
    **{name: "thinkahead.verifiers.grading" for name in GRADING_CHECKERS},
    "humaneval": "thinkahead.evals.checkers:HumanEvalChecker",
    "sql": "thinkahead.evals.checkers:SqlChecker",
    "countdown": "thinkahead.evals.puzzles:PuzzleChecker",
    "bfcl": "thinkahead.evals.bfcl:BfclChecker",
}
"""Every checker name -> where it lives: the grading registry's names (built by its `get_checker`), then
the evaluation checkers as "module:Class" (imported when first asked for)."""


def get_eval_checker(name: str, **options: Any) -> AnswerChecker:
    """The checker called `name` (a key of CHECKERS), built with `options`."""
    key = _text(name, "checker name").strip().lower()
    if key not in CHECKERS:
        raise ValueError(f"unknown checker {name!r}; choose one of: {', '.join(sorted(CHECKERS))}")
    target = CHECKERS[key]
    if ":" not in target:
        return get_checker(key, **options)
    module, _, cls = target.partition(":")
    return getattr(import_module(module), cls)(**options)
