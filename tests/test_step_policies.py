"""Step policies and the step loop on scripted models: decisions, accounting, stops and budgets."""

from __future__ import annotations

import asyncio
import math

import pytest

from thinkahead.models import ScriptedModel
from thinkahead.step_spec.loop import StepBudget, StepLoop
from thinkahead.step_spec.policies import SpecReason, make_policy
from thinkahead.step_spec.segment import SegmentConfig
from thinkahead.verifiers.judge import judge_messages, score_from_logprobs

from tests.llm_judge import LLM_JUDGE


def digits(score: int) -> dict[str, float]:
    """Judge logprobs that put 90% on `score`."""
    out = {str(d): math.log(0.1 / 9) for d in range(10) if d != score}
    out[str(score)] = math.log(0.9)
    return out


def small_steps(n: int, final: str = "So the answer is \\boxed{12}.") -> list[str]:
    return [f"small step {i}: add {i} and {i}.\n\nleftover" for i in range(n)] + [final]


def run(loop: StepLoop, problem: str = "What is 5 + 7?"):
    return asyncio.run(loop.run(problem))


def test_baselines_write_every_step_with_one_model() -> None:
    small = ScriptedModel(small_steps(2), name="small")
    large = ScriptedModel(["unused"], name="large")
    result = run(StepLoop(small, large, make_policy("small")))
    assert [s.author for s in result.steps] == ["small"] * 3
    assert result.stop_reason == "answer" and "\\boxed{12}" in result.answer
    # the delimiter is kept and the text past it dropped; steps concatenate into the reasoning
    assert result.steps[0].text == "small step 0: add 0 and 0.\n\n"
    assert result.reasoning == "".join(s.text for s in result.steps)
    assert large.calls == [] and result.small_share == 1.0
    # every call continues the reasoning so far, with the blank line as the stop string
    second = small.calls[1]
    assert second.request.messages[-1] == {"role": "assistant", "content": result.steps[0].text}
    assert second.request.continue_final and second.request.stop[0] == "\n\n"


def test_specreason_accepts_at_threshold_and_rewrites_below() -> None:
    small = ScriptedModel(small_steps(3), name="small")
    large = ScriptedModel(["large rewrite of step 1.\n\n"], logprobs=[digits(8), digits(3), digits(7), digits(9)])
    result = run(StepLoop(small, large, SpecReason(**LLM_JUDGE, threshold=7)))
    verdicts = [(s.author, s.verdict, s.score) for s in result.steps]
    assert verdicts == [
        ("small", "accepted", 8.0), ("large", "rejected", 3.0), ("small", "accepted", 7.0), ("small", "accepted", 9.0),
    ]
    rejected = result.steps[1]
    assert rejected.discarded == "small step 1: add 1 and 1.\n\n"
    assert rejected.tokens["small"] == 7 and rejected.tokens["large"] == 5  # the discarded draft is counted
    assert result.judge_calls == 4 and result.large_calls == 5
    assert result.small_share == 0.75
    # the judge prompt continues the generation prefix: reasoning so far + the draft, then the question
    judge_prompt = [c.prompt for c in large.calls if c.kind == "logprobs"][1]
    assert result.steps[0].text + "small step 1" in judge_prompt and "single digit" in judge_prompt


def test_specreason_forces_first_steps_and_expected_scores() -> None:
    small = ScriptedModel(small_steps(2), name="small")
    large = ScriptedModel(["large opening.\n\n"], logprobs=[{"6": math.log(0.5), "9": math.log(0.5)}])
    result = run(StepLoop(small, large, SpecReason(**LLM_JUDGE, threshold=7, score_mode="expected", first_large_steps=1)))
    assert result.steps[0].verdict == "forced" and result.steps[0].author == "large"
    assert result.steps[1].score == pytest.approx(7.5) and result.steps[1].verdict == "accepted"


def counting_small(prompt, request):
    k = prompt.count("STEP")
    return "So the answer is \\boxed{12}." if k >= 3 else f"STEP small {k}.\n\n"


