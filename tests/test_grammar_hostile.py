"""Grammar-constrained serving under hostile or unusual input: every bad grammar is a 400 naming its
field (never a 500), the grammar cannot be loosened by the client, free text cannot hold an
unconstrained call, tool schemas with references work, and a reply is returned, repaired or refused
as its backend's guarantee allows (tiny models, scripted replies; no real model)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from tests.test_server_grammar import LLAMA3_TEMPLATE
from tests.tiny_models import VOCAB, byte_tokenizer, tiny_model
from thinkahead.models import ScriptedModel
from thinkahead.models.base import Completion
from thinkahead.serving.asgi import RequestError
from thinkahead.serving.chat import ChatJob
from thinkahead.serving.schemas import ChatRequest, parse_request
from thinkahead.serving.tool_grammar import ANSWER_GRAMMAR, rebased, tool_call_grammar
from thinkahead.serving.tools import OutputError, check_schema
from thinkahead.token_spec.grammar import (
    JSON_STYLE, GrammarError, GrammarSpec, TokenGrammar, TokenizerUnsupported,
)

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
BUY = {"type": "function", "function": {"name": "buy", "parameters": {
    "type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.01}}, "required": ["price"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
SURROGATE = json.loads('"\\ud800x"')  # what a request's JSON gives for a lone "\ud800"
# Pydantic's shape: models under $defs, referenced from the root; a linked list refers to itself.
ORDER = {"$defs": {
    "Item": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 5}, "qty": {"type": "integer",
             "minimum": 1}}, "required": ["sku", "qty"], "additionalProperties": False},
    "Node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [
        {"$ref": "#/$defs/Node"}, {"type": "null"}]}}, "required": ["v", "next"], "additionalProperties": False}},
    "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                                     "head": {"$ref": "#/$defs/Node"}},
    "required": ["items", "head"], "additionalProperties": False}
TREE = {"type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["child"],
        "additionalProperties": False}


def special_tokenizer():
    """The byte tokenizer with `<tool_call>` and `</tool_call>` as single added tokens (as Qwen2.5's)."""
    tok = byte_tokenizer()
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    return tok


def local(tokenizer=None, arch: str = "qwen2"):
    from thinkahead.models.local import LocalModel

    model = tiny_model(arch)
    model.config.max_position_embeddings = 8192
    return LocalModel(model=model, tokenizer=tokenizer or byte_tokenizer(), name="noisy")


@pytest.fixture(scope="module")
def noisy():
    return local()


def job(model, **data) -> ChatJob:
    return ChatJob(model, parse_request(ChatRequest, {"model": "noisy", **data}), default_max_tokens=64,
                   repair_attempts=1)


def run(model, **data):
    return asyncio.run(job(model, **data).run())


def refused(model, **data) -> RequestError:
    with pytest.raises(RequestError) as info:
        run(model, **data)
    return info.value


def script(model, replies, monkeypatch, *, check: bool = True) -> list:
    """`model.generate` answers `replies` in turn (a reply: text, or pieces encoded one by one, so that
    `<tool_call>` can be spelled in plain tokens); with `check`, each one must be what the request's
    grammar allows. Returns the requests it was given."""
    queue, seen = list(replies), []

    async def generate(request):
        seen.append(request)
        reply = queue.pop(0)
        pieces = reply if isinstance(reply, list) else [reply]
        ids = [t for p in pieces for t in model.tokenizer.encode(p, add_special_tokens=False)]
        ids.append(model.stop_token_ids[0])
        if check and request.grammar is not None:
            assert model.grammars.constraint(request.grammar).valid_prefix(ids) == len(ids), reply
        return Completion(text=model.tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids,
                          completion_tokens=len(ids))

    monkeypatch.setattr(model, "generate", generate, raising=False)
    return seen


def takes(grammars: TokenGrammar, spec: GrammarSpec, pieces: list[str], eos: bool = True) -> bool:
    tok = grammars.tokenizer
    ids = [t for p in pieces for t in tok.encode(p, add_special_tokens=False)] + ([tok.eos_token_id] if eos else [])
    return grammars.constraint(spec).valid_prefix(ids) == len(ids)


# ---------------------------------------------------------------- the grammar itself
def test_a_client_x_guidance_cannot_change_the_grammar(noisy):
    spec = GrammarSpec.json_schema({"type": "object", "x-guidance": 5})  # was a TypeError: a 500
    assert json.loads(spec.source)["x-guidance"] == JSON_STYLE
    run(noisy, messages=ASK, max_tokens=4, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "x-guidance": "loose"}}})
    # "lenient" would drop the keywords llguidance lacks: [1, 1] passes the grammar, fails the schema (a 500)
    with pytest.raises(GrammarError, match="Unimplemented"):
        noisy.grammars.compile(GrammarSpec.json_schema({"type": "array", "uniqueItems": True,
                                                        "x-guidance": {"lenient": True}}))


