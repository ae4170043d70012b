"""Tool calling for chat models: prompts rendered with the request's tools, outputs parsed back into
OpenAI `tool_calls`, JSON outputs (`response_format`) extracted and validated.

Rendering goes through the model's own chat template when it has a tools section (Qwen2.5's renders
the tools in its system prompt and expects `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
back); other models get the same Hermes-style instructions as a system message and the history as
plain messages. `tool_choice` "required" or a named function is enforced by opening the assistant
turn with `<tool_call>` (and the name): the model can only go on with a call.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from thinkahead.models.base import LanguageModel
from thinkahead.serving.schemas import Message, NamedToolChoice, ResponseFormat, ToolDef
from thinkahead.serving.tool_grammar import CALL_CLOSE, CALL_OPEN, without_titles

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
_DECODER = json.JSONDecoder()
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_FENCED_BLOCK = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)
TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


class OutputError(ValueError):
    """A model output that does not fit the request (bad tool call, JSON that does not validate)."""


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(slots=True)
class Parsed:
    """A checked assistant turn: its text (None when it only calls tools) and its tool calls."""

    content: str | None
    calls: list[ParsedCall]


def call_key(name: str, arguments: str) -> tuple[str, str]:
    """A call's identity: its name and its arguments as canonical JSON (key order and spacing ignored)."""
    try:
        canonical = json.dumps(json.loads(arguments), sort_keys=True)
    except json.JSONDecodeError:
        canonical = arguments
    return name, canonical


def answered_calls(messages: list[Message]) -> set[tuple[str, str]]:
    """The calls of the history's assistant turns whose results (tool messages) follow them."""
    results = {m.tool_call_id for m in messages if m.role == "tool" and m.tool_call_id is not None}
    return {call_key(c.function.name, c.function.arguments) for m in messages for c in (m.tool_calls or [])
            if c.id in results}


def tool_dicts(tools: list[ToolDef] | None) -> list[dict[str, Any]] | None:
    """The tools as the prompt lists them: their parameters without schema `title`s. Pydantic-made
    schemas (the OpenAI Agents SDK's) title a tool's parameters `<tool>_args`, and small models copy
    that title as the tool's name (Qwen2.5-Coder 0.5B: 4 of 10 arithmetic questions with the SDK's
    agent; 0 of 10 without the titles). A title is an annotation: validation ignores it."""
    if not tools:
        return None
    out = []
    for t in tools:
        item = t.model_dump(exclude_none=True)
        if "parameters" in item["function"]:
            item["function"]["parameters"] = without_titles(item["function"]["parameters"])
        out.append(item)
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """The history as Hugging Face chat templates take it (tool calls with arguments as objects)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        item: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.tool_calls:
            item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        if m.role == "tool" and m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            item["name"] = m.name
        out.append(item)
    return out


def plain_messages(messages: list[Message], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """The history as plain {role, content} messages: tools in the system message, calls and results as text."""
    out: list[dict[str, str]] = []
    for m in messages:
        text = m.text
        if m.tool_calls:
            calls = "\n".join(f"{CALL_OPEN}\n" + json.dumps({"name": c.function.name,
                                                              "arguments": _arguments(c.function.arguments)})
                              + f"\n{CALL_CLOSE}" for c in m.tool_calls)
            text = f"{text}\n{calls}" if text else calls
        if m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    if tools:
        listing = TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def render_prompt(model: LanguageModel, messages: list[Message], tools: list[dict[str, Any]] | None) -> str:
    """The raw prompt of a chat request for `model`, ending where the assistant's reply starts."""
    tokenizer = getattr(model, "tokenizer", None)
    template = getattr(tokenizer, "chat_template", None)
    uses_tools = bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
    if isinstance(template, str) and (not uses_tools or "tool" in template):
        return tokenizer.apply_chat_template(template_messages(messages), tools=tools, tokenize=False,
                                             add_generation_prompt=True)
    return model.render(plain_messages(messages, tools))


