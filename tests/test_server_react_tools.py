"""How a workflow run ends over real HTTP (uvicorn, the `openai` client and httpx): `thinkahead/react` with
the client's tools either hands a tool call to the client (`tool_calls`), answers, or, cut short by its
turn limit, finishes with "length"; a run with neither an answer nor a call is an error, never an empty
success. A workflow's `usage.completion_tokens` never exceeds the request's `max_tokens`."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.llm_judge import LLM_SPECREASON
from tests.server_fixtures import JUDGE_YES, chat, scripted_pair, serve, sse_payloads  # noqa: F401 (fixture)
from thinkahead.models import ScriptedModel
from thinkahead.serving.openai_server import create_app

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = ' I need the weather.\nAction: get_weather[{"city": "Paris"}]\n'
MAX_TURNS = 6  # react's default `max_turns`
STEP = re.compile(r"Step \d+ goes")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def react_server(serve, outputs) -> tuple[ScriptedModel, str]:
    """A server whose large model (react's agent) writes `outputs`; the small model is never asked."""
    large = ScriptedModel(outputs=outputs, logprobs=JUDGE_YES, name="large")
    return large, serve(create_app({"policy": LLM_SPECREASON}, small=ScriptedModel(name="small"), large=large))


def streamed(url: str, request: dict) -> list:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**request, "stream": True}, timeout=30) as response:
        assert response.status_code == 200
        return list(sse_payloads(response))


# --------------------------------------------------------------------------- react: no answer, no call


def test_a_react_run_that_never_answers_nor_calls_a_tool_finishes_with_length_not_an_empty_stop(serve):
    large, url = react_server(serve, [" Hmm, I am not sure what to do.\n"])  # never an Action, never a Final Answer
    reply = client(url).chat.completions.create(model="thinkahead/react", messages=ASK, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "length"  # the turn limit cut it short: not "stop" with an empty content
    assert not choice.message.content and choice.message.tool_calls is None
    assert len(large.generated_prompts()) == MAX_TURNS
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning.count("Thought: Hmm, I am not sure what to do.") == MAX_TURNS
    assert reasoning.count("Observation: error: no action") == MAX_TURNS
    extra = reply.model_extra["thinkahead"]
    assert (extra["workflow"], extra["answer"]) == ("react", None)
    assert reply.usage.completion_tokens == extra["cost"]["total_tokens"] > 0


def test_a_react_run_that_keeps_calling_its_tools_badly_finishes_with_length_when_streamed(serve):
    # every call names the tool with arguments its schema refuses: an error observation each turn
    _, url = react_server(serve, [' Let me look.\nAction: get_weather[{"town": "Paris"}]\n'])
    events = streamed(url, {"model": "thinkahead/react", "messages": ASK, "tools": [WEATHER]})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("error" not in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert not any(c["choices"][0]["delta"].get("content") or c["choices"][0]["delta"].get("tool_calls")
                   for c in chunks)
    assert "'city' is a required property" in "".join(
        c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)


def test_an_empty_final_answer_is_a_no_answer_error_not_an_empty_success(serve):
    _, url = react_server(serve, [" I am done.\nFinal Answer: "])
    with pytest.raises(openai.InternalServerError) as err:
        client(url).chat.completions.create(model="thinkahead/react", messages=ASK, tools=[WEATHER])
    assert err.value.status_code == 500
    assert err.value.body["code"] == "no_answer" and err.value.body["type"] == "server_error"
    assert "Final Answer was empty" in err.value.body["message"]
    # streamed: the error event, then [DONE]; no finish_reason "stop"
    events = streamed(url, {"model": "thinkahead/react", "messages": ASK, "tools": [WEATHER]})
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "no_answer"
    assert events[-2]["thinkahead"]["status"] == "ok"
    assert not any(isinstance(e, dict) and "choices" in e and e["choices"][0]["finish_reason"] for e in events)


# --------------------------------------------------------------------------- react: a call for the client


def test_a_react_call_of_a_client_tool_comes_back_as_tool_calls_even_on_the_last_turn(serve):
    bad = ' Let me look.\nAction: get_weather[{"town": "Paris"}]\n'
    large, url = react_server(serve, [bad] * (MAX_TURNS - 1) + [CALL])
    reply = client(url).chat.completions.create(model="thinkahead/react", messages=ASK, tools=[WEATHER])
    choice = reply.choices[0]
    assert len(large.generated_prompts()) == MAX_TURNS  # the loop's last turn: the call wins over "length"
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I need the weather."
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")


def test_a_streamed_react_call_of_a_client_tool_is_assembled_by_the_client(serve):
    _, url = react_server(serve, [CALL])
    stream = client(url).chat.completions.create(model="thinkahead/react", messages=ASK, tools=[WEATHER], stream=True)
    content, name, arguments, finish = "", "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            name += (d.function.name or "") if d.function else ""
            arguments += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert (finish, content, name, json.loads(arguments)) == (
        "tool_calls", "I need the weather.", "get_weather", {"city": "Paris"})


# --------------------------------------------------------------------------- usage within max_tokens


def endless_steps(prompt: str, request) -> str:
    """A new seven-word step each call, never a final answer: a chain that only a budget stops."""
    n = len(STEP.findall(prompt)) + 1
    return f"Step {n} goes on and on here.\n\n"


def budget_server(serve) -> str:
    small = ScriptedModel(outputs=endless_steps, name="small")
    large = ScriptedModel(outputs=["391"], logprobs=JUDGE_YES, name="large")
    return serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))


@pytest.mark.parametrize("workflow", ["cot", "vote", "pipeline"])
def test_a_workflows_usage_never_exceeds_max_tokens(serve, workflow):
    url = budget_server(serve)
    reply = client(url).chat.completions.create(model=f"thinkahead/{workflow}", max_tokens=10,
                                                messages=[{"role": "user", "content": "What is 17 * 23?"}])
    generated = reply.model_extra["thinkahead"]["cost"]["total_tokens"]
    assert generated > 10  # the last step started under the chain budget and ran past it: the true count stays here
    assert reply.usage.completion_tokens == 10 and reply.choices[0].finish_reason == "length"
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 10
    assert reply.usage.completion_tokens_details.reasoning_tokens <= 10


def test_max_completion_tokens_caps_the_usage_of_a_streamed_workflow(serve):
    url = budget_server(serve)
    events = streamed(url, chat("thinkahead/cot", max_completion_tokens=12))
    last = events[-2]
    assert last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 12 < last["thinkahead"]["cost"]["total_tokens"]


def test_a_run_within_max_tokens_reports_its_true_usage_and_stops(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    body = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot", max_tokens=100)).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["message"]["content"] == "So \\boxed{391}."
    assert body["usage"]["completion_tokens"] == body["thinkahead"]["cost"]["total_tokens"] == 3