def test_lone_surrogates_are_a_400_by_field(noisy):
    with pytest.raises(GrammarError, match="not valid Unicode") as info:
        GrammarSpec.lark(f'start: "{SURROGATE}"', field="tools")
    assert info.value.field == "tools"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"enum": [SURROGATE]}}}}}
    # refused where the request is read, named to the string that holds it
    assert refused(noisy, messages=ASK, tools=[tool], tool_choice="required").param == \
        "tools[0].function.parameters.properties.a.enum[0]"
    assert refused(noisy, messages=[{"role": "user", "content": SURROGATE}]).param == "messages[0].content"


def test_a_tokenizer_llguidance_cannot_read_falls_back_to_checking(monkeypatch):
    class SlowTokenizer:  # not a PreTrainedTokenizerFast (a SentencePiece or Python backend)
        def __init__(self, fast):
            object.__setattr__(self, "_fast", fast)

        def __getattr__(self, name):
            return getattr(self._fast, name)

        def __setattr__(self, name, value):
            setattr(self._fast, name, value)

        def __len__(self):
            return len(self._fast)

        def __call__(self, *args, **kwargs):
            return self._fast(*args, **kwargs)

    grammars = TokenGrammar(SlowTokenizer(byte_tokenizer()), VOCAB)
    with pytest.raises(TokenizerUnsupported, match="fast tokenizers") as first:
        grammars.llg_tokenizer
    import llguidance.hf

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", lambda *a, **k: pytest.fail("tried again"))
    with pytest.raises(TokenizerUnsupported) as again:
        grammars.llg_tokenizer
    assert again.value is first.value
    monkeypatch.undo()
    model = local(SlowTokenizer(byte_tokenizer()))
    call = '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'  # after the forced "<tool_call>\n"
    seen = script(model, ["not json", '{"a": 1}', call], monkeypatch, check=False)
    [choice] = run(model, messages=ASK, response_format={"type": "json_object"})  # was a 400 on "model"
    assert (choice.content, choice.attempts) == ('{"a": 1}', 2)  # checked and repaired, as before grammars
    [choice] = run(model, messages=ASK, tools=[ADD], tool_choice="required")
    assert choice.calls[0].name == "add"
    assert all(r.grammar is None for r in seen)


# ---------------------------------------------------------------- tool grammars
@pytest.mark.parametrize("template", [None, LLAMA3_TEMPLATE])
def test_tool_schemas_with_references_compile_and_hold(template):
    tok = byte_tokenizer()
    tok.chat_template = template
    key = "parameters" if template else "arguments"
    wrap = (lambda s: s) if template else (lambda s: f"<tool_call>\n{s}\n</tool_call>")
    grammars = TokenGrammar(tok, VOCAB, [tok.eos_token_id])
    good = {"items": [{"sku": "ab", "qty": 2}], "head": {"v": 1, "next": {"v": 2, "next": None}}}
    bad = {"items": [{"sku": "ab", "qty": 0}], "head": {"v": 1, "next": None}}
    for tools in ({"order": ORDER}, {"order": ORDER, "tree": TREE, "any": None}):
        spec = tool_call_grammar(tok, tools, required=True)  # was a 400: "Pointer '/$defs/Item' does not exist"
        assert takes(grammars, spec, [wrap(json.dumps({"name": "order", key: good}))])
        assert not takes(grammars, spec, [wrap(json.dumps({"name": "order", key: bad}))])
    assert takes(grammars, spec, [wrap(json.dumps({"name": "tree", key: {"child": {"child": None}}}))])
    assert not takes(grammars, spec, [wrap(json.dumps({"name": "tree", key: {"child": {"child": 1}}}))])