def counting_large(prompt, request):
    return f"STEP large {prompt.count('STEP')}.\n\n"


def judge_rejects_small_1(prompt):
    last_step = prompt.rsplit("STEP", 1)[-1]
    return digits(2) if last_step.startswith(" small 1.") else digits(9)


def test_lookahead_drafts_next_step_during_judging_and_drops_it_on_rejection() -> None:
    def models(delay):
        return (ScriptedModel(counting_small, name="small", delay_s=delay),
                ScriptedModel(counting_large, logprobs=judge_rejects_small_1, name="large", delay_s=delay))

    plain = run(StepLoop(*models(0.0), SpecReason(**LLM_JUDGE)))
    small, large = models(0.02)
    ahead = run(StepLoop(small, large, SpecReason(**LLM_JUDGE, lookahead=True)))
    assert [s.text for s in ahead.steps] == [s.text for s in plain.steps]
    assert [s.verdict for s in ahead.steps] == ["accepted", "rejected", "accepted", "accepted"]
    # a guess continued the draft "STEP small 1." while it was judged, and was thrown away
    guesses = [p for p in small.generated_prompts() if "STEP small 1." in p]
    assert guesses and "STEP small 1." not in ahead.reasoning
    # accepted drafts were reused: the small model wrote no step twice
    assert len(small.generated_prompts()) == len(plain.steps) + 1


def test_reflect_hands_reflection_steps_to_large() -> None:
    small = ScriptedModel(["First, 5 + 7 = 12.\n\n", "Wait, let me double check that.\n\n", "Answer: 12"], name="small")
    large = ScriptedModel(["Checking: 7 + 5 = 12 as well.\n\n"], name="large")
    result = run(StepLoop(small, large, make_policy("reflect")))
    assert [(s.author, s.verdict) for s in result.steps] == [("small", "baseline"), ("large", "reflection"), ("small", "baseline")]
    assert result.steps[1].discarded.startswith("Wait")


def thinking_then(answer: str, name: str) -> ScriptedModel:
    """Writes "thinking i more." steps; asked for the boxed answer (stop at "}"), goes on with `answer`
    from wherever the prompt's box leaves off, as a real model continuing the text would."""
    steps = iter(range(1000))

    def respond(prompt: str, request) -> str:
        if request.stop == ["}"]:
            so_far = prompt.rsplit("\\boxed{", 1)[1]
            return answer[len(so_far):]
        return f"thinking {next(steps)} more.\n\n"

    return ScriptedModel(respond, name=name)


def test_budgets_stop_and_force_an_answer() -> None:
    small = thinking_then("unused", name="small")
    large = thinking_then("42", name="large")
    result = run(StepLoop(small, large, SpecReason(**LLM_JUDGE), budget=StepBudget(max_steps=3)))
    assert result.stop_reason == "max_steps"
    assert len(result.steps) == 4 and result.steps[-1].verdict == "final"
    assert result.steps[-1].text.endswith("\\boxed{42}") and result.steps[-1].author == "large"
    assert large.calls[-1].request.stop == ["}"]
    small = ScriptedModel([f"thinking {i} more and more.\n\n" for i in range(50)], name="small")
    result = run(StepLoop(small, ScriptedModel(["7"]), make_policy("small"), budget=StepBudget(max_tokens=10)))
    assert result.stop_reason == "max_tokens" and len(result.steps) == 3  # 5 tokens a step


def test_large_call_cap_and_repetition_stop() -> None:
    large = ScriptedModel([f"large step {i} here.\n\n" for i in range(10)] + ["9"], logprobs=[digits(1)])
    small = ScriptedModel(small_steps(8), name="small")
    result = run(StepLoop(small, large, SpecReason(**LLM_JUDGE), budget=StepBudget(max_large_calls=4)))
    assert result.stop_reason == "max_large_calls"  # each rejected step costs a judge call and a rewrite
    repeating = ScriptedModel(["Let me add them.\n\n", "Let me add them.\n\n", "never"], name="small")
    result = run(StepLoop(repeating, ScriptedModel(["12"]), make_policy("small")))
    assert result.stop_reason == "repetition" and len(result.steps) == 3


