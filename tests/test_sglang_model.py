"""The SGLang path against a fake SGLang 0.5.23 server: `SGLangModel`, `thinkahead launch`, the SUFFIX plugin.

SGLang itself does not install here (CUDA builds only), so everything runs against
`tests/fake_sglang.py`, real sockets and real subprocesses; nothing here has run on a GPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.fake_sglang import EOS_TOKEN_ID, FakeSGLangServer, encode
from thinkahead.models.base import GenerationRequest, render_plain
from thinkahead.models.http import ModelServerError
from thinkahead.models.sglang import SGLangModel, spec_stats
from thinkahead.token_spec.stats import SpecStats

ROOT = Path(__file__).resolve().parents[1]
FAKE_SCRIPT = str(ROOT / "tests" / "fake_sglang.py")
TIMEOUT_S = 0.3  # client timeout in the fault tests; "slow" replies take SLOW_S
SLOW_S = 1.0


@pytest.fixture
def server() -> Iterator[FakeSGLangServer]:
    srv = FakeSGLangServer(speculative_algorithm="NGRAM")
    srv.slow_s = SLOW_S
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def make_model(server: FakeSGLangServer, **kwargs: Any) -> SGLangModel:
    opts: dict[str, Any] = {"timeout_s": TIMEOUT_S, "max_retries": 2, "backoff_s": 0.01, "api_key": ""}
    opts.update(kwargs)
    return SGLangModel(server.url, "fake", **opts)


def run_model(model: Any, fn: Callable[[Any], Any]) -> Any:
    """Run `fn(model)` and close the model's connections in the same event loop."""
    async def main() -> Any:
        try:
            return await fn(model)
        finally:
            await model.aclose()

    return asyncio.run(main())


def generate_bodies(server: FakeSGLangServer) -> list[dict[str, Any]]:
    return [body for path, body in server.requests if path == "/generate"]


class CharTokenizer:
    """A tokenizer that agrees with the fake server's: one token per character."""

    chat_template = "{{ messages }}"
    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return encode(text)

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
        text = "".join(f"<|{m['role']}|>{m['content']}" for m in messages)
        return text if kwargs["continue_final_message"] else text + "<|assistant|>"


# -- every meta_info field -------------------------------------------------------------------------

# meta_info keys that have no place in a Completion (identifiers, timestamps, counters we do not use)
NOT_CARRIED = {"id", "weight_version", "num_retractions", "reasoning_tokens", "e2e_latency",
               "response_sent_to_client_ts", "spec_correct_drafts_histogram"}


def test_generate_maps_every_meta_info_field(server: FakeSGLangServer) -> None:
    server.responder = lambda prompt, body: "The answer is 4."
    model = make_model(server)
    req = GenerationRequest(prompt="What is two plus two?", max_new_tokens=64, temperature=0.6, top_p=0.95, seed=11,
                            stop=["</think>"])

    async def go(m: SGLangModel) -> Any:
        return await m.generate(req), await m.generate(req)

    first, second = run_model(model, go)
    meta = server.replies[-1]["meta_info"]
    out = second
    assert out.text == "The answer is 4." == server.replies[-1]["text"]
    assert out.token_ids == server.replies[-1]["output_ids"] == encode("The answer is 4.") + [EOS_TOKEN_ID]
    assert (out.finish_reason, out.matched_stop) == ("stop", None)  # EOS: the matched token id is not a stop string
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS_TOKEN_ID}
    assert out.prompt_tokens == meta["prompt_tokens"] == len("What is two plus two?")
    assert out.completion_tokens == meta["completion_tokens"] == len("The answer is 4.") + 1
    assert first.cached_tokens == 0 and out.cached_tokens == meta["cached_tokens"] == len("What is two plus two?") - 1
    spec_keys = {k for k in meta if k.startswith("spec_") and k not in NOT_CARRIED}
    assert spec_keys == {"spec_accept_rate", "spec_accept_length", "spec_num_correct_drafts",
                         "spec_num_proposed_drafts", "spec_verify_ct"}
    assert {k: float(getattr(out.spec, k)) for k in spec_keys} == {k: float(meta[k]) for k in spec_keys}
    assert out.spec.spec_accept_length == out.completion_tokens / out.spec.spec_verify_ct
    mapped = {"finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"} | spec_keys
    assert set(meta) == mapped | NOT_CARRIED  # nothing in meta_info is silently unaccounted for
    assert out.model == "fake" and out.time_s > 0 and out.first_token_s == 0.0
    assert generate_bodies(server)[-1] == {
        "text": "What is two plus two?",
        "sampling_params": {"max_new_tokens": 64, "temperature": 0.6, "top_p": 0.95, "stop": ["</think>"],
                            "sampling_seed": 11},
    }


