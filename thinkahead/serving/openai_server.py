"""`thinkahead serve`: an OpenAI-compatible chat endpoint, so any agent framework can call
thinkahead as if it were a model.

The model name picks what runs: `thinkahead/<workflow>` or `thinkahead/<workflow>:<policy>`
(`thinkahead/cot:specreason`, `thinkahead/react`; the prefix may be left out, a missing policy is
the config's). The two models are loaded once and shared by every workflow and policy: the app
keeps one `Orchestrator` per policy, built on first use from one base `OrchestratorConfig` and
the same small/large model instances.

Routes:
- `GET /v1/models`: every workflow:policy combination, in OpenAI's list shape.
- `GET /health`: liveness, the models and the requests in flight.
- `POST /v1/chat/completions`: the last message (a user message) is the question; earlier
  messages are folded into it as context. The reply is a `chat.completion` whose message holds
  the answer as `content` and the reasoning steps as `reasoning_content` (as SGLang and vLLM
  reasoning servers do), plus a `thinkahead` field: run id, status, cost, and each step's
  author, verdict and score. With `stream: true`, Server-Sent Events of `chat.completion.chunk`s:
  the role, each reasoning step as soon as the step policy has decided it, the answer, the
  finish reason (with `usage` and `thinkahead`), then `[DONE]`.

`max_tokens` (or `max_completion_tokens`) caps the reasoning chain of the workflows that have
one (cot, vote, pipeline); sampling fields such as `temperature` are accepted and ignored, since
the workflow and its step policy decide how each model samples. Errors have OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request, 404 for an unknown
model or route, 500 for a run that failed (with the run's error). A client that disconnects
cancels its run, so no tokens are spent on an answer nobody reads. An agent that sends its
growing conversation turn after turn may add `"session_id": "..."` (an extension field): its
drafting state then carries over between requests instead of being rebuilt.

The app is plain ASGI (no web framework); uvicorn runs it. Requests run concurrently on one event
loop, at most `concurrency` runs at once (more wait in line).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from thinkahead.config import OrchestratorConfig
from thinkahead.models.base import LanguageModel
from thinkahead.orchestrator.trace import RunResult, jsonable
from thinkahead.sdk import Orchestrator
from thinkahead.step_spec.policies import POLICY_NAMES
from thinkahead.workflows import QUESTION_ONLY  # the workflows a chat request alone can run

PREFIX = "thinkahead/"
CHAIN_BUDGET_WORKFLOWS = ("cot", "vote", "pipeline")  # their `max_tokens` caps a reasoning chain
MAX_BODY_BYTES = 4 * 1024 * 1024

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class RequestError(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


def create_app(
    config: OrchestratorConfig | Mapping[str, Any] | None = None,
    *,
    small: LanguageModel | None = None,
    large: LanguageModel | None = None,
    concurrency: int | None = None,
) -> ChatServer:
    """The ASGI app. `config` is the base of every orchestrator (budgets, policy settings, default
    policy); `small`/`large` are loaded models (else loaded now from the config's specs);
    `concurrency` bounds the runs in flight (default: the config's)."""
    if not isinstance(config, OrchestratorConfig):
        config = OrchestratorConfig.model_validate(dict(config or {}))
    given = {id(m) for m in (small, large) if m is not None}
    if small is None or large is None:
        loader = Orchestrator(small, large, config=config)  # loads a spec used by both tiers once
        small, large = loader.small, loader.large
    owned = [m for m in {id(small): small, id(large): large}.values() if id(m) not in given]
    return ChatServer(config, small, large, concurrency=concurrency or config.concurrency, owned=owned)


class ChatServer:
    """The ASGI application behind `create_app`."""

    def __init__(self, config: OrchestratorConfig, small: LanguageModel, large: LanguageModel, *,
                 concurrency: int, owned: list[LanguageModel] | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.config, self.small, self.large = config, small, large
        self.owned = list(owned or [])  # the models this app loaded, closed at shutdown
        self.concurrency = concurrency
        self.gate = asyncio.Semaphore(concurrency)
        self.in_flight = 0
        self.created = int(time.time())
        self._orchestrators: dict[str, Orchestrator] = {}

    # ------------------------------------------------------------------ models and orchestrators

    def model_names(self) -> list[str]:
        return [f"{PREFIX}{w}:{p}" for w in QUESTION_ONLY for p in POLICY_NAMES]

    def resolve(self, model: str) -> tuple[str, str]:
        """`(workflow, policy)` from a model name, or a 404 naming the choices."""
        workflow, _, policy = model.removeprefix(PREFIX).partition(":")
        policy = policy or self.config.policy.name
        if workflow not in QUESTION_ONLY or policy not in POLICY_NAMES:
            raise RequestError(
                404, f"The model {model!r} does not exist; models are {PREFIX}<workflow>[:<policy>] with workflow "
                     f"one of {', '.join(QUESTION_ONLY)} and policy one of {', '.join(POLICY_NAMES)}",
                param="model", code="model_not_found")
        return workflow, policy

    def orchestrator(self, policy: str) -> Orchestrator:
        """The orchestrator of one step policy: the base config with that policy, the shared models."""
        if policy not in self._orchestrators:
            data = self.config.model_dump()
            data["policy"]["name"] = policy  # keeps the policy settings (threshold, router, ...)
            self._orchestrators[policy] = Orchestrator(self.small, self.large, config=data)
        return self._orchestrators[policy]

    async def aclose(self) -> None:
        """Release the models this app loaded (the caller's own models stay open)."""
        for model in self.owned:
            await model.aclose()

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            route = (scope["method"], scope["path"].rstrip("/"))
            if route == ("GET", "/v1/models"):
                await send_json(send, 200, {"object": "list", "data": [
                    {"id": name, "object": "model", "created": self.created, "owned_by": "thinkahead"}
                    for name in self.model_names()]})
            elif route == ("GET", "/health"):
                await send_json(send, 200, {"status": "ok", "small": self.small.name, "large": self.large.name,
                                            "in_flight": self.in_flight})
            elif route == ("POST", "/v1/chat/completions"):
                body = await read_body(receive)
                if body is not None:
                    await until_disconnect(receive, self.chat(parse_chat_request(body), send))
            elif route[1] in ("/v1/models", "/health", "/v1/chat/completions"):
                raise RequestError(405, f"method {scope['method']} is not allowed on {scope['path']}",
                                   code="method_not_allowed")
            else:
                raise RequestError(404, f"no route {scope['method']} {scope['path']}", code="not_found")
        except RequestError as exc:
            await send_json(send, exc.status, exc.body())

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ chat completions

    async def chat(self, request: dict[str, Any], send: Send) -> None:
        """Run the request's workflow and answer it, whole or as a stream."""
        workflow, policy = self.resolve(request["model"])
        orch = self.orchestrator(policy)
        options = dict(self.config.workflow_options) if workflow == self.config.workflow else {}
        if request["max_tokens"] is not None and workflow in CHAIN_BUDGET_WORKFLOWS:
            options["max_tokens"] = request["max_tokens"]
        try:
            graph = orch.workflow(workflow, **options)
        except ValueError as exc:
            raise RequestError(500, f"cannot build workflow {workflow!r}: {exc}", type="server_error") from exc
        reply = Reply(f"chatcmpl-{uuid.uuid4().hex[:24]}", request["model"], policy)
        inputs = {"question": request["question"]}
        if not request["stream"]:
            async with self.running():
                result = await orch.run(graph, inputs, id=reply.id, session=request["session"])
            if (error := run_error(result)) is not None:
                raise error
            await send_json(send, 200, reply.completion(result))
            return
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        await send_event(send, reply.chunk({"role": "assistant", "content": ""}))
        async with self.running():
            async for item in orch.stream(graph, inputs, id=reply.id, session=request["session"]):
                if isinstance(item, RunResult):
                    for event in reply.final_chunks(item):
                        await send_event(send, event)
                elif item.kind == "step" and item.data.get("text"):
                    await send_event(send, reply.chunk({"reasoning_content": item.data["text"]}))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """A slot of the concurrency gate, held while one run is in flight."""
        async with self.gate:
            self.in_flight += 1
            try:
                yield
            finally:
                self.in_flight -= 1


class Reply:
    """Builds the OpenAI objects of one completion from a run's result and events."""

    def __init__(self, id: str, model: str, policy: str) -> None:
        self.id, self.model, self.policy = id, model, policy
        self.created = int(time.time())

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}

    def completion(self, result: RunResult) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": answer_text(result)}
        reasoning = "".join(s["data"].get("text", "") for s in result.steps())
        if reasoning:
            message["reasoning_content"] = reasoning
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(result)}],
                "usage": usage(result), "thinkahead": self.summary(result)}

    def final_chunks(self, result: RunResult) -> list[dict[str, Any]]:
        """After the reasoning chunks: the answer and the finish, or an error event for a failed run."""
        if (error := run_error(result)) is not None:
            return [{**error.body(), "thinkahead": self.summary(result)}]
        out = []
        if answer := answer_text(result):
            out.append(self.chunk({"content": answer}))
        out.append(self.chunk({}, finish_reason(result), usage=usage(result), thinkahead=self.summary(result)))
        return out

    def summary(self, result: RunResult) -> dict[str, Any]:
        """The `thinkahead` field: what ran, what it cost, who wrote each step."""
        steps = [{"node": s["node"], **{k: s["data"].get(k) for k in ("author", "verdict", "score", "tokens")}}
                 for s in result.steps()]
        return {"run_id": result.id, "workflow": result.workflow, "policy": self.policy, "status": result.status,
                "error": result.error, "cost": jsonable(result.cost), "steps": steps}


