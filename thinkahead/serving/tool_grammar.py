"""The grammar of a chat reply with tools: calls in the format the model's template defines, each
constrained to the request's tools (the name one of them, the arguments valid against its schema).

Formats (`TOOL_FORMATS`, chosen from the chat template by `tool_format`):
- `hermes` (Qwen2.5, and the server's own instructions for models without a tools template):
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. Where the tokenizer has
  `<tool_call>` as one token the grammar names that token; elsewhere the tag is text, found lazily.
- `llama3-json` (Llama 3.1/3.2's JSON tool calling): the reply is `{"name": ..., "parameters": {...}}`.

- `auto`: free text (no special tokens: they never reach content; never `<tool_call>` as text, which
  the parser would read as a call the grammar did not check) until the model opens a call; from there
  the call follows the grammar (llama3-json: a reply opening with `{` is a call).
- `required` and a named tool: the reply is calls only, from its first token (the opener is
  forced, so the decoder drafts it for free); one call where `parallel_tool_calls` is false.

A tool's parameters move into the call's schema; their document-local `$ref`s ("#/$defs/Item", as
Pydantic writes them) are rebased to where they now stand (`rebased`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from thinkahead.token_spec.grammar import GrammarSpec, styled_schema

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """How a model family writes a call: the key its arguments go under, and the tags around a call."""

    name: str
    arguments_key: str
    tagged: bool  # calls inside <tool_call> tags (else: the reply is the call's JSON object)
    marks: tuple[str, ...] = ()  # text of a chat template that uses this format


TOOL_FORMATS = (
    ToolFormat("hermes", "arguments", tagged=True, marks=("<tool_call>",)),
    ToolFormat("llama3-json", "parameters", tagged=False,
               marks=('"parameters": dictionary of argument name', "<|python_tag|>")),
)
HERMES = TOOL_FORMATS[0]


def tool_format(tokenizer: Any) -> ToolFormat:
    """The call format of `tokenizer`'s chat template; hermes where the template names none (the
    server's own tool instructions ask for it)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        for fmt in TOOL_FORMATS:
            if any(mark in template for mark in fmt.marks):
                return fmt
    return HERMES


ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Free text never holds the opener as text: the parser would read a call there that the grammar did not
# constrain (a special-token opener's text, or any text in a format without tags).
NO_OPENER = f"~/(.|\\n)*{CALL_OPEN}(.|\\n)*/"
# A reply in words: no call, no special token, not opening with JSON or a code fence (the forms a
# call takes when a model writes one as text).
ANSWER_GRAMMAR = GrammarSpec.lark(f"start: ANSWER\nANSWER: /[^{{`\\s](.|\\n)*/ & {NO_OPENER}\n", field="tools")
# Keywords whose values are data, not schemas (a "$ref" key there is no reference), and those whose
# values map names to schemas (a property may be named "$ref").
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def rebased(schema: Any, base: str) -> Any:
    """`schema` as it reads when placed at JSON pointer `base` ("#/properties/arguments") of a bigger
    schema: its document-local references ("#", "#/$defs/Item", as Pydantic writes them) point there."""
    if isinstance(schema, list):
        return [rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: rebased(sub, base) for name, sub in value.items()}
        else:
            out[key] = rebased(value, base)
    return out


def without_titles(schema: Any) -> Any:
    """`schema` less its `title` annotations, as a prompt lists it (a property named "title", and a
    "title" key inside data such as `default` or `enum`, stay)."""
    if isinstance(schema, list):
        return [without_titles(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: without_titles(sub) for name, sub in value.items()}
        else:
            out[key] = without_titles(value)
    return out


def call_schema(tools: Mapping[str, dict[str, Any] | None], arguments_key: str = "arguments") -> dict[str, Any]:
    """`{"name": <a tool>, "arguments": <its parameters>}`, one branch per tool, in this key order; each
    tool's references rebased to where its parameters now stand."""
    one = len(tools) == 1
    branches = [{"type": "object", "properties": {
        "name": {"const": name},
        arguments_key: rebased(params, f"#{'' if one else f'/anyOf/{i}'}/properties/{arguments_key}") or ANY_OBJECT},
        "required": ["name", arguments_key], "additionalProperties": False}
        for i, (name, params) in enumerate(tools.items())]
    return styled_schema(branches[0] if one else {"anyOf": branches})


def _is_token(tokenizer: Any, text: str) -> bool:
    """Whether `text` is a single token of `tokenizer` (an added token such as Qwen's `<tool_call>`)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - any tokenizer failure: treat the tag as text
        return False
    return len(ids) == 1


def tool_call_grammar(tokenizer: Any, tools: Mapping[str, dict[str, Any] | None], *, required: bool,
                      parallel: bool = True, field: str = "tools") -> GrammarSpec:
    """The Lark grammar of a reply that may (`required=False`) or must call `tools`."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    fmt = tool_format(tokenizer)
    if not fmt.tagged:
        call = f"%json {json.dumps(call_schema(tools, fmt.arguments_key), ensure_ascii=False)}"
        text = "" if required else f" | TEXT\nTEXT: /[^{{\\s](.|\\n)*/ & {NO_OPENER}"
        return GrammarSpec.lark(f"%llguidance {{}}\nstart: {call}{text}\n", field=field)
    body = f'"\\n" %json {json.dumps(call_schema(tools), ensure_ascii=False)} "\\n"'
    special = _is_token(tokenizer, CALL_OPEN) and _is_token(tokenizer, CALL_CLOSE)
    close = CALL_CLOSE if special else json.dumps(CALL_CLOSE)
    if required:
        opener = CALL_OPEN if special else json.dumps(CALL_OPEN)
        calls = 'call ("\\n" call)* "\\n"?' if parallel else 'call "\\n"?'
        lark = f"%llguidance {{}}\nstart: {calls}\ncall: {opener} {body} {close}\n"
    elif special:
        lark = (f"%llguidance {{}}\nstart: call* TEXT\ncall: TEXT {CALL_OPEN} {body} {close}\n"
                f"TEXT: /(.|\\n)*/ & {NO_OPENER}\n")
    else:
        lark = (f"%llguidance {{}}\nstart: call* TEXT\nopen[lazy]: TEXT {json.dumps(CALL_OPEN)}\n"
                f"call: open {body} {close}\nTEXT: /(.|\\n)*/\n")
    return GrammarSpec.lark(lark, field=field)


__all__ = ["ANSWER_GRAMMAR", "CALL_CLOSE", "CALL_OPEN", "HERMES", "TOOL_FORMATS", "ToolFormat", "call_schema",
           "rebased", "tool_call_grammar", "tool_format", "without_titles"]
