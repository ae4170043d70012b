"""`OpenAIModel` and `HttpClient` against a real (in-process) fake OpenAI server.

The fake server is a tiny asyncio HTTP/1.1 server (keep-alive, hand-written parsing, no extra
dependencies) running in its own thread and loop, so every test drives the client through real
sockets with `asyncio.run`. It answers `/v1/completions` in the OpenAI response shape and can be
told to fail individual requests: HTTP 500/429/400, a dropped connection, malformed JSON, a slow
reply (longer than the client's timeout), or an aborted generation.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from thinkahead.models.base import GenerationRequest, render_plain
from thinkahead.models.http import HttpClient, ModelServerError
from thinkahead.models.openai import OpenAIModel

from tests.fake_sglang import FakeHttpServer, Reply, Request, Stream, json_reply

TIMEOUT_S = 0.3  # client timeout used by the tests; "slow" replies take SLOW_S
SLOW_S = 1.0


class FakeOpenAIServer(FakeHttpServer):
    """An OpenAI-compatible `/v1/completions` server with per-request fault injection.

    `faults` is consumed one entry per completions request: "500", "429", "400", "drop",
    "badjson", "slow", "abort"; an empty queue answers normally. `responder(payload) -> text` gives
    the raw text before stop/max_tokens handling (as a server would generate it).
    """

    def __init__(self) -> None:
        super().__init__()
        self.faults: deque[str] = deque()
        self.requests: list[dict[str, Any]] = []  # completions payloads, in arrival order
        self.headers: list[dict[str, str]] = []
        self.responder: Callable[[dict[str, Any]], str] = lambda payload: "Hello world"
        self.top_logprobs: dict[str, float] = {"1": -0.1, "2": -2.3, "3": -4.0}
        self.cached_tokens: int | None = None  # None: no prompt_tokens_details in usage
        self.stop_field: str | None = "stop_reason"  # vLLM; "matched_stop" for SGLang; None: omit
        self.delay_s = 0.0
        self.hold_until = 0  # completions wait (up to 5 s) until this many are in flight together
        self.health_failures = 0  # /health answers 503 this many times first
        self.in_flight = 0
        self.max_in_flight = 0
        self.chunk_chars = 3  # a streamed completion's text per chunk
        self.chunks_sent: list[int] = []  # per streamed completion, the chunks written before it ended

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    async def respond(self, request: Request) -> Reply | Stream | None:
        method, target = request.method, request.path
        if target == "/health":
            if self.health_failures > 0:
                self.health_failures -= 1
                return json_reply(503, {"message": "loading weights"})
            return json_reply(200, {"status": "ok"})
        if target == "/v1/models" and method == "GET":
            return json_reply(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        if target == "/v1/stream" and method == "POST":
            events = b"".join(f"data: {json.dumps({'i': i})}\n\n".encode() for i in range(3))
            events = b": keep-alive comment\n\n" + events + b"data: line1\ndata: line2\n\ndata: [DONE]\n\n"
            return Reply(200, events, "text/event-stream")
        if target != "/v1/completions" or method != "POST":
            return json_reply(404, {"error": {"message": f"no route {method} {target}", "type": "not_found"}})

        payload = request.json()
        self.requests.append(payload)
        self.headers.append(request.headers)
        fault = self.faults.popleft() if self.faults else None
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            deadline = time.monotonic() + 5.0
            while self.max_in_flight < self.hold_until and time.monotonic() < deadline:
                await asyncio.sleep(0.005)  # a latch: once reached, everyone is released
            if fault == "500":
                return json_reply(500, {"object": "error", "message": "engine overloaded"})
            if fault == "429":
                return json_reply(429, {"error": {"message": "rate limited", "type": "rate_limit"}})
            if fault == "400":
                return json_reply(400, {"error": {"message": "prompt is too long for this model", "type": "invalid"}})
            if fault == "drop":
                return None
            if fault == "badjson":
                return Reply(200, b'{"id": "cmpl-x", "choices": [')
            if fault == "slow":
                await asyncio.sleep(SLOW_S)
            if payload.get("stream"):
                return Stream(self._chunks(self._completion(payload, abort=fault == "abort")))
            return json_reply(200, self._completion(payload, abort=fault == "abort"))
        finally:
            self.in_flight -= 1

    async def _chunks(self, reply: dict[str, Any]):
        """A completion streamed as llama.cpp and vLLM do: `chunk_chars` of text per event, the finish reason on
        the last one, `stop_field` (where set) on each (null until the last, as vLLM writes `stop_reason`), then
        [DONE]; paced so a client can leave early."""
        choice = reply["choices"][0]
        text, n = choice["text"], self.chunk_chars
        pieces = [text[i:i + n] for i in range(0, len(text), n)] or [""]
        self.chunks_sent.append(0)
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            out = {"index": 0, "text": piece, "finish_reason": choice["finish_reason"] if last else None}
            if self.stop_field:
                out[self.stop_field] = choice.get(self.stop_field) if last else None
            yield f"data: {json.dumps({'id': reply['id'], 'object': 'text_completion', 'choices': [out]})}\n\n".encode()
            self.chunks_sent[-1] += 1
            await asyncio.sleep(0.01)
        yield b"data: [DONE]\n\n"

    def _completion(self, payload: dict[str, Any], abort: bool = False) -> dict[str, Any]:
        prompt = payload["prompt"]
        logprobs = None
        stop_value: str | int | None = None
        if payload.get("logprobs"):
            k = int(payload["logprobs"])
            top = dict(list(self.top_logprobs.items())[:k])
            first = next(iter(top))
            text, finish = first, "length"
            logprobs = {"tokens": [first], "token_logprobs": [top[first]], "top_logprobs": [top], "text_offset": [0]}
        else:
            raw = self.responder(payload)
            text, finish = raw, "stop"
            stop_value = 2  # an EOS token id, as vLLM / SGLang report it
            hits = [(raw.find(s), s) for s in payload.get("stop") or [] if s in raw]
            if hits:
                pos, stop_value = min(hits)
                text = raw[:pos]
            words = text.split(" ")
            if len(words) > payload["max_tokens"]:
                text, finish, stop_value = " ".join(words[: payload["max_tokens"]]), "length", None
        if abort:
            finish = "abort"
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.stop_field:
            choice[self.stop_field] = stop_value
        usage: dict[str, Any] = {
            "prompt_tokens": len(prompt.split()),
            "completion_tokens": len(text.split()),
            "total_tokens": len(prompt.split()) + len(text.split()),
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return {
            "id": f"cmpl-{len(self.requests)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": payload["model"],
            "choices": [choice],
            "usage": usage,
        }


def _closed_port() -> int:
    """A local port with nothing listening on it (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    srv = FakeOpenAIServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def make_model(server: FakeOpenAIServer, **kwargs: Any) -> OpenAIModel:
    opts: dict[str, Any] = {"timeout_s": TIMEOUT_S, "max_retries": 2, "backoff_s": 0.01, "api_key": "sk-test"}
    opts.update(kwargs)
    return OpenAIModel("fake-model", base_url=server.base_url, **opts)


def run_model(model: OpenAIModel, coro_fn: Callable[[OpenAIModel], Any]) -> Any:
    async def main() -> Any:
        try:
            return await coro_fn(model)
        finally:
            await model.aclose()

    return asyncio.run(main())


# -- field mapping -------------------------------------------------------------------------------


def test_generate_maps_fields(server: FakeOpenAIServer) -> None:
    server.responder = lambda p: "The answer is 4."
    server.cached_tokens = 7
    model = make_model(server)
    req = GenerationRequest(prompt="What is two plus two ?", max_new_tokens=64, temperature=0.7, top_p=0.9, seed=11)
    out = run_model(model, lambda m: m.generate(req))
    assert out.text == "The answer is 4."
    assert out.finish_reason == "stop"
    assert out.matched_stop is None  # the server reported an EOS token id, not a stop string
    assert (out.prompt_tokens, out.completion_tokens, out.cached_tokens) == (6, 4, 7)
    assert out.model == "fake-model"
    assert out.time_s > 0
    sent = server.requests[-1]
    assert sent == {"model": "fake-model", "prompt": "What is two plus two ?", "max_tokens": 64,
                    "temperature": 0.7, "top_p": 0.9, "seed": 11}
    assert server.headers[-1]["authorization"] == "Bearer sk-test"


def test_cached_tokens_absent_is_zero(server: FakeOpenAIServer) -> None:
    out = run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert out.cached_tokens == 0
    assert "seed" not in server.requests[-1] and "stop" not in server.requests[-1]


def test_stop_and_max_tokens_are_sent_and_mapped(server: FakeOpenAIServer) -> None:
    server.responder = lambda p: "step one\n\nstep two"
    model = make_model(server)

    async def go(m: OpenAIModel) -> Any:
        learned = await m.generate(GenerationRequest(prompt="think:", stop=["\n\n", "</think>"]))
        stopped = await m.generate(GenerationRequest(prompt="think:", stop=["\n\n", "</think>"]))
        capped = await m.generate(GenerationRequest(prompt="think:", max_new_tokens=1))
        return learned, stopped, capped

    learned, stopped, capped = run_model(model, go)
    # a server not known yet streams (cut client-side); its chunks carry vLLM's stop_reason, so from then on
    # the stops go to the server
    assert server.requests[0]["stream"] is True and "stop" not in server.requests[0]
    assert learned.text == "step one" and learned.matched_stop == "\n\n"
    assert server.requests[1]["stop"] == ["\n\n", "</think>"] and "stream" not in server.requests[1]
    assert stopped.text == "step one" and stopped.finish_reason == "stop" and stopped.matched_stop == "\n\n"
    assert server.requests[2]["max_tokens"] == 1
    assert capped.text == "step" and capped.finish_reason == "length" and capped.matched_stop is None


def test_sglang_matched_stop_and_missing_stop_field(server: FakeOpenAIServer) -> None:
    server.responder = lambda p: "a</step>b"
    server.stop_field = "matched_stop"
    model = make_model(server)
    out = run_model(model, lambda m: m.generate(GenerationRequest(prompt="x", stop=["</step>"])))
    assert out.text == "a" and out.matched_stop == "</step>"
    server.stop_field = None  # the same model object: it learned that this server reports stops
    out = run_model(model, lambda m: m.generate(GenerationRequest(prompt="x", stop=["</step>"])))
    assert out.text == "a" and out.matched_stop is None  # what the server said (nothing), not a guess


def test_abort_finish_reason_raises(server: FakeOpenAIServer) -> None:
    server.faults.append("abort")
    with pytest.raises(ModelServerError, match="abort"):
        run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="x")))


