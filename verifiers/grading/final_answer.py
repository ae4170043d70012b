"""The final answer of a reasoning text: where it is (detection) and what it says (extraction).

One notion of a final answer, shared by segmentation (`thinkahead.step_spec.segment`: is this step
the last one?) and grading (`thinkahead.verifiers.grading.math`: what did the model answer?):

- a box: `\\boxed{...}` (also `\\fbox{...}` when reading the answer), its content up to the brace
  that balances the opening one, so `\\boxed{\\frac{1}{2}}` is `\\frac{1}{2}`, not `\\frac{1`;
- an answer marker: a line starting with "Answer:" / "Final answer:" (markdown emphasis and heading
  marks allowed), and, when reading the answer, also "####" (GSM8K), "The answer is" and an
  "answer:" anywhere in a line;
- when reading the answer of a text with neither, its last number.

The two questions differ on purpose, and tests pin both:

- `has_final_answer(text)` is the stop test of the step loop and must not fire early: a box that
  has been opened counts (the model is writing its answer), and so does an answer line, but not
  prose such as "The answer: we still need the sum." or a bare number.
- `extract_final_answer(text)` reads the answer out of a finished solution and is lenient: the last
  complete box, else the text after the last marker of any kind, else the last number.
"""

from __future__ import annotations

import re
from typing import Literal

from thinkahead.verifiers.grading.base import require_text

__all__ = [
    "ANSWER_LINE",
    "BOX_OPEN",
    "FoundAnswer",
    "balanced_end",
    "extract_final_answer",
    "find_final_answer",
    "has_final_answer",
    "last_boxed",
]

BOX_OPEN = re.compile(r"\\boxed\s*\{")
"""An opened `\\boxed{`: the step that holds it states the final answer."""

ANSWER_LINE = re.compile(
    r"^[ \t]*(?:[*_#>\-][ \t]*)*(?:final[ \t]+)?answer[ \t]*[*_]*[ \t]*:",
    re.IGNORECASE | re.MULTILINE,
)
"""A line starting with "Answer:" or "Final answer:", allowing markdown decoration such as
"**Final Answer:**", "### Answer:" or "- Answer:"."""

_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_MARKERS = re.compile(
    r"####|\bthe\s+(?:final\s+)?answer\s+is\b\s*:?|\banswer\s*:",
    re.IGNORECASE,
)
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?"
    r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+)?|\.\d+)"
)

FoundAnswer = tuple[str, Literal["boxed", "marker", "number"]]


def balanced_end(text: str, open_at: int) -> int | None:
    """Index of the `}` closing the `{` at `open_at` (escaped `\\{` / `\\}` skipped), or None when unbalanced."""
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


def last_boxed(text: str) -> str | None:
    """The content of the last complete, non-empty `\\boxed{...}` / `\\fbox{...}` (or `\\boxed 5`), else None."""
    for m in reversed(list(_BOX.finditer(text))):
        if m.group(1):  # \boxed{...}
            end = balanced_end(text, m.end() - 1)
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


def find_final_answer(text: str) -> FoundAnswer | None:
    """(answer, how) where how is "boxed", "marker" or "number"; None when the text has none of them."""
    require_text(text, "text")
    boxed = last_boxed(text)
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
    found = find_final_answer(text)
    return found[0] if found else None


def has_final_answer(text: str) -> bool:
    """Whether ``text`` holds a final answer: ``\\boxed{`` anywhere, or a line starting with
    ``Answer:`` / ``Final answer:`` (any case, markdown emphasis or heading marks allowed)."""
    return bool(BOX_OPEN.search(text) or ANSWER_LINE.search(text))
