"""Reasoning-step segmentation: where one step of a thinking trace ends.

Step-level policies (SpecReason, Arbitrage, reflection triggers) let a small model write the
reasoning one step at a time, then judge, route or replace each step. That needs one shared answer
to "where does a step end?", both for the generation call (which stop strings to pass) and for the
text that comes back (where to cut it, what kind of step it is, and what was left over). SpecReason
and Arbitrage both end a step at a blank line (``"\\n\\n"``); that is the default here. A sentence
mode cuts finer, at the first sentence end.

The functions here are pure string functions, independent of any model or backend:

- `stop_strings(config)`: the stop strings for a one-step generation call. Backends differ on
  whether they keep the matched stop string in the output (vLLM ``include_stop_str_in_output``,
  SGLang ``no_stop_trim``); keep it where you can, so steps concatenate back to the trace exactly.
  Where it was trimmed, `join_steps` puts the delimiter back between steps.
- `cut_step(generated, config, hit_token_cap)`: cut the raw text of one generation call into the
  step and whatever came after it (backends without stop strings run past the step end). The
  step keeps its delimiter, so ``step.consumed + step.rest == generated`` always holds and
  consecutive steps concatenate back to the original text.
- `split_steps(text, config)`: cut a whole trace into steps (e.g. for router training data).
- `has_final_answer` (from `thinkahead.verifiers.grading.final_answer`, the one final-answer module
  that grading reads too), `is_repeated`: the stop tests policies apply after each step
  (SpecReason stops on ``boxed`` / ``Answer:`` and on a step identical to the previous one).
- `join_steps`, `strip_think_tags`: build the thinking prefix for the next call.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from thinkahead.verifiers.grading.final_answer import has_final_answer

__all__ = [
    "THINK_CLOSE",
    "THINK_OPEN",
    "SegmentConfig",
    "Step",
    "StepKind",
    "closes_step",
    "cut_step",
    "has_final_answer",
    "is_repeated",
    "join_steps",
    "split_steps",
    "stop_strings",
    "strip_think_tags",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

#: Stop strings of sentence mode. ``"?\n"`` / ``"!\n"`` need no entry: ``"\n"`` stops there too.
SENTENCE_STOPS: tuple[str, ...] = (". ", ".\n", "? ", "! ", "\n")

StepKind = Literal["step", "truncated", "final", "end_think", "empty"]


# A step's token cap unless `segment.max_step_tokens` says otherwise: a GSM8K step is 20-60 tokens; one that runs
# to 128 without a blank line is more likely a loop than a step.
MAX_STEP_TOKENS = 128


class SegmentConfig(BaseModel, extra="forbid", frozen=True):
    """How reasoning is cut into steps.

    - ``mode``: ``"delimiter"`` ends a step at ``delimiter``; ``"sentence"`` at the first
      sentence end (``. ``, ``? ``, ``! `` or a newline), never inside a number such as ``3.14``
      or after an abbreviation such as ``e.g.``.
    - ``delimiter``: the step separator of delimiter mode; a blank line by default, as in
      SpecReason and Arbitrage. Ignored in sentence mode.
    - ``max_step_tokens``: the per-step token cap a generation call should use
      (``max_new_tokens``); a step that reaches it without a boundary is ``"truncated"``.
    - ``min_step_chars``: a boundary counts only once the step has at least this many
      non-whitespace characters before it, so a leading blank line does not make an empty step.
    """

    mode: Literal["delimiter", "sentence"] = "delimiter"
    delimiter: str = "\n\n"
    max_step_tokens: int = Field(default=MAX_STEP_TOKENS, gt=0)
    min_step_chars: int = Field(default=1, ge=0)

    @field_validator("delimiter")
    @classmethod
    def _delimiter_not_empty(cls, value: str) -> str:
        if value == "":
            raise ValueError("delimiter must not be empty")
        return value


@dataclass(slots=True, frozen=True)
class Step:
    """One step cut from a generation.

    - ``text``: the step, with its delimiter (or sentence end) kept at the end; for an
      ``end_think`` cut, everything before ``</think>``.
    - ``kind``: ``"final"`` (the step holds a final answer: ``\\boxed{`` or an ``Answer:`` /
      ``Final answer:`` line), ``"end_think"`` (the model closed its thinking with ``</think>``),
      ``"empty"`` (whitespace only), ``"truncated"`` (the per-step token cap was hit before any
      boundary), else ``"step"``. The first that applies, in this order, wins; ``ends_thinking``
      says independently whether ``</think>`` ended the step.
    - ``rest``: the text after the cut (after ``</think>`` when ``ends_thinking``), for the caller
      to discard or reuse.
    """

    text: str
    kind: StepKind
    rest: str = ""
    ends_thinking: bool = False

    @property
    def consumed(self) -> str:
        """The input this step used up: ``text`` plus ``</think>`` if it ended thinking.

        ``step.consumed + step.rest`` is exactly the text given to `cut_step`.
        """
        return self.text + THINK_CLOSE if self.ends_thinking else self.text


def stop_strings(config: SegmentConfig) -> list[str]:
    """Stop strings for a generation call that should produce exactly one step.

    Delimiter mode: ``[delimiter, "</think>"]``; sentence mode: the sentence ends of
    `SENTENCE_STOPS` plus ``"</think>"``. In sentence mode a stop string can fire after an
    abbreviation (``"e.g. "``); `cut_step` then finds no sentence end and keeps the whole text.
    """
    stops = [config.delimiter] if config.mode == "delimiter" else list(SENTENCE_STOPS)
    if THINK_CLOSE not in stops:
        stops.append(THINK_CLOSE)
    return stops


# --- boundaries ----------------------------------------------------------------------------------

# Words whose trailing period does not end a sentence (lowercase, without the final period).
# Single letters are not here: in math text "... equals a. Then" does end a sentence.
_ABBREVIATIONS = frozenset(
    {"e.g", "i.e", "vs", "cf", "approx", "resp", "fig", "figs", "eq", "eqs", "mr", "mrs", "ms",
     "dr", "prof", "al", "viz", "ca"}
)
_DOTTED_ABBREVIATION = re.compile(r"(?:[a-z]\.)+[a-z]")  # e.g, i.e, u.s
_SENTENCE_END = re.compile(r"\n|[.?!][ \n]")
_LEADING_PUNCT = "([{\"'`*_"


def _non_space_count(text: str) -> int:
    return sum(1 for ch in text if not ch.isspace())


def _is_false_sentence_end(text: str, i: int) -> bool:
    """Whether the punctuation at ``text[i]`` (followed by a space or newline) ends no sentence:
    an abbreviation (``e.g.``), a list number at the start of a line (``2. ``), a factorial
    (``5! = 120``). Decimals (``3.14``) never reach here: no whitespace follows their point."""
    start = i
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    word = text[start:i]
    if text[i] == "!":
        return bool(word) and (word[-1].isdigit() or word[-1] == ")")
    if text[i] != ".":
        return False
    token = word.lstrip(_LEADING_PUNCT).lower()
    if token in _ABBREVIATIONS or _DOTTED_ABBREVIATION.fullmatch(token):
        return True
    line_start = text.rfind("\n", 0, start) + 1
    return token.isdigit() and len(token) <= 3 and text[line_start:start].strip() == ""


def _find_boundary(text: str, end: int, config: SegmentConfig) -> int | None:
    """Index just past the first step boundary that lies wholly in ``text[:end]``, or None."""
    if config.mode == "delimiter":
        delimiter = config.delimiter
        pos = text.find(delimiter, 0, end)
        while pos >= 0:
            if _non_space_count(text[:pos]) >= config.min_step_chars:
                return pos + len(delimiter)
            pos = text.find(delimiter, pos + 1, end)
        return None
    for match in _SENTENCE_END.finditer(text, 0, end):
        i = match.start()
        if match.group() != "\n" and _is_false_sentence_end(text, i):
            continue
        if _non_space_count(text[:i]) >= config.min_step_chars:
            return match.end()
    return None


def closes_step(text: str, config: SegmentConfig) -> bool:
    """Whether ``text`` already holds a step boundary or ``</think>`` (nothing more belongs to it)."""
    return THINK_CLOSE in text or _find_boundary(text, len(text), config) is not None


# --- cutting -------------------------------------------------------------------------------------


def cut_step(generated: str, config: SegmentConfig, hit_token_cap: bool = False) -> Step:
    """Cut the raw output of one step's generation call into the step and the rest.

    ``generated`` may end with the stop string, or run past it when the backend ignores stop
    strings; ``hit_token_cap`` says whether the call stopped at its token cap
    (``config.max_step_tokens``). The step ends at the first boundary (delimiter or sentence end,
    kept in ``text``) or right before the first ``</think>``, whichever comes first; a boundary
    followed by nothing but whitespace and then ``</think>`` joins that ``end_think`` cut. Without
    either, the whole text is the step: ``"truncated"`` if the cap was hit, else ``"step"`` (the
    model stopped, or the backend trimmed the stop string). ``<think>`` tags are kept as text.

    Raises TypeError if ``generated`` is not a string.
    """
    if not isinstance(generated, str):
        raise TypeError(f"generated must be a str, got {type(generated).__name__}")
    think_at = generated.find(THINK_CLOSE)
    search_end = think_at if think_at >= 0 else len(generated)
    boundary = _find_boundary(generated, search_end, config)

    ends_thinking = think_at >= 0 and (
        boundary is None or generated[boundary:think_at].strip() == ""
    )
    if ends_thinking:
        text, rest = generated[:think_at], generated[think_at + len(THINK_CLOSE):]
    elif boundary is not None:
        text, rest = generated[:boundary], generated[boundary:]
    else:
        text, rest = generated, ""

    kind: StepKind
    if has_final_answer(text):
        kind = "final"
    elif ends_thinking:
        kind = "end_think"
    elif text.strip() == "":
        kind = "empty"
    elif boundary is None and hit_token_cap:
        kind = "truncated"
    else:
        kind = "step"
    return Step(text=text, kind=kind, rest=rest, ends_thinking=ends_thinking)


def split_steps(text: str, config: SegmentConfig) -> list[Step]:
    """Cut a whole trace into consecutive steps, stopping after a step that ends thinking.

    ``"".join(s.consumed for s in steps) + steps[-1].rest == text``; the last step's ``rest`` is
    empty unless thinking ended (then it is the text after ``</think>``). An empty text gives
    an empty list.
    """
    steps: list[Step] = []
    remaining = text
    while remaining:
        step = cut_step(remaining, config, hit_token_cap=False)
        steps.append(step)
        if step.ends_thinking:
            break
        remaining = step.rest
    return steps


# --- joining and tags ----------------------------------------------------------------------------


def join_steps(steps: Sequence[str], delimiter: str = "\n\n") -> str:
    """Join step texts into one thinking trace.

    Steps from `cut_step` already end with their delimiter and are concatenated unchanged, so
    the result equals the original text. A step that lacks it (the backend trimmed the stop
    string, or the step was truncated) gets the missing part of ``delimiter`` before the next
    step: ``["a", "b"]`` gives ``"a\\n\\nb"`` and ``["a\\n", "b"]`` gives ``"a\\n\\nb"``, as
    SpecReason joins its steps. Empty strings are skipped. ``delimiter=""`` concatenates as is.
    """
    parts: list[str] = []
    previous = ""
    for step in steps:
        if step == "":
            continue
        if parts and delimiter and not previous.endswith(delimiter):
            parts.append(_missing_delimiter(previous, delimiter))
        parts.append(step)
        previous = step
    return "".join(parts)


def _missing_delimiter(previous: str, delimiter: str) -> str:
    for k in range(len(delimiter) - 1, 0, -1):
        if previous.endswith(delimiter[:k]):
            return delimiter[k:]
    return delimiter


_THINK_TAG = re.compile(r"</?think>")


def strip_think_tags(text: str) -> str:
    """``text`` without any ``<think>`` / ``</think>`` tags (the text around them is kept)."""
    return _THINK_TAG.sub("", text)


# --- repetition ----------------------------------------------------------------------------------

_LOOP_MIN_REPEATS = 3  # a loop repeats its unit at least this many times
_LOOP_MAX_UNIT_CHARS = 200  # "one short line": the longest repeated unit considered
_LOOP_MIN_CHARS = 30  # the repeated run is at least this long (normalized characters)
_LOOP_MIN_UNIT_LETTERS = 3  # the unit has words in it, so "2, 4, 2, 4, ..." or "-----" is no loop


def _normalize(text: str) -> str:
    return " ".join(text.split()).lower()


def _is_degenerate_loop(normalized: str) -> bool:
    """Whether the text ends in one short unit repeated, covering at least half of it.

    A suffix of length k repeats with period p iff ``tail[p:] == tail[:-p]``; periodicity of a
    suffix implies it for every shorter one, so testing the shortest long-enough suffix suffices.
    A trailing partial repeat (a loop cut by the token cap) still counts.
    """
    n = len(normalized)
    for period in range(1, min(_LOOP_MAX_UNIT_CHARS, (n + 1) // _LOOP_MIN_REPEATS) + 1):
        # Three copies of a unit need 3p - 1 characters: no separator after the last one.
        k = max(_LOOP_MIN_REPEATS * period - 1, (n + 1) // 2, _LOOP_MIN_CHARS)
        if k > n:
            continue
        tail = normalized[n - k:]
        if tail[period:] != tail[:-period]:
            continue
        if sum(ch.isalpha() for ch in tail[:period]) >= _LOOP_MIN_UNIT_LETTERS:
            return True
    return False


def is_repeated(step: str, previous: Sequence[str], window: int = 4) -> bool:
    """Whether ``step`` repeats earlier reasoning, so a policy should stop the loop.

    True when the normalized step (whitespace collapsed, lowercased) equals one of the last
    ``window`` entries of ``previous`` (normalized the same way), or when the step is mostly one
    short line repeated (at least 3 times, at least half the step, at least 30 characters), as in
    ``"Let me check.\\nLet me check.\\nLet me check.\\n..."``. A blank step is never a repeat.

    Raises ValueError if ``window`` is negative.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    normalized = _normalize(step)
    if not normalized:
        return False
    recent = previous[-window:] if window else ()
    if any(_normalize(earlier) == normalized for earlier in recent):
        return True
    return _is_degenerate_loop(normalized)
