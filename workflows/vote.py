"""`vote`: N reasoning chains in parallel; majority vote (self-consistency, stopped once decided) or first to finish."""

from __future__ import annotations

from collections import Counter

from thinkahead.orchestrator.graph import END, START, GraphError, StepGraph
from thinkahead.verifiers.grading.final_answer import extract_final_answer
from thinkahead.verifiers.grading.latex import normalize_math

VOTE_MODES = ("majority", "first")


def _votes(answers: list) -> tuple[list[str], list[str]]:
    """The answers that vote (non-empty text) and their math-normalized keys."""
    votes = [a for a in answers if isinstance(a, str) and a.strip()]
    return votes, [normalize_math(a) for a in votes]


def majority(answers: list) -> str | None:
    """The most common answer (math-normalized); ties go to the answer seen first."""
    votes, keys = _votes(answers)
    if not votes:
        return None
    counts = Counter(keys)
    best = max(counts.values())
    return next(a for a, k in zip(votes, keys) if counts[k] == best)


def majority_decided(answers: list, remaining: int) -> bool:
    """Whether `remaining` more answers cannot change what `majority` picks: its leader has more votes than
    any other answer would have with all of them (strictly more: a tie goes to the answer seen first)."""
    counts = [c for _, c in Counter(_votes(answers)[1]).most_common(2)] + [0, 0]
    return counts[0] > 0 and counts[0] > counts[1] + remaining


def vote(*, n: int = 3, mode: str = "majority", temperature: float = 0.7, max_steps: int | None = None,
         max_tokens: int | None = None, early_stop: bool = True) -> StepGraph:
    """question -> fork -> n sampled chains -> join (majority or first) -> answer.

    `early_stop` (majority): the join runs as soon as the finished chains decide the majority
    (`majority_decided`), and the chains still running are cancelled: the same answer, up to its written form
    (the first finished chain's among equal answers), without waiting for the slowest chains (with n = 5, once
    three agree).
    """
    if mode not in VOTE_MODES:
        raise GraphError(f"vote mode must be one of {VOTE_MODES}, got {mode!r}")
    if n < 2:
        raise GraphError(f"vote needs n >= 2 chains, got {n}")
    if not isinstance(early_stop, bool):
        raise GraphError(f"vote's early_stop must be true or false, got {early_stop!r}")
    g = StepGraph("vote", inputs=["question"], output="answer", answer_extractor=extract_final_answer)
    g.add_fork("fork")
    g.add_join("answer", first=mode == "first", merge=None if mode == "first" else majority,
               decided=majority_decided if mode == "majority" and early_stop else None)
    g.add_edge(START, "fork")
    for i in range(n):
        g.add_think(f"chain_{i}", "{question}", temperature=temperature, seed=i, max_steps=max_steps,
                    max_tokens=max_tokens)
        g.add_edge("fork", f"chain_{i}")
        g.add_edge(f"chain_{i}", "answer")
    g.add_edge("answer", END)
    return g