def test_stop_string_and_length(server: FakeSGLangServer) -> None:
    server.responder = lambda prompt, body: "step one\n\nstep two"
    model = make_model(server)

    async def go(m: SGLangModel) -> Any:
        return (await m.generate(GenerationRequest(prompt="think:", stop=["\n\n", "</think>"])),
                await m.generate(GenerationRequest(prompt="think:", max_new_tokens=4)))

    stopped, capped = run_model(model, go)
    assert (stopped.text, stopped.finish_reason, stopped.matched_stop) == ("step one", "stop", "\n\n")
    assert stopped.completion_tokens == len("step one\n\n")  # the stop string's tokens were generated
    assert (capped.text, capped.finish_reason, capped.matched_stop) == ("step", "length", None)
    assert "stop" not in generate_bodies(server)[-1]["sampling_params"]


def test_server_side_abort_raises(server: FakeSGLangServer) -> None:
    server.faults.append("abort")
    with pytest.raises(ModelServerError, match="finish_reason 'abort': Abort before prefill"):
        run_model(make_model(server), lambda m: m.generate(GenerationRequest(prompt="x")))


def test_unknown_sampling_field_is_a_400_not_retried(server: FakeSGLangServer) -> None:
    model = make_model(server, sampling_extra={"seed": 3})  # SGLang's name is sampling_seed
    with pytest.raises(ModelServerError, match="unknown field `seed`") as info:
        run_model(model, lambda m: m.generate(GenerationRequest(prompt="x")))
    assert info.value.status == 400 and len(generate_bodies(server)) == 1


@pytest.mark.parametrize("incremental", [False, True])
def test_streaming_adds_up_to_the_plain_reply(incremental: bool) -> None:
    srv = FakeSGLangServer(lambda prompt, body: "Step one.\n\nStep two.", speculative_algorithm="EAGLE",
                           incremental_streaming_output=incremental, stream_chunk=2)
    srv.start()
    try:
        req = GenerationRequest(prompt="Go:", stop=["two"])
        plain = run_model(make_model(srv), lambda m: m.generate(req))
        streamed = run_model(make_model(srv, stream=True, incremental_stream=incremental), lambda m: m.generate(req))
    finally:
        srv.stop()
    assert generate_bodies(srv)[-1]["stream"] is True
    assert streamed.text == plain.text == "Step one.\n\nStep "
    assert streamed.token_ids == plain.token_ids and streamed.matched_stop == "two"
    assert streamed.completion_tokens == plain.completion_tokens
    assert streamed.spec.spec_dict() == plain.spec.spec_dict() and streamed.spec.spec_verify_ct > 0
    assert 0 < streamed.first_token_s <= streamed.time_s


def test_stream_cut_midway_raises_without_retrying(server: FakeSGLangServer) -> None:
    server.faults.append("dropstream")
    with pytest.raises(ModelServerError, match="stream broke after 1 events") as info:
        run_model(make_model(server, stream=True), lambda m: m.generate(GenerationRequest(prompt="hello")))
    assert info.value.status is None and info.value.attempts == 1  # the orchestrator does not restart it either
    assert len(generate_bodies(server)) == 1


# -- judge calls: logprobs and the radix cache -----------------------------------------------------


def test_next_token_logprobs_without_tokenizer_asks_the_server(server: FakeSGLangServer) -> None:
    server.top_logprobs = {"8": -0.2, "9": -1.9, "3": -4.0}
    top = run_model(make_model(server), lambda m: m.next_token_logprobs("Rate it. Score: ", top_k=2))
    assert top == {"8": -0.2, "9": -1.9}
    tokenized = [body for path, body in server.requests if path == "/tokenize"]
    assert tokenized == [{"prompt": "Rate it. Score: "}]
    ids = encode("Rate it. Score: ")
    assert generate_bodies(server)[-1] == {
        "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
        "top_logprobs_num": 2, "logprob_start_len": len(ids) - 1, "return_text_in_logprobs": True,
    }
    with pytest.raises(ValueError, match="top_k"):
        run_model(make_model(server), lambda m: m.next_token_logprobs("x", top_k=0))


def test_judge_calls_keep_the_radix_prefix(server: FakeSGLangServer) -> None:
    """The judge prompt extends the generation prompt; SGLang reuses that prefix only up to
    logprob_start_len, which the model keeps at the prompt's end."""
    from thinkahead.verifiers.judge import LLMJudge, judge_messages

    server.responder = lambda prompt, body: "First, 2 + 2 = 4.\n\nThen stop."
    server.top_logprobs = {"9": -0.05, "2": -3.5}
    messages = [{"role": "user", "content": "What is 2 + 2? Think step by step."},
                {"role": "assistant", "content": "<think>\nLet me see."}]

    for tokenizer in (None, CharTokenizer()):
        model = make_model(server, tokenizer=tokenizer)

        async def go(m: SGLangModel) -> Any:
            step = await m.generate(GenerationRequest(messages=messages, continue_final=True, stop=["\n\n"]))
            text = step.text + step.matched_stop  # the step as the policies keep it: delimiter put back
            return text, await LLMJudge(m, threshold=7).judge(messages, text)

        step_text, verdict = run_model(model, go)
        assert (verdict.score, verdict.accept) == (9.0, True)
        gen_prompt = model.render(messages, continue_final=True)
        judge_prompt = model.render(judge_messages(messages, step_text), continue_final=True)
        judge_ids = encode(judge_prompt)
        last = server.generations[-1]
        assert last["prompt_ids"] == judge_ids and last["logprob_start_len"] == len(judge_ids) - 1
        # everything the generation call already computed (its prompt and its step) is a cache hit
        shared = len(encode(gen_prompt)) + len(step_text)
        assert last["cached_tokens"] >= shared
        if tokenizer is not None:  # a local tokenizer: token ids everywhere, no /tokenize round trip
            assert generate_bodies(server)[-2]["input_ids"] == encode(gen_prompt)
            assert gen_prompt.startswith("<|user|>")

    # the control: a judge call that starts logprobs at 0 loses the whole prefix
    reply = httpx.post(server.url + "/generate", json={
        "input_ids": judge_ids, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1}})
    assert reply.status_code == 200 and server.generations[-1]["cached_tokens"] == 0


