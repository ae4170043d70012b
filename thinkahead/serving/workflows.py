"""Workflow models, `thinkahead/<workflow>[:<policy>]`: a chat request runs a whole workflow.

The reply's `content` is the workflow's final text as the model wrote it (cot: the final step,
"So the answer is \\boxed{391}."), the reasoning before it is in both `reasoning_content` (SGLang,
DeepSeek) and `reasoning` (vLLM), steps keeping their separators; the extracted answer and every
step (author, verdict, score, tokens, text) are in the `thinkahead` field. A parameter a workflow
cannot honour (sampling settings: the step policy decides how each model samples) is a 400 that
names it. `max_tokens` caps the reasoning chain of cot, vote and pipeline (finish reason "length"
when the chain ran out), and the reply's `usage.completion_tokens` never exceeds it: each step writes
at most what the chain budget has left, but the forced answer comes after it and a step may hold several
generations (a draft and its rewrite), so a run can generate more; its usage is then reported at the
cap, finish reason "length" (`thinkahead.cost` keeps the true count). With `tools`, `thinkahead/react` offers them to its agent loop: a call of one
ends the run with OpenAI `tool_calls`, and the next request, with the tool's result in its history,
continues the loop where it stopped.

A run ends in one of three ways: an answer (finish "stop"), a tool call for the client (finish
"tool_calls"), or cut short. A run cut short by a budget, a step limit or its loop's turn limit (react's
`max_turns`) is finish "length", with whatever text it has; one that finished with neither an answer nor
a tool call for any other reason is a 500 `no_answer` error naming why, never an empty success.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from thinkahead.models.base import FirstCompletion
from thinkahead.orchestrator.trace import RunResult, jsonable
from thinkahead.serving.asgi import RequestError, unsupported
from thinkahead.serving.schemas import ChatRequest, Message, ToolDef
from thinkahead.serving.tool_grammar import ANY_OBJECT
from thinkahead.serving.tools import OutputError, check_schema
from thinkahead.verifiers.grading.latex import normalize_math

log = logging.getLogger(__name__)

PREFIX = "thinkahead/"
CHAIN_BUDGET_WORKFLOWS = ("cot", "vote", "pipeline")  # their `max_tokens` caps a reasoning chain
SAMPLING_PARAMS = ("temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs")
LENGTH_STOPS = ("max_steps", "max_tokens", "max_large_calls")  # a chain stopped by its budget


def check_workflow_request(req: ChatRequest, workflow: str, model: str) -> None:
    """A 400 naming the first parameter the workflow cannot honour."""
    given = req.model_fields_set
    for name in SAMPLING_PARAMS:
        if name == "stop" and workflow == "react":
            continue  # the final answer is cut at a stop string (agent frameworks send their own markers)
        if name in given and not (name == "logprobs" and req.logprobs is False):
            raise unsupported(name, f"by workflow models ({model}): the step policy chooses how each model samples")
    if req.n != 1:
        raise unsupported("n", f"by workflow models ({model}): one run answers one request")
    if req.response_format is not None and req.response_format.type != "text":
        raise unsupported("response_format", f"by workflow models ({model})")
    if req.max_new is not None and workflow not in CHAIN_BUDGET_WORKFLOWS:
        raise unsupported(req.max_param, f"by workflow {workflow!r} (it caps the chain of "
                                         f"{', '.join(CHAIN_BUDGET_WORKFLOWS)})")
    if req.tools and workflow != "react":
        raise unsupported("tools", f"by workflow {workflow!r} (thinkahead/react takes tools)")
    allowed = ("auto", "none", "required") if workflow == "react" and req.tools else ("auto", "none")
    if req.tool_choice is not None and req.tool_choice not in allowed:
        raise unsupported("tool_choice", f"{req.tool_choice!r} by {model} (only {' or '.join(map(repr, allowed))})")


def fold(messages: list[Message]) -> str:
    """The workflow's question: the last message's text, after the earlier ones as context."""
    lines = [(m.role, m.text) for m in messages]
    context = "\n\n".join(f"{role}: {text}" for role, text in lines[:-1])
    return f"{context}\n\n{lines[-1][1]}" if context else lines[-1][1]


def split_history(req: ChatRequest, use_tools: bool) -> tuple[str, str]:
    """(question, react transcript so far): tool calls and results after the last user message
    become the transcript's Thought / Action / Observation lines."""
    messages = req.messages
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    if last_user < 0:
        raise RequestError(400, "the messages need a user message (the question)", param="messages")
    tail = messages[last_user + 1:]
    if tail and not use_tools:
        raise RequestError(400, f"the last message must be the user's question, got role {messages[-1].role!r}",
                           param="messages")
    transcript = ""
    for m in tail:
        if m.role == "assistant" and m.tool_calls:
            thought = m.text.strip() or f"I will call {m.tool_calls[0].function.name}."
            for call in m.tool_calls:
                transcript += f"Thought: {thought}\nAction: {call.function.name}[{call.function.arguments}]\n"
        elif m.role == "tool":
            transcript += f"Observation: {m.text}\n"
        else:
            raise RequestError(400, "after the question, only assistant tool calls and tool results may follow, "
                                    f"got role {m.role!r}", param="messages")
    question = fold(messages[:last_user + 1])
    if not question.strip():  # a workflow cannot reason about nothing
        raise RequestError(400, "the question (the last user message) is empty", param=f"messages[{last_user}].content")
    return question, transcript


