"""Per-run policy state and the policy registry.

A policy object is a stateless spec shared by every run; each run starts its own stepper
(`policy.start(ctx)`), which owns the lookahead guess and the judge. Two concurrent runs of one
`SpecReason(lookahead=True)` must each reuse their own guesses, and each run's cost must be exactly
the calls it made. The registry drives the CLI choices and the config validation.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import threading

import pytest

from thinkahead.models import ScriptedModel
from thinkahead.orchestrator import Runtime
from thinkahead.step_spec.loop import StepLoop
from thinkahead.step_spec.policies import SpecReason
from thinkahead.workflows.cot import cot

from tests.llm_judge import LLM_JUDGE

PROBLEMS = {"a": "Problem alpha: what is 5 + 7?", "b": "Problem beta: what is 6 + 6?"}
STEPS = 3  # small steps before the final one


def judge_yes(prompt: str) -> dict[str, float]:
    return {"9": math.log(0.9), "2": math.log(0.1)}


def small_writer(prompt: str, request) -> str:
    """The same step texts for both problems: a guess of one run would fit the other run's reasoning."""
    k = prompt.count("STEP")
    return "So the answer is \\boxed{12}." if k >= STEPS else f"STEP small {k}.\n\n"


def models(delay_s: float = 0.02) -> tuple[ScriptedModel, ScriptedModel]:
    return (ScriptedModel(small_writer, name="small", delay_s=delay_s),
            ScriptedModel(["unused"], logprobs=judge_yes, name="large", delay_s=delay_s))


def calls_of(model: ScriptedModel, run: str, kind: str) -> int:
    return sum(1 for c in model.calls if c.kind == kind and PROBLEMS[run] in c.prompt)


def test_concurrent_runs_keep_their_own_lookahead_and_their_own_cost() -> None:
    small, large = models()
    policy = SpecReason(**LLM_JUDGE, lookahead=True)
    runtime = Runtime(small, large, policy, concurrency=2)
    results = asyncio.run(runtime.map(cot(), [(run, problem) for run, problem in PROBLEMS.items()]))
    by_id = {r.id: r for r in results}
    assert set(by_id) == set(PROBLEMS) and all(r.ok for r in results)
    for run, result in by_id.items():
        steps = [e["data"] for e in result.trace if e["kind"] == "step"]
        assert [s["verdict"] for s in steps] == ["accepted"] * (STEPS + 1)
        assert result.answer == "12"
        # every step was drafted once, by this run: each guess was this run's and was used (STEPS hits)
        assert calls_of(small, run, "generate") == STEPS + 1
        assert calls_of(large, run, "logprobs") == STEPS + 1  # one judge call a step, over this run's large model
        assert calls_of(large, run, "generate") == 0
        # the run paid for exactly its own calls: model calls, judge calls and the tokens its steps report
        cost = result.cost
        assert cost["model_calls"] == calls_of(small, run, "generate") + calls_of(large, run, "logprobs")
        assert cost["judge_calls"] == calls_of(large, run, "logprobs") == sum(s["judge_calls"] for s in steps)
        assert cost["tokens"].get("small", 0) == sum(s["tokens"]["small"] for s in steps)
        assert cost["attempts"] == cost["model_calls"]  # no call was cancelled half-way
    assert len(small.calls) == len(PROBLEMS) * (STEPS + 1)  # nothing drafted twice, nothing orphaned


def test_concurrent_step_loops_share_one_spec_and_count_their_own_hits() -> None:
    small, large = models()
    policy = SpecReason(**LLM_JUDGE, lookahead=True)

    async def both():
        loops = [StepLoop(small, large, policy) for _ in PROBLEMS]
        return await asyncio.gather(*(loop.run(problem) for loop, problem in zip(loops, PROBLEMS.values())))

    for result in asyncio.run(both()):
        assert [s.verdict for s in result.steps] == ["accepted"] * (STEPS + 1)
        assert [s.lookahead_hit for s in result.steps] == [False] + [True] * STEPS
    assert len(small.calls) == len(PROBLEMS) * (STEPS + 1)


def test_a_run_that_stops_early_cancels_its_pending_guess() -> None:
    from thinkahead.step_spec.loop import StepBudget

    small = ScriptedModel(small_writer, name="small", delay_s=0.2)  # the guess outlives the judging
    large = ScriptedModel(["12"], logprobs=judge_yes, name="large", delay_s=0.01)

    async def one():
        loop = StepLoop(small, large, SpecReason(**LLM_JUDGE, lookahead=True), budget=StepBudget(max_steps=1))
        result = await loop.run(PROBLEMS["a"])
        return result, asyncio.all_tasks() - {asyncio.current_task()}

    result, left = asyncio.run(one())
    assert result.stop_reason == "max_steps"
    # the guess for step 1 was started while step 0 was judged, and is gone when the run returns
    assert len(small.generated_prompts()) == 2 and left == set()