def test_continuation_logprobs(server: FakeSGLangServer) -> None:
    model = make_model(server, tokenizer=CharTokenizer())
    lps = run_model(model, lambda m: m.continuation_logprobs("Q: 2+2? A:", " 4"))
    assert lps == [-0.5, -0.5]
    body = generate_bodies(server)[-1]
    assert body["input_ids"] == encode("Q: 2+2? A: 4") and body["logprob_start_len"] == len("Q: 2+2? A:")


def test_continuation_scores(server: FakeSGLangServer) -> None:
    model = make_model(server, tokenizer=CharTokenizer())
    scores = run_model(model, lambda m: m.continuation_scores("Q: 2+2? A:", " 4"))
    assert [(t.text, t.logprob, t.gap, t.top_text) for t in scores] == [(" ", -0.5, 0.0, " "), ("4", -0.5, 0.0, "4")]
    body = generate_bodies(server)[-1]
    assert body["top_logprobs_num"] == 1 and body["return_text_in_logprobs"] is True
    assert body["logprob_start_len"] == len("Q: 2+2? A:")


def test_logprob_start_len_past_the_prompt_is_refused(server: FakeSGLangServer) -> None:
    reply = httpx.post(server.url + "/generate", json={"text": "abc", "return_logprob": True, "logprob_start_len": 9})
    assert reply.status_code == 400 and "Please use a smaller logprob_start_len" in reply.json()["error"]["message"]


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


# -- the orchestrator against two fake servers -----------------------------------------------------


def small_responder(prompt: str, body: dict[str, Any]) -> str:
    """The small model: a sound first step, then a wrong final answer."""
    if "Multiply" not in prompt.split("user: ", 1)[-1].split("assistant: ", 1)[-1]:
        return "Multiply 17 by 23: 17 * 20 = 340 and 17 * 3 = 51.\n\nmore"
    return "So 340 + 51 = \\boxed{392}."


def large_responder(prompt: str, body: dict[str, Any]) -> str:
    return "So 340 + 51 = \\boxed{391}."


def judge_scores(prompt: str) -> dict[str, float]:
    """The large model as judge: the wrong sum scores 1, anything else 9."""
    return {"1": -0.1, "9": -2.4} if "392" in prompt else {"9": -0.05, "1": -3.2}


@pytest.fixture
def pair() -> Iterator[tuple[FakeSGLangServer, FakeSGLangServer]]:
    small = FakeSGLangServer(small_responder, speculative_algorithm="NGRAM", model_path="fake/small")
    large = FakeSGLangServer(large_responder, judge_scores, speculative_algorithm="SUFFIX", model_path="fake/large")
    small.start()
    large.start()
    try:
        yield small, large
    finally:
        small.stop()
        large.stop()


