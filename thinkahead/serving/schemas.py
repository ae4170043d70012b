"""Typed request bodies of the OpenAI-compatible routes (pydantic, strict types).

Every OpenAI parameter is either honoured, accepted at its neutral value (`frequency_penalty: 0`,
`store: false`, ...), or refused with a 400 that names it; a name OpenAI does not have is refused
too. Nothing is dropped silently. `null` means "not given" for every optional field.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from thinkahead.serving.asgi import RequestError, find, param_path, unsupported

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_TOP_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**63 - 1)  # OpenAI's: a signed 64-bit integer
MAX_TOKENS_LIMIT = 2**31 - 1  # max_tokens and token ids: a signed 32-bit integer (a model's context is far smaller)
PROMPT_KINDS = "a string, a list of strings, a list of token ids or a list of lists of token ids"

# OpenAI parameters this server accepts only at their neutral value (what leaving them out means).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "best_of": (1,),
    "suffix": ("",),
}
# OpenAI parameters that exist but that this server cannot honour at any value but none.
REFUSED = ("audio", "function_call", "functions", "prediction", "reasoning_effort", "verbosity",
           "web_search_options", "prompt_cache_key", "safety_identifier", "prompt_cache_retention")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    """A chat message; reasoning that a client echoes back (`reasoning_content`, `reasoning`) is
    accepted and left out of the next prompt, as chat templates do."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class _Request(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    user: str | None = None
    session_id: str | None = Field(default=None, min_length=1)  # extension: an agent session

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


Prompt = str | list[str] | list[int] | list[list[int]]  # a /v1/completions prompt


class CompletionRequest(_Request):
    prompt: Prompt
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        """One of the four shapes, token ids in range; the error names the first item that is wrong
        (a plain union would report only that the prompt is not a string)."""
        if not isinstance(value, (str, list)):
            raise ValueError(f"must be {PROMPT_KINDS}")
        for where, token in prompt_tokens(value):
            if isinstance(token, bool) or not isinstance(token, int):
                raise ValueError(f"must be {PROMPT_KINDS}; {where} is {token!r}")
            check_token_id(token, where, MAX_TOKENS_LIMIT + 1)
        return value


def prompt_tokens(prompt: Any) -> Iterator[tuple[str, Any]]:
    """`(where, item)` for each item of a prompt given as token ids (`prompt[3]`, `prompt[1][3]`);
    nothing for a prompt given as text."""
    if isinstance(prompt, str) or all(isinstance(x, str) for x in prompt):
        return
    nested = all(isinstance(x, list) for x in prompt)
    for i, row in enumerate(prompt if nested else [prompt]):
        for j, token in enumerate(row):
            yield (f"prompt[{i}][{j}]" if nested else f"prompt[{j}]"), token


def check_token_id(token: int, where: str, vocab_size: int) -> None:
    """A ValueError naming `where` unless `token` is a token id below `vocab_size`."""
    if not 0 <= token < vocab_size:
        raise ValueError(f"{where} is {token}, not a token id (0 to {vocab_size - 1})")


def has_lone_surrogate(value: Any) -> bool:
    """Whether `value` is a string that UTF-8 cannot encode (`"\\ud800"` in JSON decodes to one)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _param(loc: tuple[Any, ...]) -> str:
    """A pydantic location as OpenAI names parameters: `messages[0].role`."""
    union_branch = ("str", "int", "float", "bool", "function-after", "function-before")
    return param_path(tuple(p for p in loc if isinstance(p, int) or ("[" not in p and p not in union_branch)))


def parse_request(cls: type[_Request], data: dict[str, Any]) -> Any:
    """`data` as a `cls`, or a 400 naming the first field that is wrong, unknown or unsupported."""
    if (hit := find(data, has_lone_surrogate, max_depth=None)) is not None:  # (parse_json bounds the depth)
        param = param_path(hit[0])
        raise RequestError(400, f"{param!r} holds a lone surrogate ({ascii(hit[1])[:40]}): "
                                "strings must be valid Unicode (UTF-8)", param=param)
    data = {k: v for k, v in data.items() if v is not None}  # null is "not given"
    if isinstance(data.get("messages"), list):  # clients echo replies back with their null fields
        data["messages"] = [{k: v for k, v in m.items() if v is not None and not (k == "annotations" and v == [])}
                            if isinstance(m, dict) else m for m in data["messages"]]
    try:
        request = cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param(err["loc"])
        if err["type"] == "missing":
            raise RequestError(400, f"{param!r} is required", param=param) from None
        got = repr(err.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."
        message = err["msg"].removeprefix("Value error, ")
        raise RequestError(400, f"{param!r}: {message} (got {got})", param=param) from None
    for name, value in (request.model_extra or {}).items():
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise unsupported(name, f"by this server at {value!r} (only {NEUTRAL[name][0]!r})")
        elif name in REFUSED:
            raise unsupported(name, "by this server")
        else:
            raise RequestError(400, f"unrecognized request argument supplied: {name}", param=name,
                               code="unknown_parameter")
    if len(request.stops) > MAX_STOP:
        raise RequestError(400, f"'stop' holds at most {MAX_STOP} strings, got {len(request.stops)}", param="stop")
    return request