def test_a_given_judge_is_seen_over_each_runs_own_large_model() -> None:
    from thinkahead.verifiers.judge import LLMJudge

    small = ScriptedModel(small_writer, name="small", delay_s=0.01)
    large = ScriptedModel(["unused"], logprobs=[{"6": 0.0}], name="large", delay_s=0.01)
    policy = SpecReason(**LLM_JUDGE, verifier=LLMJudge(large, threshold=5.0))  # its own threshold: 6 passes (7 would not)
    results = asyncio.run(Runtime(small, large, policy, concurrency=2).map(cot(), list(PROBLEMS.items())))
    for result in results:
        steps = [e["data"] for e in result.trace if e["kind"] == "step"]
        assert [s["verdict"] for s in steps] == ["accepted"] * (STEPS + 1)
        assert result.cost["judge_calls"] == calls_of(large, result.id, "logprobs") == STEPS + 1
    assert policy.verifier.model is large  # the shared spec's judge was never rebound


def test_policies_stepped_by_hand_keep_their_state_per_context() -> None:
    from thinkahead.step_spec.state import StepContext

    small, large = models()
    policy = SpecReason(**LLM_JUDGE, lookahead=True)

    async def by_hand(problem: str) -> list[bool]:
        ctx = StepContext(problem, small, large)
        for _ in range(STEPS + 1):
            ctx.steps.append(await policy.next_step(ctx))
        return [s.lookahead_hit for s in ctx.steps]

    async def both():
        return await asyncio.gather(*(by_hand(p) for p in PROBLEMS.values()))

    assert asyncio.run(both()) == [[False] + [True] * STEPS] * len(PROBLEMS)


def test_an_object_with_only_next_step_still_steps() -> None:
    from thinkahead.step_spec.state import StepOutcome

    class Fixed:  # a policy written before start(ctx): no per-run state, so it may step as it is
        name = "fixed"

        async def next_step(self, ctx):
            return StepOutcome(text="Answer: 12", author="small", verdict="baseline")

    result = asyncio.run(StepLoop(*models(0.0), Fixed()).run(PROBLEMS["a"]))
    assert result.stop_reason == "answer" and result.steps[0].text == "Answer: 12"
    with pytest.raises(ValueError, match="start"):
        asyncio.run(StepLoop(*models(0.0), object()).run(PROBLEMS["a"]))


# ------------------------------------------------------------------ collect's pairs file


def test_two_collect_runs_append_whole_lines_to_one_pairs_file(tmp_path) -> None:
    from thinkahead.step_spec.loop import StepBudget
    from thinkahead.step_spec.policies import CollectPairs
    from thinkahead.verifiers.router_pairs import read_pairs

    pairs = tmp_path / "pairs.jsonl"

    def long_step(prompt: str, request) -> str:  # lines far over one write buffer
        return f"STEP {prompt.count('STEP')} " + "x" * 50000 + ".\n\n"

    small = ScriptedModel(long_step, logprobs=[{"a": 0.0}], name="small", delay_s=0.01)
    large = ScriptedModel(long_step, logprobs=judge_yes, name="large", delay_s=0.01)

    async def both():
        runs = [StepLoop(small, large, CollectPairs(pairs, problem_id=pid), budget=StepBudget(max_steps=3, max_tokens=None))
                for pid in PROBLEMS]
        return await asyncio.gather(*(loop.run(problem) for loop, problem in zip(runs, PROBLEMS.values())))

    asyncio.run(both())
    collected = read_pairs(pairs)
    assert sorted(p.problem_id for p in collected) == ["a"] * 3 + ["b"] * 3
    for pid in PROBLEMS:
        assert [p.step_index for p in collected if p.problem_id == pid] == [0, 1, 2]