def in_one_loop(orch: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Run `orch.<method>(...)` and close its models in the same event loop (pooled clients belong to it)."""
    async def main() -> Any:
        try:
            return await getattr(orch, method)(*args, **kwargs)
        finally:
            await orch.aclose()

    return asyncio.run(main())


def orchestrator(small: FakeSGLangServer, large: FakeSGLangServer, **settings: Any):
    from thinkahead import Orchestrator

    opts: dict[str, Any] = {"timeout_s": 5.0, "max_retries": 6, "backoff_s": 0.05}
    opts.update(settings.pop("client", {}))
    return Orchestrator(small=SGLangModel(small.url, "small", **opts), large=SGLangModel(large.url, "large", **opts),
                        policy="specreason", **settings)


def test_cot_specreason_end_to_end(pair: tuple[FakeSGLangServer, FakeSGLangServer]) -> None:
    small, large = pair
    result = in_one_loop(orchestrator(small, large), "run", "cot", "What is 17 * 23?")
    assert result.ok, result.error
    assert result.answer == "391"
    steps = [e["data"] for e in result.trace if e["kind"] == "step"]
    assert [(s["author"], s["verdict"], s["score"]) for s in steps] == [("small", "accepted", 9.0),
                                                                         ("large", "rejected", 1.0)]
    assert steps[0]["spec"]["spec_verify_ct"] > 0  # SGLang's speculative stats reach the trace
    judge_calls = [b for b in generate_bodies(large) if b.get("return_logprob")]
    assert len(judge_calls) == 2
    assert all(b["logprob_start_len"] == len(b["input_ids"]) - 1 for b in judge_calls)
    # each judge call reused the prefix the small model's step already shared with it
    judged = [g for g in large.generations if g["return_logprob"]]
    assert all(g["cached_tokens"] > 0 for g in judged[1:])


def test_server_dies_mid_batch_and_comes_back(tmp_path: Path, pair: tuple[FakeSGLangServer, FakeSGLangServer]) -> None:
    """The large server dies between two of its requests and is back 0.3 s later: its refused
    connections are retried until it is back. (A request it held when it died is not resent:
    see test_a_generation_the_server_may_have_run_is_not_resent.)"""
    small, large = pair
    calls = 0

    def responder(prompt: str, body: dict[str, Any]) -> str:
        nonlocal calls
        calls += 1
        if calls == 3:  # one run at a time: the large server holds no request now
            large.die(0.3)
        return small_responder(prompt, body)

    small.responder = responder
    from thinkahead.orchestrator.store import ResultStore

    store = tmp_path / "runs.jsonl"
    results = in_one_loop(orchestrator(small, large, concurrency=1), "map",
                          [f"What is 17 * 23? (#{i})" for i in range(6)], store=store)
    assert large.deaths == 1
    assert sorted(r.id for r in results) == [str(i) for i in range(6)]
    assert all(r.ok and r.answer == "391" for r in results), [r.error for r in results]
    assert len(list(ResultStore(store))) == 6


def test_server_down_keeps_finished_runs_and_the_batch_finishes_when_it_is_back(
    tmp_path: Path, pair: tuple[FakeSGLangServer, FakeSGLangServer]
) -> None:
    """The large server dies and stays down: finished runs are in the store, the others fail;
    once it is back the same batch resumes and runs only what had not finished."""
    from thinkahead.orchestrator.store import ResultStore

    small, large = pair
    large.faults.extend([""] * 9 + ["die"])  # 3 runs (2 judge calls + 1 rewrite each) finish first
    store = tmp_path / "runs.jsonl"
    questions = [f"What is 17 * 23? (#{i})" for i in range(6)]
    first = orchestrator(small, large, concurrency=1, retry={"attempts": 2, "backoff_s": 0.01},
                         client={"max_retries": 1, "backoff_s": 0.01, "timeout_s": 1.0})
    results = in_one_loop(first, "map", questions, store=store)
    done = {r.id for r in results if r.ok}
    assert done == {"0", "1", "2"}
    assert {r.status for r in results if not r.ok} == {"error"}
    assert "connection error" in next(r.error for r in results if not r.ok)
    assert ResultStore(store).done_ids() == done  # every finished run was written before the failure

    large.revive()
    before = len(generate_bodies(small))
    second = orchestrator(small, large, concurrency=2)
    resumed = in_one_loop(second, "map", questions, store=store)
    assert sorted(r.id for r in resumed) == ["3", "4", "5"]  # finished runs are not run again
    assert all(r.ok and r.answer == "391" for r in resumed)
    assert len(generate_bodies(small)) - before == 3 * 2  # two small steps per resumed run, none for the others
    latest = ResultStore(store).latest()
    assert sorted(latest) == [str(i) for i in range(6)] and all(r.status == "ok" for r in latest.values())


# -- thinkahead launch -----------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_command_lines_per_algorithm() -> None:
    from thinkahead.serving.sglang_launcher import SPECULATIVE_FLAGS, plan_servers, server_command

    small, large = plan_servers("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/QwQ-32B", speculative=("NGRAM", "EAGLE3"),
                                draft_models=(None, "org/eagle3-qwq"), tp_sizes=(1, 2),
                                extra_args=((), ("--max-running-requests", "64")))
    launcher = ("py", "-m", "sglang.launch_server")
    assert server_command(small, launcher) == [
        "py", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen2.5-1.5B-Instruct", "--host", "127.0.0.1",
        "--port", "30000", "--tp-size", "1", "--mem-fraction-static", "0.25", "--speculative-algorithm", "NGRAM",
        "--speculative-num-draft-tokens", "12", "--speculative-ngram-max-trie-depth", "18",
        "--speculative-ngram-max-bfs-breadth", "10"]
    assert server_command(large, launcher) == [
        "py", "-m", "sglang.launch_server", "--model-path", "Qwen/QwQ-32B", "--host", "127.0.0.1", "--port", "30001",
        "--tp-size", "2", "--mem-fraction-static", "0.6", "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", "org/eagle3-qwq", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16", "--max-running-requests", "64"]
    assert large.spec == "sglang:large@http://127.0.0.1:30001"
    # separate GPUs: SGLang's own memory default; plain decoding: no speculative flags
    s, l = plan_servers("a", "b", gpus=("0", "1"), speculative=(None, "standalone"), draft_models=(None, "c"))
    assert "--mem-fraction-static" not in server_command(s) and "--speculative-algorithm" not in server_command(s)
    assert server_command(l)[-9:] == ["STANDALONE", "--speculative-draft-model-path", "c",
                                      *SPECULATIVE_FLAGS["STANDALONE"]]
    assert server_command(s)[:3] == [sys.executable, "-m", "sglang.launch_server"]
    shared = plan_servers("a", "b", gpus=("0,1", "1"))
    assert [c.mem_fraction_static for c in shared] == [0.25, 0.6]


@pytest.mark.parametrize("kwargs,match", [
    ({"speculative": (None, "EAGLE")}, "needs a draft model"),
    ({"speculative": ("NGRAM", None), "draft_models": ("d", None)}, "draft model is used only"),
    ({"speculative": ("MEDUSA", None)}, "must be one of"),
    ({"ports": (30000, 30000)}, "different ports"),
    ({"mem_fractions": (1.5, None)}, "mem_fraction_static"),
    ({"tp_sizes": (0, 1)}, "tp_size"),
])
def test_bad_server_plans(kwargs: dict[str, Any], match: str) -> None:
    from thinkahead.serving.sglang_launcher import plan_servers

    with pytest.raises(ValueError, match=match):
        plan_servers("a", "b", **kwargs)


def test_suffix_environment_and_fallback() -> None:
    from thinkahead.serving.sglang_launcher import SPECULATIVE_FLAGS, ServerConfig, resolve_speculative, server_command, server_env

    cfg = ServerConfig("large", "m", 30001, speculative="SUFFIX", gpus="1", env={"THINKAHEAD_SUFFIX_MAX_DEPTH": "32"})
    env = server_env(cfg, {"SGLANG_PLUGINS": "other", "PATH": "/bin"})
    assert env == {"SGLANG_PLUGINS": "other,thinkahead_suffix", "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1",
                   "THINKAHEAD_SUFFIX_MAX_DEPTH": "32"}
    assert "SGLANG_PLUGINS" not in server_env(cfg, {})  # no whitelist: every plugin loads
    asked = []
    kept, note = resolve_speculative(cfg, lambda py, env: (asked.append(py) or True, "SGLang 0.5.23"), "py")
    assert kept is cfg and note is None and asked == ["py"]
    fallback, note = resolve_speculative(cfg, lambda py, env: (False, "sglang is not installed"), "py")
    assert fallback.algorithm == "NGRAM" and "SUFFIX plugin unavailable (sglang is not installed)" in note
    assert server_command(fallback)[-6:] == list(SPECULATIVE_FLAGS["NGRAM"])


def test_launcher_starts_waits_and_stops_fake_servers(tmp_path: Path) -> None:
    from thinkahead.serving.sglang_launcher import Launcher, plan_servers, server_command

    ports = free_ports(2)
    env = dict(os.environ, FAKE_SGLANG_RECORD_DIR=str(tmp_path), FAKE_SGLANG_STARTUP_S="0.5", FAKE_SGLANG_CHILD="1")
    configs = plan_servers("fake/small", "fake/large", ports=(ports[0], ports[1]), speculative=("NGRAM", "SUFFIX"))
    probe_calls = []
    runner = Launcher(configs, launcher=(sys.executable, FAKE_SCRIPT), log_dir=tmp_path / "logs", env=env,
                      probe=lambda py, e: (probe_calls.append(e.get("FAKE_SGLANG_CHILD")) or True, "ok"),
                      echo=lambda s: None)
    with runner:
        runner.start()
        runner.wait_healthy(timeout_s=20, interval_s=0.05)
        for config in configs:
            assert httpx.get(config.url + "/health").status_code == 200
            assert httpx.get(config.url + "/model_info").json()["model_path"] == config.model_path
        records = {p: json.loads((tmp_path / f"{p}.json").read_text()) for p in ports}
        for config in configs:
            rec = records[config.port]
            assert rec["argv"] == server_command(config, (sys.executable, FAKE_SCRIPT))[2:]
            assert rec["pgid"] == rec["pid"]  # its own process group
        children = [int((tmp_path / f"{p}.child").read_text()) for p in ports]
        assert "sglang:small@" in runner.summary() and "--large sglang:large@" in runner.summary()
        assert probe_calls == ["1"]  # asked once, for the SUFFIX server, in the servers' environment
    for p in ports:
        assert not alive(records[p]["pid"])
    for pid in children:
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
    assert "fake sglang: stopped" in (tmp_path / "logs" / "small.log").read_text()  # a clean SIGTERM exit


def test_launcher_reports_a_server_that_dies_while_loading(tmp_path: Path) -> None:
    from thinkahead.serving.sglang_launcher import Launcher, LaunchError, ServerConfig

    port = free_ports(1)[0]
    runner = Launcher([ServerConfig("small", "fake/small", port)], launcher=(sys.executable, FAKE_SCRIPT),
                      log_dir=tmp_path, env=dict(os.environ, FAKE_SGLANG_EXIT_CODE="3"), echo=lambda s: None)
    with runner, pytest.raises(LaunchError, match=r"(?s)exited with code 3.*failing on purpose while loading"):
        runner.start()
        runner.wait_healthy(timeout_s=20, interval_s=0.05)


def test_launcher_times_out_on_a_server_that_never_gets_healthy(tmp_path: Path) -> None:
    from thinkahead.serving.sglang_launcher import Launcher, LaunchError, ServerConfig

    port = free_ports(1)[0]
    runner = Launcher([ServerConfig("large", "fake/large", port)], launcher=(sys.executable, FAKE_SCRIPT),
                      log_dir=tmp_path, env=dict(os.environ, FAKE_SGLANG_STARTUP_S="60"), echo=lambda s: None)
    with runner:
        runner.start()
        with pytest.raises(LaunchError, match="not healthy after 0.5 s"):
            runner.wait_healthy(timeout_s=0.5, interval_s=0.05)
        pid = runner.servers[0].process.pid
    assert not alive(pid)


def test_launcher_reports_a_missing_launcher(tmp_path: Path) -> None:
    from thinkahead.serving.sglang_launcher import Launcher, LaunchError, ServerConfig

    runner = Launcher([ServerConfig("small", "m", free_ports(1)[0])], launcher=(str(tmp_path / "no-such-python"),),
                      log_dir=tmp_path, echo=lambda s: None)
    with runner, pytest.raises(LaunchError, match="cannot start the small server"):
        runner.start()


def test_launch_command_prints_urls_and_stops_on_sigterm(tmp_path: Path) -> None:
    ports = free_ports(2)
    env = dict(os.environ, FAKE_SGLANG_RECORD_DIR=str(tmp_path), FAKE_SGLANG_STARTUP_S="0.3")
    cmd = [sys.executable, "-c", "from thinkahead.cli.launch import launch; launch()",
           "--small", "fake/small", "--large", "fake/large", "--small-port", str(ports[0]),
           "--large-port", str(ports[1]), "--large-spec", "suffix", "--launcher", f"{sys.executable} {FAKE_SCRIPT}",
           "--log-dir", str(tmp_path / "logs"),
           "--timeout", "30"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("use: "):
                break
        assert lines and lines[-1] == (f"use: --small sglang:small@http://127.0.0.1:{ports[0]} "
                                       f"--large sglang:large@http://127.0.0.1:{ports[1]}\n"), lines
        for port in ports:
            assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "SUFFIX plugin unavailable (sglang is not installed in this environment); falling back to NGRAM" in err
    assert "stopping the servers" in err and err.rstrip().endswith("stopped")
    records = [json.loads((tmp_path / f"{p}.json").read_text()) for p in ports]
    assert records[1]["argv"][records[1]["argv"].index("--speculative-algorithm") + 1] == "NGRAM"
    assert not any(alive(r["pid"]) for r in records)


def test_launch_dry_run_prints_command_lines() -> None:
    from click.testing import CliRunner

    from thinkahead.cli.launch import launch

    result = CliRunner().invoke(launch, ["--small", "s", "--large", "l", "--large-spec", "eagle", "--large-draft", "d",
                                         "--large-arg", "--max-running-requests 8", "--python", "/opt/py", "--dry-run"])
    assert result.exit_code == 0, result.output
    small_line, large_line = result.output.strip().splitlines()
    assert small_line.startswith("/opt/py -m sglang.launch_server --model-path s ")
    assert large_line.endswith("--speculative-num-draft-tokens 16 --max-running-requests 8")
    bad = CliRunner().invoke(launch, ["--small", "s", "--large", "l", "--large-spec", "eagle", "--dry-run"])
    assert bad.exit_code == 2 and "needs a draft model" in bad.output


# -- the SUFFIX plugin -----------------------------------------------------------------------------


def parents_from_mask(mask: np.ndarray) -> list[int]:
    """SGLang's reading of a tree mask (`reconstruct_indices_from_tree_mask`): the parent of node i
    is the largest j < i marked in row i, else -1."""
    n = mask.shape[0]
    return [max((j for j in range(i) if mask[i, j]), default=-1) for i in range(n)]


def test_draft_rows_in_sglang_format() -> None:
    from thinkahead.token_spec.backends.sglang_suffix import draft_row
    from thinkahead.token_spec.draft import Draft

    tree = Draft(token_ids=[11, 12, 13, 14], parents=[-1, 0, -1, 2], probs=[0.9, 0.8, 0.5, 0.4])
    tokens, mask = draft_row(7, tree, 6)
    assert tokens == [7, 11, 12, 13, 14, 0]  # root = last context token; padding is token 0 under the root
    assert parents_from_mask(mask) == [-1, 0, 1, 0, 3, 0]
    assert mask.tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [1, 0, 0, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 0, 1]]
    chain = Draft.chain([5, 6, 7, 8, 9, 10, 11])
    tokens, mask = draft_row(4, chain, 4)  # longer than the budget: cut to n - 1 drafts
    assert tokens == [4, 5, 6, 7] and parents_from_mask(mask) == [-1, 0, 1, 2]
    with pytest.raises(ValueError, match="topological"):
        draft_row(1, Draft(token_ids=[1, 2], parents=[1, -1], probs=[1, 1]), 3)


def test_suffix_corpus_follows_requests_and_shares_outputs() -> None:
    from thinkahead.token_spec.backends.sglang_suffix import SuffixCorpus, SuffixSettings
    from thinkahead.token_spec.suffix_cache import SuffixCache

    corpus = SuffixCorpus(SuffixCache(max_depth=16), 5, SuffixSettings(max_depth=16, tree=False, max_spec_factor=4.0))
    prompt = [1, 2, 3, 4, 5, 6] * 3
    corpus.begin("a", prompt)  # the worker announces a new request with its whole prompt
    tokens, masks = corpus.batch_get(["a"], [prompt[-4:]], [len(prompt)])
    assert tokens.dtype == np.int64 and masks.dtype == np.int64 and masks.shape == (25,)
    assert tokens.tolist() == [6, 1, 2, 3, 4]  # the prompt repeats: the draft continues the pattern
    # two accepted tokens later SGLang passes only the tail and the new total length
    tokens, _ = corpus.batch_get(["a"], [(prompt + [1, 2])[-4:]], [len(prompt) + 2])
    assert tokens.tolist() == [2, 3, 4, 5, 6] and corpus._tokens["a"] == prompt + [1, 2]
    # a jump larger than the tail (tokens were lost) and a rewind are absorbed, not fatal
    corpus.batch_get(["a"], [[9, 9, 9]], [len(prompt) + 40])
    assert corpus._tokens["a"] == prompt + [1, 2, 9, 9, 9]
    corpus.batch_get(["a"], [[1, 2, 3]], [3])  # restarted: the old output went to the global tree
    assert corpus._tokens["a"] == [1, 2, 3] and corpus.cache.cached_requests == ["a"]
    corpus.batch_put([[1, 2, 3]])  # a no-op: tokens arrive in batch_get, where the request id is known
    # a finished request's output joins the global tree; an unannounced request drafts from it
    corpus.begin("b", [40, 41])
    for out in ([70], [70, 71, 72, 73]):
        corpus.batch_get(["b"], [[40, 41] + out], [2 + len(out)])
    corpus.erase_match_state(["b", "never-seen"])
    assert corpus.cache.cached_requests == ["a", "b"] and "b" not in corpus
    tokens, _ = corpus.batch_get(["c"], [[8, 70]], [2])
    assert tokens.tolist() == [70, 71, 72, 73, 0]
    corpus.reset()
    assert corpus.cache.cached_requests == [] and corpus.cache.active_requests == []
    with pytest.raises(ValueError, match="external"):
        corpus.load_external_corpus_named("c", [[1]])
    assert corpus.list_external_corpora() == {}


def test_suffix_settings_from_environment() -> None:
    from thinkahead.token_spec.backends.sglang_suffix import SuffixSettings

    s = SuffixSettings.from_env({"THINKAHEAD_SUFFIX_MAX_DEPTH": "32", "THINKAHEAD_SUFFIX_TREE": "0",
                                 "THINKAHEAD_SUFFIX_MIN_TOKEN_PROB": "0.2"})
    assert (s.max_depth, s.tree, s.min_token_prob, s.max_cached_requests) == (32, False, 0.2, 10_000)
    assert SuffixSettings.from_env({}) == SuffixSettings()
    with pytest.raises(ValueError, match="THINKAHEAD_SUFFIX_MAX_DEPTH must be a int"):
        SuffixSettings.from_env({"THINKAHEAD_SUFFIX_MAX_DEPTH": "deep"})
    with pytest.raises(ValueError, match="MIN_TOKEN_PROB"):
        SuffixSettings.from_env({"THINKAHEAD_SUFFIX_MIN_TOKEN_PROB": "2"})


@pytest.fixture
def stub_sglang(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """The slice of SGLang 0.5.23's API the plugin touches (spec_info / spec_registry / ngram_worker)."""
    registry: dict[str, Any] = {}

    class CustomSpecAlgo:
        def __init__(self, name, factory, *, supports_overlap=False, validate_server_args=None):
            self.name, self.factory = name, factory
            self.supports_overlap, self.validate_server_args = supports_overlap, validate_server_args

        def is_ngram(self) -> bool:
            return False

        def has_draft_kv(self) -> bool:
            return True

        def handle_server_args(self, server_args) -> None:
            pass

        def create_worker(self, server_args):
            return self.factory(server_args)

    class SpeculativeAlgorithm:
        @classmethod
        def register(cls, name, *, supports_overlap=False, validate_server_args=None, spec_class=CustomSpecAlgo):
            def decorator(factory):
                registry[name.upper()] = spec_class(name.upper(), factory, supports_overlap=supports_overlap,
                                                    validate_server_args=validate_server_args)
                return factory
            return decorator

    class NGRAMWorker:
        def __init__(self, server_args, gpu_id, nccl_port, target_worker):
            self.draft_token_num, self.max_trie_depth = 4, 18
            self.ngram_corpus = "the C++ NgramCorpus"

        def _prepare_draft_tokens(self, batch):  # as 0.5.23: tails and total lengths
            return self.ngram_corpus.batch_get(
                [r.rid for r in batch.reqs],
                [(list(r.origin_input_ids_unpadded) + list(r.output_ids))[-self.max_trie_depth:] for r in batch.reqs],
                [len(r.origin_input_ids_unpadded) + len(r.output_ids) for r in batch.reqs])

    modules = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt.speculative.spec_info": types.SimpleNamespace(SpeculativeAlgorithm=SpeculativeAlgorithm),
        "sglang.srt.speculative.spec_registry": types.SimpleNamespace(CustomSpecAlgo=CustomSpecAlgo,
                                                                      get_spec=lambda n: registry.get(n.upper())),
        "sglang.srt.speculative.ngram_worker": types.SimpleNamespace(NGRAMWorker=NGRAMWorker),
    }
    modules["sglang"].__version__ = "0.5.23"
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    import thinkahead.token_spec.backends.sglang_suffix as plugin

    monkeypatch.setattr(plugin, "_WORKER", None)
    return types.SimpleNamespace(registry=registry, NGRAMWorker=NGRAMWorker, plugin=plugin)