def test_stray_end_of_thinking_ends_the_loop() -> None:
    small = ScriptedModel(["We add.\n\n", "5 + 7 = 12</think>The answer is 12."], name="small")
    result = run(StepLoop(small, ScriptedModel(["12"]), make_policy("small"), segment=SegmentConfig()))
    assert result.steps[1].kind == "end_think" and result.steps[1].ends_response
    assert result.stop_reason == "end"


def test_score_parsing_and_judge_messages() -> None:
    assert score_from_logprobs({" 8": math.log(0.6), "8": math.log(0.1), "3": math.log(0.3)}, "greedy") == (8.0, pytest.approx(1.0))
    assert score_from_logprobs({"yes": -0.1}, "greedy") == (0.0, 0.0)
    msgs = judge_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a\n\n"}], "b\n\n")
    assert msgs[1] == {"role": "assistant", "content": "a\n\nb\n\n"} and msgs[-1]["content"] == "Score: "


def test_bad_policy_configs() -> None:
    with pytest.raises(ValueError, match="unknown step policy 'fast'"):
        make_policy("fast")
    with pytest.raises(ValueError, match="threshold"):
        SpecReason(**LLM_JUDGE, threshold=12)  # checked when the policy is built, not when a run first judges
    with pytest.raises(ValueError, match="first_large_steps"):
        SpecReason(**LLM_JUDGE, first_large_steps=-1)
    with pytest.raises(ValueError, match="max_steps"):
        StepBudget(max_steps=0)
    with pytest.raises(ValueError, match="problem"):
        run(StepLoop(ScriptedModel(), ScriptedModel(), make_policy("small")), problem="  ")


def test_arbitrage_routes_before_drafting() -> None:
    from thinkahead.step_spec.policies import Arbitrage
    from thinkahead.verifiers.router import HeuristicRouter

    confident = {"The": 0.0}  # entropy 0: the small model is sure
    unsure = {str(d): math.log(0.1) for d in range(10)}  # entropy ln 10 > 2
    small = ScriptedModel(["small step a.\n\n", "Answer: 12"], logprobs=[confident, unsure, confident], name="small")
    large = ScriptedModel(["large step b.\n\n"], name="large")
    result = run(StepLoop(small, large, Arbitrage(HeuristicRouter(entropy_threshold=2.0))))
    assert [(s.author, s.verdict) for s in result.steps] == [("small", "routed"), ("large", "routed"), ("small", "routed")]
    assert result.steps[1].route_p > 0.5 > result.steps[0].route_p
    assert result.judge_calls == 0 and len(large.calls) == 1  # no draft was written and thrown away


def test_collect_pairs_then_train_a_router(tmp_path) -> None:
    from thinkahead.step_spec.policies import CollectPairs
    from thinkahead.verifiers.router import LogisticRouter
    from thinkahead.verifiers.router_pairs import read_pairs, train_router

    pairs = tmp_path / "pairs.jsonl"

    def large_judge(prompt):  # the large model's own steps score 9, the small model's 2 or 8
        last = prompt.rsplit("STEP", 1)[-1]
        return digits(9) if last.startswith(" large") else digits(2 if " 1." in last[:9] else 8)

    for pid in ("p1", "p2"):
        # the small model is unsure exactly where it later writes the weak step
        unsure = lambda p: {str(d): math.log(0.1) for d in range(10)} if p.count("STEP") == 1 else {"a": 0.0}  # noqa: E731
        small = ScriptedModel(counting_small, logprobs=unsure, name="small")
        large = ScriptedModel(counting_large, logprobs=large_judge, name="large")
        policy = CollectPairs(pairs, problem_id=pid, score_mode="greedy")
        result = run(StepLoop(small, large, policy, budget=StepBudget(max_steps=3)))
        assert [s.verdict for s in result.steps[:3]] == ["collected"] * 3
        assert result.judge_calls == 6
    collected = read_pairs(pairs)
    assert len(collected) == 6 and {p.problem_id for p in collected} == {"p1", "p2"}
    assert [(p.step_index, p.small_score, p.large_score) for p in collected[:3]] == [(0, 8.0, 9.0), (1, 2.0, 9.0), (2, 8.0, 9.0)]
    report = train_router(pairs, tmp_path / "router.json", margin=1.0)
    assert report["n"] == 6 and report["positives"] == 2
    router = LogisticRouter.load(tmp_path / "router.json")
    assert router.route(collected[1].features)[0] == "large" and router.route(collected[0].features)[0] == "small"


