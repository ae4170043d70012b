"""The built-in workflows end to end on scripted models: real prompts, real answers, real loops."""

from __future__ import annotations

import asyncio
import time

import pytest

from thinkahead.models import ScriptedModel
from thinkahead.orchestrator import END, START, GraphError, Runtime, StepGraph
from thinkahead.step_spec.policies import make_policy
from thinkahead.workflows import build_workflow, cot, pipeline, react, refine, vote
from thinkahead.workflows.react import parse_turn
from thinkahead.workflows.tools import calculator
from thinkahead.workflows.vote import majority, majority_decided

from tests.llm_judge import LLM_JUDGE

JUDGE_YES = [{"9": -0.05}]


def run(graph, question, small=None, large=None, policy="specreason"):
    small = small or ScriptedModel(outputs=["unused"])
    large = large or ScriptedModel(outputs=["unused"], logprobs=JUDGE_YES)
    rt = Runtime(small, large, make_policy(policy, **(LLM_JUDGE if policy == "specreason" else {})))
    return asyncio.run(rt.run(graph, {"question": question}))


def test_cot_keeps_accepted_small_steps_and_returns_the_boxed_answer():
    small = ScriptedModel(outputs=["17 * 23 = 17 * 20 + 17 * 3 = 340 + 51.\n\n", "So the answer is \\boxed{391}."])
    result = run(cot(), "What is 17 * 23?", small=small)
    assert result.ok and result.answer == "391"
    assert [s["data"]["author"] for s in result.steps()] == ["small", "small"]
    assert "340 + 51" in result.outputs["answer_reasoning"]


def test_calculator_is_safe_and_exact():
    assert calculator("17*23") == "391"
    assert calculator("1,000 / 8") == "125"
    assert calculator("2^10") == "1024"
    assert calculator("sqrt(16) + 1") == "5"
    assert calculator("__import__('os').system('x')").startswith("error:")
    assert calculator("1/0").startswith("error:")


def test_parse_turn():
    assert parse_turn("Thought: go\nAction: calculator[3 * (4 + 5)]") == ("calculator", "3 * (4 + 5)")
    assert parse_turn("Thought: done\nFinal Answer: 27") == "27"
    assert parse_turn("Thought: hmm") is None


def test_react_calls_the_tool_and_feeds_the_observation_back():
    large = ScriptedModel(outputs=[" I need the product.\nAction: calculator[17*23]\n",
                                   " The tool says 391.\nFinal Answer: 391"])
    result = run(react(), "What is 17 * 23?", large=large)
    assert result.ok and result.answer == "391"
    second_prompt = large.generated_prompts()[1]
    assert "Action: calculator[17*23]\nObservation: 391\nThought:" in second_prompt
    assert large.calls[0].request.stop == ["Observation:"]
    assert result.outputs["observe"]["calls"] == 1


def test_react_prompts_extend_the_previous_prompt_and_output_exactly():
    # The next turn's prompt is the last prompt + the model's text as generated (leading space
    # included) + the observation, so KV prefixes and session suffix trees continue, not rebuild.
    outputs = [" I need the product.\nAction: calculator[17*23]\n", " Add one.\nAction: calculator[391+1]\n",
               " Done.\nFinal Answer: 392"]
    large = ScriptedModel(outputs=outputs)
    result = run(react(), "What is 17 * 23 + 1?", large=large)
    assert result.ok and result.answer == "392"
    prompts = large.generated_prompts()
    for turn in range(2):
        assert prompts[turn + 1].startswith(prompts[turn] + outputs[turn])


def test_react_reports_unknown_tools_and_is_bounded():
    large = ScriptedModel(outputs=[" try\nAction: search[weather]"])
    result = run(react(max_turns=3), "q", large=large)
    assert result.ok and result.answer is None  # never answered: bounded at 3 turns
    assert len(large.calls) == 3
    assert "Observation: error: unknown tool 'search'; tools: calculator" in large.generated_prompts()[1]


def test_refine_rewrites_until_the_critique_finds_nothing():
    solver = ScriptedModel(outputs=["17 * 23 = 381, so \\boxed{381}", "17 * 23 = 391, so \\boxed{391}"])
    critic = ScriptedModel(outputs=["The product is wrong: 17 * 3 = 51, not 41.", "NO ERRORS"])
    result = run(refine(rounds=4), "What is 17 * 23?", small=critic, large=solver)
    assert result.ok and result.answer == "391"
    assert result.outputs["rounds_iterations"] == 1  # stopped early: the second critique found nothing
    rewrite_prompt = solver.generated_prompts()[1]
    assert "17 * 23 = 381" in rewrite_prompt and "not 41" in rewrite_prompt
    assert len(solver.calls) == 2 and len(critic.calls) == 2


def test_vote_takes_the_majority_of_sampled_chains():
    def by_seed(prompt, request):
        return {0: "\\boxed{391}", 1: "\\boxed{381}", 2: "\\boxed{391}"}[request.seed]

    small = ScriptedModel(outputs=by_seed)
    result = run(vote(n=3), "What is 17 * 23?", small=small)
    assert result.ok and result.answer == "391"
    assert sorted((c.request.seed, c.request.temperature) for c in small.calls) == [(0, 0.7), (1, 0.7), (2, 0.7)]
    assert majority(["12", " 12", "13", None]) == "12"
    assert majority([]) is None


class SlowSeeds(ScriptedModel):
    """A scripted model whose chains take a time that depends on their seed."""

    delays: dict = {}

    async def generate(self, request):
        await asyncio.sleep(self.delays.get(request.seed, 0.0))
        return await super().generate(request)


