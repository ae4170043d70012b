"""`pipeline`: a multi-agent pipeline, planner -> solver -> checker, meant for a batch of tasks.

The planner (large) outlines an approach, the solver reasons through the step policy following
the plan, and the checker (large) reviews the solution; a checker that finds it wrong gives its
own answer, which then wins.
"""

from __future__ import annotations

from thinkahead.orchestrator.graph import END, START, StepGraph
from thinkahead.verifiers.grading.final_answer import extract_final_answer

PLAN = "Write a short numbered plan (at most 4 steps, no calculations) for solving this problem.\n\nProblem: {question}"
SOLVE = "{question}\n\nFollow this plan:\n{plan}"
CHECK = (
    "Problem: {question}\n\nSolution:\n{solution_reasoning}\n\n"
    "Is the solution's final answer correct? Reply 'VERDICT: correct' or 'VERDICT: wrong', "
    "and if wrong, give the correct final answer in \\boxed{{}}."
)


def _decide(state: dict) -> str:
    review = state["review"]
    if "VERDICT: WRONG" in review.upper():
        corrected = extract_final_answer(review)
        if corrected:
            return corrected
    return state["solution"]


def pipeline(*, planner: str = "large", checker: str = "large", max_steps: int | None = None,
             max_tokens: int | None = None) -> StepGraph:
    """question -> plan -> solution (step policy) -> review -> answer."""
    g = StepGraph("pipeline", inputs=["question"], output="answer", answer_extractor=extract_final_answer)
    g.add_generate("plan", PLAN, tier=planner, max_tokens=96)
    g.add_think("solution", SOLVE, max_steps=max_steps, max_tokens=max_tokens)
    g.add_generate("review", CHECK, tier=checker, max_tokens=96)
    g.add_tool("answer", _decide, inputs=["review", "solution"])
    g.add_sequence(START, "plan", "solution", "review", "answer", END)
    return g