def test_likelihood_prm_scores_and_plugs_into_specreason() -> None:
    from thinkahead.verifiers.likelihood import LikelihoodPRM

    class Scoring(ScriptedModel):
        async def continuation_logprobs(self, prompt, continuation):
            return [math.log(0.9)] * 3 if "good" in continuation else [math.log(0.1)] * 3

    small = ScriptedModel(["a good step.\n\n", "a bad step.\n\n", "Answer: 1"], name="small")
    large = Scoring(["large step.\n\n"], name="large")
    result = run(StepLoop(small, large, SpecReason(**LLM_JUDGE, verifier=LikelihoodPRM(large, threshold=3.0))))
    assert [(s.author, s.verdict, round(s.score, 2)) for s in result.steps[:2]] == [
        ("small", "accepted", 8.1), ("large", "rejected", 0.9)]
    assert result.steps[1].discarded == "a bad step.\n\n"
    with pytest.raises(ValueError, match="threshold"):
        LikelihoodPRM(large, threshold=10)


class AgreeingModel(ScriptedModel):
    """Scores continuations word by word: the model prefers another token by `gaps[word]` nats."""

    def __init__(self, outputs, gaps: dict[str, float], fixes: dict[str, str] | None = None, **kw) -> None:
        super().__init__(outputs, **kw)
        self.gaps = gaps
        self.fixes = fixes or {}  # word -> the model's own token in its place
        self.scored: list[str] = []

    async def continuation_scores(self, prompt, continuation):
        import re

        from thinkahead.models.base import TokenScore

        self.scored.append(continuation)
        words = re.findall(r"\s*\S+|\s+", continuation)
        return [TokenScore(w, -0.1 - self.gaps.get(w.strip(), 0.0), -0.1, self.fixes.get(w.strip(), w)) for w in words]


def test_agreement_judge_checks_digits_and_repairs_from_the_first_disagreement() -> None:
    from thinkahead.verifiers.agreement import AgreementVerifier

    # "41" is a wrong product the large model disagrees with; "sum" is a wording difference
    small = ScriptedModel(["17 * 3 = 51, the sum.\n\n", "17 * 2 = 41 so far.\n\n", "Answer: 85"], name="small")
    large = AgreeingModel([" 34 so far.\n\n"], gaps={"41": 3.0, "sum.": 2.0}, name="large")
    result = run(StepLoop(small, large, SpecReason(gate_logprob=None, judge="agreement", margin=1.0)))
    steps = [(s.author, s.verdict, s.text) for s in result.steps]
    assert steps[:2] == [("small", "accepted", "17 * 3 = 51, the sum.\n\n"),
                         ("large", "repaired", "17 * 2 = 34 so far.\n\n")]
    repaired = result.steps[1]
    assert repaired.discarded == " 41 so far.\n\n" and round(repaired.score, 3) == round(9 * math.exp(-3.0), 3)
    assert repaired.tokens == {"small": 7, "large": 3}  # the whole draft, and the large model's rest
    # the large model continued the kept start of the draft, not the step boundary
    assert large.calls[-1].request.messages[-1]["content"] == "17 * 3 = 51, the sum.\n\n17 * 2 ="
    assert result.judge_calls == 3 and "85" in result.answer
    # checking every token fails the wording step too; nothing before its first token: a full rewrite
    all_tokens = AgreementVerifier(large, margin=1.0, word_margin=1.0)
    verdict = asyncio.run(all_tokens.judge([{"role": "user", "content": "q"}], "sum. 17"))
    assert not verdict.accept and verdict.details["keep_chars"] == 0
    loose_words = AgreementVerifier(large, margin=1.0, word_margin=3.0)  # wording may trail by 3 nats, digits by 1
    assert asyncio.run(loose_words.judge([{"role": "user", "content": "q"}], "sum. 17")).accept
    assert not asyncio.run(loose_words.judge([{"role": "user", "content": "q"}], "sum. 41")).accept
    for bad in ({"margin": 0}, {"margin": "1"}, {"word_margin": 0}):
        with pytest.raises(ValueError, match="agreement"):
            AgreementVerifier(large, **bad)
    with pytest.raises(ValueError, match="judge must be one of llm, agreement"):
        SpecReason(judge="prm")
    with pytest.raises(ValueError, match="specreason repair must be one of step, token, got 'word'"):
        SpecReason(**LLM_JUDGE, repair="word")


