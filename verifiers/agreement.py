"""`AgreementVerifier`: the large model re-reads a drafted step and fails it where it disagrees.

One forward pass over the step, like `LikelihoodPRM`, but a sharper question: is there a token where
the large model's own choice is far likelier than the drafted one? By default only tokens with
digits are checked: on GSM8K the small model's steps go wrong in their numbers, while wording
differences between two models are everywhere and harmless (measured on the gsm8k-50 specreason
traces: some token of 70% of the 0.5B model's steps is over 0.7 nats below the 1.5B model's choice,
a digit token in only 13% of them, and those flag 12 of the 19 runs that the 1.5B model alone got
right and SpecReason got wrong). A failed step keeps its text up to the first disagreeing token
(`details["keep_chars"]`), so the large model rewrites only the rest; `Verdict.correction` is the
large model's own token there, which lets SpecReason's token repair go on with the small model.
A `StepVerifier` (`thinkahead.verifiers.base`).
"""

from __future__ import annotations

import math
import time

from thinkahead.models.base import LanguageModel, TokenScore
from thinkahead.verifiers.base import step_prompt
from thinkahead.verifiers.judge import Verdict

__all__ = ["AgreementVerifier"]


class AgreementVerifier:
    """Fail a step at the first token whose drafted choice trails the model's own by more than its
    margin: `margin` nats for tokens with digits, `word_margin` for the others (None: not checked).
    Score = 9 x exp(-largest checked gap), on the judge's 0-9 scale."""

    def __init__(self, model: LanguageModel, margin: float = 1.0, word_margin: float | None = None) -> None:
        for name, value in (("margin", margin), ("word_margin", word_margin)):
            if value is None and name == "word_margin":
                continue
            if not (isinstance(value, (int, float)) and 0 < value < 50):
                raise ValueError(f"agreement {name} must be a number of nats in (0, 50), got {value!r}")
        self.model = model
        self.margin = float(margin)
        self.word_margin = None if word_margin is None else float(word_margin)
        self.threshold = 9.0 * math.exp(-self.margin)

    def margin_for(self, token: TokenScore) -> float | None:
        """The gap `token` may have; None when it is not checked."""
        return self.margin if any(c.isdigit() for c in token.text) else self.word_margin

    async def judge(self, messages: list[dict[str, str]], step: str) -> Verdict:
        if not step.strip():
            return Verdict(score=0.0, accept=False, judge_calls=0)
        t0 = time.perf_counter()
        tokens = await self.model.continuation_scores(step_prompt(self.model, messages), step)
        margins = [self.margin_for(t) for t in tokens]
        worst = max((t.gap for t, m in zip(tokens, margins) if m is not None), default=0.0)
        first_bad = next((i for i, (t, m) in enumerate(zip(tokens, margins)) if m is not None and t.gap > m), None)
        details = {"worst_gap": worst, "tokens": float(len(tokens))}
        correction = ""
        if first_bad is not None:
            kept = "".join(t.text for t in tokens[:first_bad])
            rejoins = step.startswith(kept)  # token texts may not rejoin into the step
            details["keep_chars"] = len(kept) if rejoins else 0  # an int: a character count
            correction = tokens[first_bad].top_text if rejoins else ""
        return Verdict(score=9.0 * math.exp(-worst), accept=first_bad is None, time_s=time.perf_counter() - t0,
                       details=details, correction=correction)