def forced_prefix(tool_choice: str | NamedToolChoice | None) -> str:
    """Text that opens the assistant turn so that the model must call a tool (the named one)."""
    if isinstance(tool_choice, NamedToolChoice):
        return f'{CALL_OPEN}\n{{"name": {json.dumps(tool_choice.function.name)}, "arguments": '
    return f"{CALL_OPEN}\n" if tool_choice == "required" else ""


def parse_tool_calls(text: str, tools: dict[str, ToolDef], *, required: bool) -> Parsed:
    """The assistant turn `text` as content and tool calls; `OutputError` for a call that is not valid
    JSON, names no known tool, or has arguments that do not fit the tool's schema."""
    calls = []
    bodies = [m.group(1) for m in _CALL.finditer(text)]
    rest = _CALL.sub("", text)
    if not bodies and _bare_call(text, tools):
        bodies = [text.strip()]  # a call written without its tags (or a server that dropped them)
    elif not bodies:  # calls written as fenced JSON blocks, each naming a listed tool
        fenced = {m.group(0) for m in _FENCED_BLOCK.finditer(text) if _valid_call(m.group(1), tools)}
        bodies = [m.group(1) for m in _FENCED_BLOCK.finditer(text) if m.group(0) in fenced]
        rest = _FENCED_BLOCK.sub(lambda m: "" if m.group(0) in fenced else m.group(0), text)
    objects = []
    for body in bodies:
        try:
            data, end = _DECODER.raw_decode(body)
        except json.JSONDecodeError as exc:
            raise OutputError(f"the tool call {body[:200]!r} is not valid JSON: {exc}") from None
        objects.append(data)
        objects += _more_calls(body[end:], tools)  # an unclosed block running on: further calls kept
    for data in objects:
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise OutputError(f'a tool call must be an object {{"name": ..., "arguments": {{...}}}}, got {data!r}'[:300])
        name, arguments = data["name"], data.get("arguments", data.get("parameters", {}))  # Llama 3: "parameters"
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise OutputError(f"the arguments of tool call {name!r} are not valid JSON: {exc}") from None
        if name not in tools:
            raise OutputError(f"the tool call names {name!r}; the tools are {', '.join(tools)}")
        if not isinstance(arguments, dict):
            raise OutputError(f"the arguments of tool call {name!r} must be a JSON object, got {arguments!r}"[:300])
        schema = tools[name].function.parameters
        if schema:
            check_schema(arguments, schema, f"the arguments of tool call {name!r}")
        calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
    if required and not calls:
        raise OutputError("a tool call is required (tool_choice), but the reply calls none")
    content = rest.strip() if calls and bodies[0] != text.strip() else None if calls else text
    return Parsed(content or None, calls)


def _more_calls(rest: str, tools: dict[str, ToolDef]) -> list[Any]:
    """Further call objects after a call's JSON in one block; the text after them (a model running on
    past its call without closing the block) is not part of any call and is left out."""
    out = []
    while rest.strip().startswith("{"):
        try:
            data, end = _DECODER.raw_decode(rest.strip())
        except json.JSONDecodeError:
            break
        if not (isinstance(data, dict) and data.get("name") in tools and "arguments" in data):
            break
        out.append(data)
        rest = rest.strip()[end:]
    return out


def _bare_call(text: str, tools: dict[str, ToolDef]) -> bool:
    """Whether `text` is only a tool call's JSON object, `{"name": <a tool>, "arguments": ...}`."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return False
    try:
        data = json.loads(stripped)
    except json.JSONDecodeError:
        return False
    return (isinstance(data, dict) and set(data) in ({"name", "arguments"}, {"name", "parameters"})
            and data.get("name") in tools)


def _valid_call(text: str, tools: dict[str, ToolDef]) -> bool:
    """Whether `text` is one call's JSON object naming a listed tool, with arguments that fit its schema."""
    if not _bare_call(text, tools):
        return False
    data = json.loads(text)
    arguments = data.get("arguments", data.get("parameters"))
    schema = tools[data["name"]].function.parameters
    try:
        if schema and isinstance(arguments, dict):
            check_schema(arguments, schema, "arguments")
    except OutputError:
        return False
    return isinstance(arguments, dict)


