"""Token scores from remote servers through `OpenAIModel` (thinkahead/models/remote_scores.py).

Fakes on loopback ports answer as each real server does (fields and shapes from their code): vLLM's
`/v1/completions` with `echo` + `logprobs` + `max_tokens: 0` (legacy `logprobs` and `prompt_logprobs` keyed by
token id; `vllm/entrypoints/openai/completion/serving.py`) and its `/tokenize`; llama.cpp's `llama-server`
(`tools/server`): `/v1/completions` that ignores `echo` and answers logprobs in the chat shape, and the native
`/completion` with `n_probs`, `logit_bias` and `completion_probabilities` of raw-softmax log-probabilities, and
`/tokenize` (`content`). Both score with one toy language model whose numbers the tests compute directly. Then
thinkahead's own `serve` over a real (tiny) model: its scores equal the local model's.
"""

from __future__ import annotations

import asyncio
import math
import socket
from typing import Any

import numpy as np
import pytest

from thinkahead.models.http import ModelServerError
from thinkahead.models.openai import OpenAIModel
from thinkahead.models.remote_scores import FORCE_BIAS, PROBE_TEXT, ScoresUnavailable

from tests.fake_http import FakeHttpServer, Reply, Request, json_reply
from tests.server_fixtures import serve, tiny, tiny_url  # noqa: F401 - fixtures
from tests.test_openai_model import FakeOpenAIServer, run_model
from tests.tiny_models import VOCAB

WORDS = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]  # the tiny word-level tokenizer's
PROMPT = "w5 w9 w2 w7"


def toy_logprobs(prefix: list[int]) -> np.ndarray:
    """The toy model: next-token log-probabilities after `prefix` (float64, a function of its last token and length)."""
    rng = np.random.default_rng(prefix[-1] * 7919 + len(prefix))
    logits = rng.normal(0.0, 3.0, VOCAB)
    return logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()


def ids_of(text: str) -> list[int]:
    return [WORDS.index(w) if w in WORDS else 3 for w in text.split()]



def _continuation() -> str:
    """Words the toy model picks itself (its argmax after the prompt) and words it does not."""
    ids = ids_of(PROMPT)
    ids.append(int(toy_logprobs(ids).argmax()))
    return " " + " ".join(WORDS[t] for t in ids[-1:]) + " w3 w3 w40"


CONTINUATION = _continuation()


def expected(ids: list[int], start: int) -> list[tuple[str, float, float, str]]:
    """(text, logprob, top logprob, top text) of each of ids[start:] under the toy model."""
    out = []
    for i in range(start, len(ids)):
        row = toy_logprobs(ids[:i])
        best = int(row.argmax())
        out.append((WORDS[ids[i]], float(row[ids[i]]), float(row[best]), WORDS[best]))
    return out


class FakeVLLM(FakeHttpServer):
    """vLLM's completions with echo (`max_tokens: 0` returns the prompt only) and its `/tokenize`."""

    def __init__(self, prompt_logprobs: bool = True) -> None:
        super().__init__()
        self.prompt_logprobs = prompt_logprobs  # newer vLLM puts choices[0].prompt_logprobs beside the legacy field
        self.requests: list[tuple[str, Any]] = []

    async def respond(self, request: Request) -> Reply:
        body = request.json()
        self.requests.append((request.path, body))
        if request.path == "/tokenize":
            ids = ids_of(body["prompt"])
            return json_reply(200, {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None})
        if request.path != "/v1/completions":
            return json_reply(404, {"detail": "Not Found"})
        ids = body["prompt"] if isinstance(body["prompt"], list) else ids_of(body["prompt"])
        if not (body.get("echo") and body.get("max_tokens") == 0 and body.get("logprobs") is not None):
            return json_reply(400, {"object": "error", "message": "this fake only echoes", "code": 400})
        k = body["logprobs"]
        rows: list[Any] = [None]
        for i in range(1, len(ids)):
            lp = toy_logprobs(ids[:i])
            order = np.argsort(-lp)
            keep = [ids[i]] + [int(t) for t in order[:k] if int(t) != ids[i]]  # the token first, then the top k
            rows.append({str(t): {"logprob": float(lp[t]), "rank": int((lp > lp[t]).sum()) + 1,
                                  "decoded_token": WORDS[t]} for t in keep})
        text = [WORDS[t] for t in ids]
        legacy = {"tokens": text, "token_logprobs": [None] + [max(r[str(t)]["logprob"], -9999.0)
                                                                for r, t in zip(rows[1:], ids[1:])],
                  "top_logprobs": [None] + [{v["decoded_token"]: v["logprob"] for v in r.values()} for r in rows[1:]],
                  "text_offset": [sum(len(w) for w in text[:i]) for i in range(len(text))]}
        choice = {"index": 0, "text": "".join(text), "logprobs": legacy, "finish_reason": "length", "stop_reason": None}
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = rows
        return json_reply(200, {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                                "choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": 0}})


