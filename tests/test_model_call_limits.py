"""Model calls are bounded in time and attempts (issue 15), against real servers on loopback ports.

One retry layer: `HttpClient` resends a request only when it cannot have reached the server
(refused connection, connect or pool timeout) or when the server asked for it (429, 503 with
Retry-After), and for idempotent requests (GET, /tokenize) after any transient failure; the
metering layer (`MeteredModel`) does not retry a call an HTTP client already handled. Every
request ends by a deadline: the call's own (`call_timeout_s`), the run's `max_call_s`, and what is
left of the run's and the batch's `max_wall_s`. The error's attempt count and the run's cost
(`attempts`, `retries`, `failed_calls`) count the requests really tried.

Time limits here are short (0.5 s deadlines); upper bounds on wall time are generous (< 10 s), the
assertions are on what the server saw and on what the error and the cost say.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fake_sglang import FakeHttpServer, FakeSGLangServer, Reply, Request, json_reply
from thinkahead.models import ScriptedModel
from thinkahead.models.base import GenerationRequest, LanguageModel, model_call
from thinkahead.models.http import HttpClient, ModelServerError
from thinkahead.models.openai import OpenAIModel
from thinkahead.models.sglang import SGLangModel
from thinkahead.orchestrator import END, START, RetryPolicy, RunBudget, Runtime, StepGraph
from thinkahead.orchestrator.trace import RunResult
from thinkahead.step_spec.policies import make_policy

HUNG_TIMEOUT_S = 2.0  # per-attempt timeout in the hung-server tests: longer than their 0.5 s deadlines
COMPLETION = {"choices": [{"index": 0, "text": "fine", "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1}, "model": "m"}


class ScriptServer(FakeHttpServer):
    """Answers each request with the next action of `script`, then with `default`.

    Actions: "ok" (a completions reply), "hang" (read the request, never answer), "drop" (read
    the request, close the connection), an int (that HTTP status), `(status, retry_after)`.
    `seen` records (method, path, time.monotonic()) of every request that arrived.
    """

    def __init__(self, default: Any = "ok") -> None:
        super().__init__()
        self.script: deque[Any] = deque()
        self.default = default
        self.seen: list[tuple[str, str, float]] = []

    def posts(self) -> int:
        return sum(1 for method, _, _ in self.seen if method == "POST")

    async def respond(self, request: Request) -> Reply | None:
        self.seen.append((request.method, request.path, time.monotonic()))
        action = self.script.popleft() if self.script else self.default
        if action == "ok":
            return json_reply(200, COMPLETION)
        if action == "hang":
            await asyncio.sleep(3600)  # cancelled by stop()
        if action == "drop":
            return None
        status, retry_after = action if isinstance(action, tuple) else (action, None)
        headers = [] if retry_after is None else [f"Retry-After: {retry_after}"]
        return Reply(status, b'{"error": {"message": "scripted failure"}}', headers=headers)


@pytest.fixture
def server() -> Iterator[ScriptServer]:
    srv = ScriptServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def openai(url: str, **kwargs: Any) -> OpenAIModel:
    opts: dict[str, Any] = {"timeout_s": HUNG_TIMEOUT_S, "max_retries": 2, "backoff_s": 0.01, "api_key": ""}
    opts.update(kwargs)
    return OpenAIModel("m", base_url=url, **opts)


def generate(model: LanguageModel) -> Any:
    async def main() -> Any:
        try:
            return await model.generate(GenerationRequest(prompt="hi"))
        finally:
            await model.aclose()

    return asyncio.run(main())


def failed_generate(model: LanguageModel) -> tuple[ModelServerError, float]:
    start = time.monotonic()
    with pytest.raises(ModelServerError) as info:
        generate(model)
    return info.value, time.monotonic() - start


def run_graph(large: LanguageModel, **kwargs: Any) -> tuple[RunResult, float]:
    """One generate node on `large` under a `Runtime` (whose `MeteredModel` counts the cost)."""
    g = StepGraph(inputs=["question"])
    g.add_generate("ask", "{question}")
    g.add_sequence(START, "ask", END)
    rt = Runtime(ScriptedModel(outputs=["s"]), large, make_policy("large"),
                 retry=RetryPolicy(attempts=3, backoff_s=0.001), **kwargs)

    async def main() -> RunResult:
        try:
            return await rt.run(g, "q")
        finally:
            await large.aclose()

    start = time.monotonic()
    result = asyncio.run(main())
    return result, time.monotonic() - start


# -- what is resent ------------------------------------------------------------------------------


def test_a_500_post_is_sent_once_and_a_500_get_a_bounded_number_of_times(server: ScriptServer) -> None:
    server.default = 500
    err, _ = failed_generate(openai(server.url + "/v1", max_retries=3))
    assert server.posts() == 1  # a 500 after the server read the request: generation is not idempotent
    assert err.status == 500 and err.attempts == 1
    assert "after 1 attempt:" in str(err) and "not resent" in str(err)

    client = HttpClient(server.url, max_retries=2, backoff_s=0.01)

    async def get() -> None:
        try:
            await client.get_json("/v1/models")
        finally:
            await client.aclose()

    with pytest.raises(ModelServerError, match="after 3 attempts: HTTP 500") as info:
        asyncio.run(get())
    assert [m for m, _, _ in server.seen].count("GET") == 3 == info.value.attempts  # max_retries + 1


def test_a_dropped_connection_after_the_request_is_not_reposted(server: ScriptServer) -> None:
    server.default = "drop"
    err, _ = failed_generate(openai(server.url + "/v1", max_retries=3))
    assert server.posts() == 1 == err.attempts
    assert "after 1 attempt:" in str(err) and "connection error" in str(err) and "not resent" in str(err)


def test_a_read_timeout_is_not_reposted(server: ScriptServer) -> None:
    server.default = "hang"
    err, elapsed = failed_generate(openai(server.url + "/v1", timeout_s=0.3, max_retries=3))
    assert server.posts() == 1 == err.attempts
    assert "read timeout after 0.3 s" in str(err) and "not resent" in str(err)
    assert elapsed < 10


def test_a_refused_connection_is_retried_up_to_the_limit() -> None:
    err, _ = failed_generate(openai(f"http://127.0.0.1:{closed_port()}/v1", max_retries=2))
    assert err.attempts == 3 and err.status is None
    assert "after 3 attempts: connection error" in str(err)


def test_a_refused_connection_is_retried_until_the_server_is_up() -> None:
    srv = ScriptServer()
    srv.port = closed_port()
    timer = threading.Timer(0.3, srv.start)  # nothing listens for 0.3 s
    model = openai(srv.url + "/v1", max_retries=50, backoff_s=0.02)

    async def main() -> tuple[Any, Any]:
        try:
            with model_call() as scope:
                return await model.generate(GenerationRequest(prompt="hi")), scope
        finally:
            await model.aclose()

    timer.start()
    try:
        out, scope = asyncio.run(main())
    finally:
        timer.join()
        srv.stop()
    assert out.text == "fine"
    assert srv.posts() == 1  # the refused attempts never reached it
    assert scope.attempts > 1 and scope.retries == scope.attempts - 1


def test_429_with_retry_after_is_retried_after_that_long(server: ScriptServer) -> None:
    server.script.append((429, "0.4"))
    result, _ = run_graph(openai(server.url + "/v1", backoff_s=0.01))
    assert result.ok and result.answer == "fine"
    (_, _, first), (_, _, second) = server.seen
    assert second - first >= 0.35  # honoured, not the 0.01 s backoff
    assert (result.cost["attempts"], result.cost["retries"], result.cost["model_calls"]) == (2, 1, 1)


def test_retry_after_is_capped(server: ScriptServer) -> None:
    server.script.append((429, "60"))
    client = HttpClient(server.url, max_retries=2, backoff_s=0.01, max_backoff_s=0.2)

    async def post() -> dict[str, Any]:
        try:
            return await client.post_json("/v1/completions", {"prompt": "hi"})
        finally:
            await client.aclose()

    start = time.monotonic()
    assert asyncio.run(post())["choices"][0]["text"] == "fine"
    assert server.posts() == 2 and time.monotonic() - start < 10


def test_retry_after_past_the_deadline_gives_up_at_once(server: ScriptServer) -> None:
    server.default = (429, "60")
    err, elapsed = failed_generate(openai(server.url + "/v1", call_timeout_s=1.0))
    assert server.posts() == 1 == err.attempts and err.status == 429
    assert "Retry-After" in str(err) and "deadline" in str(err)
    assert elapsed < 10


def test_503_is_resent_only_with_retry_after(server: ScriptServer) -> None:
    server.script.extend([(503, "0"), 503])
    err, _ = failed_generate(openai(server.url + "/v1", max_retries=3))
    assert server.posts() == 2 == err.attempts  # the second 503 said nothing about retrying
    assert "after 2 attempts: HTTP 503" in str(err)


# -- deadlines -------------------------------------------------------------------------------------


def test_a_hung_server_fails_the_call_at_its_deadline(server: ScriptServer) -> None:
    server.default = "hang"
    err, elapsed = failed_generate(openai(server.url + "/v1", call_timeout_s=0.5, max_retries=3))
    assert server.posts() == 1 == err.attempts
    assert "after 1 attempt:" in str(err) and "deadline" in str(err)
    assert elapsed < 10


def test_a_hung_sglang_stream_fails_at_the_deadline() -> None:
    srv = FakeSGLangServer()
    srv.slow_s = 30.0
    srv.faults.append("slow")
    srv.start()
    try:
        model = SGLangModel(srv.url, timeout_s=HUNG_TIMEOUT_S, call_timeout_s=0.5, max_retries=3, backoff_s=0.01,
                            stream=True, api_key="")
        err, elapsed = failed_generate(model)
    finally:
        srv.stop()
    assert [path for path, _ in srv.requests] == ["/generate"] and err.attempts == 1
    assert "deadline" in str(err) and elapsed < 10


def test_the_run_budget_sets_a_deadline_per_call(server: ScriptServer) -> None:
    server.default = "hang"
    result, elapsed = run_graph(openai(server.url + "/v1"), budget=RunBudget(max_call_s=0.5))
    assert result.status == "error" and "deadline" in result.error and "after 1 attempt" in result.error
    assert server.posts() == 1
    assert (result.cost["attempts"], result.cost["failed_calls"], result.cost["retries"]) == (1, 1, 0)
    assert elapsed < 10


def test_a_call_cannot_outlive_the_run_wall_budget(server: ScriptServer) -> None:
    server.default = "hang"
    result, elapsed = run_graph(openai(server.url + "/v1"), budget=RunBudget(max_wall_s=0.5))
    assert result.status == "budget" and "run budget max_wall_s=0.5" in result.error
    assert server.posts() == 1 and result.cost["attempts"] == 1
    assert elapsed < 10


def test_a_call_cannot_outlive_the_batch_wall_budget(server: ScriptServer) -> None:
    server.default = "hang"
    result, elapsed = run_graph(openai(server.url + "/v1"), batch_budget=RunBudget(max_wall_s=0.5))
    assert result.status == "budget" and "batch budget max_wall_s=0.5" in result.error
    assert server.posts() == 1 and result.cost["attempts"] == 1
    assert elapsed < 10


# -- true counts -----------------------------------------------------------------------------------


def test_the_error_and_the_cost_count_the_requests_the_server_saw(server: ScriptServer) -> None:
    server.default = (429, "0")
    result, _ = run_graph(openai(server.url + "/v1", max_retries=2))
    assert result.status == "error"
    assert server.posts() == 3  # the client's 3 attempts, not retried again by the metering layer
    assert "after 3 attempts: HTTP 429" in result.error
    assert (result.cost["attempts"], result.cost["retries"], result.cost["failed_calls"]) == (3, 2, 1)
    assert result.cost["model_calls"] == 0


def test_the_metering_layer_does_not_retry_what_the_client_handled(server: ScriptServer) -> None:
    server.default = "drop"
    result, _ = run_graph(openai(server.url + "/v1", max_retries=3))
    assert result.status == "error" and "after 1 attempt" in result.error
    assert server.posts() == 1 and result.cost["attempts"] == 1


def test_in_process_failures_are_retried_by_the_metering_layer_and_counted() -> None:
    large = ScriptedModel(outputs=["fine"], failures=[ModelServerError("busy", status=503), ConnectionError("reset")])
    result, _ = run_graph(large)
    assert result.ok and result.answer == "fine"
    assert (result.cost["attempts"], result.cost["retries"], result.cost["model_calls"]) == (3, 2, 1)


def test_defaults_bound_every_call_and_run() -> None:
    from thinkahead.config import DEFAULT_RUN_WALL_S, OrchestratorConfig
    from thinkahead.models.http import DEFAULT_CALL_TIMEOUT_S

    assert HttpClient("http://127.0.0.1:1").call_timeout_s == DEFAULT_CALL_TIMEOUT_S
    assert OpenAIModel("m").client.call_timeout_s == DEFAULT_CALL_TIMEOUT_S
    assert SGLangModel().client.call_timeout_s == DEFAULT_CALL_TIMEOUT_S
    assert OrchestratorConfig().budget.max_wall_s == DEFAULT_RUN_WALL_S
    assert OrchestratorConfig(budget={"max_tokens": 9}).budget.max_wall_s == DEFAULT_RUN_WALL_S
    assert OrchestratorConfig(budget={"max_wall_s": None}).budget.max_wall_s is None  # explicitly unlimited
    assert OrchestratorConfig(budget=RunBudget(max_call_s=5)).budget.max_wall_s == DEFAULT_RUN_WALL_S
    with pytest.raises(ValueError):
        HttpClient("http://127.0.0.1:1", call_timeout_s=0)
    with pytest.raises(ValueError):
        RunBudget(max_call_s=0)