def test_register_wires_suffix_into_the_registry(stub_sglang: types.SimpleNamespace,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = stub_sglang.plugin
    plugin.register()
    plugin.register()  # a second load in the same process is harmless
    algo = stub_sglang.registry["SUFFIX"]
    assert algo.is_ngram() and not algo.has_draft_kv() and algo.supports_overlap
    args = types.SimpleNamespace(device="cuda", disable_overlap_schedule=False, max_running_requests=None,
                                 enable_mixed_chunk=True, speculative_ngram_max_bfs_breadth=10,
                                 speculative_eagle_topk=None, speculative_num_draft_tokens=None,
                                 speculative_num_steps=None, speculative_ngram_capacity=10_000_000, page_size=1,
                                 speculative_ngram_external_corpus_path=None, speculative_ngram_max_trie_depth=18)
    algo.validate_server_args(args)
    algo.handle_server_args(args)
    assert (args.max_running_requests, args.enable_mixed_chunk, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens, args.speculative_num_steps, args.speculative_ngram_capacity) == (
        48, False, 10, 12, 1, 1024)
    with pytest.raises(ValueError, match="max-trie-depth"):
        algo.validate_server_args(types.SimpleNamespace(speculative_ngram_external_corpus_path=None,
                                                        speculative_ngram_max_trie_depth=8,
                                                        speculative_num_draft_tokens=None))
    monkeypatch.setenv("THINKAHEAD_SUFFIX_MAX_DEPTH", "20")
    worker_cls = algo.create_worker(args)
    assert issubclass(worker_cls, stub_sglang.NGRAMWorker)
    worker = worker_cls(args, 0, 0, None)
    assert isinstance(worker.ngram_corpus, plugin.SuffixCorpus) and worker.ngram_corpus.cache.max_depth == 20
    req = types.SimpleNamespace(rid="r", origin_input_ids_unpadded=[3, 1, 4, 1, 5, 9, 2, 6] * 4, output_ids=[3, 1])
    tokens, _ = worker._prepare_draft_tokens(types.SimpleNamespace(reqs=[req]))
    assert worker.ngram_corpus._tokens["r"] == req.origin_input_ids_unpadded + [3, 1]  # the whole prompt, not a tail
    assert tokens.tolist() == [1, 4, 1, 5]


def test_plugin_status_names_what_is_missing(stub_sglang: types.SimpleNamespace,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    plugin = stub_sglang.plugin
    installed: list[Any] = []
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [ep for ep in installed if group == ep.group])
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    ok, why = plugin.plugin_status()
    assert not ok and "entry point 'thinkahead_suffix' is not installed" in why
    installed.append(types.SimpleNamespace(name="thinkahead_suffix", group="sglang.srt.plugins"))
    assert plugin.plugin_status() == (True, "SGLang 0.5.23")
    monkeypatch.setenv("SGLANG_PLUGINS", "someone_else")
    assert plugin.plugin_status() == (False, "SGLANG_PLUGINS='someone_else' does not list thinkahead_suffix")
    monkeypatch.delenv("SGLANG_PLUGINS")
    sys.modules["sglang"].__version__ = "0.6.0"
    assert plugin.plugin_status() == (True, "SGLang 0.6.0 (the plugin was written against 0.5.23)")


def test_plugin_entry_point_is_declared() -> None:
    from importlib import import_module

    from thinkahead.token_spec.backends import sglang_suffix

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    target = eps[sglang_suffix.ENTRY_POINT_GROUP][sglang_suffix.ENTRY_POINT_NAME]
    module, _, attr = target.partition(":")
    assert getattr(import_module(module), attr) is sglang_suffix.register
    assert sglang_suffix.plugin_status() == (False, "sglang is not installed in this environment")
