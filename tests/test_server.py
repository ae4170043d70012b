"""The OpenAI-compatible server's workflow models (`thinkahead/<workflow>[:<policy>]`), answered over real
HTTP: uvicorn in a thread, httpx as the client. Plain chat models, tools, completions and limits have
their own files (tests/test_server_*.py)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest
import uvicorn
from click.testing import CliRunner

from tests.llm_judge import LLM_SPECREASON
from tests.server_fixtures import JUDGE_YES, chat, scripted_pair, serve, sse_payloads  # noqa: F401 (fixture)
from thinkahead.cli.serve import serve as serve_command
from thinkahead.models import ScriptedModel
from thinkahead.serving.openai_server import ChatServer, create_app


def doubling_small(prompt: str, request) -> str:
    """Two steps for 'What is N * 2?': the answer depends on the request, whatever the interleaving."""
    n = int(re.search(r"What is (\d+) \* 2\?", prompt).group(1))
    return f"So \\boxed{{{2 * n}}}." if "Double it." in prompt else "Double it.\n\n"


def test_models_lists_every_workflow_policy_combination_and_health(serve):
    small, large = scripted_pair()
    app = create_app({"policy": LLM_SPECREASON}, small=small, large=large)
    assert app.owned == []  # the caller's models: the app never closes them
    url = serve(app)
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list"
    ids = [m["id"] for m in models["data"]]
    workflows = ["cot", "react", "refine", "vote", "pipeline"]
    policies = ["large", "small", "specreason", "arbitrage", "reflect"]
    assert ids == ["small-scripted", "large-scripted"] + [f"thinkahead/{w}:{p}" for w in workflows for p in policies]
    assert {(m["object"], m["owned_by"]) for m in models["data"]} == {("model", "thinkahead")}
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "small": "small-scripted",
                                                 "large": "large-scripted", "in_flight": 0, "waiting": 0}
    card = httpx.get(f"{url}/v1/models/thinkahead/cot:specreason")
    assert card.status_code == 200 and card.json()["id"] == "thinkahead/cot:specreason"
    assert httpx.get(f"{url}/v1/models/small-scripted").json()["id"] == "small-scripted"
    missing = httpx.get(f"{url}/v1/models/gpt-4o")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_completion_holds_the_final_text_the_reasoning_usage_and_the_steps(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    request = {"model": "thinkahead/cot:specreason", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 * 23?"}]}
    response = httpx.post(f"{url}/v1/chat/completions", json=request)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "thinkahead/cot:specreason"
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    # content: the final text as written; the reasoning before it, separators kept, under both names
    assert body["choices"] == [{"index": 0, "finish_reason": "stop", "logprobs": None, "message": {
        "role": "assistant", "content": "So \\boxed{391}.", "reasoning_content": "Multiply.\n\n",
        "reasoning": "Multiply.\n\n"}}]
    extra = body["thinkahead"]
    assert (extra["run_id"], extra["workflow"], extra["policy"], extra["status"], extra["error"], extra["answer"]) == (
        body["id"], "cot", "specreason", "ok", None, "391")
    assert extra["steps"] == [
        {"node": "answer", "author": "small", "verdict": "accepted", "score": 9.0, "tokens": {"small": 1, "large": 0},
         "kind": "step", "text": "Multiply.\n\n"},
        {"node": "answer", "author": "small", "verdict": "accepted", "score": 9.0, "tokens": {"small": 2, "large": 0},
         "kind": "final", "text": "So \\boxed{391}."},
    ]
    assert (extra["cost"]["tokens"], extra["cost"]["model_calls"], extra["cost"]["judge_calls"]) == ({"small": 3}, 4, 2)
    # usage: the request's own prompt (not the sum of every internal call's), every generated token,
    # of which those outside the content are reasoning
    own_prompt = large.count_tokens("system: Be brief.\n\nWhat is 17 * 23?".join(["user: ", "\n\nassistant: "]))
    assert extra["cost"]["prompt_tokens"] > own_prompt
    assert body["usage"] == {"prompt_tokens": own_prompt, "completion_tokens": 3, "total_tokens": own_prompt + 3,
                             "prompt_tokens_details": {"cached_tokens": 0},
                             "completion_tokens_details": {"reasoning_tokens": 1}}
    # the system message is folded into the question as context
    assert "user: system: Be brief.\n\nWhat is 17 * 23?" in small.generated_prompts()[0]


def test_the_model_name_selects_the_policy_and_the_models_are_shared(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    body = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot:large")).json()
    assert body["thinkahead"]["answer"] == "391"
    assert [(s["author"], s["verdict"]) for s in body["thinkahead"]["steps"]] == [("large", "baseline")]
    assert body["thinkahead"]["policy"] == "large"
    assert small.calls == [] and len(large.generated_prompts()) == 1  # the large policy never asks the small model
    # no policy: the config's; no prefix is fine too; both reuse the same two model instances
    default = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot")).json()
    assert default["thinkahead"]["policy"] == "specreason"
    assert [s["author"] for s in default["thinkahead"]["steps"]] == ["small", "small"]
    assert httpx.post(f"{url}/v1/chat/completions", json=chat("cot:large")).json()["thinkahead"]["policy"] == "large"
    assert len(small.generated_prompts()) == 2 and len(large.generated_prompts()) == 2


def test_max_tokens_caps_the_reasoning_chain(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    body = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot", max_tokens=1)).json()
    # after one small token the chain is out of budget: the large model writes the final step
    assert [s["author"] for s in body["thinkahead"]["steps"]] == ["small", "large"]
    assert len(small.generated_prompts()) == 1
    assert body["choices"][0]["finish_reason"] == "length"  # the cap stopped the chain


def test_streaming_sends_role_each_step_as_decided_the_answer_finish_and_done(serve):
    small, large = scripted_pair(delay_s=0.2)
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    arrivals = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat("thinkahead/cot:specreason", stream=True),
                      timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = []
        for event in sse_payloads(response):
            events.append(event)
            arrivals.append(time.perf_counter())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {(c["object"], c["id"], c["model"]) for c in chunks} == {
        ("chat.completion.chunk", chunks[0]["id"], "thinkahead/cot:specreason")}
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "Multiply.\n\n", "reasoning": "Multiply.\n\n"},
        {"content": "So \\boxed{391}."},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]
    final = chunks[-1]
    assert final["usage"]["completion_tokens"] == 3
    assert final["thinkahead"]["run_id"] == chunks[0]["id"]
    assert [s["verdict"] for s in final["thinkahead"]["steps"]] == ["accepted", "accepted"]
    # each step is sent once decided (a draft and a judge call, 0.2 s each), not all at the end
    assert arrivals[2] - arrivals[1] >= 0.35
    assert arrivals[-1] - arrivals[1] >= 0.35


def test_unknown_models_and_routes_get_openai_shaped_404s(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    for model in ("thinkahead/tot", "thinkahead/cot:judge", "gpt-4o"):
        response = httpx.post(f"{url}/v1/chat/completions", json=chat(model))
        assert response.status_code == 404
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
        assert error["message"].startswith(f"The model {model!r} does not exist; models are 'small-scripted', "
                                           "'large-scripted' and thinkahead/<workflow>")
    missing = httpx.get(f"{url}/v1/engines")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{url}/v1/chat/completions").status_code == 405
    assert small.calls == [] and large.calls == []


def test_bad_requests_get_400s_that_name_the_problem(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    endpoint = f"{url}/v1/chat/completions"
    response = httpx.post(endpoint, content=b'{"model": "thinkahead/cot", "messages": [',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("the request body is not valid JSON")
    cases = [
        ({"model": "thinkahead/cot"}, "messages", "'messages' is required"),
        ({"model": "thinkahead/cot", "messages": []}, "messages", "'messages': List should have at least 1 item"),
        ({"messages": [{"role": "user", "content": "q"}]}, "model", "'model' is required"),
        ({"model": "thinkahead/cot",
          "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
         "messages", "the last message must be the user's question, got role 'assistant'"),
        ({"model": "thinkahead/cot", "messages": [{"role": "robot", "content": "q"}]}, "messages[0].role",
         "'messages[0].role': Input should be"),
        (chat("thinkahead/cot", max_tokens=0), "max_tokens", "'max_tokens': Input should be greater than or equal to 1"),
        (chat("thinkahead/cot", max_tokens="5"), "max_tokens", "'max_tokens': Input should be a valid integer"),
        (chat("thinkahead/cot", stream="yes"), "stream", "'stream': Input should be a valid boolean"),
        (chat("thinkahead/cot", session_id=5), "session_id", "'session_id': Input should be a valid string"),
        (chat("thinkahead/cot", temprature=0.5), "temprature", "unrecognized request argument supplied: temprature"),
        (chat("thinkahead/cot", functions=[]), "functions", "'functions' is not supported"),
        (chat("thinkahead/cot", frequency_penalty=0.5), "frequency_penalty", "'frequency_penalty' is not supported"),
    ]
    for payload, param, message in cases:
        response = httpx.post(endpoint, json=payload)
        assert response.status_code == 400, payload
        error = response.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert error["message"].startswith(message), error["message"]
    assert httpx.post(endpoint, json=[1, 2]).json()["error"]["message"] == "the request body must be a JSON object"
    assert small.calls == [] and large.calls == []


def test_a_session_id_reaches_the_models_and_outlives_the_request(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    for _ in range(2):
        response = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot:specreason", session_id="agent-7"))
        assert response.status_code == 200
    assert {c.request.session_id for c in small.calls if c.request is not None} == {"agent-7/answer"}


def test_content_parts_are_read_as_text(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    request = {"model": "thinkahead/cot", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "text", "text": "17 * 23?"}]}]}
    assert httpx.post(f"{url}/v1/chat/completions", json=request).json()["thinkahead"]["answer"] == "391"
    assert small.generated_prompts()[0].startswith("user: What is 17 * 23?\n\nassistant:")
    image = {"model": "thinkahead/cot", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}
    response = httpx.post(f"{url}/v1/chat/completions", json=image)
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages[0].content")


def test_concurrent_requests_overlap_and_each_gets_its_own_answer(serve):
    delay = 0.2  # each run: 2 drafts + 2 judge calls = 0.8 s of model time
    small = ScriptedModel(outputs=doubling_small, delay_s=delay)
    large = ScriptedModel(logprobs=JUDGE_YES, delay_s=delay)
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large, concurrency=8))
    numbers = [3, 5, 8, 13, 21, 34]

    async def ask_all():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            started = time.perf_counter()
            responses = await asyncio.gather(*[
                client.post("/v1/chat/completions", json=chat("thinkahead/cot:specreason", f"What is {n} * 2?"))
                for n in numbers])
            return responses, time.perf_counter() - started

    responses, wall = asyncio.run(ask_all())
    assert [r.status_code for r in responses] == [200] * len(numbers)
    assert [r.json()["thinkahead"]["answer"] for r in responses] == [str(2 * n) for n in numbers]
    assert len({r.json()["id"] for r in responses}) == len(numbers)
    serial = len(numbers) * 4 * delay
    assert wall < serial / 2, f"{wall:.2f}s for {len(numbers)} requests; serially {serial:.1f}s"


def test_concurrency_limits_the_runs_in_flight(serve):
    delay = 0.1
    small = ScriptedModel(outputs=doubling_small, delay_s=delay)
    large = ScriptedModel(logprobs=JUDGE_YES, delay_s=delay)
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large, concurrency=1))

    async def ask_all():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            started = time.perf_counter()
            responses = await asyncio.gather(*[
                client.post("/v1/chat/completions", json=chat("thinkahead/cot", f"What is {n} * 2?"))
                for n in (1, 2, 3)])
            return responses, time.perf_counter() - started

    responses, wall = asyncio.run(ask_all())
    assert [r.json()["thinkahead"]["answer"] for r in responses] == ["2", "4", "6"]
    assert wall >= 3 * 4 * delay * 0.95  # one run at a time


def test_a_failed_run_is_a_500_with_the_runs_error(serve):
    def broken(prompt, request):
        raise ValueError("the small model is broken")

    url = serve(create_app({"policy": LLM_SPECREASON}, small=ScriptedModel(outputs=broken), large=ScriptedModel(logprobs=JUDGE_YES)))
    response = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot:specreason"))
    assert response.status_code == 500
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "run_failed")
    assert re.fullmatch(r"run chatcmpl-\w+ ended error: node 'answer' \(think\) failed: "
                        r"ValueError: the small model is broken", error["message"]), error["message"]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat("thinkahead/cot", stream=True)) as streamed:
        events = list(sse_payloads(streamed))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[1]["error"]["message"].endswith("ValueError: the small model is broken")
    assert events[1]["thinkahead"]["status"] == "error"
    assert events[2:] == ["[DONE]"]


def test_a_run_cut_short_by_its_budget_finishes_with_length(serve):
    small, large = scripted_pair()
    url = serve(create_app({"budget": {"max_model_calls": 3}, "policy": LLM_SPECREASON}, small=small, large=large))
    body = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot")).json()
    assert body["choices"] == [{"index": 0, "finish_reason": "length", "logprobs": None, "message": {
        "role": "assistant", "content": "", "reasoning_content": "Multiply.\n\n", "reasoning": "Multiply.\n\n"}}]
    assert (body["thinkahead"]["status"], body["thinkahead"]["error"]) == (
        "budget", "run budget max_model_calls=3 exhausted (used 3)")


def test_a_client_that_goes_away_cancels_its_run(serve):
    def endless(prompt, request):  # a new step each time, never a final one: 16 steps (3.3 s) if left alone
        return f"Step {prompt.count('Step ') + 1} of many.\n\n"

    small = ScriptedModel(outputs=endless, delay_s=0.1)
    large = ScriptedModel(logprobs=JUDGE_YES, delay_s=0.1)
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat("thinkahead/cot", stream=True)) as response:
        line = next(line for line in response.iter_lines() if "reasoning_content" in line)
        assert json.loads(line[len("data: "):])["choices"][0]["delta"]["reasoning_content"] == "Step 1 of many.\n\n"
    time.sleep(0.5)
    calls = len(small.calls) + len(large.calls)
    time.sleep(0.5)
    assert len(small.calls) + len(large.calls) == calls < 8
    assert httpx.get(f"{url}/health").json()["in_flight"] == 0


def test_the_serve_command_loads_the_models_once_and_runs_uvicorn(monkeypatch, tmp_path):
    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app, **kw))
    config = tmp_path / "serve.yaml"
    config.write_text("policy: {name: specreason, threshold: 5, judge: llm, gate_logprob: null}\nbudget: {max_tokens: 900}\n")
    remote = "openai:qwen@http://127.0.0.1:9/v1"  # built without connecting: no weights load in this test
    result = CliRunner().invoke(serve_command, [
        "--config", str(config), "--small", remote, "--large", remote, "--port", "8123", "--policy", "large",
        "--concurrency", "3", "--max-steps", "5"])
    assert result.exit_code == 0, result.output
    app = started["app"]
    assert isinstance(app, ChatServer) and (started["host"], started["port"]) == ("127.0.0.1", 8123)
    assert app.small is app.large and app.small.name == "qwen"  # one spec for both tiers: loaded once
    assert app.owned == [app.small]
    c = app.config
    assert (c.policy.name, c.policy.threshold, c.budget.max_tokens, c.steps.max_steps) == ("large", 5.0, 900, 5)
    assert app.concurrency == 3
    assert app.orchestrator("specreason").config.policy.threshold == 5.0
    assert app.orchestrator("specreason").small is app.small
    assert "serving qwen and thinkahead/<workflow>[:<policy>] at http://127.0.0.1:8123/v1" in result.output
    assert app.settings.allowed_hosts == ["127.0.0.1", "localhost", "::1"]  # loopback: a Host check by default
    assert (app.settings.api_key, app.settings.allow_origins, app.settings.max_queue) == (None, [], 64)
    asyncio.run(app.aclose())


def test_the_serve_command_reports_a_bad_model_spec():
    result = CliRunner().invoke(serve_command, ["--small", "no-such-model"])
    assert result.exit_code == 2  # an input error, caught before any model loads
    assert "cannot resolve model spec 'no-such-model'" in result.output


def test_a_policy_the_models_cannot_run_is_refused_at_start_or_per_request(serve):
    small, large = scripted_pair()  # scripted models score no tokens
    with pytest.raises(ValueError, match="judge 'agreement' needs token scores from the large model"):
        create_app({"policy": "specreason"}, small=small, large=large)  # the agreement check behind the gate
    url = serve(create_app(small=small, large=large))  # the default policy (large) needs no scores
    reply = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "thinkahead/cot:specreason", "messages": [{"role": "user", "content": "What is 17 * 23?"}]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "model" and "policy 'specreason' cannot run on this server's models" in error["message"]
    assert small.calls == [] and large.calls == []
