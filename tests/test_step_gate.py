"""The step level's cheaper paths: the small model's own confidence gate, a router before drafting,
and router training with agreement labels, a held-out split and the router that ships."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from thinkahead.models import GenerationRequest, LocalModel, ScriptedModel
from thinkahead.step_spec.loop import StepLoop
from thinkahead.step_spec.specreason import SpecReason
from thinkahead.verifiers.router import LogisticRouter
from thinkahead.verifiers.router_features import RouterFeatures
from thinkahead.verifiers.router_labels import draft_confidence, own_confidence
from thinkahead.verifiers.router_pairs import PairedStep, label, read_pairs, train_router, write_pairs
from thinkahead.verifiers.router_training import evaluate, fit_router, roc_auc

from tests.test_step_policies import AgreeingModel, run

STEPS = ["17 * 3 = 51.\n\n", "17 * 2 = 41 so far.\n\n", "Answer: 85"]


def test_gate_keeps_confident_drafts_unchecked_and_checks_the_unsure_one() -> None:
    # the small model gave "41" 2.1 nats (unsure); every other number it wrote it was sure of
    small = AgreeingModel(STEPS, gaps={"41": 2.0}, name="small")
    large = AgreeingModel([" 34 so far.\n\n"], gaps={"41": 3.0}, name="large")
    result = run(StepLoop(small, large, SpecReason(judge="agreement", gate_logprob=-1.0)))
    assert [(s.author, s.verdict) for s in result.steps] == [
        ("small", "confident"), ("large", "repaired"), ("small", "confident")]
    assert large.scored == ["17 * 2 = 41 so far.\n\n"]  # the only step the large model re-read
    assert result.steps[1].text == "17 * 2 = 34 so far.\n\n" and result.judge_calls == 1
    # without the gate every step is checked
    small2 = AgreeingModel(STEPS, gaps={"41": 2.0}, name="small")
    large2 = AgreeingModel([" 34 so far.\n\n"], gaps={"41": 3.0}, name="large")
    assert run(StepLoop(small2, large2, SpecReason(judge="agreement", gate_logprob=None))).judge_calls == 3
    with pytest.raises(ValueError, match="gate_logprob"):
        SpecReason(gate_logprob=0.5)


class AskedModel(AgreeingModel):
    """Records whether each generation asked for its tokens' log-probabilities."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[bool] = []

    async def generate(self, request: GenerationRequest):
        self.asked.append(request.logprobs)
        return await super().generate(request)


@pytest.mark.parametrize("gate", [-1.0, None])
def test_the_small_models_drafts_carry_logprobs_only_where_the_gate_reads_them(gate) -> None:
    """A local model computes token log-probabilities only when asked (a pass over the vocabulary per token);
    the gate's drafts ask, the large model's steps and an ungated run's drafts do not."""
    small = AskedModel(STEPS, gaps={"41": 2.0}, name="small")
    large = AskedModel([" 34 so far.\n\n"], gaps={"41": 3.0}, name="large")
    run(StepLoop(small, large, SpecReason(judge="agreement", gate_logprob=gate)))
    assert small.asked and set(small.asked) == {gate is not None}
    assert not any(large.asked)


def step_index_router(path: Path, from_step: int) -> Path:
    """A router that sends steps from `from_step` on to the large model."""
    LogisticRouter([10.0], -10.0 * (from_step - 0.5), [0.0], [1.0], feature_names=["step_index"]).save(path)
    return path


def test_pre_router_hands_steps_to_the_large_model_before_drafting(tmp_path) -> None:
    small = AgreeingModel(STEPS, gaps={}, name="small")
    large = AgreeingModel(["17 * 2 = 34 so far.\n\n", "Answer: 85"], gaps={}, name="large")
    policy = SpecReason(judge="agreement", gate_logprob=None, pre_router=str(step_index_router(tmp_path / "r.json", 1)))
    result = run(StepLoop(small, large, policy))
    assert [(s.author, s.verdict) for s in result.steps] == [("small", "accepted"), ("large", "routed"),
                                                            ("large", "routed")]
    assert len(small.generated_prompts()) == 1  # routed steps were never drafted
    assert result.steps[1].route_p > 0.99
    with pytest.raises(ValueError, match="unknown router"):
        SpecReason(pre_router="no-such-router")


def test_own_confidence_from_the_decoder_equals_a_scoring_pass(tiny_model_dir) -> None:
    """The decoder's per-token log-probabilities give the same confidence as re-scoring the step."""
    model = LocalModel(str(tiny_model_dir), dtype="float32", name="tiny")
    messages = [{"role": "user", "content": "w5 w6 w7 w5 w6 w7 w5 w6"}]
    completion = asyncio.run(model.generate(GenerationRequest(messages=messages, max_new_tokens=12, logprobs=True)))
    assert len(completion.token_logprobs) == len(completion.token_ids) == 12
    free = asyncio.run(own_confidence(model, messages, completion, completion.text))
    scores = asyncio.run(model.continuation_scores(model.render(messages), completion.text))
    scored = draft_confidence(scores)
    assert free.tokens == scored.tokens == 12
    assert free.min_logprob == pytest.approx(scored.min_logprob, abs=1e-4)
    assert free.mean_logprob == pytest.approx(scored.mean_logprob, abs=1e-4)


