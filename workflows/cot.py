"""`cot`: one long reasoning chain through the step policy, then the final answer."""

from __future__ import annotations

from thinkahead.orchestrator.graph import END, START, StepGraph
from thinkahead.verifiers.grading.final_answer import extract_final_answer


def cot(*, system: str | None = None, max_steps: int | None = None, max_tokens: int | None = None) -> StepGraph:
    """question -> think (small drafts, large judges) -> answer (the boxed answer when there is one)."""
    g = StepGraph("cot", inputs=["question"], output="answer", answer_extractor=extract_final_answer)
    g.add_think("answer", "{question}", system=system, max_steps=max_steps, max_tokens=max_tokens)
    g.add_sequence(START, "answer", END)
    return g
