"""The step judge (SpecReason): the large model scores a drafted step 0-9 in one forward pass.

The judge prompt is the generation prompt itself (problem, reasoning so far, the drafted step)
followed by a short evaluation turn, so a backend with prefix caching (our KV prefix pool, SGLang's
radix cache) only reads the new tokens. The score comes from the logprobs of the digit tokens at
the next position: the likeliest digit ("greedy", SpecReason's default) or the probability-weighted
mean ("expected").
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from thinkahead.models.base import LanguageModel

JUDGE_QUESTION = (
    "Evaluate the last reasoning step above: is it correct and useful for solving the problem? "
    "Reply with a single digit from 0 (wrong or useless) to 9 (correct and useful)."
)
SCORE_PREFIX = "Score: "


@dataclass(slots=True)
class Verdict:
    """A judged step: its score, whether it passes the threshold, and what judging cost."""

    score: float
    accept: bool
    judge_calls: int = 1
    time_s: float = 0.0
    digit_mass: float = 0.0  # probability mass the judge put on digits (low: the prompt confused it)
    details: dict[str, float] = field(default_factory=dict)
    correction: str = ""  # what the verifier would write where the step first fails ("" if it cannot say)


def judge_messages(messages: list[dict[str, str]], step: str) -> list[dict[str, str]]:
    """The judge conversation: the generation messages with `step` appended, then the question.

    `messages` ends with the partial assistant message (the reasoning so far) or with the user turn
    when no step has been written yet.
    """
    if messages and messages[-1]["role"] == "assistant":
        head = messages[:-1] + [{"role": "assistant", "content": messages[-1]["content"] + step}]
    else:
        head = list(messages) + [{"role": "assistant", "content": step}]
    return head + [{"role": "user", "content": JUDGE_QUESTION}, {"role": "assistant", "content": SCORE_PREFIX}]


def score_from_logprobs(logprobs: dict[str, float], mode: Literal["greedy", "expected"]) -> tuple[float, float]:
    """(score, digit probability mass) from next-token logprobs; (0, 0) when no digit is among them."""
    import math

    mass = [0.0] * 10
    for text, lp in logprobs.items():
        t = text.strip()
        if len(t) == 1 and "0" <= t <= "9":  # ASCII digits only: str.isdigit() also takes '²', '٣', ...
            mass[int(t)] += math.exp(lp)
    total = sum(mass)
    if total <= 0:
        return 0.0, 0.0
    if mode == "greedy":
        return float(max(range(10), key=lambda d: mass[d])), total
    return sum(d * m for d, m in enumerate(mass)) / total, total


class LLMJudge:
    """Scores a step with `model` (normally the large model) and accepts it at `threshold` or above."""

    def __init__(
        self,
        model: LanguageModel,
        threshold: float = 7.0,
        mode: Literal["greedy", "expected"] = "greedy",
        top_k: int = 20,
    ) -> None:
        if not 0 <= threshold <= 9:
            raise ValueError(f"judge threshold must be in [0, 9], got {threshold}")
        if mode not in ("greedy", "expected"):
            raise ValueError(f"judge mode must be 'greedy' or 'expected', got {mode!r}")
        self.model = model
        self.threshold = threshold
        self.mode = mode
        self.top_k = top_k

    async def judge(self, messages: list[dict[str, str]], step: str) -> Verdict:
        t0 = time.perf_counter()
        prompt = self.model.render(judge_messages(messages, step), continue_final=True)
        logprobs = await self.model.next_token_logprobs(prompt, self.top_k)
        score, mass = score_from_logprobs(logprobs, self.mode)
        return Verdict(
            score=score, accept=score >= self.threshold, time_s=time.perf_counter() - t0, digit_mass=mass
        )
