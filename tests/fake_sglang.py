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

Layout: the HTTP/1.1 transport (keep-alive, streams, death and revival) is `tests/fake_http.py`;
the character-level model and the `/generate` and `/v1/completions` routes are
`tests/fake_sglang_engine.py`; this module holds the server's state, routing, faults, `/health`,
`/model_info`, `/tokenize` and script mode, and re-exports the names tests import from it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # run as a script (`python tests/fake_sglang.py`): make `tests.` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the transport and the engine, re-exported (see __all__): tests import them from here
from tests.fake_http import (
    DropConnection,
    FakeHttpServer,
    Reply,
    Request,
    Stream,
    json_reply,
    read_request,
)
from tests.fake_sglang_engine import (
    EOS_TOKEN_ID,
    SAMPLING_PARAMS_FIELDS,
    Responder,
    SGLangGenerationRoutes,
    common_prefix,
    decode,
    encode,
)

__all__ = [
    "EOS_TOKEN_ID", "SAMPLING_PARAMS_FIELDS", "SGLANG_VERSION", "DropConnection", "FakeHttpServer",
    "FakeSGLangServer", "Reply", "Request", "Responder", "Stream", "common_prefix", "decode", "encode",
    "json_reply", "main", "read_request",
]

SGLANG_VERSION = "0.5.23"


class FakeSGLangServer(SGLangGenerationRoutes, FakeHttpServer):
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
