"""The OpenAI-compatible server, answered over real HTTP: uvicorn in a thread, httpx as the client."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
import uvicorn
from click.testing import CliRunner

from thinkahead.models import ScriptedModel
from thinkahead.cli.serve import serve as serve_command
from thinkahead.serving.openai_server import ChatServer, create_app

JUDGE_YES = [{"9": -0.05}]
STEPS = ["Multiply.\n\n", "So \\boxed{391}."]


def scripted_pair(delay_s: float = 0.0):
    small = ScriptedModel(outputs=list(STEPS), name="small-scripted", delay_s=delay_s)
    large = ScriptedModel(outputs=["\\boxed{391}"], logprobs=JUDGE_YES, name="large-scripted", delay_s=delay_s)
    return small, large


def doubling_small(prompt: str, request) -> str:
    """Two steps for 'What is N * 2?': the answer depends on the request, whatever the interleaving."""
    n = int(re.search(r"What is (\d+) \* 2\?", prompt).group(1))
    return f"So \\boxed{{{2 * n}}}." if "Double it." in prompt else "Double it.\n\n"


@pytest.fixture
def serve():
    """Starts apps with uvicorn on free ports; returns their base URLs; stops them afterwards."""
    running = []

    def start(app) -> str:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        running.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=10)


def chat(model: str, question: str = "What is 17 * 23?", **extra):
    return {"model": model, "messages": [{"role": "user", "content": question}], **extra}


def sse_payloads(response: httpx.Response):
    """The `data:` payloads of an event stream as they arrive, JSON-decoded except the final [DONE]."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)
        else:
            assert line == "", f"unexpected line in the event stream: {line!r}"


def test_models_lists_every_workflow_policy_combination_and_health(serve):
    small, large = scripted_pair()
    app = create_app(small=small, large=large)
    assert app.owned == []  # the caller's models: the app never closes them
    url = serve(app)
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list"
    ids = [m["id"] for m in models["data"]]
    workflows = ["cot", "react", "refine", "vote", "pipeline"]
    policies = ["large", "small", "specreason", "arbitrage", "reflect"]
    assert ids == [f"thinkahead/{w}:{p}" for w in workflows for p in policies]
    assert {(m["object"], m["owned_by"]) for m in models["data"]} == {("model", "thinkahead")}
    assert httpx.get(f"{url}/health").json() == {"status": "ok", "small": "small-scripted",
                                                 "large": "large-scripted", "in_flight": 0}


def test_a_completion_holds_the_answer_the_reasoning_usage_and_the_steps(serve):
    small, large = scripted_pair()
    url = serve(create_app(small=small, large=large))
    request = {"model": "thinkahead/cot:specreason", "temperature": 0.2, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 * 23?"}]}
    response = httpx.post(f"{url}/v1/chat/completions", json=request)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "thinkahead/cot:specreason"
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "391", "reasoning_content": "Multiply.\n\nSo \\boxed{391}."}}]
    extra = body["thinkahead"]
    assert (extra["run_id"], extra["workflow"], extra["policy"], extra["status"], extra["error"]) == (
        body["id"], "cot", "specreason", "ok", None)
    assert extra["steps"] == [
        {"node": "answer", "author": "small", "verdict": "accepted", "score": 9.0, "tokens": {"small": 1, "large": 0}},
        {"node": "answer", "author": "small", "verdict": "accepted", "score": 9.0, "tokens": {"small": 2, "large": 0}},
    ]
    assert (extra["cost"]["tokens"], extra["cost"]["model_calls"], extra["cost"]["judge_calls"]) == ({"small": 3}, 4, 2)
    prompt_tokens = extra["cost"]["prompt_tokens"]
    assert prompt_tokens > 0
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3, "total_tokens": prompt_tokens + 3}
    # the system message is folded into the question as context
    assert "user: system: Be brief.\n\nWhat is 17 * 23?" in small.generated_prompts()[0]


