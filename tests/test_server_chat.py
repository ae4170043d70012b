"""Plain chat models on the server (the small and the large model by their names), with the real
`openai` client against uvicorn on a loopback port: every sampling parameter honoured or refused
by name, hard `max_tokens` caps, `n`, `logprobs`, JSON outputs that parse and validate."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.llm_judge import LLM_SPECREASON
from tests.server_fixtures import TINY_QUESTION, openai_client, scripted_pair, serve, tiny, tiny_url  # noqa: F401 (fixtures)
from thinkahead.models import ScriptedModel
from thinkahead.models.base import GenerationRequest
from thinkahead.serving.openai_server import create_app

QUESTION = TINY_QUESTION
client = openai_client


def test_a_plain_model_generates_greedily_as_the_model_itself_and_max_tokens_is_a_hard_cap(tiny_url, tiny):
    reply = client(tiny_url).chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=6)
    own = tiny.generate_sync(GenerationRequest(messages=QUESTION, max_new_tokens=6, temperature=0))
    choice = reply.choices[0]
    assert (choice.message.content, choice.finish_reason) == (own.text, "length")
    assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens == own.prompt_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens == 0 or reply.usage.prompt_tokens_details.cached_tokens > 0
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    extra = reply.model_extra["thinkahead"]
    assert extra["model"] == "tiny" and extra["model_calls"] == 1 and extra["spec"]["spec_verify_ct"] >= 1
    again = client(tiny_url).chat.completions.create(model="tiny", messages=QUESTION, temperature=0,
                                                    max_completion_tokens=3)
    assert again.usage.completion_tokens == 3 and again.choices[0].finish_reason == "length"
    assert own.text.startswith(again.choices[0].message.content)


def test_seed_n_temperature_and_top_p_are_honoured(tiny_url):
    c = client(tiny_url)
    ask = dict(model="tiny", messages=QUESTION, temperature=1.0, top_p=0.9, max_tokens=8)
    first = c.chat.completions.create(seed=11, **ask)
    assert first.choices[0].message.content == c.chat.completions.create(seed=11, **ask).choices[0].message.content
    three = c.chat.completions.create(seed=10, n=3, **ask)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    assert three.choices[1].message.content == first.choices[0].message.content  # choice i samples with seed + i
    assert len({ch.message.content for ch in three.choices}) > 1
    assert three.usage.completion_tokens == sum(
        len(ch.message.content.split()) for ch in three.choices)  # word-level tokenizer: one token a word


def test_stop_strings_end_the_text_before_them(tiny_url, tiny):
    own = tiny.generate_sync(GenerationRequest(messages=QUESTION, max_new_tokens=8, temperature=0)).text.split()
    reply = client(tiny_url).chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=8,
                                                     stop=[own[3]])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content.split() == own[:own.index(own[3])]


def test_logprobs_are_the_models_own_scores(tiny_url, tiny):
    reply = client(tiny_url).chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=5,
                                                     logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert [t.token for t in content] == reply.choices[0].message.content.split()
    prompt = tiny.render(QUESTION)
    expected = tiny.continuation_logprobs_sync(prompt, " " + reply.choices[0].message.content)
    assert [t.logprob for t in content] == pytest.approx(expected, abs=1e-5)
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy: the top choice
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6)


def test_parameters_a_model_cannot_honour_are_refused_by_name(serve, tiny_url):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    cases = [
        (url, dict(model="small-scripted", logprobs=True), "logprobs"),
        (tiny_url, dict(model="tiny", top_logprobs=2), "top_logprobs"),
        (tiny_url, dict(model="tiny", frequency_penalty=1.0), "frequency_penalty"),
        (tiny_url, dict(model="tiny", logit_bias={"5": 10}), "logit_bias"),
        (tiny_url, dict(model="tiny", reasoning_effort="high"), "reasoning_effort"),
        (tiny_url, dict(model="tiny", n=99), "n"),
        (tiny_url, dict(model="tiny", stop=["a", "b", "c", "d", "e"]), "stop"),
        (tiny_url, dict(model="tiny", response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}), "response_format"),
    ]
    for base, params, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client(base).chat.completions.create(messages=QUESTION, **params)
        assert err.value.body["param"] == param, (params, err.value.body)
    for params, param in [(dict(temperature=0.5), "temperature"), (dict(seed=1), "seed"), (dict(stop="x"), "stop"),
                          (dict(n=2), "n"), (dict(response_format={"type": "json_object"}), "response_format"),
                          (dict(max_tokens=5, model="thinkahead/react"), "max_tokens")]:
        body = {"model": "thinkahead/cot", "messages": QUESTION, **params}
        response = httpx.post(f"{url}/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    # neutral values of unsupported parameters are fine
    ok = client(tiny_url).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2, frequency_penalty=0,
                                                  presence_penalty=0, store=False, user="me")
    assert ok.choices[0].finish_reason == "length"
    assert small.calls == [] and large.calls == []


def test_a_prompt_longer_than_the_context_is_refused_before_any_work(tiny_url, tiny):
    long = [{"role": "user", "content": " ".join(["w9"] * 600)}]
    with pytest.raises(openai.BadRequestError) as err:
        client(tiny_url).chat.completions.create(model="tiny", messages=long)
    assert err.value.body["code"] == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client(tiny_url).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=600)
    assert (err.value.body["code"], err.value.body["param"]) == ("context_length_exceeded", "max_tokens")


def json_server(serve, outputs):
    model = ScriptedModel(outputs=outputs, name="json-model")
    return model, serve(create_app({"policy": LLM_SPECREASON}, small=model, large=model))


def test_json_object_output_is_parsed_and_a_bad_reply_is_repaired(serve):
    model, url = json_server(serve, ["Sure! Here it is: {'a': 1}", 'Here: ```json\n{"a": 1}\n```'])
    reply = client(url).chat.completions.create(model="json-model", messages=QUESTION,
                                                response_format={"type": "json_object"})
    assert json.loads(reply.choices[0].message.content) == {"a": 1}
    assert reply.model_extra["thinkahead"]["attempts"] == [2]
    first, second = model.generated_prompts()
    assert "Reply with one JSON object only" in first
    assert "Your reply was not valid: the reply is not valid JSON" in second


def test_json_schema_output_must_validate_or_the_request_fails_loudly(serve):
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "number"}},
              "required": ["city", "temp"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}
    model, url = json_server(serve, ['{"city": "Paris"}', '{"city": "Paris", "temp": 18.5}'])
    reply = client(url).chat.completions.create(model="json-model", messages=QUESTION, response_format=fmt)
    assert json.loads(reply.choices[0].message.content) == {"city": "Paris", "temp": 18.5}
    assert "'temp' is a required property" in model.generated_prompts()[1]
    assert json.dumps(schema) in model.generated_prompts()[0]
    _, url = json_server(serve, ['{"city": 5, "temp": 1}'])
    with pytest.raises(openai.InternalServerError) as err:
        client(url).chat.completions.create(model="json-model", messages=QUESTION, response_format=fmt)
    assert err.value.body["code"] == "invalid_model_output"
    assert "after 3 attempts" in err.value.body["message"] and "at city" in err.value.body["message"]


def test_streaming_a_plain_model_with_usage(tiny_url, tiny):
    stream = client(tiny_url).chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=6,
                                                      stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    own = tiny.generate_sync(GenerationRequest(messages=QUESTION, max_new_tokens=6, temperature=0))
    assert text == own.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
