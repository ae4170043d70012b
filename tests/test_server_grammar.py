"""The server's tool calls and JSON formats through the grammar, on a local model (a tiny random model
whose every free choice is noise, with a byte-level BPE tokenizer): whatever the model would write,
a forced call is a valid call and a JSON format is valid JSON, first time; a bad schema is a 400."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server_fixtures import openai_client, serve  # noqa: F401 (fixture)
from tests.tiny_models import byte_tokenizer, tiny_model
from thinkahead.serving.openai_server import create_app
from thinkahead.serving.tool_grammar import ANSWER_GRAMMAR, tool_call_grammar
from thinkahead.serving.tools import parse_tool_calls
from thinkahead.serving.schemas import ToolDef
from thinkahead.models.templates import repaired_template

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["a", "b"], "additionalProperties": False}}}
CITY = {"type": "function", "function": {"name": "city", "parameters": {
    "type": "object", "properties": {"name": {"enum": ["Paris", "Rome"]}}, "required": ["name"],
    "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def noisy():
    from thinkahead.models.local import LocalModel

    model = tiny_model("qwen2")
    model.config.max_position_embeddings = 4096  # the tool listing is ~800 byte-level tokens
    return LocalModel(model=model, tokenizer=byte_tokenizer(), name="noisy")


@pytest.fixture
def client(serve, noisy):
    return openai_client(serve(create_app(small=noisy, large=noisy)))


ASK = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "city"}}])
def test_a_forced_call_is_a_valid_call_first_time(client, choice):
    for seed_words in ("What is 2 + 3?", "Which city?", "x y z"):
        reply = client.chat.completions.create(model="noisy", messages=[{"role": "user", "content": seed_words}],
                                               tools=[ADD, CITY], tool_choice=choice, temperature=0, max_tokens=80)
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        assert reply.model_extra["thinkahead"]["attempts"] == [1]
        for call in c.message.tool_calls:
            tool = {"add": ADD, "city": CITY}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        if isinstance(choice, dict):
            assert {call.function.name for call in c.message.tool_calls} == {"city"}


def test_a_forced_call_streams_as_tool_call_deltas(client):
    stream = client.chat.completions.create(model="noisy", messages=ASK, tools=[ADD], tool_choice="required",
                                            temperature=0, max_tokens=80, stream=True)
    chunks = list(stream)
    args = "".join(d.function.arguments or "" for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])
                   if d.function)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(args), ADD["function"]["parameters"])


def test_a_json_schema_format_is_valid_by_construction(client):
    for temperature in (0, 1):
        reply = client.chat.completions.create(
            model="noisy", messages=ASK, temperature=temperature, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
        assert reply.model_extra["thinkahead"]["attempts"] == [1]
    reply = client.chat.completions.create(model="noisy", messages=ASK, temperature=0, max_tokens=120,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason in ("stop", "length")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "if": {"type": "object"}}, "Unimplemented"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "matches no output"),
    ({"type": "string", "pattern": "(a|b"}, "regex"),
])
def test_a_bad_schema_is_a_400_naming_the_field(client, schema, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="noisy", messages=ASK, max_tokens=20, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": schema}})
    assert info.value.body["param"].startswith("response_format"), info.value.body  # jsonschema's check comes first
    assert words in info.value.body["message"]


def test_a_tool_with_a_bad_schema_is_a_400(client):
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "object", "if": {}}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="noisy", messages=ASK, tools=[bad], tool_choice="required", max_tokens=20)
    assert info.value.body["param"] == "tools"


def test_auto_allows_text_then_a_call_and_no_special_tokens(noisy):
    tok = noisy.tokenizer
    spec = tool_call_grammar(tok, {"add": ADD["function"]["parameters"]}, required=False)
    c = noisy.grammars.constraint(spec)
    assert c.valid_prefix(tok.encode("Let me add. <tool_call>\n")) == len(tok.encode("Let me add. <tool_call>\n"))
    c.advance(tok.encode("Let me add. <tool_call>\n"))
    assert c.valid_prefix(tok.encode('{"name": "sub"')) < len(tok.encode('{"name": "sub"'))  # only listed tools
    call = '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert c.valid_prefix(tok.encode(call)) == len(tok.encode(call))
    answer = noisy.grammars.constraint(ANSWER_GRAMMAR)
    assert answer.valid_prefix(tok.encode("{")) == 0 and answer.valid_prefix(tok.encode("```")) == 0
    assert not answer.mask()[tok.eos_token_id] and not answer.mask()[tok.bos_token_id]


def test_calls_written_in_fenced_blocks_naming_a_listed_tool_are_calls():
    tools = {"add": ToolDef.model_validate(ADD)}
    text = 'Adding.\n```json\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n```\n```json\n{"x": 1}\n```'
    parsed = parse_tool_calls(text, tools, required=False)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("add", {"a": 2, "b": 3})]
    assert parsed.content == 'Adding.\n\n```json\n{"x": 1}\n```'
    bad_args = '```json\n{"name": "add", "arguments": {"a": "two"}}\n```'
    assert parse_tool_calls(bad_args, tools, required=False).calls == []  # not a valid call: left as text


def test_the_doubled_brace_tool_example_is_repaired():
    damaged = '{{- "\\n<tool_call>\\n{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}\\n</tool_call>" }}'
    fixed = repaired_template(damaged)
    assert '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n' in fixed
    assert fixed.startswith("{{- ") and fixed.endswith(" }}")  # Jinja's own braces untouched
    assert repaired_template(fixed) == fixed


LLAMA3_TEMPLATE = (
    "{%- if tools %}<|system|>Given the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\nRespond in the format {\"name\": function "
    "name, \"parameters\": dictionary of argument name and its value}.\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>")


def test_a_llama3_json_template_gets_calls_in_its_own_format(serve):
    """A template that asks for `{"name": ..., "parameters": {...}}` (Llama 3.1/3.2) gets calls in that
    shape, from the grammar, returned as OpenAI tool_calls; with `auto` a reply opening with `{` is a call."""
    from thinkahead.models.local import LocalModel
    from thinkahead.serving.tool_grammar import tool_format

    tokenizer = byte_tokenizer()
    tokenizer.chat_template = LLAMA3_TEMPLATE
    model = tiny_model("llama")
    model.config.max_position_embeddings = 4096
    local = LocalModel(model=model, tokenizer=tokenizer, name="llama3ish")
    assert tool_format(tokenizer).name == "llama3-json"
    spec = tool_call_grammar(tokenizer, {"add": ADD["function"]["parameters"]}, required=False)
    c = local.grammars.constraint(spec)
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert c.valid_prefix(tokenizer.encode(call)) == len(tokenizer.encode(call))
    assert c.valid_prefix(tokenizer.encode('{"name": "add", "arguments"')) < len(tokenizer.encode('{"name": "add", "arguments"'))
    client = openai_client(serve(create_app(small=local, large=local)))
    reply = client.chat.completions.create(model="llama3ish", messages=ASK, tools=[ADD], tool_choice="required",
                                           temperature=0, max_tokens=60)
    [made] = reply.choices[0].message.tool_calls
    assert made.function.name == "add"
    jsonschema.validate(json.loads(made.function.arguments), ADD["function"]["parameters"])


def test_tools_are_listed_without_schema_titles():
    """Pydantic-made tool schemas title the parameters `<tool>_args`; small models copied that as the
    tool's name. The listing drops `title` annotations, never a property named "title"."""
    from thinkahead.serving.tools import tool_dicts

    tool = ToolDef.model_validate({"type": "function", "function": {"name": "multiply", "parameters": {
        "title": "multiply_args", "type": "object", "required": ["a", "title"],
        "properties": {"a": {"title": "A", "type": "number"}, "title": {"title": "Title", "type": "string"}}}}})
    [listed] = tool_dicts([tool])
    assert listed["function"]["parameters"] == {"type": "object", "required": ["a", "title"], "properties": {
        "a": {"type": "number"}, "title": {"type": "string"}}}
    assert tool.function.parameters["title"] == "multiply_args"  # the request's own schema is untouched
    # data is no schema: a "title" key in a default or an enum value is the data's own (it was dropped)
    book = ToolDef.model_validate({"type": "function", "function": {"name": "shelve", "parameters": {
        "type": "object", "properties": {"book": {"type": "object", "default": {"title": "Dune"},
                                                  "enum": [{"title": "Dune"}], "examples": [{"title": "Emma"}]}}}}})
    [listed] = tool_dicts([book])
    assert listed["function"]["parameters"]["properties"]["book"] == {
        "type": "object", "default": {"title": "Dune"}, "enum": [{"title": "Dune"}], "examples": [{"title": "Emma"}]}


