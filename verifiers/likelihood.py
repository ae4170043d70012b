"""`LikelihoodPRM`: a process reward model that scores a step by how likely the large model finds it.

The score is the geometric-mean token probability of the step under the model, times 9 (the
judge's 0-9 scale), in one forward pass over the step (the prefix is shared with generation, so a
prefix cache reads only the step). It needs no judge prompt, which small instruction models follow
poorly; it does penalise unusual wording as well as wrong content. A `StepVerifier`
(`thinkahead.verifiers.base`).
"""

from __future__ import annotations

import math
import time

from thinkahead.models.base import LanguageModel
from thinkahead.verifiers.base import step_prompt
from thinkahead.verifiers.judge import Verdict

__all__ = ["LikelihoodPRM"]


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
        logprobs = await self.model.continuation_logprobs(step_prompt(self.model, messages), step)
        mean = sum(logprobs) / len(logprobs)
        score = 9.0 * math.exp(mean)
        return Verdict(score=score, accept=score >= self.threshold, time_s=time.perf_counter() - t0,
                       details={"mean_logprob": mean, "tokens": float(len(logprobs))})