def test_token_repair_fixes_one_token_and_lets_the_small_model_go_on() -> None:
    # "41" is wrong: the large model puts its own " 34" there and the small model drafts the rest
    small = ScriptedModel(["17 * 2 = 41 so far.\n\n", " so far.\n\n", "Answer: 34"], name="small")
    large = AgreeingModel([], gaps={"41": 3.0}, fixes={"41": " 34"}, name="large")
    policy = SpecReason(gate_logprob=None, judge="agreement", word_margin=1.0, margin=1.0, repair="token")
    result = run(StepLoop(small, large, policy))
    first = result.steps[0]
    assert (first.author, first.verdict, first.text) == ("small", "corrected", "17 * 2 = 34 so far.\n\n")
    assert first.tokens == {"small": 7 + 2, "large": 1} and first.judge_calls == 2
    assert first.discarded == " 41 so far.\n\n"
    assert small.calls[1].request.messages[-1]["content"] == "17 * 2 = 34"  # the draft goes on after the fix
    assert large.scored[:2] == ["17 * 2 = 41 so far.\n\n", " so far.\n\n"]
    assert not large.calls  # the large model never generated: its token came from the verify pass
    assert "34" in result.answer and result.steps[1].verdict == "accepted"


def test_token_repair_ends_the_step_where_the_correction_does_and_falls_back_to_the_large_model() -> None:
    # the large model would end the step after "5": its token closes the step, nothing more is drafted
    small = ScriptedModel(["The total is 5 and more.\n\n", "Answer: 5"], name="small")
    large = AgreeingModel([], gaps={"and": 2.0}, fixes={"and": ".\n\n"}, name="large")
    result = run(StepLoop(small, large, SpecReason(gate_logprob=None, judge="agreement", word_margin=1.0, repair="token")))
    assert (result.steps[0].verdict, result.steps[0].text) == ("corrected", "The total is 5.\n\n")
    assert len(small.calls) == 2 and result.steps[1].text == "Answer: 5"
    # every redraft fails again: after max_corrections fixes the large model writes the rest of the step
    small = ScriptedModel(["a bad1 b\n\n", " bad2 c\n\n", "Answer: 3"], name="small")
    large = AgreeingModel([" done.\n\n"], gaps={"bad1": 3.0, "bad2": 3.0}, fixes={"bad1": " ok1", "bad2": " ok2"},
                          name="large")
    result = run(StepLoop(small, large, SpecReason(gate_logprob=None, judge="agreement", word_margin=1.0, repair="token", max_corrections=1)))
    first = result.steps[0]
    assert (first.author, first.verdict, first.text) == ("large", "corrected", "a ok1 done.\n\n")
    assert first.tokens == {"small": 3 + 2, "large": 1 + 1} and first.judge_calls == 2
    assert large.calls[0].request.messages[-1]["content"] == "a ok1"
    for bad in ({"repair": "word"}, {"max_corrections": 0}):
        with pytest.raises(ValueError, match="repair|max_corrections"):
            SpecReason(gate_logprob=None, judge="agreement", **bad)


