"""Plain Python agents that use thinkahead as their model: a solver team and a reviewer.

Each agent is an ordinary async function; the orchestrator is what they call instead of a model
API. The solvers work on their problems concurrently (the runtime overlaps their steps), and the
reviewer runs a different workflow on the same two models. Run it with the packaged models:

    python examples/plain_agents.py
"""

from __future__ import annotations

import asyncio

from thinkahead import Orchestrator


async def solver(orch: Orchestrator, problem: str) -> dict:
    """Solve one problem step by step (small model drafts, large model judges)."""
    result = await orch.run("cot", problem)
    return {"problem": problem, "answer": result.answer, "steps": len(result.steps()), "ok": result.ok}


async def reviewer(orch: Orchestrator, solved: dict) -> str:
    """Ask for a one-line check of a solution, as a second agent would."""
    question = f"Problem: {solved['problem']}\nProposed answer: {solved['answer']}\nIs it right? Answer yes or no."
    result = await orch.run("cot", question)
    return str(result.answer)


async def team(orch: Orchestrator, problems: list[str]) -> list[dict]:
    """The solvers in parallel, then a review of each answer."""
    solved = await asyncio.gather(*(solver(orch, p) for p in problems))
    reviews = await asyncio.gather(*(reviewer(orch, s) for s in solved))
    return [{**s, "review": r} for s, r in zip(solved, reviews)]


if __name__ == "__main__":
    orchestrator = Orchestrator(small="qwen2.5-coder-0.5b", large="qwen2.5-coder-1.5b", policy="specreason",
                                concurrency=2)
    for row in asyncio.run(team(orchestrator, ["What is 17 * 23?", "What is 144 / 12?"])):
        print(row)