def test_rebasing_touches_references_only():
    schema = {"properties": {"$ref": {"$ref": "#/$defs/A"}, "c": {"const": {"$ref": "#"}, "enum": [{"$ref": "#"}]}},
              "$defs": {"A": {"items": [{"$ref": "#"}], "$ref": "http://x/#/y"}}}
    assert rebased(schema, "#/p") == {
        "properties": {"$ref": {"$ref": "#/p/$defs/A"}, "c": {"const": {"$ref": "#"}, "enum": [{"$ref": "#"}]}},
        "$defs": {"A": {"items": [{"$ref": "#/p"}], "$ref": "http://x/#/y"}}}


def test_free_text_cannot_spell_the_call_opener():
    """Text a grammar leaves free never holds `<tool_call>` as text: the parser would read an
    unconstrained call there (a broken one was a 500)."""
    special = special_tokenizer()
    llama = byte_tokenizer()
    llama.chat_template = LLAMA3_TEMPLATE
    params = {"add": ADD["function"]["parameters"]}
    for tok in (special, llama, byte_tokenizer()):
        grammars = TokenGrammar(tok, VOCAB, [tok.eos_token_id])
        for spec in (tool_call_grammar(tok, params, required=False), ANSWER_GRAMMAR):
            assert takes(grammars, spec, ["Sure, it is five."])
            assert not takes(grammars, spec, ["Sure. <", 'tool_call>\n{"name": oops'], eos=False)
    grammars = TokenGrammar(special, VOCAB, [special.eos_token_id])
    auto = tool_call_grammar(special, params, required=False)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert takes(grammars, auto, ["Adding. ", call, " Done."])  # the real opener (one token) still opens calls


# ---------------------------------------------------------------- replies
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"}]


def test_a_repeated_call_is_answered_as_text_whatever_the_answer_holds(noisy, monkeypatch):
    repeat = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    seen = script(noisy, [repeat, "It is 5. <tool_call> {oops"], monkeypatch, check=False)
    [choice] = run(noisy, messages=HISTORY, tools=[ADD])  # was a 500: the answer was parsed for calls
    assert seen[1].grammar is ANSWER_GRAMMAR
    assert (choice.content, choice.calls, choice.finish_reason) == ("It is 5. <tool_call> {oops", [], "stop")


def test_auto_text_the_grammar_read_as_text_is_content(noisy, monkeypatch):
    text = '{"name": "add", "arguments": {"a": "two"}}'  # a bare call with bad arguments, in free text
    script(noisy, [text], monkeypatch)
    [choice] = run(noisy, messages=ASK, tools=[ADD], tool_choice="auto")  # was a 500
    assert (choice.content, choice.calls, choice.finish_reason) == (text, [], "stop")


def test_multiple_of_is_checked_in_decimal(noisy, monkeypatch):
    check_schema(19.99, {"multipleOf": 0.01}, "x")  # jsonschema alone: 19.99 / 0.01 = 1998.9999999999998
    check_schema(1e308, {"multipleOf": 0.01}, "x")
    for value in (19.995, float("inf")):
        with pytest.raises(OutputError, match="multiple"):
            check_schema(value, {"multipleOf": 0.01}, "x")
    script(noisy, ['<tool_call>\n{"name": "buy", "arguments": {"price": 19.99}}\n</tool_call>'], monkeypatch)
    [choice] = run(noisy, messages=ASK, tools=[BUY], tool_choice="required")  # was a 500
    assert json.loads(choice.calls[0].arguments) == {"price": 19.99}


@dataclass
class RemoteLike(ScriptedModel):
    """A backend that passes JSON schemas on to a server (as OpenAIModel): its output is not guaranteed."""

    grammar_kinds = ("json_schema",)


def test_a_remote_backends_reply_is_still_checked_and_repaired():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    model = RemoteLike(outputs=["Sure! here it is", '{"a": 1}'], name="remote")
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    [choice] = run(model, messages=ASK, response_format=fmt)  # was a 500 at the first bad reply
    assert (choice.content, choice.attempts) == ('{"a": 1}', 2)
    assert model.calls[0].request.grammar is not None
    model = RemoteLike(outputs=["no", '{"a": 1}'], name="remote")
    chat = job(model, messages=ASK, response_format=fmt)
    model.grammar_kinds = ()  # as OpenAIModel after its server refused response_format
    asyncio.run(chat.run())
    assert [c.request.grammar for c in model.calls] == [None, None]  # was a GrammarError: a 500


