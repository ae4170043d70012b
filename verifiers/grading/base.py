"""The answer-checker contract and the input checks every checker shares."""

from __future__ import annotations

from fractions import Fraction
from typing import Protocol, runtime_checkable

__all__ = ["AnswerChecker", "math_text", "require_text"]


@runtime_checkable
class AnswerChecker(Protocol):
    """Decides whether `answer` is correct given `reference` (arguments are positional)."""

    name: str

    def check(self, answer: str, reference: str, /) -> bool:
        """True when the answer matches the reference."""
        ...


def require_text(value: object, what: str) -> str:
    """`value` when it is a str; TypeError naming `what` otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    return value


def math_text(value: object, what: str) -> str:
    """A math value as text: str as is, int/float/Fraction converted; anything else is a TypeError."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float, Fraction)) and not isinstance(value, bool):
        return str(value)
    raise TypeError(f"{what} must be a str (or a number), got {type(value).__name__}")
