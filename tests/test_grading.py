"""The verifiers' seams: one final-answer module for segmentation and grading, one checker registry
for the CLI and the suites, the workflow (not the runtime) choosing how a `think` node reads its
answer, and one `StepVerifier` protocol for every step verifier."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from thinkahead.models import ScriptedModel
from thinkahead.orchestrator import Runtime
from thinkahead.orchestrator.graph import END, START, GraphError, StepGraph
from thinkahead.step_spec import segment
from thinkahead.step_spec.policies import make_policy
from thinkahead.verifiers.grading import CHECKER_NAMES, CHECKERS, AnswerChecker, MathChecker, get_checker
from thinkahead.verifiers.grading import final_answer
from thinkahead.workflows import cot

from tests.llm_judge import LLM_JUDGE

ROOT = Path(__file__).resolve().parents[1]
JUDGE_YES = [{"9": -0.05}]


# --------------------------------------------------------------------------- one final-answer module


def test_segmentation_and_grading_read_one_final_answer_module() -> None:
    assert segment.has_final_answer is final_answer.has_final_answer
    text = "Half of the pie is left, so the answer is $\\boxed{\\frac{1}{2}}$.\n\n"
    step = segment.cut_step(text + "Wait, let me check.", segment.SegmentConfig())
    assert (step.text, step.kind) == (text, "final")  # the step loop stops here
    assert final_answer.extract_final_answer(step.text) == "\\frac{1}{2}"  # the whole box, nested braces kept
    assert MathChecker().check(step.text, "0.5") and not MathChecker().check(step.text, "1")


def test_detection_and_extraction_differ_where_tests_pin_them() -> None:
    # The stop test waits for an answer line or an opened box; the extractor takes any marker.
    prose = "The answer: we still need the sum."
    assert not final_answer.has_final_answer(prose)
    assert final_answer.extract_final_answer(prose) == "we still need the sum."
    # An opened box ends the reasoning, but there is nothing complete to read yet.
    assert final_answer.has_final_answer("so \\boxed{\\frac{1}{2")
    assert final_answer.last_boxed("so \\boxed{\\frac{1}{2") is None


# --------------------------------------------------------------------------- one checker registry


@pytest.mark.parametrize("name", CHECKER_NAMES)
def test_every_registered_checker_builds_under_its_name(name: str) -> None:
    checker = get_checker(name)
    assert type(checker) is CHECKERS[name] and isinstance(checker, AnswerChecker) and checker.name == name


def test_cli_and_suites_read_the_registry() -> None:
    from thinkahead.cli.bench import bench
    from thinkahead.cli.run import run as run_command
    from thinkahead.evals import CHECKERS as EVAL_CHECKERS
    from thinkahead.evals import get_eval_checker

    def choices(command) -> tuple[str, ...]:
        return tuple(next(p for p in command.params if p.name == "checker").type.choices)

    assert CHECKER_NAMES == ("math", "exact", "code")
    assert choices(bench) == CHECKER_NAMES
    assert choices(run_command) == (*CHECKER_NAMES, "none")
    assert set(CHECKER_NAMES) < set(EVAL_CHECKERS)
    for name in CHECKER_NAMES:
        assert type(get_eval_checker(name)) is CHECKERS[name]


# --------------------------------------------------------------------------- the workflow hands over its extractor


def _run(graph: StepGraph, small: ScriptedModel):
    rt = Runtime(small, ScriptedModel(outputs=["unused"], logprobs=JUDGE_YES), make_policy("specreason", **LLM_JUDGE))
    return asyncio.run(rt.run(graph, {"question": "What is 17 * 23?"}))


def _steps() -> ScriptedModel:
    return ScriptedModel(outputs=["17 * 23 = 340 + 51.\n\n", "Final answer: 391 (not \\boxed{999})."])


def _one_think(extractor) -> StepGraph:
    g = StepGraph("custom", inputs=["question"], output="answer", answer_extractor=extractor)
    g.add_think("answer", "{question}")
    g.add_sequence(START, "answer", END)
    return g


def test_the_runtime_uses_the_workflows_answer_extractor() -> None:
    seen: list[str] = []

    def after_final_answer(text: str) -> str | None:
        seen.append(text)
        return text.split("Final answer:")[-1].split()[0] if "Final answer:" in text else None

    result = _run(_one_think(after_final_answer), _steps())
    assert result.ok and result.answer == "391"
    assert seen == [result.outputs["answer_reasoning"]]
    # cot hands over the math extractor: the last box wins.
    assert cot().compile().answer_extractor is final_answer.extract_final_answer
    assert _run(cot(), _steps()).answer == "999"
    # No extractor: the text after the reasoning, here the last step, as written.
    assert _run(_one_think(None), _steps()).answer == "Final answer: 391 (not \\boxed{999})."


def test_the_runtime_imports_no_answer_format() -> None:
    tree = ast.parse((ROOT / "orchestrator" / "runtime.py").read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not any(module.startswith("thinkahead.verifiers") for module in imported)
    with pytest.raises(GraphError, match="answer_extractor must be a function"):
        StepGraph("g", answer_extractor="boxed")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- one step-verifier protocol


def test_every_built_in_step_verifier_is_a_step_verifier() -> None:
    from thinkahead.step_spec.specreason import SpecReason, SpecReasonOptions
    from thinkahead.verifiers.agreement import AgreementVerifier
    from thinkahead.verifiers.base import StepVerifier
    from thinkahead.verifiers.judge import LLMJudge
    from thinkahead.verifiers.likelihood import LikelihoodPRM

    model = ScriptedModel(outputs=["unused"])
    for verifier in (LLMJudge(model), AgreementVerifier(model), LikelihoodPRM(model)):
        assert isinstance(verifier, StepVerifier)
    assert not isinstance(object(), StepVerifier)
    # specreason builds its verifier from the settings, and each one is a StepVerifier
    for judge, cls in (("llm", LLMJudge), ("agreement", AgreementVerifier)):
        built = SpecReason(judge=judge).make_verifier(model)
        assert type(built) is cls and isinstance(built, StepVerifier)
    # the default: the agreement check behind the small model's confidence gate (issue 18's frontier)
    defaults = SpecReasonOptions()
    assert (defaults.judge, defaults.gate_logprob) == ("agreement", -0.1)