def run_error(result: RunResult) -> RequestError | None:
    """A 500 for a run that failed; None for one that finished or that a budget cut short."""
    if result.status in ("ok", "budget"):
        return None
    return RequestError(500, f"run {result.id} ended {result.status}: {result.error}", type="server_error",
                        code="run_failed")


def answer_text(result: RunResult) -> str:
    answer = result.answer
    if answer is None:
        return ""
    return answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)


def finish_reason(result: RunResult) -> str:
    return "length" if result.status == "budget" else "stop"  # a budget cut the run short


def usage(result: RunResult) -> dict[str, int]:
    """Tokens of every model call of the run (judges and discarded drafts included)."""
    prompt, completion = int(result.cost.get("prompt_tokens", 0)), int(result.cost.get("total_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---------------------------------------------------------------------- requests


def parse_chat_request(body: bytes) -> dict[str, Any]:
    """The fields of a chat request the server uses, or a 400 naming what is wrong."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required: a string such as 'thinkahead/cot:specreason'", param="model")
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError(400, f"'max_tokens' must be a positive integer, got {max_tokens!r}", param="max_tokens")
    if data.get("n", 1) != 1:
        raise RequestError(400, "only n=1 is supported", param="n")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
    session = data.get("session_id")
    if session is not None and (not isinstance(session, str) or not session):
        raise RequestError(400, f"'session_id' must be a non-empty string, got {session!r}", param="session_id")
    return {"model": model, "question": question_from(data.get("messages")), "stream": stream,
            "max_tokens": max_tokens, "session": session}


def question_from(messages: Any) -> str:
    """The workflow's question: the last (user) message, after the earlier ones as context."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' is required: a non-empty list of {role, content} objects",
                           param="messages")
    lines = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string 'role'", param="messages")
        lines.append((m["role"], message_text(m.get("content"), i)))
    if lines[-1][0] != "user":
        raise RequestError(400, f"the last message must be the user's question, got role {lines[-1][0]!r}",
                           param="messages")
    context = "\n\n".join(f"{role}: {text}" for role, text in lines[:-1])
    return f"{context}\n\n{lines[-1][1]}" if context else lines[-1][1]


def message_text(content: Any, i: int) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise RequestError(400, f"messages[{i}].content: only text parts are supported", param="messages")
        return "".join(p["text"] for p in content)
    if content is None:
        return ""
    raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")


# ---------------------------------------------------------------------- ASGI helpers


async def read_body(receive: Receive) -> bytes | None:
    """The request body, or None if the client went away before sending it all."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > MAX_BODY_BYTES:
            raise RequestError(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
        if not message.get("more_body", False):
            return bytes(body)


async def until_disconnect(receive: Receive, work: Awaitable[None]) -> None:
    """Await `work`, cancelling it (and so its run) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task  # the run's own cleanup (cancelling its nodes) finishes before we return
    if not task.cancelled():
        task.result()  # re-raises a RequestError for the caller to answer


async def send_json(send: Send, status: int, payload: Any) -> None:
    body = json.dumps(payload, ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def send_event(send: Send, payload: Any) -> None:
    await send({"type": "http.response.body", "body": b"data: " + json.dumps(payload, ensure_ascii=False).encode()
                + b"\n\n", "more_body": True})
