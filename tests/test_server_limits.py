"""Access and limits of the server over real HTTP: API key, JSON content type, CORS, Host check, a bounded
waiting line, hostile bodies answered with OpenAI-shaped 4xx (never a 500), and /metrics."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from click.testing import CliRunner

from tests.llm_judge import LLM_JUDGE_FLAGS, LLM_SPECREASON
from tests.server_fixtures import JUDGE_YES, chat, scripted_pair, serve  # noqa: F401 (fixture)
from thinkahead.cli.serve import serve as serve_command
from thinkahead.models import ScriptedModel
from thinkahead.serving.openai_server import create_app

COT = "thinkahead/cot:specreason"


def test_an_api_key_is_required_when_set(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large, settings={"api_key": "s3cret"}))
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic s3cret"}):
        response = httpx.post(f"{url}/v1/chat/completions", json=chat(COT), headers=headers)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200  # liveness probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
    assert good.chat.completions.create(model=COT, messages=chat(COT)["messages"]).model_extra["thinkahead"]["answer"] \
        == "391"
    assert small.calls  # only the keyed request ran


def test_the_api_key_comes_from_the_environment_in_the_cli(monkeypatch):
    import uvicorn

    started = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: started.update(app=app, **kw))
    monkeypatch.setenv("THINKAHEAD_API_KEY", "from-env")
    remote = "openai:qwen@http://127.0.0.1:9/v1"
    result = CliRunner().invoke(serve_command, ["--small", remote, "--large", remote, *LLM_JUDGE_FLAGS, "--host", "0.0.0.0",
                                                "--allow-origin", "http://localhost:3000", "--max-queue", "3"])
    assert result.exit_code == 0, result.output
    settings = started["app"].settings
    assert (settings.api_key, settings.allow_origins, settings.allowed_hosts, settings.max_queue) == (
        "from-env", ["http://localhost:3000"], None, 3)
    assert "(API key required)" in result.output
    asyncio.run(started["app"].aclose())


def test_only_json_bodies_start_work(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    body = b'{"model": "thinkahead/cot", "messages": [{"role": "user", "content": "q"}]}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"content-type": content_type} if content_type else {}
        response = httpx.post(f"{url}/v1/chat/completions", content=body, headers=headers)
        assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"
    assert small.calls == [] and large.calls == []


def test_cors_only_for_allowed_origins_and_hosts_checked(serve):
    small, large = scripted_pair()
    closed = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    evil = httpx.post(f"{closed}/v1/chat/completions", json=chat(COT), headers={"origin": "https://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in evil.headers
    opened = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large, settings={
        "allow_origins": ["http://localhost:3000"], "allowed_hosts": ["127.0.0.1", "localhost"], "api_key": "k"}))
    preflight = httpx.options(f"{opened}/v1/chat/completions", headers={
        "origin": "http://localhost:3000", "access-control-request-method": "POST"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    ok = httpx.post(f"{opened}/v1/chat/completions", json=chat(COT), headers={"origin": "http://localhost:3000",
                                                                             "authorization": "Bearer k"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    rebound = httpx.get(f"{opened}/v1/models", headers={"host": "attacker.example"})
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "host_not_allowed"
    assert len(small.generated_prompts()) == 2  # only the allowed request ran


def test_a_full_waiting_line_gets_429_with_retry_after(serve):
    small = ScriptedModel(outputs=["So \\boxed{1}."], delay_s=0.3)
    large = ScriptedModel(logprobs=JUDGE_YES, delay_s=0.3)
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large, concurrency=1, settings={"max_queue": 1, "retry_after_s": 3}))

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await asyncio.gather(*[client.post("/v1/chat/completions", json=chat(COT)) for _ in range(4)])

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 429, 429]
    refused = [r for r in responses if r.status_code == 429]
    assert all(r.headers["retry-after"] == "3" and r.json()["error"]["type"] == "rate_limit_error" for r in refused)


def test_hostile_bodies_get_openai_shaped_4xx_never_a_500(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large, settings={"max_body_bytes": 100_000}))
    endpoint = f"{url}/v1/chat/completions"
    cases = [
        (b"[" * 50_000 + b"]" * 50_000, 400, "nests deeper than"),
        (b'{"model": "thinkahead/cot", "messages": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "nests deeper than"),
        (b'{"model": "thinkahead/cot", "n": ' + b"9" * 5000 + b"}", 400, "not valid JSON"),
        (b'{"model": "thinkahead/cot", "temperature": 1e999}', 400, "not valid JSON"),
        (b'{"model": "thinkahead/cot", "temperature": NaN}', 400, "not valid JSON"),
        (b'{"model": "x", "pad": "' + b"a" * 200_000 + b'"}', 413, "exceeds 100000 bytes"),
        (b"\xff\xfe", 400, "not valid JSON"),
    ]
    for body, status, message in cases:
        response = httpx.post(endpoint, content=body, headers={"content-type": "application/json"})
        assert response.status_code == status, (body[:60], response.text[:200])
        error = response.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"
    big = httpx.post(endpoint, json=chat(COT, n=10**30))
    assert big.status_code == 400 and big.json()["error"]["param"] == "n"
    assert small.calls == [] and large.calls == []


def test_metrics_in_prometheus_text(serve):
    small, large = scripted_pair()
    url = serve(create_app({"policy": LLM_SPECREASON}, small=small, large=large))
    httpx.post(f"{url}/v1/chat/completions", json=chat(COT))
    httpx.post(f"{url}/v1/chat/completions", json=chat("nope"))
    response = httpx.get(f"{url}/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    assert 'thinkahead_requests_total{model="workflow",route="/v1/chat/completions",status="200"} 1' in text
    assert 'thinkahead_requests_total{model="workflow",route="/v1/chat/completions",status="404"} 1' in text
    assert 'thinkahead_steps_total{author="small",verdict="accepted"} 2' in text
    assert "thinkahead_step_accept_rate 1" in text and "thinkahead_queue_length 0" in text
    assert "thinkahead_completion_tokens_total 3" in text
    assert re.search(r'thinkahead_request_duration_seconds_bucket\{route="/v1/chat/completions",le="\+Inf"\} 2', text)
    assert 'thinkahead_request_duration_seconds_count{route="/v1/chat/completions"} 2' in text
    for line in text.splitlines():  # every line a comment or `name{labels} value`
        assert line.startswith("# TYPE ") or re.fullmatch(r'[a-z_]+(\{[^}]*\})? [0-9.e+-]+', line), line
