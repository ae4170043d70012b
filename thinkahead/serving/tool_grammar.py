"""The grammar of a chat reply with tools: calls in the format the model's template defines, each
constrained to the request's tools (the name one of them, the arguments valid against its schema).

Format: Qwen/Hermes, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (what Qwen2.5's
template asks for and what the server's own instructions ask of models without a tools template).
Where the tokenizer has `<tool_call>` as one token the grammar names that token; elsewhere the tag
is text, found lazily in the free text.

- `auto`: free text (no special tokens: they never reach content) until the model opens a call;
  from there the call follows the grammar; text or more calls may follow.
- `required` and a named tool: the reply is calls only, from its first token (the opener is
  forced, so the decoder drafts it for free); one call where `parallel_tool_calls` is false.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from thinkahead.token_spec.grammar import GrammarSpec, styled_schema

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# A reply in words: no call, no special token, not opening with JSON or a code fence (the forms a
# call takes when a model writes one as text).
ANSWER_GRAMMAR = GrammarSpec.lark("start: /[^{`\\s](.|\\n)*/", field="tools")


def call_schema(tools: Mapping[str, dict[str, Any] | None]) -> dict[str, Any]:
    """`{"name": <a tool>, "arguments": <its parameters>}`, one branch per tool, in this key order."""
    branches = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params or ANY_OBJECT},
                 "required": ["name", "arguments"], "additionalProperties": False} for name, params in tools.items()]
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


__all__ = ["ANSWER_GRAMMAR", "CALL_CLOSE", "CALL_OPEN", "call_schema", "tool_call_grammar"]