@pytest.mark.parametrize("early_stop", [True, False])
def test_vote_stops_once_the_finished_chains_decide_the_majority(early_stop) -> None:
    answers = {0: "\\boxed{391}", 1: "\\boxed{391}", 2: "\\boxed{381}", 3: "\\boxed{391}", 4: "\\boxed{381}"}
    small = SlowSeeds(outputs=lambda prompt, request: answers[request.seed])
    small.delays = {1: 0.05, 2: 0.1, 3: 0.15, 4: 1.5}  # 391 leads 3 to 1 with one chain out: decided
    start = time.perf_counter()
    result = run(vote(n=5, early_stop=early_stop), "What is 17 * 23?", small=small)
    wall = time.perf_counter() - start
    assert result.ok and result.answer == "391"  # what all five give: 391 three times, 381 twice
    ends = {e["node"]: e["data"] for e in result.trace if e["kind"] == "node_end"}
    if early_stop:
        assert wall < 1.2
        assert ends["chain_4"]["status"] == "cancelled"
        assert "'answer' was decided by 'chain_0', 'chain_1', 'chain_2', 'chain_3'" in ends["chain_4"]["reason"]
        assert (ends["answer"]["decided_by"], ends["answer"]["of"]) == (4, 5)
    else:
        assert wall >= 1.5
        assert all(ends[f"chain_{i}"]["status"] == "ok" for i in range(5)) and "decided_by" not in ends["answer"]


def test_majority_is_decided_only_when_the_rest_cannot_change_it() -> None:
    assert majority_decided(["1", " 1", "1"], 2)  # 3 against at most 2
    assert not majority_decided(["1", "1"], 3)  # 2 against a possible 3
    assert not majority_decided(["1", "1", "2"], 1)  # 2 against a possible 2: a tie goes to the first seen
    assert majority_decided(["1", "1", "2"], 0)
    assert majority_decided(["\\frac12", "\\frac{1}{2}", None, ""], 1)  # equal once normalized; no answer: no vote
    assert not majority_decided([None, ""], 0) and not majority_decided([], 0)


def test_a_join_given_first_and_decided_is_refused_and_a_failing_decided_fails_its_run() -> None:
    g = StepGraph("bad", inputs=["question"], output="answer")
    with pytest.raises(GraphError, match="give `first` or `decided`, not both"):
        g.add_join("answer", first=True, decided=majority_decided)
    g = StepGraph("broken", inputs=["question"], output="answer")
    g.add_fork("fork")
    g.add_join("answer", decided=lambda answers, remaining: 1 / 0)
    g.add_edge(START, "fork")
    for i in range(2):

        async def branch(state, delay=0.2 * i):
            await asyncio.sleep(delay)
            return "x"

        g.add_tool(f"b{i}", branch)
        g.add_edge("fork", f"b{i}")
        g.add_edge(f"b{i}", "answer")
    g.add_edge("answer", END)
    result = run(g, "q")
    assert not result.ok and "node 'answer' (join): its `decided` failed: ZeroDivisionError" in result.error


def test_vote_first_returns_the_first_finished_chain():
    result = run(vote(n=2, mode="first"), "q", small=ScriptedModel(outputs=["\\boxed{5}"]))
    assert result.ok and result.answer == "5"
    with pytest.raises(GraphError, match="vote mode must be one of"):
        vote(mode="best")
    with pytest.raises(GraphError, match="vote's early_stop must be true or false, got 'no'"):
        vote(early_stop="no")


def test_bad_workflow_options_are_refused_at_build_time_naming_the_node():
    with pytest.raises(GraphError, match=r"node 'answer': max_steps must be > 0, got 0"):
        cot(max_steps=0)
    with pytest.raises(GraphError, match=r"node 'chain_0': temperature must be >= 0, got -1"):
        vote(temperature=-1)
    with pytest.raises(ValueError, match=r"node 'solve': max_tokens must be > 0, got 0"):
        build_workflow("refine", max_tokens=0)
    with pytest.raises(GraphError, match=r"node 'turns': max_iters must be > 0, got 0"):
        react(max_turns=0)


def test_pipeline_checker_overrides_a_wrong_solution():
    large = ScriptedModel(outputs=["1. multiply", "VERDICT: wrong. The answer is \\boxed{391}."], logprobs=JUDGE_YES)
    small = ScriptedModel(outputs=["17 * 23 = 381, so \\boxed{381}"])
    result = run(pipeline(), "What is 17 * 23?", small=small, large=large)
    assert result.ok and result.answer == "391"
    assert result.outputs["solution"] == "381"
    assert "Follow this plan:\n1. multiply" in small.generated_prompts()[0]


def test_build_workflow_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown workflow 'tot'"):
        build_workflow("tot")
    with pytest.raises(ValueError, match="bad options for workflow 'cot'"):
        build_workflow("cot", rounds=3)


def test_refine_can_run_every_round_regardless_of_the_critique():
    solver = ScriptedModel(outputs=["\\boxed{391}"])
    critic = ScriptedModel(outputs=["NO ERRORS"])
    result = run(refine(rounds=2, stop_early=False), "What is 17 * 23?", small=critic, large=solver)
    assert result.ok and result.answer == "391"
    assert result.outputs["rounds_iterations"] == 2
    assert len(solver.calls) == 3 and len(critic.calls) == 3  # solve + 2 rewrites; 3 critiques