def test_react_with_client_tools_calls_them_under_the_grammar(client):
    """thinkahead/react on a local model: each turn follows the ReAct grammar, so even a model whose
    every free choice is noise writes an action naming a client tool with arguments that fit its schema
    (required: no final answer), which comes back as tool_calls; `stop` is taken (the answer is cut at it)."""
    for question in ("What is 2 + 3?", "Add 40 and 2."):
        reply = client.chat.completions.create(model="thinkahead/react", tools=[ADD, CITY], tool_choice="required",
                                               stop=["Observation:"],
                                               messages=[{"role": "user", "content": question}])
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls", c.message
        for call in c.message.tool_calls:
            tool = {"add": ADD, "city": CITY}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_metered_models_pass_grammars_through():
    """Workflows see models through a run's meter: the grammar kinds are the model's own."""
    from thinkahead.orchestrator.budget import Meter, MeteredModel, RetryPolicy
    from thinkahead.models.scripted import ScriptedModel
    from thinkahead.token_spec.grammar import GRAMMAR_KINDS

    model = LocalModel_for_test()
    metered = MeteredModel(model, "large", Meter(), RetryPolicy())
    assert metered.grammar_kinds == GRAMMAR_KINDS and metered.grammar_guaranteed
    assert MeteredModel(ScriptedModel(), "small", Meter(), RetryPolicy()).grammar_kinds == ()


def LocalModel_for_test():
    from thinkahead.models.local import LocalModel

    return LocalModel(model=tiny_model("llama"), tokenizer=byte_tokenizer(), name="m")


def test_loading_a_model_leaves_the_grammar_tokenizer_unbuilt_and_a_server_builds_it() -> None:
    """Building llguidance's tokenizer costs about a second of CPU: a batch job that never asks for a
    grammar (`thinkahead run`) must not pay it while it loads; a server starts it at once."""
    import threading
    import time

    from thinkahead.models.local import LocalModel

    local = LocalModel(model=tiny_model("qwen2"), tokenizer=byte_tokenizer(), name="lazy")
    time.sleep(0.2)
    assert local.grammars._llt is None
    assert not any(t.name == "grammar-tokenizer" for t in threading.enumerate())
    create_app(small=local, large=local)
    deadline = time.monotonic() + 30
    while local.grammars._llt is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert local.grammars._llt is not None
