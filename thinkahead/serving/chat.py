"""Plain chat models: the small and the large model by their names, one generation per choice (with
token-level speculation), as any OpenAI-compatible server answers.

Honoured: `temperature` (default 1, as OpenAI's), `top_p`, `seed` (choice i uses seed + i; seeded sampling
decodes without speculation, so that a seed gives the same text every time), `stop`,
`max_tokens` / `max_completion_tokens` (hard caps: finish reason "length"), `n`, `logprobs` /
`top_logprobs` (models that can score tokens), `response_format` (`json_object`, `json_schema`) and
tools (see `thinkahead.serving.tools`). A reply that breaks its tool-call or JSON format is retried
with the problem named (`repair_attempts` times), then answered with an error: never passed on as
if it were valid. Streaming sends the role at once, then the text as the model decodes it (round by
round, with each piece's logprobs), in OpenAI's chunk shapes; a reply that must be whole before it
can be checked (a JSON `response_format`, or tools) is sent when it is generated (tool calls as
`tool_calls` deltas).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError  # what a chat template's raise_exception raises (no ValueError)

from thinkahead.models.base import (
    Completion, GenerationRequest, LanguageModel, TextDelta, TokenLogprob, grammar_fits,
)
from thinkahead.serving.asgi import RequestError, Responder, unsupported
from thinkahead.serving.limits import check_context
from thinkahead.serving.schemas import SEED_RANGE, ChatRequest, Message, NamedToolChoice
from thinkahead.serving.tool_grammar import ANSWER_GRAMMAR, CALL_CLOSE, CALL_OPEN, tool_call_grammar
from thinkahead.serving.tools import (
    OutputError, ParsedCall, answered_calls, call_key, forced_prefix, json_instruction, parse_json_output,
    parse_tool_calls, render_prompt, schema_problem, tool_dicts,
)
from thinkahead.token_spec.grammar import GrammarError, GrammarSpec, TokenizerUnsupported
from thinkahead.token_spec.stats import SPEC_COUNTERS, SpecStats

log = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request gives none
# After tool results, as the last message: small models otherwise often repeat the call they made
# (Qwen2.5-Coder 0.5B and 1.5B: 0 of 2 answered from the result without it, 2 of 2 each with it; a longer
# text that also invited further calls was echoed back by the 0.5B). Further calls stay possible.
TOOL_RESULT_INSTRUCTION = "The tool results are above. Answer the user's question with them, in words."


@dataclass(slots=True)
class Choice:
    index: int
    content: str | None
    calls: list[ParsedCall]
    finish_reason: str
    logprobs: list[dict[str, Any]] | None
    completion_tokens: int  # of the reply returned (the last attempt)
    attempts: int = 1


@dataclass(slots=True)
class Spent:
    """Every internal call of one request, summed (the `thinkahead` field)."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec: SpecStats = field(default_factory=SpecStats)

    def add(self, c: Completion) -> None:
        self.calls += 1
        self.prompt_tokens += c.prompt_tokens
        self.completion_tokens += c.completion_tokens
        self.cached_tokens += c.cached_tokens
        self.spec += c.spec

    def to_dict(self) -> dict[str, Any]:
        return {"model_calls": self.calls, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                "spec": {k: getattr(self.spec, k) for k in SPEC_COUNTERS},
                "spec_accept_length": round(self.spec.spec_accept_length, 4) if self.spec.speculated else None}


def reproducible_speculation(seed: int | None, temperature: float) -> bool:
    """Whether to speculate: always, except for seeded sampling. Speculative sampling follows the
    model's distribution exactly, but its drafts (learnt from earlier requests) change how the seeded
    random numbers are drawn; plain decoding makes a seed give the same text every time."""
    return seed is None or temperature == 0


def sample_seed(seed: int, sample: int) -> int:
    """The seed of sample `sample` of a request seeded `seed`: `seed + sample`, wrapped into OpenAI's
    signed 64-bit range (which `seed` is in) so that a backend never gets a larger one."""
    low, high = SEED_RANGE
    return (seed + sample - low) % (high - low + 1) + low


def sampled_request(req: Any, prompt: str, max_new: int, sample: int, request_id: str | None = None) -> GenerationRequest:
    """One generation of a chat or completions request: its sampling settings, sample `sample`'s seed."""
    temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
    return GenerationRequest(
        prompt=prompt, max_new_tokens=max_new, temperature=temperature,
        top_p=1.0 if req.top_p is None else req.top_p, stop=req.stops,
        seed=None if req.seed is None else sample_seed(req.seed, sample), session_id=req.session_id,
        speculative=reproducible_speculation(req.seed, temperature), request_id=request_id)


def can_score(model: LanguageModel) -> bool:
    return type(model).token_logprobs is not LanguageModel.token_logprobs


