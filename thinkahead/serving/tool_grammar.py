"""The grammar of a chat reply with tools: calls in the format the model's template defines, each
constrained to the request's tools (the name one of them, the arguments valid against its schema).

Formats (`TOOL_FORMATS`, chosen from the chat template by `tool_format`):
- `hermes` (Qwen2.5, and the server's own instructions for models without a tools template):
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. Where the tokenizer has
  `<tool_call>` as one token the grammar names that token; elsewhere the tag is text, found lazily.
- `llama3-json` (Llama 3.1/3.2's JSON tool calling): the reply is `{"name": ..., "parameters": {...}}`.

- `auto`: free text (no special tokens: they never reach content) until the model opens a call;
  from there the call follows the grammar (llama3-json: a reply opening with `{` is a call).
- `required` and a named tool: the reply is calls only, from its first token (the opener is
  forced, so the decoder drafts it for free); one call where `parallel_tool_calls` is false.
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
# A reply in words: no call, no special token, not opening with JSON or a code fence (the forms a
# call takes when a model writes one as text).
ANSWER_GRAMMAR = GrammarSpec.lark("start: /[^{`\\s](.|\\n)*/", field="tools")


def call_schema(tools: Mapping[str, dict[str, Any] | None], arguments_key: str = "arguments") -> dict[str, Any]:
    """`{"name": <a tool>, "arguments": <its parameters>}`, one branch per tool, in this key order."""
    branches = [{"type": "object", "properties": {"name": {"const": name}, arguments_key: params or ANY_OBJECT},
                 "required": ["name", arguments_key], "additionalProperties": False} for name, params in tools.items()]
    return styled_schema(branches[0] if len(branches) == 1 else {"anyOf": branches})


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
        lark = f"%llguidance {{}}\nstart: {call}" + ("" if required else " | /[^{\\s](.|\\n)*/") + "\n"
        return GrammarSpec.lark(lark, field=field)
    body = f'"\\n" %json {json.dumps(call_schema(tools), ensure_ascii=False)} "\\n"'
    special = _is_token(tokenizer, CALL_OPEN) and _is_token(tokenizer, CALL_CLOSE)
    close = CALL_CLOSE if special else json.dumps(CALL_CLOSE)
    if required:
        opener = CALL_OPEN if special else json.dumps(CALL_OPEN)
        calls = 'call ("\\n" call)* "\\n"?' if parallel else 'call "\\n"?'
        lark = f"%llguidance {{}}\nstart: {calls}\ncall: {opener} {body} {close}\n"
    elif special:
        lark = (f"%llguidance {{}}\nstart: call* TEXT\ncall: TEXT {CALL_OPEN} {body} {close}\n"
                "TEXT: /(.|\\n)*/\n")
    else:
        lark = (f"%llguidance {{}}\nstart: call* TEXT\nopen[lazy]: TEXT {json.dumps(CALL_OPEN)}\n"
                f"call: open {body} {close}\nTEXT: /(.|\\n)*/\n")
    return GrammarSpec.lark(lark, field=field)


__all__ = ["ANSWER_GRAMMAR", "CALL_CLOSE", "CALL_OPEN", "HERMES", "TOOL_FORMATS", "ToolFormat", "call_schema",
           "tool_call_grammar", "tool_format"]