def test_the_model_name_selects_the_policy_and_the_models_are_shared(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": {"name": "specreason"}}, small=small, large=large))
    body = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot:large")).json()
    assert body["choices"][0]["message"]["content"] == "391"
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
    url = serve(create_app(small=small, large=large))
    body = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot", max_tokens=1)).json()
    # after one small token the chain is out of budget: the large model writes the final step
    assert [s["author"] for s in body["thinkahead"]["steps"]] == ["small", "large"]
    assert len(small.generated_prompts()) == 1


def test_streaming_sends_role_each_step_as_decided_the_answer_finish_and_done(serve):
    small, large = scripted_pair(delay_s=0.2)
    url = serve(create_app(small=small, large=large))
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
        {"reasoning_content": "Multiply.\n\n"},
        {"reasoning_content": "So \\boxed{391}."},
        {"content": "391"},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, None, "stop"]
    final = chunks[-1]
    assert final["usage"]["completion_tokens"] == 3
    assert final["thinkahead"]["run_id"] == chunks[0]["id"]
    assert [s["verdict"] for s in final["thinkahead"]["steps"]] == ["accepted", "accepted"]
    # each step is sent once decided (a draft and a judge call, 0.2 s each), not all at the end
    assert arrivals[2] - arrivals[1] >= 0.35
    assert arrivals[-1] - arrivals[1] >= 0.35


def test_unknown_models_and_routes_get_openai_shaped_404s(serve):
    small, large = scripted_pair()
    url = serve(create_app(small=small, large=large))
    for model in ("thinkahead/tot", "thinkahead/cot:judge", "gpt-4o"):
        response = httpx.post(f"{url}/v1/chat/completions", json=chat(model))
        assert response.status_code == 404
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
        assert error["message"].startswith(f"The model {model!r} does not exist; models are thinkahead/<workflow>")
    missing = httpx.get(f"{url}/v1/engines")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{url}/v1/chat/completions").status_code == 405
    assert small.calls == [] and large.calls == []


