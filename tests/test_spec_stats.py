"""`SpecStats` travels typed from the decoder to the run's cost, and says one accept length everywhere."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.tiny_models import VOCAB
from thinkahead.models import LocalModel, ScriptedModel
from thinkahead.models.base import Completion
from thinkahead.orchestrator.budget import Meter, MeteredModel, RetryPolicy, RunBudget
from thinkahead.step_spec.loop import StepBudget, StepLoop
from thinkahead.step_spec.policies import make_policy
from thinkahead.step_spec.segment import SegmentConfig
from thinkahead.token_spec.stats import SpecStats


def test_sum_views_and_the_one_accept_length() -> None:
    a = SpecStats(completion_tokens=10, spec_verify_ct=4, spec_num_proposed_drafts=9, spec_num_correct_drafts=7,
                  draft_time_s=0.5, verify_time_s=1.0, prefill_time_s=0.25)
    b = SpecStats(completion_tokens=6, spec_verify_ct=2, spec_num_proposed_drafts=3, spec_num_correct_drafts=3)
    total = a + b + SpecStats()  # a backend without speculation adds nothing
    assert (total.completion_tokens, total.spec_verify_ct, total.spec_num_proposed_drafts,
            total.spec_num_correct_drafts) == (16, 6, 12, 10)
    assert total.draft_time_s == 0.5 and b.draft_time_s is None  # a timing only one side measured
    assert total.spec_accept_length == 16 / 6 and total.spec_accept_rate == 10 / 12
    assert a.spec_accept_length == 2.5 != (a.spec_num_correct_drafts + a.spec_verify_ct) / a.spec_verify_ct
    assert a.spec_dict() == {"spec_verify_ct": 4, "spec_num_proposed_drafts": 9, "spec_num_correct_drafts": 7,
                             "draft_time_s": 0.5, "verify_time_s": 1.0, "prefill_time_s": 0.25,
                             "spec_accept_length": 2.5}
    assert list(b.spec_dict()) == ["spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts",
                                   "spec_accept_length"]  # a server measures no timings
    assert total.counters() == {"spec_verify_ct": 6, "spec_num_proposed_drafts": 12, "spec_num_correct_drafts": 10}
    assert SpecStats().spec_dict() == {} == SpecStats().counters() and SpecStats().spec_accept_length == 0.0
    assert "spec_accept_length" in a.to_dict() and "draft_time_s" not in b.to_dict()


def test_completion_text_with_stop_and_its_dict() -> None:
    c = Completion(text="step one", matched_stop="\n\n", spec=SpecStats(completion_tokens=3, spec_verify_ct=2))
    assert c.text_with_stop == "step one\n\n" and Completion(text="x").text_with_stop == "x"
    assert c.to_dict()["spec"]["spec_accept_length"] == 1.5 and Completion(text="x").to_dict()["spec"] == {}


def test_meter_sums_typed_stats_and_keeps_the_cost_keys() -> None:
    meter = Meter()
    meter.record_call("small", Completion(text="a", completion_tokens=9, spec=SpecStats(
        completion_tokens=9, spec_verify_ct=3, spec_num_proposed_drafts=8, spec_num_correct_drafts=7)))
    meter.record_call("large", Completion(text="b", completion_tokens=5))  # no speculation reported
    cost = meter.snapshot()
    assert cost["spec"] == {"spec_verify_ct": 3, "spec_num_proposed_drafts": 8, "spec_num_correct_drafts": 7}
    assert cost["accept_length"] == 3.0  # 9 tokens of the speculating call over 3 verify forwards
    assert Meter().snapshot()["spec"] == {} and Meter().snapshot()["accept_length"] is None


def record_returns(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> list:
    """Wrap the method `obj.name` so that every value it returns is appended to the list returned."""
    returned: list = []
    method = getattr(obj, name)

    def recording(*args, **kwargs):
        returned.append(method(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(obj, name, recording)
    return returned


def record_rounds_returns(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> list:
    """`record_returns` for a method that returns a coroutine of the scheduler: what each coroutine returns."""
    returned: list = []
    method = getattr(obj, name)

    def recording(*args, **kwargs):
        returned.append((yield from method(*args, **kwargs)))
        return returned[-1]

    monkeypatch.setattr(obj, name, recording)
    return returned


@pytest.fixture(scope="module")
def tiny_local(tiny_model_dir) -> LocalModel:
    # suffix-tree: the match-length controller, whose draft budgets do not depend on timings
    return LocalModel(str(tiny_model_dir), dtype="float32", drafter="suffix-tree", name="tiny")


def test_accept_length_is_one_number_at_every_layer_when_a_stop_token_cuts_the_last_round(
    tiny_local: LocalModel, monkeypatch: pytest.MonkeyPatch,
) -> None:
    local = tiny_local
    rng = random.Random(3)
    phrases = [[rng.randrange(3, VOCAB) for _ in range(5)] for _ in range(3)]
    ids: list[int] = []
    while len(ids) < 40:
        ids += rng.choice(phrases)
    problem = " ".join(f"w{i - 3}" for i in ids)  # word-level tokenizer: id i is "w{i-3}"

    def loop(small) -> StepLoop:
        policy = make_policy("small")
        policy.answer_tier = "large"  # the scripted large model writes the forced answer: one small generation per run
        return StepLoop(small, ScriptedModel(outputs=["42"]), policy, SegmentConfig(max_step_tokens=40),
                        StepBudget(max_steps=1))

    # A first run without stop tokens: the reference output, and a suffix cache whose drafts now run past any stop.
    monkeypatch.setattr(local, "stop_token_ids", [])
    captured = record_returns(monkeypatch, local._speculative, "_result")
    asyncio.run(loop(local).run(problem))
    reference = captured[-1].token_ids
    j = next(i for i in range(8, len(reference)) if reference[i] not in reference[:i])  # a token seen first at i
    monkeypatch.setattr(local, "stop_token_ids", [reference[j]])

    meter = Meter()
    completions = record_rounds_returns(monkeypatch, local, "_completion_rounds")
    result = asyncio.run(loop(MeteredModel(local, "small", meter, RetryPolicy())).run(problem))

    decoded = captured[-1]
    assert decoded.token_ids == reference[: j + 1] and decoded.matched_stop == reference[j]  # still exact
    stats = decoded.stats
    # the stop token cut the last round: some accepted drafts were dropped after it
    assert stats.spec_num_correct_drafts + stats.spec_verify_ct > stats.completion_tokens
    accept_length = stats.completion_tokens / stats.spec_verify_ct
    step = result.steps[0]
    assert stats.spec_accept_length == accept_length  # decoder
    assert completions[-1].spec.spec_accept_length == accept_length  # model (Completion)
    assert step.spec.spec_accept_length == accept_length  # step (StepOutcome)
    assert step.to_dict()["spec"]["spec_accept_length"] == accept_length  # the step's trace record
    assert meter.snapshot()["accept_length"] == round(accept_length, 3)  # the run's cost


def test_a_metered_model_passes_token_scores_and_ids_through() -> None:
    """A run's view of a model (`MeteredModel`) scores token ids and encodes as the model does, each scoring
    call counted as a judge call."""
    from thinkahead.models.base import TokenLogprob

    class Scoring(ScriptedModel):
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

        async def token_logprobs(self, token_ids, start, top_k=0):
            return [TokenLogprob(t, chr(t), -0.5) for t in token_ids[start:]]

    meter = Meter(RunBudget())
    metered = MeteredModel(Scoring(outputs=["x"]), "large", meter, RetryPolicy())
    assert metered.encode("ab") == [97, 98]
    scored = asyncio.run(metered.token_logprobs([97, 98, 99], 1))
    assert [(t.token_id, t.logprob) for t in scored] == [(98, -0.5), (99, -0.5)]
    assert meter.judge_calls == 1
