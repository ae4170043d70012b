"""A fake SGLang server for tests: SGLang 0.5.23's native and OpenAI response shapes, with faults.

SGLang does not install on CPU machines, so `SGLangModel` and `thinkahead launch` are tested
against this stand-in. The shapes are taken from the sglang 0.5.23 wheel (the version the
suffix plugin is pinned to, see `thinkahead.token_spec.backends.sglang_suffix`):

- `POST /generate` (`sglang/srt/entrypoints/http_server.py`: `generate_request`,
  `serve_generate_request`): the body is checked against `sglang/api/v1/api_types.py`
  (`GenerateRequest` ignores unknown keys; `SamplingParams` rejects them with serde's
  "unknown field" text, so `seed` is refused and `sampling_seed` is the field). The reply is
  `{"text", "output_ids", "meta_info"}`; meta_info is assembled as in
  `sglang/srt/managers/tokenizer_manager.py` (`_handle_batch_output`, `add_logprob_to_meta_info`,
  `_calculate_spec_decoding_metrics`): `id`, `finish_reason` (`{"type": "stop", "matched": str |
  token id}`, `{"type": "length", "length": n}`, `{"type": "abort", ...}` from
  `managers/schedule_batch.py` FINISH_*), `prompt_tokens`, `weight_version`, `num_retractions`,
  the logprob lists (entries `[logprob, token_id, text]`), `reasoning_tokens`,
  `completion_tokens`, `cached_tokens`, `e2e_latency`, and with a speculative algorithm
  `spec_accept_rate`, `spec_accept_length` (completion tokens / verify steps),
  `spec_num_correct_drafts`, `spec_num_proposed_drafts` (verify steps x (draft tokens - 1)),
  `spec_verify_ct`, `spec_correct_drafts_histogram`. With `stream: true` every event is
  `data: {json}` (by default cumulative text and ids, `--incremental-streaming-output` sends
  deltas) and the stream ends with `data: [DONE]`. A request-level abort with status 400 (e.g.
  `logprob_start_len` beyond the prompt, `managers/scheduler.py`) answers HTTP 400
  `{"error": {"message"}}`.
- Prefix cache: `Req._compute_max_prefix_len` (`schedule_batch.py`) reuses at most
  `len(prompt) - 1` tokens and, for a logprob request, no more than `logprob_start_len`;
  `logprob_start_len = -1` with `return_logprob` resolves to `len(prompt)` (`scheduler.py`). The
  fake reports `cached_tokens` as the longest prefix shared with an earlier sequence, capped so.
- `GET /health` (200 with an empty body, 503 while starting), `GET /model_info` and its
  deprecated alias `GET /get_model_info`, `POST /tokenize` (`{"tokens", "count",
  "max_model_len"}`, `entrypoints/openai/serving_tokenize.py`) and `POST /v1/completions`
  (`entrypoints/openai/protocol.py`: `CompletionResponse`, choices with `matched_stop`,
  `usage.prompt_tokens_details` only with `--enable-cache-report`).

The "model" is a character-level tokenizer (token id = code point, EOS = 0) and a `responder`
function that writes the raw continuation, so every count in a reply can be checked by hand.

Faults (`server.faults`, consumed one per /generate or /v1/completions request): "500", "503",
"429", "400", "drop" (close without a reply), "badjson", "slow" (reply after `slow_s`),
"abort" (a 200 reply whose finish_reason is an abort), "dropstream" (a stream cut after its
first event), "die:SECONDS" (the whole server dies, dropping every connection, and comes back
on the same port after SECONDS), "die" (it dies and stays down until `revive()`); "" is no fault.

Run as a script it stands in for `python -m sglang.launch_server` in `thinkahead launch` tests:
it takes `--model-path` and `--port`, ignores the other flags, records its argv, pid and a few
environment variables to `$FAKE_SGLANG_RECORD_DIR/<port>.json`, answers /health with 503 for
`$FAKE_SGLANG_STARTUP_S` seconds, exits at once with `$FAKE_SGLANG_EXIT_CODE` when that is set,
starts a child process when `$FAKE_SGLANG_CHILD` is set (SGLang runs its scheduler and
detokenizer as children), and stops cleanly on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

SGLANG_VERSION = "0.5.23"
EOS_TOKEN_ID = 0

# sglang/api/v1/api_types.py, SamplingParams (unknown keys are a contract error)
SAMPLING_PARAMS_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width",
    "watermark", "choice",
)

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


# ------------------------------------------------------------------------------------------------
# A tiny threaded HTTP/1.1 server: keep-alive, streamed replies, death and revival on one port
# ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


async def read_request(reader: asyncio.StreamReader) -> Request | None:
    """One HTTP/1.1 request off a keep-alive connection; None when the client closed it."""
    line = await reader.readline()
    if not line:
        return None
    method, target, _version = line.decode("latin-1").split()
    headers: dict[str, str] = {}
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        key, _, value = h.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return Request(method, target.split("?")[0], headers, body)


@dataclass(slots=True)
class Reply:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Stream:
    """A chunked reply: each item of `events` is written and flushed as it comes.

    The iterator may raise `DropConnection` to cut the connection mid-stream.
    """

    events: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"


class DropConnection(Exception):
    """Raised by a handler or a stream to close the connection without (more of) a reply."""


def json_reply(status: int, obj: Any) -> Reply:
    return Reply(status, json.dumps(obj).encode())


class FakeHttpServer:
    """An asyncio HTTP/1.1 server in its own thread; subclasses implement `respond`.

    `die(down_s)` closes the listener and every open connection (clients see resets and refused
    connections) and, with `down_s`, listens again on the same port after that long.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.connections = 0
        self.alive = False
        self.deaths = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def respond(self, request: Request) -> Reply | Stream | None:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- lifecycle (called from the test's thread) -------------------------------------------------

    def start(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._listen())
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=f"fake-http-{id(self)}", daemon=True)
        self._thread.start()
        if not ready.wait(10) or failure:
            raise RuntimeError(f"fake server did not start: {failure[0] if failure else 'timeout'}")

    def stop(self) -> None:
        loop = self._loop
        if loop is None or self._thread is None or loop.is_closed():
            return

        async def shutdown() -> None:
            await self._close_all()
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), loop)
        self._thread.join(10)

    def die(self, down_s: float | None = None) -> None:
        """Kill the server now (from any thread); with `down_s`, revive it that much later."""
        self._call(self._die(down_s))

    def revive(self) -> None:
        """Listen again on the same port."""
        self._call(self._listen())

    def _call(self, coro: Any) -> Any:
        loop = self._loop
        assert loop is not None, "server not started"
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            return asyncio.ensure_future(coro)
        return asyncio.run_coroutine_threadsafe(coro, loop).result(10)

    # -- internals (server loop) -------------------------------------------------------------------

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self.alive = True

    async def _close_all(self) -> None:
        self.alive = False
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            transport = writer.transport
            if transport is not None:
                transport.abort()
        self._writers.clear()

    async def _die(self, down_s: float | None) -> None:
        self.deaths += 1
        await self._close_all()
        if down_s is not None:
            async def later() -> None:
                await asyncio.sleep(down_s)
                await self._listen()

            asyncio.ensure_future(later())

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    return
                headers = request.headers
                try:
                    reply = await self.respond(request)
                except DropConnection:
                    reply = None
                if reply is None or not self.alive:
                    return
                if isinstance(reply, Stream):
                    head = [f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'OK')}",
                            f"Content-Type: {reply.content_type}", "Transfer-Encoding: chunked",
                            "Connection: keep-alive"]
                    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
                    try:
                        async for chunk in reply.events:
                            if not self.alive:
                                return
                            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                            await writer.drain()
                    except DropConnection:
                        return
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()
                else:
                    head = [f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'OK')}",
                            f"Content-Type: {reply.content_type}", f"Content-Length: {len(reply.body)}",
                            "Connection: keep-alive", *reply.headers]
                    writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + reply.body)
                    await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