def react_arguments(tool: ToolDef, text: str) -> dict[str, Any]:
    """The arguments of a react `Action: name[...]`: a JSON object, or the bare text of a one-parameter tool."""
    schema = tool.function.parameters or {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        props = list((schema.get("properties") or {}))
        if len(props) != 1:
            raise OutputError(f"the input of {tool.function.name} must be a JSON object of its arguments") from None
        value = {props[0]: text}
    if not isinstance(value, dict):
        raise OutputError(f"the input of {tool.function.name} must be a JSON object of its arguments")
    if schema:
        check_schema(value, schema, f"the arguments of {tool.function.name}")
    return value


def client_tools(tools: list[ToolDef]) -> dict[str, Any]:
    """The request's tools as react client tools: each checks a call's argument (its doc is its listing)."""
    out = {}
    for tool in tools:
        def check(text: str, tool: ToolDef = tool) -> str | None:
            try:
                react_arguments(tool, text)
            except OutputError as exc:
                return str(exc)
            return None

        params = json.dumps(tool.function.parameters or {"type": "object", "properties": {}})
        check.__doc__ = f"{(tool.function.description or tool.function.name).splitlines()[0]} Input: a JSON object, schema {params}"
        check.parameters = tool.function.parameters or ANY_OBJECT  # type: ignore[attr-defined]  # react's grammar
        out[tool.function.name] = check
    return out


def answer_text(result: RunResult) -> str:
    answer = result.answer
    if answer is None:
        return ""
    return answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)


def content_node(result: RunResult) -> str | None:
    """The think node whose final step is the workflow's final text."""
    o = result.outputs
    if result.workflow == "cot":
        return "answer"
    if result.workflow == "pipeline":
        return "solution" if o.get("answer") == o.get("solution") else None
    if result.workflow == "vote" and isinstance(result.answer, str):
        key = normalize_math(result.answer)
        return next((n for n in sorted(o) if n.startswith("chain_") and not n.endswith("_reasoning")
                     and isinstance(o[n], str) and normalize_math(o[n]) == key), None)
    return None


def texts(result: RunResult) -> tuple[str, str]:
    """(content, reasoning) of a finished run."""
    o = result.outputs
    if result.workflow == "react":
        observe = o.get("observe") or {}
        return (observe.get("final") or ""), observe.get("transcript", "")
    if result.workflow == "refine":
        return str(o.get("draft") or answer_text(result)), str(o.get("critique") or "")
    node = content_node(result)
    steps = [s for s in result.steps() if node is None or s["node"] == node]
    final = "".join(s["data"].get("text", "") for s in steps if s["data"].get("kind") == "final")
    reasoning = "".join(s["data"].get("text", "") for s in steps if s["data"].get("kind") != "final")
    if result.workflow == "pipeline" and node is None:
        return str(o.get("review") or answer_text(result)), reasoning
    return final or answer_text(result), reasoning


def pending_call(result: RunResult) -> tuple[str, dict[str, Any]] | None:
    """(thought, tool call) of a react run that stopped at a client tool."""
    observe = result.outputs.get("observe") or {}
    pending = observe.get("pending") if isinstance(observe, dict) else None
    if not pending:
        return None
    turn = observe.get("transcript", "").rstrip().rsplit("Thought:", 1)[-1]
    return turn.split("Action:", 1)[0].strip(), pending