def test_next_token_logprobs(server: FakeOpenAIServer) -> None:
    model = make_model(server)
    top = run_model(model, lambda m: m.next_token_logprobs("Score (1-3):", top_k=2))
    assert top == {"1": -0.1, "2": -2.3}
    sent = server.requests[-1]
    assert (sent["max_tokens"], sent["logprobs"], sent["temperature"], sent["prompt"]) == (1, 2, 0, "Score (1-3):")
    with pytest.raises(ValueError):
        run_model(make_model(server), lambda m: m.next_token_logprobs("x", top_k=0))


# -- retries and errors --------------------------------------------------------------------------


def test_a_rate_limited_request_is_resent(server: FakeOpenAIServer) -> None:
    server.faults.append("429")
    out = run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert out.text == "Hello world"
    assert len(server.requests) == 2


@pytest.mark.parametrize("fault", ["500", "drop", "badjson", "slow"])
def test_a_completion_the_server_may_have_run_is_not_resent(server: FakeOpenAIServer, fault: str) -> None:
    server.faults.append(fault)  # the server read the request: generating again would cost it twice
    with pytest.raises(ModelServerError, match=r"failed after 1 attempt: .*\(not resent: ") as info:
        run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert len(server.requests) == 1 == info.value.attempts


def test_400_is_not_retried(server: FakeOpenAIServer) -> None:
    server.faults.append("400")
    with pytest.raises(ModelServerError, match="prompt is too long for this model") as info:
        run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert info.value.status == 400
    assert len(server.requests) == 1


