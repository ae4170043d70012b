"""Streaming through the server with the real `openai` client against uvicorn on a loopback port: plain
chat models stream as they decode (several content chunks, each with its logprobs, concatenating to
the non-streamed reply), `/v1/completions` streams in OpenAI's `text_completion` chunks, a client that
leaves stops the decoder, and a workflow's usage reports the cached tokens of its first call."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest

from tests.llm_judge import LLM_SPECREASON
from tests.server_fixtures import (  # noqa: F401 (fixtures)
    JUDGE_YES, STEPS, TINY_QUESTION, chat, openai_client, serve, sse_payloads, tiny, tiny_url,
)
from tests.test_streaming import assert_stopped, slow_forwards
from thinkahead.models import ScriptedModel
from thinkahead.models.base import GenerationRequest
from thinkahead.models.local import LocalModel
from thinkahead.serving.openai_server import create_app

QUESTION = TINY_QUESTION
client = openai_client


def test_a_plain_model_streams_token_by_token_with_logprobs_as_the_whole_reply(tiny_url):
    ask = dict(model="tiny", messages=QUESTION, temperature=0, max_tokens=40, logprobs=True, top_logprobs=2)
    whole = client(tiny_url).chat.completions.create(**ask)
    chunks = list(client(tiny_url).chat.completions.create(**ask, stream=True))
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1  # pieces as the model decodes, not one reply at the end
    assert "".join(c.choices[0].delta.content for c in content) == whole.choices[0].message.content
    streamed = [t for c in content for t in c.choices[0].logprobs.content]
    for c in content:  # each chunk carries the logprobs of its own tokens (one token a word here)
        assert [t.token for t in c.choices[0].logprobs.content] == c.choices[0].delta.content.split()
    assert [t.token for t in streamed] == [t.token for t in whole.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole.choices[0].logprobs.content],
                                                          abs=1e-5)
    assert [len(t.top_logprobs) for t in streamed] == [2] * len(streamed)
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_seed_and_stop_stream_each_choice_as_the_whole_reply(tiny_url, tiny):
    words = tiny.generate_sync(GenerationRequest(messages=QUESTION, max_new_tokens=20, temperature=0)).text.split()
    c = client(tiny_url)
    for ask in (dict(temperature=1.0, seed=3, n=2, max_tokens=20), dict(temperature=0, stop=[words[9]], max_tokens=20)):
        whole = c.chat.completions.create(model="tiny", messages=QUESTION, **ask)
        texts, finish = {}, {}
        for chunk in c.chat.completions.create(model="tiny", messages=QUESTION, stream=True, **ask):
            choice = chunk.choices[0]
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        assert texts == {ch.index: ch.message.content for ch in whole.choices}
        assert finish == {ch.index: ch.finish_reason for ch in whole.choices}
    assert finish == {0: "stop"} and words[9] not in texts[0]


def test_completions_stream_in_text_completion_chunks(tiny_url, tiny):
    c = client(tiny_url)
    ask = dict(model="tiny", prompt="w5 w6 w7", max_tokens=30, temperature=0, logprobs=1)
    whole = c.completions.create(**ask)
    chunks = list(c.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert {ch.object for ch in chunks} == {"text_completion"} and len({ch.id for ch in chunks}) == 1
    pieces = [ch for ch in chunks if ch.choices and ch.choices[0].text]
    assert len(pieces) > 1
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    tokens = [t for p in pieces for t in p.choices[0].logprobs.tokens]
    values = [v for p in pieces for v in p.choices[0].logprobs.token_logprobs]
    offsets = [o for p in pieces for o in p.choices[0].logprobs.text_offset]
    assert tokens == whole.choices[0].logprobs.tokens and offsets == whole.choices[0].logprobs.text_offset
    assert values == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == 3


def test_a_streamed_echo_sends_the_prompt_first(tiny_url):
    payload = {"model": "tiny", "prompt": ["w5 w6", "w7"], "max_tokens": 4, "temperature": 0, "echo": True,
               "stream": True}
    with httpx.stream("POST", f"{tiny_url}/v1/completions", json=payload, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_payloads(response))
    assert events[-1] == "[DONE]"
    by_choice: dict[int, list[dict]] = {}
    for e in events[:-1]:
        by_choice.setdefault(e["choices"][0]["index"], []).append(e["choices"][0])
    whole = httpx.post(f"{tiny_url}/v1/completions", json={**payload, "stream": False}, timeout=60).json()
    for index, prompt in [(0, "w5 w6"), (1, "w7")]:
        entries = by_choice[index]
        assert entries[0]["text"] == prompt and entries[-1]["finish_reason"] == "length"
        assert "".join(e["text"] for e in entries) == whole["choices"][index]["text"]


def test_a_client_that_leaves_a_stream_stops_the_decoder(serve, tiny_model_dir):
    model = LocalModel(str(tiny_model_dir), dtype="float32", name="slow-tiny", drafter="none")
    calls = slow_forwards(model, 0.02)
    url = serve(create_app({"policy": LLM_SPECREASON}, small=model, large=model))
    body = {"model": "slow-tiny", "messages": QUESTION, "temperature": 0, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        line = next(line for line in response.iter_lines() if '"content": "w' in line)
        assert json.loads(line[len("data: "):])["choices"][0]["delta"]["content"].startswith("w")
    assert_stopped(calls, 0)
    assert httpx.get(f"{url}/health").json()["in_flight"] == 0
    started = len(calls)
    with pytest.raises(httpx.ReadTimeout):  # the same without streaming: the generation ends with the request
        httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=0.5)
    assert_stopped(calls, started)


@dataclass
class CachingModel(ScriptedModel):
    """Reports `cached` prompt tokens for its calls in order (then the last forever)."""

    cached: tuple[int, ...] = (0,)

    async def generate(self, request):
        completion = await super().generate(request)
        done = len(self.generated_prompts()) - 1
        completion.cached_tokens = self.cached[min(done, len(self.cached) - 1)]
        return completion


@pytest.mark.parametrize("stream", [False, True])
def test_a_workflows_cached_tokens_are_its_first_calls_capped_at_its_prompt(serve, stream):
    for cached, expected in [((3, 50, 50), 3), ((10_000, 7), None)]:
        small = CachingModel(outputs=list(STEPS), name="small-c", cached=cached)
        large = CachingModel(outputs=["\\boxed{391}"], logprobs=JUDGE_YES, name="large-c", cached=(0,))
        url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
        body = chat("thinkahead/cot:specreason", stream=stream, stream_options={"include_usage": True})
        if stream:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
                last = [e for e in sse_payloads(response) if e != "[DONE]"][-1]
        else:
            body.pop("stream_options")
            last = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).json()
        usage = last["usage"]
        first = usage["prompt_tokens"] if expected is None else expected  # capped at the request's own prompt
        assert usage["prompt_tokens_details"]["cached_tokens"] == first
        assert last["thinkahead"]["cost"]["cached_tokens"] == sum(cached[:len(small.generated_prompts())])
