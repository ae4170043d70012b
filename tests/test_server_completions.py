"""`/v1/completions` on the plain models: lm-evaluation-harness's loglikelihood requests (its request
shape and its parsing, copied) score exactly as the local model does, and thinkahead's own `openai:`
backend runs against `thinkahead serve` for generations and judge calls."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server_fixtures import serve  # noqa: F401 (fixture)
from thinkahead.models.base import GenerationRequest
from thinkahead.models.local import LocalModel
from thinkahead.models.openai import OpenAIModel
from thinkahead.serving.openai_server import create_app
from thinkahead.verifiers.judge import LLMJudge

ITEMS = [("w5 w6 w7", " w8 w9"), ("w10 w11", " w12"), ("w20 w21 w22 w23", " w24 w25 w26")]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LocalModel(str(tiny_model_dir), dtype="float32", name="tiny")


def lm_eval_parse_logprobs(outputs: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm_eval.models.openai_completions.OpenAICompletionsAPI.parse_logprobs (lm-eval 0.4), as written there."""
    res = []
    for choice, ctxlen in zip(sorted(outputs["choices"], key=lambda c: c["index"]), ctxlens):
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(tokens_logprobs, top_logprobs))
        res.append((logprobs, is_greedy))
    return res


def test_lm_eval_loglikelihood_requests_score_as_the_local_model(serve, tiny):
    url = serve(create_app(small=tiny, large=tiny))
    # lm-eval tokenizes itself and sends a batch of token-id prompts: context + continuation
    prompts = [tiny.encode(context + continuation) for context, continuation in ITEMS]
    ctxlens = [len(tiny.encode(context)) for context, _ in ITEMS]
    payload = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    response = httpx.post(f"{url}/v1/completions", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and len(body["choices"]) == len(ITEMS)
    for choice, ids in zip(body["choices"], prompts):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(ids) + 1  # the echoed prompt and the one generated token
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    scored = lm_eval_parse_logprobs(body, ctxlens)
    for (context, continuation), (total, greedy) in zip(ITEMS, scored):
        own = tiny.continuation_logprobs_sync(context, continuation)
        assert total == pytest.approx(sum(own), abs=1e-4)
        greedy_ids = tiny.generate_sync(GenerationRequest(prompt=context, max_new_tokens=len(own), temperature=0,
                                                          speculative=False)).token_ids
        assert greedy == (greedy_ids[:len(own)] == tiny.encode(context + continuation)[-len(own):])
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_a_text_prompt_echoed_with_zero_new_tokens(serve, tiny):
    url = serve(create_app(small=tiny, large=tiny))
    context, continuation = ITEMS[0]
    body = httpx.post(f"{url}/v1/completions", json={
        "model": "tiny", "prompt": context + continuation, "max_tokens": 0, "echo": True, "logprobs": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == context + continuation
    assert choice["logprobs"]["tokens"] == (context + continuation).split()
    own = tiny.continuation_logprobs_sync(context, continuation)
    assert choice["logprobs"]["token_logprobs"][-len(own):] == pytest.approx(own, abs=1e-5)
    assert choice["logprobs"]["text_offset"][:2] == [0, 2]
    bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    missing = httpx.post(f"{url}/v1/completions", json={"model": "thinkahead/cot", "prompt": "w1"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_the_openai_backend_runs_against_thinkahead_serve(serve, tiny):
    """Generation and judge calls of `OpenAIModel` (the `openai:` spec) answered by our own server."""
    url = serve(create_app(small=tiny, large=tiny))
    prompt = tiny.render([{"role": "user", "content": "w5 w6 w7 w8"}])

    async def remote_calls():
        remote = OpenAIModel("tiny", base_url=f"{url}/v1", api_key="")
        try:
            completion = await remote.generate(GenerationRequest(prompt=prompt, max_new_tokens=7, temperature=0))
            top = await remote.next_token_logprobs(prompt, top_k=5)
            verdict = await LLMJudge(remote).judge([{"role": "user", "content": "w1 w2"}], "w3 w4")
            return completion, top, verdict
        finally:
            await remote.aclose()

    completion, top, verdict = asyncio.run(remote_calls())
    own = tiny.generate_sync(GenerationRequest(prompt=prompt, max_new_tokens=7, temperature=0))
    assert (completion.text, completion.finish_reason, completion.completion_tokens) == (own.text, "length", 7)
    own_top = tiny.next_token_logprobs_sync(prompt, 5)
    assert list(top) == list(own_top) and list(top.values()) == pytest.approx(list(own_top.values()), abs=1e-5)
    own_verdict = asyncio.run(LLMJudge(tiny).judge([{"role": "user", "content": "w1 w2"}], "w3 w4"))
    assert (verdict.score, verdict.accept) == (own_verdict.score, own_verdict.accept)