def test_429s_exhaust_retries(server: FakeOpenAIServer) -> None:
    server.faults.extend(["429"] * 3)
    with pytest.raises(ModelServerError, match="after 3 attempts: HTTP 429: rate limited") as info:
        run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert info.value.status == 429
    assert len(server.requests) == 3 == info.value.attempts


def test_a_timeout_ends_the_call_without_a_resend(server: FakeOpenAIServer) -> None:
    server.faults.extend(["slow"] * 2)
    start = time.perf_counter()
    with pytest.raises(ModelServerError, match=r"after 1 attempt: read timeout after 0\.3 s"):
        run_model(make_model(server, max_retries=1), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert len(server.requests) == 1
    assert time.perf_counter() - start < SLOW_S  # gave up at the timeout


def test_malformed_json_is_not_resent(server: FakeOpenAIServer) -> None:
    server.faults.extend(["badjson"] * 3)
    with pytest.raises(ModelServerError, match="reply was not JSON"):
        run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert len(server.requests) == 1


def test_connection_refused_raises() -> None:
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    model = OpenAIModel("m", base_url=url, timeout_s=TIMEOUT_S, max_retries=1, backoff_s=0.01)
    with pytest.raises(ModelServerError, match="connection error") as info:
        run_model(model, lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert info.value.status is None


# -- concurrency and rendering -------------------------------------------------------------------


def test_50_concurrent_requests_share_one_client(server: FakeOpenAIServer) -> None:
    server.responder = lambda p: "echo " + p["prompt"]
    model = make_model(server, timeout_s=10.0, max_retries=0)

    async def go(m: OpenAIModel) -> Any:
        await m.generate(GenerationRequest(prompt="warm-up"))
        pool = m.client._client
        server.hold_until = 50  # the server answers only once all 50 are in flight at once
        outs = await asyncio.gather(*(m.generate(GenerationRequest(prompt=f"p{i}")) for i in range(50)))
        assert m.client._client is pool  # one pooled httpx client for every request
        return outs

    outs = run_model(model, go)
    assert [o.text for o in outs] == [f"echo p{i}" for i in range(50)]
    assert server.max_in_flight == 50  # all requests really overlapped on the server
    assert server.connections <= 64


class _FakeTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        self.calls.append(kwargs)
        text = "".join(f"<|{m['role']}|>{m['content']}" for m in messages)
        return text if kwargs["continue_final_message"] else text + "<|assistant|>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split())))


def test_messages_rendering_continue_final(server: FakeOpenAIServer) -> None:
    messages = [{"role": "user", "content": "Solve 2+2."}, {"role": "assistant", "content": "<think>First,"}]
    req = GenerationRequest(messages=messages, continue_final=True)

    run_model(make_model(server), lambda m: m.generate(req))
    assert server.requests[-1]["prompt"] == render_plain(messages, continue_final=True)
    assert server.requests[-1]["prompt"].endswith("assistant: <think>First,")

    tok = _FakeTokenizer()
    model = make_model(server, tokenizer=tok)
    run_model(model, lambda m: m.generate(req))
    assert server.requests[-1]["prompt"] == "<|user|>Solve 2+2.<|assistant|><think>First,"
    assert tok.calls[-1] == {"tokenize": False, "add_generation_prompt": False, "continue_final_message": True}
    assert model.count_tokens("a b c") == 3
    with pytest.raises(ValueError, match="continue_final"):
        model.render([{"role": "user", "content": "hi"}], continue_final=True)


@pytest.mark.slow  # the packaged 0.5B's tokenizer, from its GGUF (~15 s)
def test_a_remote_model_named_like_a_packaged_model_renders_with_its_chat_template(server: FakeOpenAIServer) -> None:
    # the README's remote job: without the packaged model's template, llama-server serving that GGUF got
    # "user: ...\n\nassistant: " and wrote other chains (1-2 steps where the local model wrote 5)
    from thinkahead.models.base import render_chat
    from thinkahead.models.loader import load_model
    from thinkahead.models.engine.weights.load import load_tokenizer

    messages = [{"role": "user", "content": "Solve 2+2."}]
    packaged = load_model(f"openai:qwen2.5-coder-0.5b@{server.base_url}")
    run_model(packaged, lambda m: m.generate(GenerationRequest(messages=messages)))
    want = render_chat(load_tokenizer("qwen2.5-coder-0.5b"), messages)
    assert server.requests[-1]["prompt"] == want and want.startswith("<|im_start|>system")
    assert packaged.count_tokens("Solve 2+2.") == len(packaged.tokenizer.encode("Solve 2+2.", add_special_tokens=False))

    other = load_model(f"openai:plain-model@{server.base_url}")
    run_model(other, lambda m: m.generate(GenerationRequest(messages=messages)))
    assert other.tokenizer is None and server.requests[-1]["prompt"] == render_plain(messages)
    given = _FakeTokenizer()
    assert load_model(f"openai:qwen2.5-coder-0.5b@{server.base_url}", tokenizer=given).tokenizer is given


def test_a_remote_model_named_like_a_packaged_model_not_prepared_here_downloads_nothing(server, monkeypatch,
                                                                                      caplog) -> None:
    import thinkahead.models.registry as registry
    from thinkahead.models.loader import load_model

    monkeypatch.setattr(registry, "prepared_path", lambda name, cache_dir=None: None)
    monkeypatch.setattr(registry, "prepare", lambda *a, **k: pytest.fail("a remote model prepared a local one"))
    with caplog.at_level("WARNING", logger="thinkahead.models.loader"):
        model = load_model(f"openai:qwen2.5-coder-1.5b@{server.base_url}")
    assert model.tokenizer is None and "not prepared here" in caplog.text and "models prepare" in caplog.text


# -- HttpClient directly -------------------------------------------------------------------------


def test_http_client_stream_health_and_get(server: FakeOpenAIServer) -> None:
    server.health_failures = 2
    client = HttpClient(f"http://127.0.0.1:{server.port}", timeout_s=TIMEOUT_S, backoff_s=0.01)

    async def go() -> tuple[list[str], dict[str, Any]]:
        try:
            await client.wait_healthy("/health", timeout_s=5, interval_s=0.01)
            events = [e async for e in client.stream_lines("/v1/stream", {"x": 1})]
            models = await client.get_json("/v1/models")
            with pytest.raises(ModelServerError, match="HTTP 404: no route") as info:
                await client.get_json("/nope")
            assert info.value.status == 404
            return events, models
        finally:
            await client.aclose()

    events, models = asyncio.run(go())
    assert server.health_failures == 0
    assert events == ['{"i": 0}', '{"i": 1}', '{"i": 2}', "line1\nline2"]
    assert models["data"][0]["id"] == "fake-model"


def test_wait_healthy_times_out() -> None:
    client = HttpClient(f"http://127.0.0.1:{_closed_port()}", timeout_s=TIMEOUT_S)

    async def go() -> None:
        try:
            await client.wait_healthy(timeout_s=0.3, interval_s=0.05)
        finally:
            await client.aclose()

    with pytest.raises(ModelServerError, match="not healthy after 0.3 s"):
        asyncio.run(go())


@pytest.mark.parametrize(
    "kwargs",
    [{"base_url": "localhost:8000"}, {"timeout_s": 0}, {"max_retries": -1}, {"backoff_s": -1.0},
     {"max_connections": 0}],
)
def test_http_client_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"base_url": "http://localhost:8000"}
    args.update(kwargs)
    with pytest.raises(ValueError):
        HttpClient(**args)


def test_openai_model_rejects_empty_model_name() -> None:
    with pytest.raises(ValueError):
        OpenAIModel("")


def test_aclose_from_another_event_loop_drops_the_old_client(server):
    model = OpenAIModel("m", base_url=server.base_url)
    asyncio.run(model.generate(GenerationRequest(prompt="hi", max_new_tokens=4)))  # opens a client in loop 1
    asyncio.run(model.aclose())  # loop 2: must not touch loop 1's transports
    completion = asyncio.run(model.generate(GenerationRequest(prompt="hi", max_new_tokens=4)))
    assert completion.text == "Hello world"
    asyncio.run(model.aclose())


def test_a_json_schema_grammar_goes_as_response_format_and_a_server_that_refuses_it_is_remembered(
        server: FakeOpenAIServer) -> None:
    from thinkahead.token_spec.grammar import GrammarError, GrammarSpec

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    model = make_model(server)
    assert not model.grammar_guaranteed  # a server's output is still checked by the caller
    server.responder = lambda p: '{"a": 1}'
    run_model(model, lambda m: m.generate(GenerationRequest(prompt="hi", grammar=GrammarSpec.json_schema(schema))))
    assert server.requests[-1]["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "output", "schema": schema, "strict": True}}  # the schema as given, without llguidance's style key
    with pytest.raises(GrammarError, match="regex grammar cannot be enforced"):
        run_model(model, lambda m: m.generate(GenerationRequest(prompt="hi", grammar=GrammarSpec.regex("a+"))))
    server.faults.append("400")  # a server that does not take response_format on completions
    out = run_model(model, lambda m: m.generate(GenerationRequest(prompt="hi", grammar=GrammarSpec.json_schema(schema))))
    assert out.text == '{"a": 1}' and "response_format" not in server.requests[-1]
    assert model.grammar_kinds == ()  # from now on its replies are checked and repaired instead