class ChatJob:
    """One chat request to one plain model: checked on construction, run by `run`."""

    def __init__(self, model: LanguageModel, req: ChatRequest, *, default_max_tokens: int, repair_attempts: int) -> None:
        self.model, self.req, self.repair_attempts = model, req, repair_attempts
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if req.logprobs and not can_score(model):
            raise unsupported("logprobs", f"by model {model.name!r} (its backend cannot score tokens)")
        self.tools = {t.function.name: t for t in req.tools or []}
        for name, tool in self.tools.items():  # checked now: a call's arguments are checked against it
            if tool.function.parameters and (problem := schema_problem(tool.function.parameters)):
                raise RequestError(400, f"the parameters of tool {name!r} are not a valid JSON schema: {problem}",
                                   param="tools")
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if self.tools else "none")
        if choice in ("required", "auto") and not self.tools and req.tool_choice is not None:
            raise RequestError(400, f"tool_choice {choice!r} needs 'tools'", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tools:
            raise RequestError(400, f"tool_choice names {choice.function.name!r}, which is not in 'tools'",
                               param="tool_choice")
        self.tool_choice = choice
        self.required = choice == "required" or isinstance(choice, NamedToolChoice)
        self.rendered_tools = tool_dicts(req.tools) if self.tools and choice != "none" else None
        fmt = req.response_format if req.response_format is not None and req.response_format.type != "text" else None
        if fmt is not None and self.rendered_tools:
            raise RequestError(400, "response_format with tools is not supported: use one or the other",
                               param="response_format", code="unsupported_parameter")
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise RequestError(400, "response_format json_schema needs 'json_schema'", param="response_format")
            if fmt.json_schema.schema_ and (problem := schema_problem(fmt.json_schema.schema_)):
                raise RequestError(400, f"response_format.json_schema.schema is not a valid JSON schema: {problem}",
                                   param="response_format")
        self.fmt = fmt
        self.grammar = self._grammar(model)  # enforced while decoding, where the model can
        # valid by construction (no repair): only where our own decoder enforced it, not a remote server
        self.guaranteed = self.grammar is not None and model.grammar_guaranteed
        messages = list(req.messages)
        if fmt is not None:
            instruction = json_instruction(fmt)
            if messages[0].role in ("system", "developer"):
                messages[0] = Message(role="system", content=f"{messages[0].text}\n\n{instruction}")
            else:
                messages.insert(0, Message(role="system", content=instruction))
        if self.rendered_tools and messages[-1].role == "tool":
            messages.append(Message(role="system", content=TOOL_RESULT_INSTRUCTION))
        self.messages = messages
        self.answered = answered_calls(req.messages) if self.grammar is not None else set()
        self.prefix = forced_prefix(choice) if self.rendered_tools and self.grammar is None else ""
        try:
            self.prompt = self._render(messages)
        except (ValueError, TemplateError) as exc:  # e.g. a template that refuses this order of roles
            raise RequestError(400, f"the messages cannot be rendered for {model.name!r}: {exc}", param="messages") from None
        self.prompt_tokens = model.count_tokens(self.prompt)
        room = check_context(self.prompt_tokens, req.max_new, model.context_length, max_param=req.max_param)
        self.max_new = req.max_new or (default_max_tokens if room is None else min(default_max_tokens, room))
        self.spent = Spent()
        self.cached_tokens = 0

    def _render(self, messages: list[Message]) -> str:
        """The prompt; a template that refuses a system message after the tool results gets none."""
        try:
            return render_prompt(self.model, messages, self.rendered_tools) + self.prefix
        except (ValueError, TemplateError):
            if messages[-1].content != TOOL_RESULT_INSTRUCTION:
                raise
            self.messages = messages = messages[:-1]
            return render_prompt(self.model, messages, self.rendered_tools) + self.prefix

    def _grammar(self, model: LanguageModel) -> GrammarSpec | None:
        """The grammar of this request's reply (a JSON format, or calls to its tools) where `model`
        enforces it while decoding, else None (then the reply is checked and repaired afterwards)."""
        kinds = model.grammar_kinds
        try:
            if self.fmt is not None and "json_schema" in kinds:
                schema = self.fmt.json_schema.schema_ if self.fmt.json_schema is not None else None
                spec = (GrammarSpec.json_schema(schema, "response_format.json_schema.schema") if schema
                        else GrammarSpec.json_object("response_format"))
            elif self.fmt is None and self.rendered_tools and "lark" in kinds and getattr(model, "tokenizer", None):
                tools = self.tools
                if isinstance(self.tool_choice, NamedToolChoice):
                    tools = {self.tool_choice.function.name: tools[self.tool_choice.function.name]}
                spec = tool_call_grammar(model.tokenizer, {n: t.function.parameters for n, t in tools.items()},
                                         required=self.required, parallel=self.req.parallel_tool_calls is not False)
            else:
                return None
            model.check_grammar(spec)
        except TokenizerUnsupported as exc:  # the model's fault, not the request's: checked and repaired instead
            log.info("%s decodes without a grammar: %s", model.name, exc.reason)
            return None
        except GrammarError as exc:
            raise RequestError(400, str(exc), param=exc.field) from None
        return spec

    async def run(self) -> list[Choice]:
        return [await self.choice(i) for i in range(self.req.n)]

    @property
    def streams_text(self) -> bool:
        """Whether a streamed reply goes out as it is decoded: not when it must be whole to be checked
        (a JSON format, tools)."""
        return self.fmt is None and not self.rendered_tools

    def _request(self, prompt: str, index: int, grammar: GrammarSpec | None = None) -> GenerationRequest:
        request = sampled_request(self.req, prompt, self.max_new, index, request_id=f"chat-{uuid.uuid4().hex[:12]}")
        # only while the model still enforces it (a remote server that refused it stops enforcing any)
        request.grammar = grammar if grammar_fits(self.model, grammar) else None
        return request

    def repeats_answered(self, calls: list[ParsedCall]) -> bool:
        """Whether every call repeats one (same name and arguments) whose result is in the history,
        where the model could answer instead (tool_choice auto, a grammar to hold it to text)."""
        return (not self.required and grammar_fits(self.model, self.grammar)
                and all(call_key(c.name, c.arguments) in self.answered for c in calls))

    async def _generate(self, prompt: str, index: int, grammar: GrammarSpec | None = None) -> Completion:
        try:
            completion = await self.model.generate(self._request(prompt, index, grammar))
        except GrammarError as exc:  # one that compiled but cannot be followed (a schema with no finite output)
            raise RequestError(400, f"{exc.field}: the grammar cannot be followed while decoding: {exc.reason}",
                               param=exc.field) from None
        self.spent.add(completion)
        return completion

    async def stream_choice(self, index: int) -> AsyncIterator[TextDelta | Choice]:
        """Choice `index` as it is decoded (`streams_text` requests): its text deltas, then the `Choice`."""
        top = (self.req.top_logprobs or 0) if self.req.logprobs else None
        content: list[str] = []
        async for item in self.model.stream(self._request(self.prompt, index, self.grammar), top_logprobs=top):
            if isinstance(item, TextDelta):
                content.append(item.text)
                yield item
                continue
            self.spent.add(item)
            if index == 0:
                self.cached_tokens = item.cached_tokens
            yield Choice(index, "".join(content), [], item.finish_reason, None, item.completion_tokens)

    async def choice(self, index: int) -> Choice:
        prompt, attempts, grammar = self.prompt, 0, self.grammar
        while True:
            attempts += 1
            completion = await self._generate(prompt, index, grammar)
            if index == 0 and attempts == 1:
                self.cached_tokens = completion.cached_tokens
            text = self.prefix + self._text(completion)
            if completion.finish_reason == "length":  # cut by max_tokens: returned as is, marked "length"
                return Choice(index, text, [], "length", await self._logprobs(prompt, completion),
                              completion.completion_tokens, attempts)
            try:
                # the answer after a repeated call is text, whatever it holds
                content, calls = (text, []) if grammar is ANSWER_GRAMMAR else self._check(text)
            except OutputError as exc:
                as_text = completion.matched_stop is not None or (self.rendered_tools and not self.required)
                if self.guaranteed and as_text:
                    # the client's stop string cut the reply, or "auto" text the grammar read as text
                    # (a bare call with bad arguments): returned as it is, as a reply that max_tokens cut
                    return Choice(index, text, [], "stop", await self._logprobs(prompt, completion),
                                  completion.completion_tokens, attempts)
                if attempts > self.repair_attempts or self.guaranteed:  # a grammar: valid by construction
                    raise RequestError(
                        500, f"the model's reply did not fit the request after {attempts} attempts: {exc}",
                        type="server_error", code="invalid_model_output") from None
                retry = [*self.messages, Message(role="assistant", content=text),
                         Message(role="user", content=f"Your reply was not valid: {exc}. Reply again, correctly.")]
                prompt = render_prompt(self.model, retry, self.rendered_tools) + self.prefix
                continue
            if calls and grammar is self.grammar and self.repeats_answered(calls):
                # a call whose result the conversation already holds (a loop an agent framework would
                # follow forever): decode once more, as text only
                grammar = ANSWER_GRAMMAR
                continue
            finish = "tool_calls" if calls else "stop"
            return Choice(index, content, calls, finish, await self._logprobs(prompt, completion),
                          completion.completion_tokens, attempts)

    def _text(self, completion: Completion) -> str:
        """The reply's text; with tools, special tokens kept (Qwen2.5's `<tool_call>` is one, which a
        plain decode drops), end-of-turn tokens and a matched stop string left out."""
        tokenizer = getattr(self.model, "tokenizer", None)
        if not self.rendered_tools or tokenizer is None or not completion.token_ids:
            return completion.text
        drop = set(getattr(self.model, "stop_token_ids", ())) | set(getattr(tokenizer, "all_special_ids", ()))
        tags = {tokenizer.convert_tokens_to_ids(tag) for tag in (CALL_OPEN, CALL_CLOSE)}
        ids = [t for t in completion.token_ids if t not in drop or t in tags]  # no other special token is content
        text = tokenizer.decode(ids, skip_special_tokens=False)
        if completion.matched_stop and completion.matched_stop in text:
            text = text[:text.rfind(completion.matched_stop)]
        return text

    def _check(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.rendered_tools:
            parsed = parse_tool_calls(text, self.tools, required=self.required)
            calls = parsed.calls
            if isinstance(self.tool_choice, NamedToolChoice):
                calls = [c for c in calls if c.name == self.tool_choice.function.name]
            if self.req.parallel_tool_calls is False:
                calls = calls[:1]
            return parsed.content, calls
        if self.fmt is not None:
            return parse_json_output(text, self.fmt), []
        return text, []

    async def _logprobs(self, prompt: str, completion: Completion) -> list[dict[str, Any]] | None:
        if not self.req.logprobs:
            return None
        ids = list(completion.token_ids)
        stops = set(getattr(self.model, "stop_token_ids", ()))
        if ids and (ids[-1] in stops or completion.matched_stop is not None):
            ids = ids[:-1]  # the end-of-turn token or the token that completed a stop string is no content
        if not ids:
            return []
        prompt_ids = self.model.encode(prompt)
        return logprob_entries(await self.model.token_logprobs(prompt_ids + ids, len(prompt_ids),
                                                               self.req.top_logprobs or 0))


def logprob_entries(scored: list[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` entries of scored tokens."""
    return [token_entry(t.text, t.logprob, [token_entry(a, lp) for _, a, lp in t.top]) for t in scored]


def token_entry(text: str, logprob: float, top: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    if top is not None:
        entry["top_logprobs"] = top
    return entry


def tool_call_objects(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def chat_usage(job: ChatJob, choices: list[Choice], reasoning_tokens: int = 0) -> dict[str, Any]:
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
            "total_tokens": job.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


async def answer_chat(job: ChatJob, out: Responder, model_name: str) -> dict[str, Any]:
    """Run `job` and send its `chat.completion` (or its chunks); returns the usage, for metrics."""
    req, cid, created = job.req, f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    base = {"id": cid, "created": created, "model": model_name}
    if not req.stream:
        choices = await job.run()
        usage = chat_usage(job, choices)
        body = {**base, "object": "chat.completion", "choices": [], "usage": usage,
                "thinkahead": {"model": job.model.name, "attempts": [c.attempts for c in choices], **job.spent.to_dict()}}
        for c in choices:
            message: dict[str, Any] = {"role": "assistant", "content": c.content}
            if c.calls:
                message["tool_calls"] = tool_call_objects(c.calls)
            body["choices"].append({"index": c.index, "message": message, "finish_reason": c.finish_reason,
                                    "logprobs": None if c.logprobs is None else {"content": c.logprobs}})
        await out.json(200, body)
        return usage

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]}

    await out.start_events()
    for i in range(req.n):
        await out.event(chunk(i, {"role": "assistant", "content": ""}))
    choices = []
    for i in range(req.n):
        if job.streams_text:
            async for item in job.stream_choice(i):
                if isinstance(item, Choice):
                    choices.append(item)
                    await out.event(chunk(i, {}, item.finish_reason))
                elif item.text or item.logprobs:
                    await out.event(chunk(i, {"content": item.text}, logprobs=None if item.logprobs is None
                                          else {"content": logprob_entries(item.logprobs)}))
            continue
        c = await job.choice(i)
        choices.append(c)
        if c.content:
            await out.event(chunk(i, {"content": c.content},
                                  logprobs=None if c.logprobs is None else {"content": c.logprobs}))
        for k, call in enumerate(tool_call_objects(c.calls)):
            await out.event(chunk(i, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                      "function": {"name": call["function"]["name"], "arguments": ""}}]}))
            await out.event(chunk(i, {"tool_calls": [{"index": k, "function": {
                "arguments": call["function"]["arguments"]}}]}))
        await out.event(chunk(i, {}, c.finish_reason))
    usage = chat_usage(job, choices)
    if req.stream_options is not None and req.stream_options.include_usage:
        await out.event({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage,
                         "thinkahead": {"model": job.model.name, **job.spent.to_dict()}})
    await out.done()
    return usage
