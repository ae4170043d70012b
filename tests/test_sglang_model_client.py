"""`SGLangModel`'s transport against a fake SGLang server: retries, timeouts, health, construction.

Which faults are resent and which are not (a generation the server may have run is never
resent), per-attempt timeouts, refused connections, `/health` and `/model_info`, constructor
checks and `sglang:` model specs, SGLang's OpenAI-compatible `/v1/completions` read by
`OpenAIModel`, and 100 concurrent requests over one connection pool.

SGLang itself does not install here (CUDA builds only), so everything runs against
`tests/fake_sglang.py`, real sockets and real subprocesses; nothing here has run on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fake_sglang import FakeSGLangServer
from tests.sglang_fixtures import SLOW_S, TIMEOUT_S, generate_bodies, make_model, run_model, running_server
from thinkahead.models.base import GenerationRequest, render_plain
from thinkahead.models.http import ModelServerError
from thinkahead.models.sglang import SGLangModel, spec_stats
from thinkahead.token_spec.stats import SpecStats


@pytest.fixture
def server() -> Iterator[FakeSGLangServer]:
    yield from running_server()


# -- retries, timeouts, health ---------------------------------------------------------------------


def test_a_rate_limited_generation_is_resent(server: FakeSGLangServer) -> None:
    server.faults.append("429")
    out = run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert out.text == "Hello world"
    assert len(generate_bodies(server)) == 2


@pytest.mark.parametrize("fault", ["500", "503", "drop", "badjson", "slow"])
def test_a_generation_the_server_may_have_run_is_not_resent(server: FakeSGLangServer, fault: str) -> None:
    server.faults.append(fault)  # a 503 without Retry-After does not say the request was refused
    with pytest.raises(ModelServerError, match=r"failed after 1 attempt: .*\(not resent: ") as info:
        run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert len(generate_bodies(server)) == 1 == info.value.attempts


def test_429s_exhaust_retries(server: FakeSGLangServer) -> None:
    server.faults.extend(["429"] * 3)
    with pytest.raises(ModelServerError, match="after 3 attempts: HTTP 429: too many requests") as info:
        run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert info.value.status == 429 and len(generate_bodies(server)) == 3 == info.value.attempts


def test_timeouts_are_per_attempt(server: FakeSGLangServer) -> None:
    server.faults.extend(["slow", "slow"])
    start = time.perf_counter()
    with pytest.raises(ModelServerError, match=r"after 1 attempt: read timeout after 0\.3 s"):
        run_model(make_model(server, max_retries=1), lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert time.perf_counter() - start < SLOW_S and len(generate_bodies(server)) == 1


def test_connection_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model = SGLangModel(f"http://127.0.0.1:{port}", timeout_s=TIMEOUT_S, max_retries=1, backoff_s=0.01)
    with pytest.raises(ModelServerError, match="connection error") as info:
        run_model(model, lambda m: m.generate(GenerationRequest(prompt="hi")))
    assert info.value.status is None


def test_health_and_model_info(server: FakeSGLangServer) -> None:
    server.health_failures = 3  # still loading weights

    async def go(m: SGLangModel) -> Any:
        await m.wait_ready(timeout_s=5, interval_s=0.01)
        info = await m.model_info()
        server.model_info_paths = ("/get_model_info",)  # a server from before /model_info
        legacy = await m.model_info()
        return info, legacy

    info, legacy = run_model(make_model(server), go)
    assert server.health_failures == 0
    assert info == legacy and info["model_path"] == "fake-org/fake-model" and info["is_generation"] is True


def test_constructor_checks_and_names() -> None:
    with pytest.raises(ValueError, match="root"):
        SGLangModel("http://h:30000/v1")
    with pytest.raises(ValueError, match="http"):
        SGLangModel("h:30000")
    model = SGLangModel("http://gpu1:30000", api_key="k")
    assert model.name == "sglang@gpu1:30000" and model.client.headers == {"Authorization": "Bearer k"}
    assert model.render([{"role": "user", "content": "hi"}]) == render_plain([{"role": "user", "content": "hi"}])
    assert spec_stats({"spec_verify_ct": 3, "spec_correct_drafts_histogram": [1, 2], "prompt_tokens": 4}) == SpecStats(
        prompt_tokens=4, spec_verify_ct=3)


def test_openai_model_works_against_sglang_v1_completions() -> None:
    """The same fake serves SGLang's OpenAI-compatible surface, which `OpenAIModel` reads."""
    from thinkahead.models.openai import OpenAIModel

    srv = FakeSGLangServer(lambda prompt, body: "a</step>b", enable_cache_report=True)
    srv.top_logprobs = {"9": -0.1, "4": -2.0}
    srv.start()
    try:
        model = OpenAIModel("fake-org/fake-model", base_url=srv.url + "/v1", timeout_s=5, api_key="")

        async def go(m: OpenAIModel) -> Any:
            return (await m.generate(GenerationRequest(prompt="xy", stop=["</step>"], seed=3)),
                    await m.generate(GenerationRequest(prompt="xy")),
                    await m.next_token_logprobs("Score: ", top_k=2))

        stopped, plain, top = run_model(model, go)
    finally:
        srv.stop()
    assert (stopped.text, stopped.finish_reason, stopped.matched_stop) == ("a", "stop", "</step>")
    assert (plain.text, plain.matched_stop, plain.cached_tokens) == ("a</step>b", None, 1)  # EOS: a token id
    assert top == {"9": -0.1, "4": -2.0}