# ------------------------------------------------------------------------------------------------
# The SGLang stand-in
# ------------------------------------------------------------------------------------------------


def encode(text: str) -> list[int]:
    """The fake's tokenizer: one token per character, id = code point."""
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids if i != EOS_TOKEN_ID)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


Responder = Callable[[str, dict[str, Any]], str]


class FakeSGLangServer(FakeHttpServer):
    """SGLang 0.5.23's HTTP API over a character-level fake model (see the module docstring).

    Args:
        responder: `(prompt_text, payload) -> raw continuation` before stop/length handling.
        top_logprobs: the next-token distribution (text -> logprob) after a prompt: a dict or a
            function of the prompt text. A `max_new_tokens=1` logprob request emits its argmax.
        speculative_algorithm, accept_length, num_draft_tokens: when an algorithm is set, finished
            replies carry the spec_* fields of a run that accepted `accept_length` tokens per
            verify step on average.
    """

    def __init__(
        self,
        responder: Responder | None = None,
        top_logprobs: dict[str, float] | Callable[[str], dict[str, float]] | None = None,
        *,
        model_path: str = "fake-org/fake-model",
        served_model_name: str | None = None,
        speculative_algorithm: str | None = None,
        accept_length: float = 2.5,
        num_draft_tokens: int = 4,
        enable_cache_report: bool = False,
        incremental_streaming_output: bool = False,
        stream_chunk: int = 3,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(host, port)
        self.responder: Responder = responder or (lambda prompt, payload: "Hello world")
        self.top_logprobs = top_logprobs if top_logprobs is not None else {"7": -0.1, "3": -2.5, "x": -4.0}
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.speculative_algorithm = speculative_algorithm
        self.accept_length = accept_length
        self.num_draft_tokens = num_draft_tokens
        self.enable_cache_report = enable_cache_report
        self.incremental_streaming_output = incremental_streaming_output
        self.stream_chunk = stream_chunk
        self.faults: deque[str] = deque()
        self.delay_s = 0.0
        self.slow_s = 1.0
        self.hold_until = 0  # generation waits (up to 5 s) until this many are in flight together
        self.starting_until = 0.0  # /health answers 503 until this time.monotonic()
        self.health_failures = 0
        self.requests: list[tuple[str, Any]] = []  # (path, json body) of every POST, in arrival order
        self.generations: list[dict[str, Any]] = []  # per finished /generate: prompt ids, resolved lsl, cached
        self.replies: list[dict[str, Any]] = []  # every non-streamed /generate reply body
        self.model_info_paths = ("/model_info", "/get_model_info")  # 0.5.23 serves both
        self.in_flight = 0
        self.max_in_flight = 0
        self._radix: list[list[int]] = []

    # -- routing -----------------------------------------------------------------------------------

    async def respond(self, request: Request) -> Reply | Stream | None:
        path, method = request.path, request.method
        if method == "GET" and path in ("/health", "/health_generate"):
            if self.health_failures > 0 or time.monotonic() < self.starting_until:
                self.health_failures = max(0, self.health_failures - 1)
                return Reply(503, b"", "text/plain")
            return Reply(200, b"", "text/plain")
        if method == "GET" and path in self.model_info_paths:
            return json_reply(200, self.model_info())
        if method == "GET" and path == "/v1/models":
            return json_reply(200, {"object": "list", "data": [
                {"id": self.served_model_name, "object": "model", "created": int(time.time()),
                 "owned_by": "sglang", "root": self.served_model_name, "max_model_len": 32768}]})
        if method == "POST" and path in ("/tokenize", "/v1/tokenize"):
            body = request.json()
            self.requests.append((path, body))
            return self._tokenize(body)
        if method in ("POST", "PUT") and path == "/generate":
            return await self._guarded(request, self._generate)
        if method == "POST" and path == "/v1/completions":
            return await self._guarded(request, self._completions)
        return json_reply(404, {"detail": "Not Found"})

    def model_info(self) -> dict[str, Any]:
        """`GET /model_info` of 0.5.23 (http_server.py `model_info`)."""
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "fake",
            "architectures": ["FakeForCausalLM"],
        }

    async def _guarded(self, request: Request, handler: Callable[[dict[str, Any], str | None], Any]) -> Any:
        """Record the request, apply the next fault, then run `handler(body, fault)`."""
        try:
            body = request.json()
        except json.JSONDecodeError:
            return json_reply(400, {"error": {"message": "invalid JSON body"}})
        self.requests.append((request.path, body))
        fault = self.faults.popleft() if self.faults else None
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if fault and fault.startswith("die"):
                _, _, down_s = fault.partition(":")
                self.die(float(down_s) if down_s else None)
                raise DropConnection
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            deadline = time.monotonic() + 5.0
            while self.max_in_flight < self.hold_until and time.monotonic() < deadline:
                await asyncio.sleep(0.005)  # a latch: once reached, everyone is released
            if fault in ("500", "503"):
                return json_reply(int(fault), {"error": {"message": "scheduler overloaded", "code": int(fault)}})
            if fault == "429":
                return Reply(429, json.dumps({"error": {"message": "too many requests"}}).encode(),
                             headers=["Retry-After: 0"])
            if fault == "400":
                return json_reply(400, {"error": {"message": "The input (9999 tokens) is longer than the "
                                                             "model's context length (8192 tokens)."}})
            if fault == "drop":
                raise DropConnection
            if fault == "badjson":
                return Reply(200, b'{"text": "Hel', "application/json")
            if fault == "slow":
                await asyncio.sleep(self.slow_s)
            return await handler(body, fault)
        finally:
            self.in_flight -= 1

    # -- /tokenize ---------------------------------------------------------------------------------

    def _tokenize(self, body: Any) -> Reply:
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), (str, list)):
            return json_reply(400, {"object": "error", "message": "Exactly one of 'prompt' or 'messages' "
                                    "must be provided.", "type": "BadRequestError", "param": None, "code": 400})
        prompt = body["prompt"]
        if isinstance(prompt, str):
            tokens: Any = encode(prompt)
            count: Any = len(tokens)
        else:
            tokens = [encode(p) for p in prompt]
            count = [len(t) for t in tokens]
        return json_reply(200, {"tokens": tokens, "count": count, "max_model_len": 32768})

    # -- /generate ---------------------------------------------------------------------------------

    async def _generate(self, body: Any, fault: str | None) -> Reply | Stream:
        if not isinstance(body, dict):
            return json_reply(400, {"error": f"invalid type: {type(body).__name__}, expected struct GenerateRequest"})
        sampling = body.get("sampling_params") or {}
        unknown = [k for k in sampling if k not in SAMPLING_PARAMS_FIELDS]
        if unknown:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_PARAMS_FIELDS)
            return json_reply(400, {"error": f"unknown field `{unknown[0]}`, expected one of {listed}"})
        if (body.get("text") is None) == (body.get("input_ids") is None):
            return json_reply(400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}})
        prompt_ids = list(body["input_ids"]) if body.get("input_ids") is not None else encode(body["text"])
        return_logprob = bool(body.get("return_logprob"))
        lsl = body.get("logprob_start_len")
        lsl = -1 if lsl is None or not return_logprob else int(lsl)
        if lsl == -1 and return_logprob:
            lsl = len(prompt_ids)  # scheduler.py: output logprobs only, by default
        if lsl > len(prompt_ids):
            message = (f"req.logprob_start_len={lsl} is higher than the number of input tokens "
                       f"len(req.origin_input_ids)={len(prompt_ids)}. Please use a smaller logprob_start_len.")
            return json_reply(400, {"error": {"message": message}})
        out = self._run_model(body, sampling, prompt_ids, return_logprob, lsl)
        if fault == "abort":
            out["finish"] = {"type": "abort", "message": "Abort before prefill", "status_code": None,
                             "err_type": None}
        if body.get("stream"):
            return Stream(self._stream_events(body, out, dropped=fault == "dropstream"))
        reply = self._response(body, out, len(out["output_ids"]), final=True)
        self.replies.append(reply)
        return json_reply(200, reply)

    def _run_model(self, body: dict[str, Any], sampling: dict[str, Any], prompt_ids: list[int],
                   return_logprob: bool, lsl: int) -> dict[str, Any]:
        """Generate: text, ids, finish reason and the cached-prefix length, as the engine would."""
        t0 = time.perf_counter()
        prompt = decode(prompt_ids)
        max_new = int(sampling.get("max_new_tokens", 128))
        top_k = int(body.get("top_logprobs_num") or 0)
        dist = self._dist(prompt)
        if return_logprob and top_k > 0 and max_new == 1:
            raw = max(dist, key=dist.get)  # a one-token scoring call: the greedy token
        else:
            raw = self.responder(prompt, body)
        stops = sampling.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        hits = [(raw.find(s), s) for s in stops if s and s in raw]
        finish: dict[str, Any]
        if hits and min(hits)[0] + len(min(hits)[1]) <= max_new:
            pos, stop = min(hits)
            generated = raw[: pos + len(stop)]
            text = generated if sampling.get("no_stop_trim") else raw[:pos]
            finish = {"type": "stop", "matched": stop}
        elif len(raw) >= max_new:
            generated = text = raw[:max_new]
            finish = {"type": "length", "length": max_new}
        else:
            generated = text = raw
            finish = {"type": "stop", "matched": EOS_TOKEN_ID}
        output_ids = encode(generated) + ([EOS_TOKEN_ID] if finish.get("matched") == EOS_TOKEN_ID else [])
        # RadixAttention: reuse the longest cached prefix, at most len-1, at most logprob_start_len
        max_prefix = len(prompt_ids) - 1
        if return_logprob and lsl >= 0:
            max_prefix = min(max_prefix, lsl)
        best = max((common_prefix(prompt_ids, seq) for seq in self._radix), default=0)
        cached = max(0, min(best, max_prefix))
        self._radix.append(prompt_ids + output_ids)
        self.generations.append({"prompt_ids": prompt_ids, "logprob_start_len": lsl, "cached_tokens": cached,
                                 "return_logprob": return_logprob})
        return {"text": text, "output_ids": output_ids, "finish": finish, "prompt_ids": prompt_ids,
                "cached": cached, "lsl": lsl, "dist": dist, "top_k": top_k, "t0": t0,
                "rid": body.get("rid") or uuid.uuid4().hex}

    def _dist(self, prompt: str) -> dict[str, float]:
        dist = self.top_logprobs(prompt) if callable(self.top_logprobs) else self.top_logprobs
        return dict(sorted(dist.items(), key=lambda kv: -kv[1]))

    def _response(self, body: dict[str, Any], out: dict[str, Any], n: int, final: bool,
                  start: int = 0) -> dict[str, Any]:
        """The reply (or one stream event) after the first `n` output tokens."""
        ids = out["output_ids"][:n]

        def visible(k: int) -> str:  # the text after k tokens: a prefix of the final (stop-trimmed) text
            return out["text"][: len(decode(out["output_ids"][:k]))]

        meta: dict[str, Any] = {
            "id": out["rid"],
            "finish_reason": out["finish"] if final else None,
            "prompt_tokens": len(out["prompt_ids"]),
            "weight_version": "default",
            "num_retractions": 0,
        }
        if body.get("return_logprob"):
            meta.update(self._logprobs(body, out, n))
        meta.update({"reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": out["cached"]})
        if final:
            meta["e2e_latency"] = time.perf_counter() - out["t0"]
            # the first token comes from prefill; each verify step of decode yields accepted drafts + 1
            verify_ct = math.ceil((n - 1) / self.accept_length) if n > 1 else 0
            if self.speculative_algorithm and verify_ct > 0:
                proposed = verify_ct * (self.num_draft_tokens - 1)
                correct = (n - 1) - verify_ct
                meta.update({
                    "spec_accept_rate": correct / proposed,
                    "spec_accept_length": n / verify_ct,
                    "spec_num_correct_drafts": correct,
                    "spec_num_proposed_drafts": proposed,
                    "spec_verify_ct": verify_ct,
                    "spec_correct_drafts_histogram": _histogram(correct, verify_ct, self.num_draft_tokens),
                })
            meta["response_sent_to_client_ts"] = time.time()
        if start:  # incremental streaming: this event's share only
            return {"text": visible(n)[len(visible(start)):], "output_ids": ids[start:], "meta_info": meta}
        return {"text": visible(n), "output_ids": ids, "meta_info": meta}

    def _logprobs(self, body: dict[str, Any], out: dict[str, Any], n: int) -> dict[str, Any]:
        """input/output token logprobs and top logprobs, as `[logprob, token_id, text]` entries."""
        with_text = bool(body.get("return_text_in_logprobs"))
        prompt_ids, lsl, dist, top_k = out["prompt_ids"], out["lsl"], out["dist"], out["top_k"]

        def entry(lp: float | None, tid: int) -> list[Any]:
            return [lp, tid, chr(tid) if with_text else None]

        input_lps = [entry(None if pos == 0 else -0.5, prompt_ids[pos]) for pos in range(lsl, len(prompt_ids))]
        top_rows = [[entry(lp, ord(t[0])) for t, lp in list(dist.items())[:top_k]]]
        output_ids = out["output_ids"][:n]
        output_lps = [entry(dist.get(chr(t), -0.01) if i == 0 else -0.01, t) for i, t in enumerate(output_ids)]
        meta: dict[str, Any] = {
            "input_token_logprobs": input_lps,
            "output_token_logprobs": output_lps,
            "output_token_logprobs_length": len(output_lps),
        }
        if top_k > 0:
            meta["input_top_logprobs"] = [None if pos == 0 else [entry(-0.5, prompt_ids[pos])]
                                          for pos in range(lsl, len(prompt_ids))]
            meta["output_top_logprobs"] = [top_rows[0] if i == 0 else [entry(-0.01, t)]
                                           for i, t in enumerate(output_ids)]
        return meta

    async def _stream_events(self, body: dict[str, Any], out: dict[str, Any], dropped: bool) -> AsyncIterator[bytes]:
        total = len(out["output_ids"])
        cuts = list(range(self.stream_chunk, total, self.stream_chunk)) + [total]
        sent = 0
        for i, n in enumerate(cuts):
            final = n == total
            start = sent if self.incremental_streaming_output else 0
            event = self._response(body, out, n, final, start=start)
            yield b"data: " + json.dumps(event).encode() + b"\n\n"
            sent = n
            if dropped and i == 0:
                raise DropConnection
            await asyncio.sleep(0)
        yield b"data: [DONE]\n\n"

    # -- /v1/completions ---------------------------------------------------------------------------

    async def _completions(self, body: Any, fault: str | None) -> Reply:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return json_reply(400, {"object": "error", "message": "prompt must be a string", "type": "BadRequestError",
                                    "param": None, "code": 400})
        sampling = {"max_new_tokens": body.get("max_tokens", 16), "stop": body.get("stop"),
                    "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                    "sampling_seed": body.get("seed")}
        native = {"text": prompt, "sampling_params": sampling}
        if body.get("logprobs"):
            native.update(return_logprob=True, top_logprobs_num=int(body["logprobs"]), return_text_in_logprobs=True)
        ids = encode(prompt)
        out = self._run_model(native, sampling, ids, bool(body.get("logprobs")),
                              len(ids) if body.get("logprobs") else -1)
        finish = out["finish"]
        reason = "abort" if fault == "abort" else finish["type"]
        logprobs = None
        if body.get("logprobs"):
            k = int(body["logprobs"])
            top = dict(list(out["dist"].items())[:k])
            tokens = [chr(t) for t in out["output_ids"] if t != EOS_TOKEN_ID]
            logprobs = {"text_offset": list(range(len(tokens))), "token_logprobs": [top.get(t, -0.01) for t in tokens],
                        "tokens": tokens, "top_logprobs": [top] + [{t: -0.01} for t in tokens[1:]]}
        usage: dict[str, Any] = {
            "prompt_tokens": len(ids), "total_tokens": len(ids) + len(out["output_ids"]),
            "completion_tokens": len(out["output_ids"]),
            "prompt_tokens_details": {"cached_tokens": out["cached"], "image_tokens": None, "audio_tokens": None,
                                      "video_tokens": None} if self.enable_cache_report else None,
            "reasoning_tokens": 0, "completion_tokens_details": None,
        }
        return json_reply(200, {
            "id": out["rid"], "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or self.served_model_name,
            "choices": [{"index": 0, "text": out["text"], "logprobs": logprobs, "finish_reason": reason,
                         "matched_stop": finish.get("matched")}],
            "usage": usage, "metadata": None,
        })


def _histogram(correct: int, verify_ct: int, num_draft_tokens: int) -> list[int]:
    """Verify steps by number of accepted drafts, spread as evenly as the totals allow."""
    hist = [0] * num_draft_tokens
    base, extra = divmod(correct, verify_ct)
    base = min(base, num_draft_tokens - 1)
    hist[base] += verify_ct - extra
    hist[min(base + 1, num_draft_tokens - 1)] += extra
    return hist


# ------------------------------------------------------------------------------------------------
# Script mode: a stand-in for `python -m sglang.launch_server`
# ------------------------------------------------------------------------------------------------


def _flag(argv: list[str], *names: str, default: str | None = None) -> str | None:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return default


def main(argv: list[str]) -> int:
    model = _flag(argv, "--model-path", "--model")
    port = _flag(argv, "--port", default="30000")
    host = _flag(argv, "--host", default="127.0.0.1")
    if model is None:
        print("error: the following arguments are required: --model-path", file=sys.stderr)
        return 2
    record_dir = os.environ.get("FAKE_SGLANG_RECORD_DIR")
    if record_dir:
        record = {"pid": os.getpid(), "pgid": os.getpgid(0), "argv": argv,
                  "env": {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "SGLANG_PLUGINS")
                          if k in os.environ} | {k: v for k, v in os.environ.items()
                                                 if k.startswith("THINKAHEAD_SUFFIX_")}}
        with open(os.path.join(record_dir, f"{port}.json"), "w", encoding="utf-8") as f:
            json.dump(record, f)
    if os.environ.get("FAKE_SGLANG_EXIT_CODE"):
        print(f"fake sglang: failing on purpose while loading {model}", file=sys.stderr)
        return int(os.environ["FAKE_SGLANG_EXIT_CODE"])
    child = None
    if os.environ.get("FAKE_SGLANG_CHILD"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if record_dir:
            with open(os.path.join(record_dir, f"{port}.child"), "w", encoding="utf-8") as f:
                f.write(str(child.pid))
    server = FakeSGLangServer(model_path=model, served_model_name=_flag(argv, "--served-model-name"),
                              speculative_algorithm=_flag(argv, "--speculative-algorithm"),
                              host=host or "127.0.0.1", port=int(port or 30000))
    server.starting_until = time.monotonic() + float(os.environ.get("FAKE_SGLANG_STARTUP_S", "0"))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"fake sglang {SGLANG_VERSION} serving {model} at {server.url}", flush=True)
    while not stop.wait(0.05):
        pass
    server.stop()
    if child is not None:
        child.terminate()
        child.wait(10)
    print("fake sglang: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