def test_pairs_appended_from_threads_never_tear(tmp_path) -> None:
    from thinkahead.step_spec.routing import append_pairs
    from thinkahead.verifiers.router_features import RouterFeatures
    from thinkahead.verifiers.router_pairs import PairedStep

    path = tmp_path / "pairs.jsonl"
    features = RouterFeatures(step_index=0, prev_score=None, small_entropy=0.5, prev_step_tokens=0,
                              prev_had_reflection=False, problem_tokens=3)

    def writer(pid: str) -> None:
        for i in range(20):
            append_pairs(path, [PairedStep(pid, i, features, pid * 20000, "l", 1.0, 2.0)])

    threads = [threading.Thread(target=writer, args=(c,)) for c in "xyz"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 60 and all(json.loads(line)["small_text"] in ("x" * 20000, "y" * 20000, "z" * 20000)
                                    for line in lines)


# ------------------------------------------------------------------ the registry


def test_the_registry_drives_cli_choices_and_config_validation() -> None:
    from click.testing import CliRunner

    from thinkahead.cli import main, options

    reason = importlib.import_module("thinkahead.cli.reason")  # the package's `reason` is the command
    from thinkahead.config import OrchestratorConfig, PolicyConfig
    from thinkahead.step_spec.policies import ALL_POLICY_NAMES, POLICIES, POLICY_NAMES, make_policy

    assert tuple(POLICIES) == ALL_POLICY_NAMES and "collect" in ALL_POLICY_NAMES
    assert "collect" not in POLICY_NAMES and set(POLICY_NAMES) < set(ALL_POLICY_NAMES)  # not for batch runs
    assert options.POLICIES == POLICY_NAMES and reason.POLICIES == ALL_POLICY_NAMES
    # every batch policy's settings are fields of PolicyConfig, from the registry's options models
    for name in POLICY_NAMES:
        assert set(POLICIES[name].options.model_fields) <= set(PolicyConfig.model_fields)
    for bad in ({"name": "fast"}, "fast"):
        with pytest.raises(ValueError, match="unknown policy 'fast'; choose one of " + ", ".join(POLICY_NAMES)):
            OrchestratorConfig.model_validate({"policy": bad})
    with pytest.raises(ValueError, match="policy.treshold"):
        OrchestratorConfig.model_validate({"policy": {"name": "specreason", "treshold": 5}})
    with pytest.raises(ValueError, match="unknown policy 'collect'; choose one of " + ", ".join(POLICY_NAMES)):
        OrchestratorConfig.model_validate({"policy": {"name": "collect"}})
    with pytest.raises(ValueError, match="unknown step policy 'fast'; choose one of " + ", ".join(ALL_POLICY_NAMES)):
        make_policy("fast")
    with pytest.raises(ValueError, match=r"policy 'small'.*unknown option 'threshold'"):
        make_policy("small", threshold=5)
    # the config builds the named policy from its own settings; string and mapping forms both work
    assert OrchestratorConfig.model_validate({"policy": "reflect"}).policy.build().name == "reflect"
    built = OrchestratorConfig.model_validate({"policy": {"name": "specreason", "threshold": 5, "lookahead": True}})
    assert (built.policy.build().threshold, built.policy.build().lookahead) == (5.0, True)
    # another policy's settings are kept (the server switches names) and ignored by the named one
    large = OrchestratorConfig.model_validate({"policy": {"name": "large", "threshold": 5}}).policy
    assert large.threshold == 5.0 and large.build().name == "large"
    # the CLI lists the registry's names
    out = CliRunner().invoke(main, ["reason", "q", "--policy", "fast"])
    assert out.exit_code == 2 and all(name in out.output for name in ALL_POLICY_NAMES)
    out = CliRunner().invoke(main, ["run", "in.jsonl", "-o", "o.jsonl", "--policy", "collect"])
    assert out.exit_code == 2 and "'collect' is not one of" in out.output
    assert all(repr(name) in out.output for name in POLICY_NAMES)


def test_a_step_writes_at_most_what_the_token_budget_has_left() -> None:
    """The chain budget was checked only before each step, so the last step could write a whole
    `max_step_tokens` past `max_tokens` (238 tokens reported for max_tokens=200): each step's
    generation is now given at most the tokens the budget has left."""
    from thinkahead.step_spec.baselines import SingleModel
    from thinkahead.step_spec.loop import StepBudget

    words = " ".join(f"w{i}" for i in range(40))
    small = ScriptedModel([f"{words}\n\n"] * 8, name="small")
    large = ScriptedModel(["7}"], name="large")
    loop = StepLoop(small, large, SingleModel(tier="small"), budget=StepBudget(max_tokens=50, max_steps=8))
    result = asyncio.run(loop.run("What is 3 + 4?"))
    asked = [c.request.max_new_tokens for c in small.calls if c.kind == "generate"]
    assert asked[0] == 50 and asked[1] == 10, asked  # 40 written, 10 left for the second step
    chain = [s for s in result.steps if s.verdict != "final"]
    assert sum(s.tokens["small"] for s in chain) == 50 and result.stop_reason == "max_tokens"
    # the forced final answer comes after, within its own `final_answer_tokens` (the server caps what it reports)
    assert result.steps[-1].verdict == "final" and result.steps[-1].tokens["small"] <= StepBudget().final_answer_tokens