def test_bad_requests_get_400s_that_name_the_problem(serve):
    small, large = scripted_pair()
    url = serve(create_app(small=small, large=large))
    endpoint = f"{url}/v1/chat/completions"
    response = httpx.post(endpoint, content=b'{"model": "thinkahead/cot", "messages": [',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("the request body is not valid JSON")
    cases = [
        ({"model": "thinkahead/cot"}, "messages", "'messages' is required"),
        ({"model": "thinkahead/cot", "messages": []}, "messages", "'messages' is required"),
        ({"messages": [{"role": "user", "content": "q"}]}, "model", "'model' is required"),
        ({"model": "thinkahead/cot",
          "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
         "messages", "the last message must be the user's question, got role 'assistant'"),
        (chat("thinkahead/cot", max_tokens=0), "max_tokens", "'max_tokens' must be a positive integer, got 0"),
        (chat("thinkahead/cot", stream="yes"), "stream", "'stream' must be true or false"),
        (chat("thinkahead/cot", session_id=5), "session_id", "'session_id' must be a non-empty string"),
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
    url = serve(create_app(small=small, large=large))
    for _ in range(2):
        response = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot:specreason", session_id="agent-7"))
        assert response.status_code == 200
    assert {c.request.session_id for c in small.calls if c.request is not None} == {"agent-7/answer"}


def test_content_parts_are_read_as_text(serve):
    small, large = scripted_pair()
    url = serve(create_app(small=small, large=large))
    request = {"model": "thinkahead/cot", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is "}, {"type": "text", "text": "17 * 23?"}]}]}
    assert httpx.post(f"{url}/v1/chat/completions", json=request).json()["choices"][0]["message"]["content"] == "391"
    assert small.generated_prompts()[0].startswith("user: What is 17 * 23?\n\nassistant:")


def test_concurrent_requests_overlap_and_each_gets_its_own_answer(serve):
    delay = 0.2  # each run: 2 drafts + 2 judge calls = 0.8 s of model time
    small = ScriptedModel(outputs=doubling_small, delay_s=delay)
    large = ScriptedModel(logprobs=JUDGE_YES, delay_s=delay)
    url = serve(create_app(small=small, large=large, concurrency=8))
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
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == [str(2 * n) for n in numbers]
    assert len({r.json()["id"] for r in responses}) == len(numbers)
    serial = len(numbers) * 4 * delay
    assert wall < serial / 2, f"{wall:.2f}s for {len(numbers)} requests; serially {serial:.1f}s"


def test_concurrency_limits_the_runs_in_flight(serve):
    delay = 0.1
    small = ScriptedModel(outputs=doubling_small, delay_s=delay)
    large = ScriptedModel(logprobs=JUDGE_YES, delay_s=delay)
    url = serve(create_app(small=small, large=large, concurrency=1))

    async def ask_all():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            started = time.perf_counter()
            responses = await asyncio.gather(*[
                client.post("/v1/chat/completions", json=chat("thinkahead/cot", f"What is {n} * 2?"))
                for n in (1, 2, 3)])
            return responses, time.perf_counter() - started

    responses, wall = asyncio.run(ask_all())
    assert [r.json()["choices"][0]["message"]["content"] for r in responses] == ["2", "4", "6"]
    assert wall >= 3 * 4 * delay * 0.95  # one run at a time


def test_a_failed_run_is_a_500_with_the_runs_error(serve):
    def broken(prompt, request):
        raise ValueError("the small model is broken")

    url = serve(create_app(small=ScriptedModel(outputs=broken), large=ScriptedModel(logprobs=JUDGE_YES)))
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
    url = serve(create_app({"budget": {"max_model_calls": 3}}, small=small, large=large))
    body = httpx.post(f"{url}/v1/chat/completions", json=chat("thinkahead/cot")).json()
    assert body["choices"] == [{"index": 0, "finish_reason": "length", "message": {
        "role": "assistant", "content": "", "reasoning_content": "Multiply.\n\n"}}]
    assert (body["thinkahead"]["status"], body["thinkahead"]["error"]) == (
        "budget", "run budget max_model_calls=3 exhausted (used 3)")


def test_a_client_that_goes_away_cancels_its_run(serve):
    def endless(prompt, request):  # a new step each time, never a final one: 16 steps (3.3 s) if left alone
        return f"Step {prompt.count('Step ') + 1} of many.\n\n"

    small = ScriptedModel(outputs=endless, delay_s=0.1)
    large = ScriptedModel(logprobs=JUDGE_YES, delay_s=0.1)
    url = serve(create_app(small=small, large=large))
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat("thinkahead/cot", stream=True)) as response:
        line = next(line for line in response.iter_lines() if "reasoning_content" in line)
        assert json.loads(line[len("data: "):])["choices"][0]["delta"] == {"reasoning_content": "Step 1 of many.\n\n"}
    time.sleep(0.5)
    calls = len(small.calls) + len(large.calls)
    time.sleep(0.5)
    assert len(small.calls) + len(large.calls) == calls < 8
    assert httpx.get(f"{url}/health").json()["in_flight"] == 0


def test_the_serve_command_loads_the_models_once_and_runs_uvicorn(monkeypatch, tmp_path):
    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app, **kw))
    config = tmp_path / "serve.yaml"
    config.write_text("policy: {name: specreason, threshold: 5}\nbudget: {max_tokens: 900}\n")
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
    assert "serving thinkahead/<workflow>[:<policy>] at http://127.0.0.1:8123/v1" in result.output
    asyncio.run(app.aclose())


def test_the_serve_command_reports_a_bad_model_spec():
    result = CliRunner().invoke(serve_command, ["--small", "no-such-model"])
    assert result.exit_code == 2  # an input error, caught before any model loads
    assert "cannot resolve model spec 'no-such-model'" in result.output
