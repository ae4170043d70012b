"""`SGLangModel` against a fake SGLang 0.5.23 server: generation, streaming and judge calls.

Every meta_info field of `/generate`, stop strings and length, aborts, sampling-field contract
errors, streamed vs. plain replies, and the judge's logprob calls (next-token logprobs,
continuation logprobs and scores) with the radix-cache prefix they keep.

SGLang itself does not install here (CUDA builds only), so everything runs against
`tests/fake_sglang.py`, real sockets and real subprocesses; nothing here has run on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.fake_sglang import EOS_TOKEN_ID, FakeSGLangServer, encode
from tests.sglang_fixtures import generate_bodies, make_model, run_model, running_server
from thinkahead.models.base import GenerationRequest
from thinkahead.models.http import ModelServerError
from thinkahead.models.sglang import SGLangModel


@pytest.fixture
def server() -> Iterator[FakeSGLangServer]:
    yield from running_server()


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


def test_token_logprobs_score_given_ids_with_their_alternatives_in_one_prefill(server: FakeSGLangServer) -> None:
    # what `serve` answers `logprobs`/`echo` with when its model is an SGLang server
    model = make_model(server, tokenizer=CharTokenizer())
    ids = encode("Q: 2+2? A: 4")
    scored = run_model(model, lambda m: m.token_logprobs(ids, 8, top_k=3))
    assert [(t.token_id, t.text, t.logprob) for t in scored] == [(i, chr(i), -0.5) for i in ids[8:]]
    assert all(t.top == [(t.token_id + j, chr(t.token_id + j), -0.5 - j) for j in range(3)] for t in scored)
    body = generate_bodies(server)[-1]
    assert (body["input_ids"], body["logprob_start_len"], body["top_logprobs_num"]) == (ids, 8, 3)
    plain = run_model(make_model(server, tokenizer=CharTokenizer()), lambda m: m.token_logprobs(ids, 8))
    assert [t.top for t in plain] == [[]] * (len(ids) - 8) and "top_logprobs_num" not in generate_bodies(server)[-1]
    with pytest.raises(ValueError, match="0 < start < len"):
        run_model(make_model(server), lambda m: m.token_logprobs(ids, len(ids)))


def test_logprob_start_len_past_the_prompt_is_refused(server: FakeSGLangServer) -> None:
    reply = httpx.post(server.url + "/generate", json={"text": "abc", "return_logprob": True, "logprob_start_len": 9})
    assert reply.status_code == 400 and "Please use a smaller logprob_start_len" in reply.json()["error"]["message"]
