"""Process reward models: any model that scores one reasoning step, on the judge's 0-9 scale.

A PRM is a `StepVerifier`: `judge(messages, step) -> Verdict`, so SpecReason can take a trained
PRM, the LLM judge, or the likelihood scorer here interchangeably.

`LikelihoodPRM` scores a step by how likely the (large) model finds it: the geometric-mean token
probability of the step under the model, times 9, in one forward pass over the step (the prefix is
shared with generation, so a prefix cache reads only the step). It needs no judge prompt, which
small instruction models follow poorly; it does penalise unusual wording as well as wrong content.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

from thinkahead.models.base import LanguageModel
from thinkahead.verifiers.judge import Verdict


class ProcessRewardModel(Protocol):
    """Scores a step (0-9) given the conversation it continues; accept at the threshold or above."""

    threshold: float

    async def judge(self, messages: list[dict[str, str]], step: str) -> Verdict: ...


class LikelihoodPRM:
    """Score = 9 x exp(mean token log-probability of the step under `model`)."""

    def __init__(self, model: LanguageModel, threshold: float = 3.0) -> None:
        if not 0 <= threshold <= 9:
            raise ValueError(f"PRM threshold must be in [0, 9], got {threshold}")
        self.model = model
        self.threshold = threshold

    async def judge(self, messages: list[dict[str, str]], step: str) -> Verdict:
        if not step.strip():
            return Verdict(score=0.0, accept=False, judge_calls=0)
        t0 = time.perf_counter()
        continuing = bool(messages) and messages[-1]["role"] == "assistant"
        prompt = self.model.render(messages, continue_final=continuing)
        logprobs = await self.model.continuation_logprobs(prompt, step)
        mean = sum(logprobs) / len(logprobs)
        score = 9.0 * math.exp(mean)
        return Verdict(score=score, accept=score >= self.threshold, time_s=time.perf_counter() - t0,
                       details={"mean_logprob": mean, "tokens": float(len(logprobs))})
