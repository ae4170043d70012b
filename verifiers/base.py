"""The step-verifier contract: anything that scores one drafted reasoning step.

A `StepVerifier` gets the conversation a step continues (the generation messages: the problem and,
when steps were written, a last assistant message with the reasoning so far) and the drafted step,
and returns a `Verdict` (`thinkahead.verifiers.judge`): a score on the 0-9 scale, whether the step
passes, what judging cost, and optionally how much of the step to keep (`details["keep_chars"]`) and
the verifier's own text where it first fails (`correction`).

The built-in verifiers: `LLMJudge` (`judge.py`, the large model answers a 0-9 question),
`AgreementVerifier` (`agreement.py`, the large model re-reads the step token by token) and
`LikelihoodPRM` (`likelihood.py`, the step's mean token probability under the large model). Step
policies (`thinkahead.step_spec.specreason`) take any of them, or any other object with `judge`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from thinkahead.models.base import LanguageModel
from thinkahead.verifiers.judge import Verdict

__all__ = ["StepVerifier", "step_prompt"]


@runtime_checkable
class StepVerifier(Protocol):
    """Scores a drafted step given the messages it continues; `Verdict.accept` says whether it passes."""

    async def judge(self, messages: list[dict[str, str]], step: str) -> Verdict:
        """The verdict on `step`, the next text of the last assistant message (or the first one)."""
        ...


def step_prompt(model: LanguageModel, messages: list[dict[str, str]]) -> str:
    """The prompt a step continues: the generation prompt itself, so a prefix cache reads only the step."""
    return model.render(messages, continue_final=bool(messages) and messages[-1]["role"] == "assistant")
