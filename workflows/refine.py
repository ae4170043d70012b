"""`refine`: solve, then critique and rewrite for N rounds (Self-Refine).

Each rewrite repeats most of the previous draft, so suffix drafts from the draft and the critique
pay off: a repetitive workload by design. The loop stops early when the critique finds nothing to
fix.
"""

from __future__ import annotations

from thinkahead.orchestrator.graph import END, START, StepGraph
from thinkahead.verifiers.grading.final_answer import extract_final_answer

SOLVE = "Solve the problem. Reason step by step and put the final answer in \\boxed{{}}.\n\nProblem: {question}"
CRITIQUE = (
    "Problem: {question}\n\nProposed solution:\n{draft}\n\n"
    "Check the solution step by step. List every mistake. If it is fully correct, reply exactly: NO ERRORS."
)
REWRITE = (
    "Problem: {question}\n\nPrevious solution:\n{draft}\n\nFeedback:\n{critique}\n\n"
    "Rewrite the solution, fixing the mistakes named in the feedback and keeping what was right. "
    "Put the final answer in \\boxed{{}}."
)
DONE_MARK = "NO ERRORS"


def _needs_work(state: dict) -> bool:
    return DONE_MARK not in state.get("critique", "").upper()


def _final_answer(state: dict) -> str:
    return extract_final_answer(state["draft"]) or state["draft"].strip()


def refine(*, rounds: int = 2, max_tokens: int = 384, solver: str = "large", critic: str = "small",
           stop_early: bool = True) -> StepGraph:
    """solve -> critique -> (rewrite -> critique) while the critique finds mistakes, at most `rounds` times.

    `stop_early=False` always runs every round (a fixed amount of rewriting, for benchmarks).
    """
    g = StepGraph("refine", inputs=["question"], output="answer")
    g.add_generate("solve", SOLVE, tier=solver, output="draft", max_tokens=max_tokens)
    g.add_generate("first_critique", CRITIQUE, tier=critic, output="critique", max_tokens=max_tokens // 2)
    g.add_loop("rounds", max_iters=rounds, condition=_needs_work if stop_early else None)
    g.add_generate("rewrite", REWRITE, tier=solver, output="draft", max_tokens=max_tokens)
    g.add_generate("critique", CRITIQUE, tier=critic, max_tokens=max_tokens // 2)
    g.add_tool("answer", _final_answer, inputs=["draft"])
    g.add_sequence(START, "solve", "first_critique", "rounds")
    g.add_cycle("rounds", ["rewrite", "critique"], "answer")
    g.add_edge("answer", END)
    return g