class WorkflowReply:
    """Builds the OpenAI objects of one workflow run from its result and events."""

    def __init__(self, model: str, policy: str, prompt_tokens: int, count_tokens: Any,
                 tools: list[ToolDef] | None, max_tokens: int | None = None, stop: list[str] | None = None) -> None:
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
        self.id, self.model, self.policy = f"chatcmpl-{uuid.uuid4().hex[:24]}", model, policy
        self.created = int(time.time())
        self.prompt_tokens, self.count_tokens = prompt_tokens, count_tokens
        self.tools = {t.function.name: t for t in tools or []}
        self.max_tokens = max_tokens  # the request's max_tokens / max_completion_tokens, where the workflow takes it
        self.stop = [t for t in stop or [] if t]  # the content ends before the first of these (OpenAI's semantics)
        self.first_call = FirstCompletion()  # the run's first internal generation (`observe_first_completion`)

    @property
    def cached_tokens(self) -> int:
        """Tokens of the request's own prompt that the run's first generation found in the prefix cache."""
        first = self.first_call.completion
        return 0 if first is None else min(first.cached_tokens, self.prompt_tokens)

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra}

    def message(self, result: RunResult) -> tuple[dict[str, Any], str]:
        """The assistant message and the finish reason."""
        content, reasoning = texts(result)
        cuts = [content.find(t) for t in self.stop if t in content]
        content = content[:min(cuts)] if cuts else content
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        pending = pending_call(result)
        if pending is not None:
            thought, call = pending
            arguments = react_arguments(self.tools[call["tool"]], call["input"])
            message["content"] = thought or None
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {
                "name": call["tool"], "arguments": json.dumps(arguments, ensure_ascii=False)}}]
            return message, "tool_calls"
        return message, "length" if self.over_cap(result) else finish_reason(result, content)

    def over_cap(self, result: RunResult) -> bool:
        """Whether the run generated more tokens than the request's `max_tokens` allowed."""
        return self.max_tokens is not None and generated(result) > self.max_tokens

    def completion(self, result: RunResult) -> dict[str, Any]:
        message, finish = self.message(result)
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                "usage": self.usage(result, message.get("content") or ""), "thinkahead": self.summary(result)}

    def final_chunks(self, result: RunResult, streamed_reasoning: bool) -> list[dict[str, Any]]:
        """After the reasoning chunks: the content (or tool calls) and the finish."""
        if (error := run_error(result)) is not None:
            return [{**error.body(), "thinkahead": self.summary(result)}]
        message, finish = self.message(result)
        out = []
        if not streamed_reasoning and message.get("reasoning"):
            out.append(self.chunk({"reasoning_content": message["reasoning"], "reasoning": message["reasoning"]}))
        if message.get("content"):
            out.append(self.chunk({"content": message["content"]}))
        for k, call in enumerate(message.get("tool_calls") or []):
            out.append(self.chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function", "function": {
                "name": call["function"]["name"], "arguments": ""}}]}))
            out.append(self.chunk({"tool_calls": [{"index": k, "function": {
                "arguments": call["function"]["arguments"]}}]}))
        out.append(self.chunk({}, finish, usage=self.usage(result, message.get("content") or ""),
                              thinkahead=self.summary(result)))
        return out

    def usage(self, result: RunResult, content: str) -> dict[str, Any]:
        """OpenAI's usage: the request's own prompt, every generated token (judges and discarded drafts
        included), of which those not in `content` are reasoning."""
        completion = generated(result)
        if self.max_tokens is not None and completion > self.max_tokens:
            log.info("run %s generated %d tokens, over the request's max_tokens=%d: usage reports the cap",
                     result.id, completion, self.max_tokens)
            completion = self.max_tokens
        reasoning = max(0, completion - self.count_tokens(content)) if content else completion
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                "completion_tokens_details": {"reasoning_tokens": reasoning}}

    def summary(self, result: RunResult) -> dict[str, Any]:
        """The `thinkahead` field: what ran, its answer, what every internal call cost, who wrote each step."""
        steps = [{"node": s["node"], **{k: s["data"].get(k) for k in ("author", "verdict", "score", "tokens", "kind",
                                                                        "text")}}
                 for s in result.steps()]
        return {"run_id": result.id, "workflow": result.workflow, "policy": self.policy, "status": result.status,
                "error": result.error, "answer": result.answer, "cost": jsonable(result.cost), "steps": steps}


def generated(result: RunResult) -> int:
    """Every token the run generated (judges and discarded drafts included)."""
    return int(result.cost.get("total_tokens", 0))


def run_error(result: RunResult) -> RequestError | None:
    """A 500 for a run that failed, or that finished with neither an answer nor a tool call and was not
    cut short; None for one that answered, stopped at a client tool, or that a budget or limit cut short."""
    if result.status not in ("ok", "budget"):
        return RequestError(500, f"run {result.id} ended {result.status}: {result.error}", type="server_error",
                            code="run_failed")
    if (why := no_answer(result)) is not None:
        return RequestError(500, f"run {result.id} of workflow {result.workflow!r} finished without an answer: {why}",
                            type="server_error", code="no_answer")
    return None


def no_answer(result: RunResult) -> str | None:
    """Why a run that was not cut short has no answer (no final text, no client tool call); None otherwise."""
    if pending_call(result) is not None:
        return None
    content, _ = texts(result)
    if content.strip() or finish_reason(result, content) == "length":
        return None
    observe = result.outputs.get("observe")
    if result.workflow == "react" and isinstance(observe, dict) and observe.get("final") is not None:
        return "the agent's Final Answer was empty"
    return "the workflow produced no final text and no tool call"


def finish_reason(result: RunResult, content: str = "") -> str:
    """"length" when a budget cut the run or its chain short, or a loop ran out of turns before the
    run had any final text (react's `max_turns`), else "stop"."""
    if result.status == "budget":
        return "length"
    ends = [e["data"] for e in result.trace if e["kind"] == "node_end"]
    if any(d.get("stop_reason") in LENGTH_STOPS for d in ends):
        return "length"
    return "length" if not content.strip() and any(d.get("bounded") for d in ends) else "stop"
