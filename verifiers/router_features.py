"""What an Arbitrage router sees before a step is written: `RouterFeatures` and the helpers that compute them.

- `RouterFeatures`: step index, the judge score of the previous step, the small model's next-token
  entropy, previous step length and reflection cue, problem length; `to_vector()` in the fixed
  order `FEATURE_NAMES` (a saved `LogisticRouter` records that order and must match it).
- `entropy_from_logprobs`: the entropy of a top-k next-token distribution.
- `REFLECTION_CUES`, `opens_with_reflection`: whether a step opens with "Wait", "Hmm", ...

The routers are in `thinkahead.verifiers.router`, their training data in `router_pairs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
import math
import re

import numpy as np

__all__ = [
    "FEATURE_NAMES",
    "IMPUTED_PREV_SCORE",
    "REFLECTION_CUES",
    "RouterFeatures",
    "entropy_from_logprobs",
    "is_number",
    "opens_with_reflection",
]

IMPUTED_PREV_SCORE = 5.0
"""Value used for `prev_score` when it is unknown (middle of the judge's 0-9 scale)."""

FEATURE_NAMES: tuple[str, ...] = (
    "step_index",
    "prev_score",
    "prev_score_missing",
    "small_entropy",
    "prev_step_tokens",
    "prev_had_reflection",
    "problem_tokens",
)
"""Order of `RouterFeatures.to_vector()`; a saved `LogisticRouter` records it and must match."""


# --------------------------------------------------------------------------- features


def is_number(value: object) -> bool:
    """A real number: an int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(slots=True)
class RouterFeatures:
    """What the router sees before the next step is written.

    - `step_index`: 0-based index of the step about to be written.
    - `prev_score`: judge score (0-9) of the previous step, None if unknown (first step, or the
      previous step was not judged).
    - `small_entropy`: entropy (nats) of the small model's next-token distribution at the start of
      this step, from its top-k logprobs (`entropy_from_logprobs`).
    - `prev_step_tokens`: length of the previous step in tokens (0 for the first step).
    - `prev_had_reflection`: the previous step opened with a reflection cue ("Wait", ...).
    - `problem_tokens`: length of the problem statement in tokens.
    """

    step_index: int
    prev_score: float | None
    small_entropy: float
    prev_step_tokens: int
    prev_had_reflection: bool
    problem_tokens: int

    def __post_init__(self) -> None:
        for name in ("step_index", "prev_step_tokens", "problem_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"RouterFeatures.{name} must be a non-negative int, got {value!r}")
        if self.prev_score is not None and (
            not is_number(self.prev_score) or not math.isfinite(self.prev_score)
        ):
            raise ValueError(
                "RouterFeatures.prev_score must be a finite number or None, "
                f"got {self.prev_score!r}"
            )
        if (
            not is_number(self.small_entropy)
            or not math.isfinite(self.small_entropy)
            or self.small_entropy < 0
        ):
            raise ValueError(
                "RouterFeatures.small_entropy must be a finite number >= 0, "
                f"got {self.small_entropy!r}"
            )
        if not isinstance(self.prev_had_reflection, bool):
            raise ValueError(
                "RouterFeatures.prev_had_reflection must be a bool, "
                f"got {self.prev_had_reflection!r}"
            )

    def to_vector(self, names: tuple[str, ...] = FEATURE_NAMES) -> list[float]:
        """The features `names` as floats, in that order (default `FEATURE_NAMES`): step_index,
        prev_score (None -> 5.0), prev_score_missing (1.0 if None), small_entropy, prev_step_tokens,
        prev_had_reflection (0/1), problem_tokens. A router trained on a subset names it."""
        missing = self.prev_score is None
        values = {
            "step_index": float(self.step_index),
            "prev_score": IMPUTED_PREV_SCORE if missing else float(self.prev_score),  # type: ignore[arg-type]
            "prev_score_missing": 1.0 if missing else 0.0,
            "small_entropy": float(self.small_entropy),
            "prev_step_tokens": float(self.prev_step_tokens),
            "prev_had_reflection": 1.0 if self.prev_had_reflection else 0.0,
            "problem_tokens": float(self.problem_tokens),
        }
        unknown = [n for n in names if n not in values]
        if unknown:
            raise ValueError(f"unknown router features {unknown}; known: {list(FEATURE_NAMES)}")
        return [values[n] for n in names]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of the raw fields (prev_score stays None when unknown)."""
        return {
            "step_index": self.step_index,
            "prev_score": self.prev_score,
            "small_entropy": self.small_entropy,
            "prev_step_tokens": self.prev_step_tokens,
            "prev_had_reflection": self.prev_had_reflection,
            "problem_tokens": self.problem_tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RouterFeatures:
        """Inverse of `to_dict`; ValueError for missing or unexpected keys and bad values."""
        if not isinstance(data, Mapping):
            raise ValueError(f"features must be a JSON object, got {type(data).__name__}")
        expected = {
            "step_index",
            "prev_score",
            "small_entropy",
            "prev_step_tokens",
            "prev_had_reflection",
            "problem_tokens",
        }
        missing = expected - set(data)
        extra = set(data) - expected
        if missing or extra:
            raise ValueError(
                f"features keys: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        return cls(**{k: data[k] for k in expected})


def entropy_from_logprobs(logprobs: Mapping[str, float]) -> float:
    """Entropy (nats) of the top-k distribution given as token -> logprob, renormalised to sum 1.

    Empty -> 0.0. Logprobs of -inf count as probability 0; NaN or +inf is a ValueError.
    """
    if not logprobs:
        return 0.0
    values = np.asarray([float(v) for v in logprobs.values()], dtype=np.float64)
    if np.isnan(values).any() or np.isposinf(values).any():
        raise ValueError("logprobs must be finite or -inf")
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0
    shifted = finite - finite.max()
    log_z = math.log(float(np.exp(shifted).sum()))
    logp = shifted - log_z
    p = np.exp(logp)
    return max(0.0, float(-(p * logp).sum()))


# --------------------------------------------------------------------------- reflection cues

REFLECTION_CUES: tuple[str, ...] = (
    "wait",
    "alternatively",
    "let me check",
    "hmm",
    "but wait",
    "on second thought",
    "let me verify",
    "however",
    "actually",
)
"""Lowercase openers that mark a reflective step (after Speculative Thinking's keyword classes)."""

_LEADING_NOISE = re.compile(r"^(?:[\s#*_>`~\-+]|\d+[.)]\s)*")
_CUE_PATTERN = re.compile(
    r"(?:"
    + "|".join(
        # "hmm" also matches "hmmm..."; every cue must end at a word boundary.
        re.escape(c) + ("+" if c == "hmm" else "")
        for c in sorted(REFLECTION_CUES, key=len, reverse=True)
    )
    + r")(?![a-z0-9])",
    re.IGNORECASE,
)


def opens_with_reflection(text: str) -> bool:
    """True when `text` opens with a reflection cue, ignoring case, leading whitespace and markdown
    (headings, emphasis, quotes, list bullets). The cue must be a whole word: "Waiting" is not
    "wait"."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    body = _LEADING_NOISE.sub("", text, count=1)
    return _CUE_PATTERN.match(body) is not None