def pairs_with_labels(n_problems: int = 8) -> list[PairedStep]:
    """Synthetic pairs whose agreement label follows the small model's entropy (late steps fail more)."""
    out = []
    for p in range(n_problems):
        for i in range(5):
            entropy = 0.2 * i + 0.05 * p
            fails = entropy > 0.55
            out.append(PairedStep(f"train-{p}", i, RouterFeatures(i, 5.0 if i else None, entropy, 10 * i, False, 40),
                                  "s", "l", 5.0, 5.5, small_fails=fails, small_gap=2.0 if fails else 0.0))
    return out


def test_router_training_with_agreement_labels_and_a_held_out_split(tmp_path) -> None:
    pairs = pairs_with_labels()
    path = tmp_path / "pairs.jsonl"
    write_pairs(path, pairs)
    assert read_pairs(path) == pairs  # the labels round-trip
    report = train_router(path, tmp_path / "router.json", threshold=None, rule="agreement", holdout_every=4)
    assert report["heldout_problems"] == ["train-0", "train-4"] and "prev_score" not in report["features"]
    assert report["heldout"]["auc"] == 1.0 and report["heldout"]["recall"] == 1.0
    saved = LogisticRouter.load(tmp_path / "router.json")
    assert saved.provenance["heldout"] == report["heldout"]  # how it was made travels with it
    held = [p for p in pairs if p.problem_id in report["heldout_problems"]]
    assert evaluate(saved, held, "agreement") == report["heldout"]
    # the paper's rule on the same pairs: every large step beats the small one by 0.5 < margin 1
    with pytest.raises(ValueError, match="label 0"):
        train_router(path, tmp_path / "r2.json", rule="judge")
    unlabelled = [PairedStep("x", 0, pairs[0].features, "s", "l", 5.0, 5.0)]
    with pytest.raises(ValueError, match="no agreement label"):
        label(unlabelled[0], rule="agreement")
    with pytest.raises(ValueError, match="holdout_every"):
        fit_router(pairs, rule="agreement", holdout_every=1)
    assert roc_auc([0.1, 0.9], [0, 1]) == 1.0 and roc_auc([0.5, 0.5], [0, 1]) == 0.5


def test_the_shipped_router_loads_routes_and_reproduces_its_held_out_metrics() -> None:
    from thinkahead.verifiers.router import SHIPPED_ROUTERS, load_router

    router = load_router("trained")
    assert isinstance(router, LogisticRouter) and Path(SHIPPED_ROUTERS["trained"]).is_file()
    made = router.provenance
    pairs_file = Path(__file__).resolve().parents[1] / made["data"]
    pairs = [p for p in read_pairs(pairs_file) if p.problem_id in made["heldout_problems"]]
    got = evaluate(router, pairs, made["rule"], made["margin"])
    assert got == pytest.approx(made["heldout"])
    assert not math.isnan(got["auc"]) and 0.0 < got["route_share"] < 1.0
    tier, p = router.route(pairs[0].features)
    assert tier in ("small", "large") and 0.0 <= p <= 1.0
    assert json.loads(Path(SHIPPED_ROUTERS["trained"]).read_text())["provenance"]["features"] == list(
        router.feature_names)


def test_which_backends_score_tokens_agrees_with_the_spec_check() -> None:
    # the config refuses by spec (before loading); the runtime by instance: both must say the same
    from thinkahead.models.loader import load_model, scores_tokens
    from thinkahead.models.sglang import SGLangModel

    for spec in ("openai:qwen@http://127.0.0.1:9/v1", "sglang:http://127.0.0.1:9"):
        model = load_model(spec)
        assert model.scores_tokens == scores_tokens(spec), spec
    assert isinstance(load_model("sglang:http://127.0.0.1:9"), SGLangModel)
    assert LocalModel.continuation_scores is not ScriptedModel.continuation_scores  # local models score
    assert not ScriptedModel().scores_tokens and AgreeingModel([], gaps={}).scores_tokens


def test_appends_to_a_pairs_file_wait_for_a_rewrite_holding_its_lock(tmp_path) -> None:
    # bench/label_pairs.py rewrites the pairs file by a rename under this lock: a collect run's
    # append meanwhile must wait, not land in the file about to be replaced
    import threading
    import time

    from thinkahead.verifiers.router_pairs import pairs_lock

    path = tmp_path / "pairs.jsonl"
    pairs = pairs_with_labels(1)
    with pairs_lock(path):
        writer = threading.Thread(target=write_pairs, args=(path, pairs[:2]))
        writer.start()
        time.sleep(0.3)
        assert not path.exists() and writer.is_alive()  # blocked on the lock
        path.write_text("")  # the rewrite's result
    writer.join(5)
    assert read_pairs(path) == pairs[:2]
