"""Exact-match answers: string equality after optional case folding and punctuation stripping."""

from __future__ import annotations

import unicodedata

from thinkahead.verifiers.grading.base import require_text

__all__ = ["ExactMatchChecker"]


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
        text = require_text(text, "text")
        if self.strip_punctuation:
            text = "".join(" " if unicodedata.category(ch).startswith("P") else ch for ch in text)
        if not self.case_sensitive:
            text = text.casefold()
        return " ".join(text.split())

    def check(self, answer: str, reference: str, /) -> bool:
        """True when both normalise to the same string."""
        return self.normalize(require_text(answer, "answer")) == self.normalize(require_text(reference, "reference"))
