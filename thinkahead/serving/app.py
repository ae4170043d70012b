"""`thinkahead serve`: an OpenAI-compatible endpoint, so any agent framework can call thinkahead as a model.

Two kinds of model names (both listed by `GET /v1/models`):
- the plain chat models, the small and the large model by their names: one generation per choice,
  with token-level speculation (`thinkahead.serving.chat`; tools and JSON outputs too);
- `thinkahead/<workflow>[:<policy>]` (`thinkahead/cot:specreason`, `thinkahead/react`; the prefix may
  be left out, a missing policy is the config's): a whole workflow per request
  (`thinkahead.serving.workflows`).

Routes: `POST /v1/chat/completions` (streaming too), `POST /v1/completions` (plain models),
`GET /v1/models`, `GET /v1/models/{id}`, `GET /health`, `GET /metrics` (Prometheus text).
Access and limits (`thinkahead.serving.limits`): an optional API key, JSON bodies only, CORS for the
allowed origins only, an optional Host check, prompts that fit the context, and a bounded waiting
line (429 with Retry-After past it). Errors have OpenAI's shape. A client that disconnects cancels
its request. The app is plain ASGI; uvicorn runs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from thinkahead.config import OrchestratorConfig
from thinkahead.models.base import LanguageModel, observe_first_completion
from thinkahead.orchestrator.trace import RunResult
from thinkahead.sdk import Orchestrator
from thinkahead.serving.asgi import (
    Receive, RequestError, Responder, Scope, Send, parse_json, read_body, until_disconnect,
)
from thinkahead.serving.chat import ChatJob, answer_chat
from thinkahead.serving.completions import CompletionJob, answer_completions
from thinkahead.serving.limits import (
    Admission, ServerSettings, check_access, check_context, check_json_content, cors_headers, preflight_headers,
)
from thinkahead.serving.metrics import Metrics
from thinkahead.serving.schemas import ChatRequest, CompletionRequest, parse_request
from thinkahead.serving.workflows import (
    PREFIX, WorkflowReply, check_workflow_request, client_tools, run_error, split_history,
)
from thinkahead.step_spec.policies import POLICY_NAMES
from thinkahead.workflows import QUESTION_ONLY  # the workflows a chat request alone can run

log = logging.getLogger(__name__)
ROUTES = {"/v1/chat/completions": "POST", "/v1/completions": "POST", "/v1/models": "GET", "/health": "GET",
          "/metrics": "GET"}


def create_app(
    config: OrchestratorConfig | Mapping[str, Any] | None = None,
    *,
    small: LanguageModel | None = None,
    large: LanguageModel | None = None,
    concurrency: int | None = None,
    settings: ServerSettings | Mapping[str, Any] | None = None,
) -> ChatServer:
    """The ASGI app. `config` is the base of every orchestrator (budgets, policy settings, default
    policy); `small`/`large` are loaded models (else loaded now from the config's specs);
    `concurrency` bounds the requests at work (default: the config's); `settings` are the server's
    own (API key, origins, queue, ...; see `ServerSettings`)."""
    if not isinstance(config, OrchestratorConfig):
        config = OrchestratorConfig.model_validate(dict(config or {}))
    if not isinstance(settings, ServerSettings):
        settings = ServerSettings.model_validate(dict(settings or {}))
    given = {id(m) for m in (small, large) if m is not None}
    if small is None or large is None:
        loader = Orchestrator(small, large, config=config)  # loads a spec used by both tiers once
        small, large = loader.small, loader.large
    owned = [m for m in {id(small): small, id(large): large}.values() if id(m) not in given]
    return ChatServer(config, small, large, concurrency=concurrency or config.concurrency, owned=owned,
                      settings=settings)


class ChatServer:
    """The ASGI application behind `create_app`."""

    def __init__(self, config: OrchestratorConfig, small: LanguageModel, large: LanguageModel, *,
                 concurrency: int, owned: list[LanguageModel] | None = None,
                 settings: ServerSettings | None = None) -> None:
        self.config, self.small, self.large = config, small, large
        self.settings = settings or ServerSettings()
        self.owned = list(owned or [])  # the models this app loaded, closed at shutdown
        self.concurrency = concurrency
        self.admission = Admission(concurrency, self.settings.max_queue, self.settings.retry_after_s)
        self.metrics = Metrics(lambda: {"thinkahead_queue_length": self.admission.waiting,
                                        "thinkahead_requests_running": self.admission.running})
        self.created = int(time.time())
        self._orchestrators: dict[str, Orchestrator] = {}
        self._orchestrators[config.policy.name] = self._build(config.policy.name)  # the default refuses at start
        for model in self.chat_models().values():  # tools and JSON replies: the first one need not wait
            model.prepare_grammars()

    @property
    def in_flight(self) -> int:
        return self.admission.running

    # ------------------------------------------------------------------ models and orchestrators

    def chat_models(self) -> dict[str, LanguageModel]:
        """The plain chat models by name (one entry when both tiers are one model)."""
        return {m.name: m for m in (self.small, self.large)}

    def model_names(self) -> list[str]:
        return [*self.chat_models(), *(f"{PREFIX}{w}:{p}" for w in QUESTION_ONLY for p in POLICY_NAMES)]

    def resolve(self, model: str) -> tuple[str, str]:
        """`(workflow, policy)` from a workflow model name, or a 404 naming the choices."""
        workflow, _, policy = model.removeprefix(PREFIX).partition(":")
        policy = policy or self.config.policy.name
        if workflow not in QUESTION_ONLY or policy not in POLICY_NAMES:
            raise RequestError(
                404, f"The model {model!r} does not exist; models are {', '.join(map(repr, self.chat_models()))} "
                     f"and {PREFIX}<workflow>[:<policy>] with workflow one of {', '.join(QUESTION_ONLY)} and policy "
                     f"one of {', '.join(POLICY_NAMES)}", param="model", code="model_not_found")
        return workflow, policy

    def orchestrator(self, policy: str) -> Orchestrator:
        """The orchestrator of one step policy: the base config with that policy, the shared models;
        a 400 where the policy's settings cannot run on these models (it names the setting)."""
        if policy not in self._orchestrators:
            try:
                self._orchestrators[policy] = self._build(policy)
            except ValueError as exc:
                raise RequestError(400, f"policy {policy!r} cannot run on this server's models: {exc}",
                                   param="model", code="model_not_supported") from None
        return self._orchestrators[policy]

    def _build(self, policy: str) -> Orchestrator:
        data = self.config.model_dump()
        data["policy"]["name"] = policy  # keeps the policy settings (threshold, router, ...)
        orch = Orchestrator(self.small, self.large, config=data)
        orch.runtime  # noqa: B018 - builds the policy over the shared models, which checks that it can run on them
        return orch

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
        out = Responder(send, cors_headers(scope, self.settings))
        started, status, model = time.perf_counter(), 200, ""
        path, method = scope["path"].rstrip("/") or "/", scope["method"]
        route = path if path in ROUTES else "/v1/models/{id}" if path.startswith("/v1/models/") else "other"
        try:
            check_access(scope, self.settings)
            if method == "OPTIONS" and route != "other":
                await out.start(204, preflight_headers())
                await send({"type": "http.response.body", "body": b""})
                return
            if route == "/v1/models/{id}" and method == "GET":
                name = path.removeprefix("/v1/models/")
                if name not in self.model_names():
                    self.resolve(name)  # a 404, or a workflow name written without its prefix or policy
                await out.json(200, self.model_card(name))
            elif route == "other":
                raise RequestError(404, f"no route {method} {scope['path']}", code="not_found")
            elif method != ROUTES.get(route, "GET"):
                raise RequestError(405, f"method {method} is not allowed on {scope['path']}", code="method_not_allowed")
            elif route == "/v1/models":
                await out.json(200, {"object": "list", "data": [self.model_card(n) for n in self.model_names()]})
            elif route == "/health":
                await out.json(200, {"status": "ok", "small": self.small.name, "large": self.large.name,
                                     "in_flight": self.admission.running, "waiting": self.admission.waiting})
            elif route == "/metrics":
                await out.text(200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
            else:
                check_json_content(scope)
                body = await read_body(receive, self.settings.max_body_bytes)
                if body is None:
                    return
                data = parse_json(body)
                model = data.get("model") if isinstance(data.get("model"), str) else ""
                handler = self.chat if route == "/v1/chat/completions" else self.completions
                await until_disconnect(receive, handler(data, out))
        except RequestError as exc:
            status = exc.status
            if exc.status >= 500:
                log.warning("%s %s: %s", method, path, exc)
            await out.error(exc)
        finally:
            if route != "/metrics":
                self.metrics.request(route, model if model in self.chat_models() else "workflow" if model else "",
                                     status, time.perf_counter() - started)

    def model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "thinkahead"}

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ handlers

    async def completions(self, data: dict[str, Any], out: Responder) -> None:
        req = parse_request(CompletionRequest, data)
        model = self.chat_models().get(req.model)
        if model is None:
            raise RequestError(404, f"The model {req.model!r} does not exist on /v1/completions; its models are "
                                    f"{', '.join(map(repr, self.chat_models()))}", param="model", code="model_not_found")
        job = CompletionJob(model, req)
        async with self.admission.slot():
            usage = await answer_completions(job, out, req.model)
        self._count(usage, job.spent)

    async def chat(self, data: dict[str, Any], out: Responder) -> None:
        req = parse_request(ChatRequest, data)
        model = self.chat_models().get(req.model)
        if model is not None:
            job = ChatJob(model, req, default_max_tokens=self.settings.default_max_tokens,
                          repair_attempts=self.settings.repair_attempts)
            async with self.admission.slot():
                usage = await answer_chat(job, out, req.model)
            self._count(usage, job.spent)
            return
        await self.workflow_chat(req, out)

    def _count(self, usage: dict[str, Any], spent: Any) -> None:
        self.metrics.tokens(usage["prompt_tokens"], usage["completion_tokens"],
                            usage["prompt_tokens_details"]["cached_tokens"])
        self.metrics.speculation({**spent.spec.counters(), "completion_tokens": spent.completion_tokens})

    async def workflow_chat(self, req: ChatRequest, out: Responder) -> None:
        """Run the request's workflow and answer it, whole or as a stream."""
        workflow, policy = self.resolve(req.model)
        check_workflow_request(req, workflow, req.model)
        use_tools = bool(req.tools) and req.tool_choice != "none"
        question, transcript = split_history(req, use_tools)
        counter = self.large
        prompt_tokens = counter.count_tokens(counter.render([{"role": "user", "content": question}]))
        for m in (self.small, self.large):
            check_context(prompt_tokens, None, m.context_length)
        orch = self.orchestrator(policy)
        options = dict(self.config.workflow_options) if workflow == self.config.workflow else {}
        if req.max_new is not None:
            options["max_tokens"] = req.max_new
        if use_tools:
            options["client_tools"] = client_tools(req.tools or [])
            options["require_call"] = req.tool_choice == "required"  # each turn an action (under its grammar)
        try:
            graph = orch.workflow(workflow, **options)
        except ValueError as exc:
            raise RequestError(500, f"cannot build workflow {workflow!r}: {exc}", type="server_error") from exc
        reply = WorkflowReply(req.model, policy, prompt_tokens, counter.count_tokens, req.tools if use_tools else None,
                              max_tokens=req.max_new, stop=req.stops)  # usage never reports more than allowed
        inputs = {"question": question, **({"transcript": transcript} if transcript else {})}
        if not req.stream:
            async with self.admission.slot():
                with observe_first_completion() as reply.first_call:
                    result = await orch.run(graph, inputs, id=reply.id, session=req.session_id)
            self._observe(result)
            if (error := run_error(result)) is not None:
                raise error
            await out.json(200, reply.completion(result))
            return
        async with self.admission.slot():
            await out.start_events()
            await out.event(reply.chunk({"role": "assistant", "content": ""}))
            streamed = False
            with observe_first_completion() as reply.first_call:
                async for item in orch.stream(graph, inputs, id=reply.id, session=req.session_id):
                    if isinstance(item, RunResult):
                        self._observe(item)
                        for event in reply.final_chunks(item, streamed):
                            await out.event(event)
                    elif item.kind == "step" and item.data.get("text") and item.data.get("kind") != "final":
                        text = item.data["text"]
                        await out.event(reply.chunk({"reasoning_content": text, "reasoning": text}))
                        streamed = True
        await out.done()

    def _observe(self, result: RunResult) -> None:
        cost = result.cost
        self.metrics.inc("thinkahead_workflow_runs_total", workflow=result.workflow, status=result.status)
        self.metrics.tokens(int(cost.get("prompt_tokens", 0)), int(cost.get("total_tokens", 0)),
                            int(cost.get("cached_tokens", 0)))
        self.metrics.speculation({**(cost.get("spec") or {}), "completion_tokens": cost.get("total_tokens", 0)})
        for s in result.steps():
            self.metrics.step(str(s["data"].get("author")), str(s["data"].get("verdict")))