def check_schema(value: Any, schema: dict[str, Any], what: str) -> None:
    import jsonschema

    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)  # as jsonschema.validate: a SchemaError for a schema that is none
    error = jsonschema.exceptions.best_match(_exact_validator(cls)(schema).iter_errors(value))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path)
        raise OutputError(f"{what} do not fit the schema{' at ' + where if where else ''}: {error.message}")


def _multiple_of(validator: Any, divisor: Any, instance: Any, schema: Any) -> Any:
    """`multipleOf` in decimal: jsonschema divides floats (19.99 is no multiple of 0.01 there, while the
    grammar, and everyone reading the JSON, takes it)."""
    import math
    from decimal import Decimal, InvalidOperation, localcontext

    from jsonschema import ValidationError
    from jsonschema._keywords import multipleOf

    if (not validator.is_type(instance, "number") or isinstance(divisor, bool)
            or not isinstance(divisor, (int, float)) or not divisor > 0):
        yield from multipleOf(validator, divisor, instance, schema)
        return
    if isinstance(instance, float) and not math.isfinite(instance):  # jsonschema's check raises on these
        yield ValidationError(f"{instance!r} is not a multiple of {divisor}")
        return
    try:
        with localcontext() as ctx:
            ctx.prec = 1000  # every finite float's quotient is exact at this precision
            failed = Decimal(repr(instance)) % Decimal(repr(divisor)) != 0
    except (InvalidOperation, ValueError):  # a longer integer: jsonschema's own (exact for integers)
        yield from multipleOf(validator, divisor, instance, schema)
        return
    if failed:
        yield ValidationError(f"{instance!r} is not a multiple of {divisor}")


@functools.cache
def _exact_validator(cls: Any) -> Any:
    import jsonschema

    return jsonschema.validators.extend(cls, {"multipleOf": _multiple_of})


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why `schema` is not a valid JSON schema, or None."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return exc.message
    except RecursionError:
        return "the schema is nested too deeply"
    return None


def json_instruction(fmt: ResponseFormat) -> str:
    """The system instruction of a JSON `response_format`."""
    if fmt.type == "json_schema" and fmt.json_schema is not None and fmt.json_schema.schema_:
        return ("Reply with one JSON value only, no other text, that matches this JSON schema:\n"
                + json.dumps(fmt.json_schema.schema_))
    return "Reply with one JSON object only, no other text."


def parse_json_output(text: str, fmt: ResponseFormat) -> str:
    """The JSON of a reply (fences and surrounding text removed), checked against the format."""
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    if fenced:
        stripped = fenced.group(1)
    try:  # the whole reply is one JSON value (any type: a schema's root need not be an object)
        value, start, end = json.loads(stripped), 0, len(stripped)
    except json.JSONDecodeError:
        value = None
        start = -1
    if start == 0:
        _check_json_value(value, fmt)
        return stripped[start:end]
    starts = [i for i in (stripped.find("{"), stripped.find("[")) if i >= 0]
    if not starts:
        raise OutputError(f"the reply holds no JSON: {text[:200]!r}")
    try:
        value, end = json.JSONDecoder().raw_decode(stripped, min(starts))
    except json.JSONDecodeError as exc:
        raise OutputError(f"the reply is not valid JSON: {exc}") from None
    _check_json_value(value, fmt)
    return stripped[min(starts):end]


def _check_json_value(value: Any, fmt: ResponseFormat) -> None:
    if fmt.type == "json_object" and not isinstance(value, dict):
        raise OutputError(f"the reply must be a JSON object, got {type(value).__name__}")
    if fmt.type == "json_schema" and fmt.json_schema is not None and fmt.json_schema.schema_:
        check_schema(value, fmt.json_schema.schema_, "the reply's JSON")
