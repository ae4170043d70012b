"""Named benchmark suites: which tasks, how many, which workflow runs them and which checker grades them.

A `SuiteSpec` is a fixed recipe (task source, count, slice or seed, workflow and its options,
checker), so `thinkahead bench --suite NAME` is reproducible; `load_suite(name)` reads the data and
returns a `Suite`: the tasks plus what is needed to run and grade them.

    suite = load_suite("gsm8k-50")
    for task in suite.tasks:
        graph = build_workflow(suite.workflow, **suite.workflow_options(task))
        result = await runtime.run(graph, task.inputs)
        correct = suite.grade(task, result.answer, result.outputs)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from thinkahead.evals.tasks import Task
from thinkahead.verifiers.grading import AnswerChecker

__all__ = ["SUITES", "Suite", "SuiteSpec", "load_suite"]


def _frozen(mapping: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True, slots=True)
class SuiteSpec:
    """The recipe of a suite.

    `source` names a task loader (`thinkahead.evals.loaders.LOADERS`); `n`, `offset` and `seed`
    select its tasks (see that module); `grade_on` names the run output holding the text to grade:
    "answer" (the workflow's answer), or a path into `RunResult.outputs` such as
    "answer_reasoning" (cot's full reasoning, which holds the code of a HumanEval reply) or
    "observe.transcript" (react's transcript, which holds the tool calls).
    """

    name: str
    description: str
    source: str
    n: int
    workflow: str
    checker: str
    offset: int = 0
    seed: int | None = None
    loader_options: Mapping[str, Any] = field(default_factory=_frozen)
    workflow_options: Mapping[str, Any] = field(default_factory=_frozen)
    grade_on: str = "answer"


def _spec(name: str, description: str, source: str, n: int, workflow: str, checker: str, *,
          loader_options: Mapping[str, Any] | None = None, workflow_options: Mapping[str, Any] | None = None,
          **rest: Any) -> SuiteSpec:
    return SuiteSpec(name, description, source, n, workflow, checker, loader_options=_frozen(loader_options),
                     workflow_options=_frozen(workflow_options), **rest)


SUITES: dict[str, SuiteSpec] = {
    s.name: s
    for s in (
        _spec("gsm8k-50", "GSM8K test, problems 0-49, one chain of thought each", "gsm8k", 50, "cot", "math"),
        _spec("math500-30", "MATH-500, problems 0-29 (all subjects and levels), one chain of thought each",
              "math500", 30, "cot", "math"),
        _spec("humaneval-20", "HumanEval/0-19: write the function, graded by its unit tests", "humaneval", 20,
              "cot", "humaneval", grade_on="answer_reasoning"),
        _spec("agentic-refine", "Self-Refine over GSM8K test 0-19: solve, then critique and rewrite twice "
              "(repetitive drafts: where suffix drafting pays)", "gsm8k", 20, "refine", "math",
              loader_options={"instruction": False}, workflow_options={"rounds": 2, "stop_early": False}),
        _spec("agentic-codefix", "HumanEval/0-19 as a coding agent: write the function, run its tests, fix it "
              "from the failures (at most 3 fixes; the feedback comes from the graded tests)", "humaneval", 20,
              "codefix", "humaneval"),
        _spec("agentic-pipeline", "planner -> solver -> checker over GSM8K test 0-99: the same sub-tasks "
              "run many times", "gsm8k", 100, "pipeline", "math"),
        _spec("tools-bfcl-20", "BFCL v4 multi_turn_base 0-19: multi-turn tool use (file system, trading, "
              "travel, ...) in a react loop on BFCL's Python tool environments", "bfcl", 20, "react", "bfcl",
              loader_options={"category": "multi_turn_base"}, grade_on="observe.transcript"),
        _spec("countdown-20", "countdown puzzles 0-19 of seed 0 (4-6 numbers, target 100-999)", "countdown", 20,
              "cot", "countdown", seed=0),
        _spec("game24-20", "game-of-24 puzzles 0-19 of seed 0", "game24", 20, "cot", "countdown", seed=0),
    )
}
"""Every suite by name."""


@dataclass(slots=True)
class Suite:
    """A loaded suite: its recipe and its tasks, with what it takes to run and grade them."""

    spec: SuiteSpec
    tasks: list[Task]
    _checker: AnswerChecker | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def workflow(self) -> str:
        """The built-in workflow that runs each task (`thinkahead.workflows.build_workflow`)."""
        return self.spec.workflow

    @property
    def checker(self) -> AnswerChecker:
        """The checker that grades each task (built once)."""
        if self._checker is None:
            from thinkahead.evals.checkers import get_eval_checker

            self._checker = get_eval_checker(self.spec.checker)
        return self._checker

    def workflow_options(self, task: Task) -> dict[str, Any]:
        """Options for `build_workflow(self.workflow, ...)` to run `task`.

        For BFCL these are per task: react tools bound to a fresh copy of the task's tool
        environment, and a turn bound that leaves room beyond the ground truth's call count; build
        one graph per task. For the others they are the suite's fixed options.
        """
        options = dict(self.spec.workflow_options)
        if self.spec.checker == "bfcl":
            import json

            from thinkahead.evals.bfcl import BfclEnvironment

            calls = sum(len(turn) for turn in json.loads(task.reference or "{}").get("ground_truth", []))
            options.setdefault("tools", BfclEnvironment(task.reference or "").tools())
            options.setdefault("max_turns", 2 * calls + 4)
        if self.spec.checker == "humaneval" and self.spec.workflow == "codefix":
            options.setdefault("tests", _humaneval_runner(self.checker, task.reference or ""))
        return options

    def answer_text(self, answer: Any, outputs: Mapping[str, Any] | None = None) -> str:
        """The text to grade: the run output named by `spec.grade_on`, else the answer ("" for None)."""
        value: Any = outputs
        if self.spec.grade_on != "answer" and outputs is not None:
            for key in self.spec.grade_on.split("."):
                value = value.get(key) if isinstance(value, Mapping) else None
            if isinstance(value, str):
                return value
        return "" if answer is None else answer if isinstance(answer, str) else str(answer)

    def grade(self, task: Task, answer: Any, outputs: Mapping[str, Any] | None = None) -> bool:
        """True when a run's answer (or output, per `spec.grade_on`) is correct for `task`."""
        if task.reference is None:
            raise ValueError(f"task {task.id!r} has no reference answer")
        try:
            return bool(self.checker.check(self.answer_text(answer, outputs), task.reference))
        except ValueError:
            return False


def load_suite(name: str, limit: int | None = None) -> Suite:
    """The suite called `name` with its tasks read (the first `limit` of them, if given).

    ValueError names the known suites for an unknown name.
    """
    if not isinstance(name, str) or name not in SUITES:
        raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(SUITES)}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int, got {limit!r}")
    from thinkahead.evals.loaders import load_tasks

    spec = SUITES[name]
    n = spec.n if limit is None else min(spec.n, limit)
    tasks = load_tasks(spec.source, n, spec.offset, spec.seed, **spec.loader_options)
    return Suite(spec, tasks)


def _humaneval_runner(checker: AnswerChecker, reference: str):
    """code -> (passed, feedback) for a codefix agent: the task's tests and what a failure printed."""

    def run(code: str) -> tuple[bool, str]:
        result = checker.run(code, reference)  # type: ignore[attr-defined]
        if result.timed_out:
            return False, "the tests timed out (an infinite loop?)"
        return result.passed, result.stderr_tail
    return run