class FakeLlamaServer(FakeHttpServer):
    """llama-server: `/v1/completions` ignores echo (chat-shaped logprobs of generated tokens), native `/completion`
    samples greedily after `logit_bias` and reports raw-softmax probabilities, `/tokenize` takes `content`."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, Any]] = []
        self.slot: list[int] = []  # the one slot's cached tokens
        self.evaluated: list[int] = []  # prompt tokens evaluated per /completion (the rest came from the cache)

    def _generate(self, ids: list[int], n: int, n_probs: int, bias: dict[int, float]) -> list[dict[str, Any]]:
        out, ids = [], list(ids)
        for _ in range(n):
            lp = toy_logprobs(ids)
            tok = int(np.argmax(lp + np.array([bias.get(t, 0.0) for t in range(VOCAB)])))
            top = [{"id": int(t), "token": WORDS[t], "bytes": list(WORDS[t].encode()), "logprob": float(lp[t])}
                   for t in np.argsort(-lp)[:n_probs]]
            out.append({"id": tok, "token": WORDS[tok], "bytes": list(WORDS[tok].encode()), "logprob": float(lp[tok]),
                        "top_logprobs": top})
            ids.append(tok)
        return out

    async def respond(self, request: Request) -> Reply:
        body = request.json()
        self.requests.append((request.path, body))
        if request.path == "/tokenize":
            return json_reply(200, {"tokens": ids_of(body["content"]) if "content" in body else []})  # as it does
        prompt = body["prompt"] if isinstance(body["prompt"], list) else ids_of(body["prompt"])
        if request.path == "/v1/completions":  # echo is not read; logprobs come in the chat shape
            probs = self._generate(prompt, max(1, body.get("max_tokens") or 16), body.get("logprobs") or 0, {})
            logprobs = {"content": probs} if body.get("logprobs") else None
            return json_reply(200, {"choices": [{"text": "".join(p["token"] for p in probs), "index": 0,
                                                 "logprobs": logprobs, "finish_reason": "length"}],
                                    "object": "text_completion", "usage": {"prompt_tokens": len(prompt)}})
        if request.path != "/completion":
            return json_reply(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})
        cached = next((i for i, (a, b) in enumerate(zip(self.slot, prompt)) if a != b), min(len(self.slot), len(prompt)))
        cached = min(cached, len(prompt) - 1)  # at least one token is evaluated, for its logits
        self.evaluated.append(len(prompt) - cached)
        self.slot = list(prompt)  # the sampled token is not evaluated when n_predict ends the generation
        bias = {int(t): float(b) for t, b in body.get("logit_bias", [])}
        probs = self._generate(prompt, body["n_predict"], body.get("n_probs", 0), bias)
        reply = {"index": 0, "content": "".join(p["token"] for p in probs), "tokens": [], "id_slot": 0, "stop": True,
                 "tokens_predicted": len(probs), "tokens_evaluated": len(prompt), "stop_type": "limit",
                 "stopping_word": "", "tokens_cached": cached}
        if body.get("n_probs"):
            reply["completion_probabilities"] = probs
        return json_reply(200, reply)


@pytest.fixture
def word_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def started(server: FakeHttpServer):
    server.start()
    return server


def check_scores(scores, ids: list[int], start: int) -> None:
    want = expected(ids, start)
    assert [(s.text, s.logprob, s.top_logprob) for s in scores] == [(w[0], w[1], max(w[1], w[2])) for w in want]
    assert [s.top_text for s in scores] == [w[0] if w[1] >= w[2] else w[3] for w in want]
    assert any(s.gap > 1 for s in scores) and any(s.gap == 0 for s in scores)  # both cases are covered


@pytest.mark.parametrize("prompt_logprobs", [True, False])
def test_vllm_scores_a_continuation_in_one_echo_request_of_our_token_ids(word_tokenizer, prompt_logprobs) -> None:
    server = started(FakeVLLM(prompt_logprobs))
    try:
        model = OpenAIModel("m", base_url=f"{server.url}/v1", api_key="", tokenizer=word_tokenizer)
        scores = run_model(model, lambda m: m.continuation_scores(PROMPT, CONTINUATION))
        ids = ids_of(PROMPT + CONTINUATION)
        check_scores(scores, ids, len(ids_of(PROMPT)))
        (_, probe), (_, scored) = server.requests  # one probe, then one request for the whole continuation
        assert scored == {"model": "m", "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
        assert model.scorer.method == "echo" and model.scores_tokens
        top = run_model(model, lambda m: m.token_logprobs(ids, 2, top_k=3))
        row = toy_logprobs(ids[:2])
        assert [(a, t, lp) for a, t, lp in top[0].top] == [(int(t), WORDS[t], float(row[t])) for t in np.argsort(-row)[:3]]
        assert (top[0].token_id, top[0].logprob) == (ids[2], float(row[ids[2]])) and len(top) == len(ids) - 2
    finally:
        server.stop()


def test_without_a_local_tokenizer_the_servers_tokenize_gives_the_ids() -> None:
    for server in (started(FakeVLLM()), started(FakeLlamaServer())):
        try:
            model = OpenAIModel("m", base_url=f"{server.url}/v1", api_key="")
            scores = run_model(model, lambda m: m.continuation_scores(PROMPT, CONTINUATION))
            ids = ids_of(PROMPT + CONTINUATION)
            check_scores(scores, ids, len(ids_of(PROMPT)))
            asked = [b for p, b in server.requests if p == "/tokenize"]
            texts = [PROBE_TEXT, PROMPT, PROMPT + CONTINUATION]
            if isinstance(server, FakeVLLM):
                assert asked == [{"model": "m", "prompt": t} for t in texts]
            else:  # the echo probe asked in vLLM's shape first (llama-server answers no tokens to that)
                assert asked == [{"model": "m", "prompt": PROBE_TEXT}] + [
                    {"content": t, "add_special": True, "parse_special": True} for t in texts]
        finally:
            server.stop()


def test_llama_server_scores_each_token_by_forcing_it_on_the_native_endpoint(word_tokenizer) -> None:
    server = started(FakeLlamaServer())
    try:
        model = OpenAIModel("m", base_url=f"{server.url}/v1", api_key="", tokenizer=word_tokenizer)
        scores = run_model(model, lambda m: m.continuation_scores(PROMPT, CONTINUATION))
        ids, start = ids_of(PROMPT + CONTINUATION), len(ids_of(PROMPT))
        check_scores(scores, ids, start)
        paths = [p for p, _ in server.requests]
        assert paths[0] == "/v1/completions"  # the echo probe first: llama-server ignores echo, so not that
        assert model.scorer.method == "llama"
        scored = [b for p, b in server.requests[2:]]  # after the two probes: one request per continuation token
        assert len(scored) == len(ids) - start
        for i, body in zip(range(start, len(ids)), scored):
            assert body == {"prompt": ids[:i], "n_predict": 1, "n_probs": 1, "temperature": 0, "cache_prompt": True,
                            "post_sampling_probs": False, "logit_bias": [[ids[i], FORCE_BIAS]]}
        assert server.evaluated[-len(scored) + 1:] == [1] * (len(scored) - 1)  # the prefix came from the slot's cache
        # a token outside the top k still gets its exact log-probability (it was the one sampled)
        worst = min(scores, key=lambda s: s.logprob)
        assert worst.gap > 3 and worst.logprob == min(w[1] for w in expected(ids, start))
        judge = run_model(model, lambda m: m.next_token_logprobs(PROMPT, top_k=2))  # /v1/completions' chat-shaped logprobs
        row = toy_logprobs(ids_of(PROMPT))
        assert judge == {WORDS[t]: float(row[t]) for t in np.argsort(-row)[:2]}
    finally:
        server.stop()


def test_a_server_that_scores_nothing_is_refused_by_name_after_one_probe_each() -> None:
    from thinkahead.models.loader import load_model, scores_tokens

    server = FakeOpenAIServer()  # echo ignored (one generated token scored), no /completion, no /tokenize
    server.start()
    try:
        model = OpenAIModel("plain-model", base_url=server.base_url, api_key="", tokenizer=None)
        spec = f"openai:plain-model@{server.base_url}"
        assert scores_tokens(spec) and load_model(spec).scores_tokens  # nothing refused before the probe
        with pytest.raises(ScoresUnavailable) as info:
            run_model(model, lambda m: m.continuation_scores("w1 w2", " w3"))
        message = str(info.value)
        assert "'plain-model'" in message and server.base_url in message and "cannot score tokens" in message
        assert "echo + logprobs" in message and "/completion with n_probs" in message and "404" in message
        assert not model.scores_tokens
        asked = len(server.requests)
        with pytest.raises(ScoresUnavailable):
            run_model(model, lambda m: m.probe_scores())
        assert len(server.requests) == asked  # probed once
    finally:
        server.stop()


def test_a_server_that_is_down_during_the_probe_is_not_taken_for_a_scoreless_one() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model = OpenAIModel("m", base_url=f"http://127.0.0.1:{port}/v1", api_key="", max_retries=0)
    with pytest.raises(ModelServerError) as info:
        run_model(model, lambda m: m.probe_scores())
    assert not isinstance(info.value, ScoresUnavailable) and model.scores_tokens and model.scorer.method is None


def test_specreason_refuses_a_scoreless_remote_large_model_before_the_runs_first_step() -> None:
    from thinkahead.models import ScriptedModel
    from thinkahead.step_spec.loop import StepLoop
    from thinkahead.step_spec.policies import SpecReason

    server = FakeOpenAIServer()
    server.start()
    try:
        small = ScriptedModel(outputs=["Step one.\n\n"], name="small")
        large = OpenAIModel("plain-model", base_url=server.base_url, api_key="")
        loop = StepLoop(small, large, SpecReason(gate_logprob=None))  # built: no static check can know yet
        with pytest.raises(ValueError, match=r"judge 'agreement' needs token scores from the large model.*"
                                             r"'plain-model' at http://127\.0\.0\.1:\d+/v1 cannot score tokens"):
            asyncio.run(loop.run("What is 2 + 2?"))
        assert small.calls == [] and all(r.get("max_tokens") in (0, 1) for r in server.requests)  # no step drafted
        # with the LLM judge it runs (next-token logprobs only)
        assert asyncio.run(StepLoop(ScriptedModel(outputs=["So \\boxed{4}."]), large,
                                    SpecReason(judge="llm", gate_logprob=None)).run("What is 2 + 2?")).steps
    finally:
        server.stop()


def test_our_serve_scores_exactly_as_the_local_model(tiny, tiny_url) -> None:
    """thinkahead serve (echo + logprobs over token ids) as the remote: the scores are the local model's own."""
    prompt, continuation = "w5 w6 w7", " w8 w9 w10 w11 w12"
    model = OpenAIModel("tiny", base_url=f"{tiny_url}/v1", api_key="", tokenizer=tiny.tokenizer)

    async def both(m: OpenAIModel) -> Any:
        ids = m.encode(prompt + continuation)
        return (await m.continuation_scores(prompt, continuation), await m.token_logprobs(ids, 2, top_k=3),
                await tiny.continuation_scores(prompt, continuation), await tiny.token_logprobs(ids, 2, top_k=3))

    remote, remote_ids, local, local_ids = run_model(model, both)
    assert model.scorer.method == "echo"
    assert [(s.text, s.top_text) for s in remote] == [(s.text, s.top_text) for s in local]
    for a, b in zip(remote, local):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5) and math.isclose(a.top_logprob, b.top_logprob, abs_tol=1e-5)
    assert [(t.token_id, [x[:2] for x in t.top]) for t in remote_ids] == [(t.token_id, [x[:2] for x in t.top])
                                                                          for t in local_ids]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-5) for a, b in zip(remote_ids, local_ids))