def test_load_model_spec() -> None:
    from thinkahead.models.loader import load_model

    m = load_model("sglang:http://127.0.0.1:30000", dtype="int8", drafter="suffix")
    assert isinstance(m, SGLangModel) and m.client.base_url == "http://127.0.0.1:30000" and m.name.startswith("sglang@")
    m = load_model("sglang:qwq@http://gpu1:30001")
    assert (m.name, m.client.base_url) == ("qwq", "http://gpu1:30001")
    for bad in ("sglang:", "sglang:@http://h:1", "sglang:name@gpu1:30000", "sglang:http://"):
        with pytest.raises(ValueError, match="SGLang model spec"):
            load_model(bad)


# -- many requests at once -------------------------------------------------------------------------


def test_100_concurrent_requests_share_one_pool(server: FakeSGLangServer) -> None:
    server.responder = lambda prompt, body: "echo " + prompt
    model = make_model(server, timeout_s=10.0, max_retries=0)

    async def go(m: SGLangModel) -> Any:
        await m.generate(GenerationRequest(prompt="warm-up"))
        pool = m.client._client
        server.hold_until = 100  # the server answers only once all 100 are in flight together
        outs = await asyncio.gather(*(m.generate(GenerationRequest(prompt=f"p{i}")) for i in range(100)))
        assert m.client._client is pool
        return outs

    outs = run_model(model, go)
    assert [o.text for o in outs] == [f"echo p{i}" for i in range(100)]
    assert server.max_in_flight == 100
    assert server.connections <= 101


def test_a_grammar_goes_to_sglangs_own_constrained_decoding(server: FakeSGLangServer) -> None:
    """JSON schema, regex and EBNF travel as SGLang's `sampling_params` fields (xgrammar enforces them
    there); a Lark grammar has no SGLang field and is refused by name before any request."""
    from thinkahead.token_spec.grammar import GrammarError, GrammarSpec

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    model = make_model(server)
    for spec, field, sent in [(GrammarSpec.json_schema(schema), "json_schema", schema),
                              (GrammarSpec.regex("[ab]+"), "regex", "[ab]+"),
                              (GrammarSpec.ebnf('root ::= "yes" | "no"'), "ebnf", 'root ::= "yes" | "no"')]:
        run_model(model, lambda m: m.generate(GenerationRequest(prompt="hi", max_new_tokens=4, grammar=spec)))
        value = generate_bodies(server)[-1]["sampling_params"][field]
        assert (json.loads(value) if field == "json_schema" else value) == sent
    before = len(generate_bodies(server))
    with pytest.raises(GrammarError, match="lark grammar cannot be enforced"):
        run_model(model, lambda m: m.generate(GenerationRequest(prompt="hi", grammar=GrammarSpec.lark("start: /a+/"))))
    assert len(generate_bodies(server)) == before
