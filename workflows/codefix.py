"""`codefix`: a coding agent: write a function, run its tests, fix it from the failures, repeat.

The conversation grows turn by turn (task, code, test failures, fixed code, ...), so every fix
prompt extends the previous prompt and output exactly, and each fix repeats most of the last
version of the code: session suffix trees and KV prefix reuse pay off, as in real coding agents.
The loop stops when the tests pass or after `rounds` fixes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from thinkahead.orchestrator.graph import END, START, GraphError, StepGraph
from thinkahead.verifiers.grading.code import extract_code

WRITE = "Complete this Python function. Reply with the whole function in one ```python block.\n\n{question}"
FIX = (
    "The tests failed:\n{feedback}\n\n"
    "Fix the function. Reply with the whole corrected function in one ```python block."
)

TestRunner = Callable[[str], tuple[bool, str]]
"""code -> (passed, feedback): what a failing run printed, for the model to read."""


def codefix(*, tests: TestRunner | None = None, rounds: int = 3, max_tokens: int = 512, tier: str = "large") -> StepGraph:
    """write -> test -> (fix -> test) while the tests fail, at most `rounds` times -> answer (the code)."""
    if tests is None or not callable(tests):
        raise GraphError("codefix needs tests=: a function code -> (passed, feedback)")

    def first_turn(state: dict) -> list[dict[str, str]]:
        return [{"role": "user", "content": WRITE.format(question=state["question"])}]

    async def run_tests(state: dict) -> dict:
        previous = state.get("test") or {"history": first_turn(state), "fixes": -1}
        code = state["code"]
        passed, feedback = await asyncio.to_thread(tests, extract_code(code))  # a subprocess: off the event loop
        history = previous["history"] + [{"role": "assistant", "content": code}]
        if not passed:
            history.append({"role": "user", "content": FIX.format(feedback=feedback.strip() or "(no output)")})
        return {"passed": passed, "feedback": feedback, "history": history, "fixes": previous["fixes"] + 1}

    g = StepGraph("codefix", inputs=["question"], output="answer")
    g.add_generate("write", first_turn, tier=tier, inputs=["question"], output="code", max_tokens=max_tokens, strip=False,
                   session="agent")
    g.add_tool("first_test", run_tests, inputs=["code"], output="test")
    g.add_loop("fixes", max_iters=rounds, condition=lambda s: not s["test"]["passed"])
    g.add_generate("fix", lambda s: s["test"]["history"], tier=tier, inputs=["test"], output="code",
                   max_tokens=max_tokens, strip=False, session="agent")
    g.add_tool("test", run_tests, inputs=["code"])
    g.add_tool("answer", lambda s: extract_code(s["code"]), inputs=["code"])
    g.add_sequence(START, "write", "first_test", "fixes")
    g.add_cycle("fixes", ["fix", "test"], "answer")
    g.add_edge("answer", END)
    return g