def test_a_schema_without_a_finite_output_is_a_400(noisy):
    endless = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"],
                               "additionalProperties": False}}, "$ref": "#/$defs/a"}
    error = refused(noisy, messages=ASK, max_tokens=20, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": endless}})  # compiles; was a 500 at decoding
    assert error.status == 400 and error.param == "response_format.json_schema.schema"
    assert "cannot be followed" in str(error)
    listed = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"$ref": "#/$defs/a"}}, "required": ["n"],
        "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}}}}
    error = refused(noisy, messages=ASK, max_tokens=40, temperature=0, tools=[listed], tool_choice="required")
    assert (error.status, error.param) == (400, "tools")


def test_a_stop_string_that_cuts_a_grammar_reply_returns_it(noisy):
    [choice] = run(noisy, messages=ASK, max_tokens=40, temperature=0, stop=['"'],
                   response_format={"type": "json_object"})  # was a 500: '{' is no JSON
    assert (choice.content, choice.finish_reason) == ("{", "stop")
    [choice] = run(noisy, messages=ASK, max_tokens=40, temperature=0, stop=['"'], tools=[ADD], tool_choice="required")
    assert (choice.content, choice.calls, choice.finish_reason) == ("<tool_call>\n{", [], "stop")


def test_malformed_or_oversized_grammars_are_400s(noisy):
    deep = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    for tools in ([{"type": "function", "function": {"name": "f", "parameters": deep}}],  # a RecursionError
                  [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
                      "a": {"type": "integer", "title": ["x"]}}}}}]):  # a SchemaError when a call was parsed
        error = refused(noisy, messages=ASK, tools=tools, tool_choice="required")
        assert (error.status, error.param) == (400, "tools")
    error = refused(noisy, messages=ASK, response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": deep}})
    assert (error.status, error.param) == (400, "response_format")
    many = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object", "properties": {
        f"p{j}": {"type": "string", "description": "d" * 40} for j in range(12)}}}} for i in range(400)]
    error = refused(noisy, messages=ASK, tools=many)  # the grammar's size limit: was a 500 (not inside the try)
    assert (error.status, error.param) == (400, "tools") and "characters" in str(error)
    remote = RemoteLike(outputs=["fine"], name="remote")  # no Lark there: the tools grammar is never built
    remote.tokenizer = byte_tokenizer()  # as OpenAIModel's, for counting
    assert job(remote, messages=ASK, tools=many).grammar is None  # was the size limit's 500


def test_a_template_that_refuses_the_messages_is_a_400():
    tok = byte_tokenizer()
    tok.chat_template = ("{% if messages|length > 1 %}{{ raise_exception('roles must alternate') }}{% endif %}"
                         "{% for m in messages %}{{ m.content }}\n{% endfor %}")
    error = refused(local(tok), messages=ASK + [{"role": "user", "content": "again"}])  # a TemplateError: a 500
    assert (error.status, error.param) == (400, "messages") and "alternate" in str(error)


def test_a_walk_that_fails_raises_the_grammars_error_not_its_rollbacks():
    """A matcher in error cannot roll back: the walk's GrammarError (a 400 naming the field) must not
    turn into the rollback's ValueError (a 500)."""
    import torch

    from thinkahead.token_spec.constrained import row_masks, verify_greedy_constrained
    from thinkahead.token_spec.draft import Draft

    tok = byte_tokenizer()  # printable ASCII only: no token can write the NUL the grammar needs after "aba"
    grammars = TokenGrammar(tok, VOCAB, [tok.eos_token_id])
    spec = GrammarSpec.regex("ab*a\x00", field="response_format")
    draft = Draft.chain(tok.encode("aba"))
    with pytest.raises(GrammarError, match="cannot go on") as info:
        row_masks(grammars.constraint(spec), draft)
    assert info.value.field == "response_format"
    logits = torch.zeros(len(draft) + 1, VOCAB)
    for row, t in enumerate(draft.token_ids):
        logits[row, t] = 1.0
    with pytest.raises(GrammarError, match="cannot go on"):
        verify_greedy_constrained(logits, draft, grammars.constraint(spec))
    # an error that leaves the matcher sound (here: the mask's caller interrupted): the walk gives back all it took
    constraint = grammars.constraint(GrammarSpec.regex("(ab|a)+"))
    real, calls = constraint.mask, []

    def failing_mask():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real()

    constraint.mask = failing_mask
    tree = Draft(tok.encode("ab") + tok.encode("a"), [-1, -1], [1.0, 1.0])  # two siblings
    assert not tree.is_chain
    for walk in (lambda: row_masks(constraint, draft), lambda: row_masks(constraint, tree)):
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            walk()
        assert constraint.consumed == 0