def test_router_train_command(tmp_path) -> None:
    from click.testing import CliRunner

    from thinkahead.cli import main
    from thinkahead.verifiers.router_features import RouterFeatures
    from thinkahead.verifiers.router_pairs import PairedStep, write_pairs

    pairs = []
    for i in range(12):
        weak = i % 3 == 0  # the small model is unsure on these steps and writes a worse one
        features = RouterFeatures(step_index=i % 4, prev_score=7.0, small_entropy=3.0 if weak else 0.2,
                                  prev_step_tokens=20, prev_had_reflection=False, problem_tokens=40)
        pairs.append(PairedStep("p", i, features, "s", "l", 2.0 if weak else 8.0, 9.0))
    write_pairs(tmp_path / "pairs.jsonl", pairs)
    out = CliRunner().invoke(main, ["router", "train", str(tmp_path / "pairs.jsonl"), "-o", str(tmp_path / "r.json")])
    assert out.exit_code == 0, out.output
    assert '"positives": 4' in out.output and (tmp_path / "r.json").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    out = CliRunner().invoke(main, ["router", "train", str(bad), "-o", str(tmp_path / "x.json")])
    assert out.exit_code != 0 and "bad.jsonl:1" in out.output


def test_reason_command_rejects_bad_options_before_loading_models() -> None:
    from click.testing import CliRunner

    from thinkahead.cli import main

    out = CliRunner().invoke(main, ["reason", "What is 2+2?", "--policy", "collect"])
    assert out.exit_code == 2 and "--pairs" in out.output
    out = CliRunner().invoke(main, ["reason", "What is 2+2?", "--max-steps", "0"])
    assert out.exit_code == 2 and "max_steps" in out.output


def test_forced_answer_keeps_nested_braces() -> None:
    """The box closes at the brace that balances it, not at the first "}" (`\\frac{1}{2}` was cut to `\\frac{1}`)."""
    small = thinking_then("unused", name="small")
    large = thinking_then("\\frac{1}{2}} and more text", name="large")
    result = run(StepLoop(small, large, SpecReason(**LLM_JUDGE), budget=StepBudget(max_steps=2)))
    final = result.steps[-1]
    assert final.text == "Therefore, the final answer is \\boxed{\\frac{1}{2}}"
    assert [c.request.stop for c in large.calls if c.kind == "generate"][-3:] == [["}"]] * 3
    assert final.tokens["large"] == 2  # "\\frac{1" and "{2" (scripted tokens are words)


def test_forced_answer_budget_bounds_the_continuations() -> None:
    small = thinking_then("unused", name="small")
    large = thinking_then("{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{}", name="large")
    budget = StepBudget(max_steps=1, final_answer_tokens=3)
    result = run(StepLoop(small, large, SpecReason(**LLM_JUDGE), budget=budget))
    assert result.steps[-1].verdict == "final" and result.steps[-1].tokens["large"] <= 3


def test_small_policy_writes_its_own_forced_answer() -> None:
    small = thinking_then("12", name="small")
    large = ScriptedModel(["unused"], name="large")
    result = run(StepLoop(small, large, make_policy("small"), budget=StepBudget(max_steps=2)))
    final = result.steps[-1]
    assert final.author == "small" and final.text.endswith("\\boxed{12}")
    assert large.calls == [] and result.large_calls == 0


def test_judge_reads_ascii_digits_only() -> None:
    """'²'.isdigit() is True and int('²') raises: a real SmolLM2 judge call failed this way."""
    logprobs = {"²": math.log(0.5), "٣": math.log(0.1), "7": math.log(0.4)}
    score, mass = score_from_logprobs(logprobs, "greedy")
    assert score == 7.0 and math.isclose(mass, 0.4)
    assert score_from_logprobs({"²": 0.0}, "expected") == (0.0, 0.0)
