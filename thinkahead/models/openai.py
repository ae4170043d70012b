"""`OpenAIModel`: a `LanguageModel` over any OpenAI-compatible server (vLLM, SGLang, llama.cpp, ...).

It uses the legacy `POST /completions` API, not chat completions, because the step loop continues
raw text: a prompt rendered once (with the model's chat template when a tokenizer is given, see
`render`) and then extended step by step, including partial assistant messages. Chat completions
would re-template every call and cannot continue an open assistant message portably.

Which stop string ended a generation (a step boundary, not the end of the answer) is known on every
server, never guessed: vLLM's `stop_reason` and SGLang's `matched_stop` say it; a server that reports
neither (llama.cpp's OpenAI endpoint, others) gets requests with stop strings streamed without them,
cut client-side at the first stop string, the stream closed there (the server stops generating). A
server is taken to report stops once a reply or chunk carries either field; until then, streaming.
`usage.prompt_tokens_details.cached_tokens` gives `cached_tokens`.
Token scores (`continuation_scores`, `token_logprobs`: the agreement judge, token repair) come by the method the
server takes, probed once when first needed: `echo` on `/v1/completions` (vLLM, SGLang, thinkahead serve) or
llama-server's native `/completion` (see `thinkahead.models.remote_scores`); a server that takes neither is
refused by name (`ScoresUnavailable`).
Token-level speculation (`GenerationRequest.speculative`) is the server's business and is not sent.
Transport, retries and errors come from `thinkahead.models.http.HttpClient`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

from thinkahead.models.base import (
    Completion,
    GenerationRequest,
    LanguageModel,
    TokenLogprob,
    TokenScore,
    encode_prompt,
    observed,
    prompt_text,
    render_chat,
    render_plain,
    resolve_tokenizer,
)
from thinkahead.models.http import DEFAULT_CALL_TIMEOUT_S, HttpClient, ModelServerError, bearer_headers
from thinkahead.models.remote_scores import RemoteScorer
from thinkahead.token_spec.grammar import plain_schema

log = logging.getLogger(__name__)


class OpenAIModel(LanguageModel):
    """A model served behind an OpenAI-compatible `/completions` endpoint.

    Args:
        model: the served model's name (the `model` field of every request).
        base_url: the API root, ending in `/v1` for the usual servers.
        api_key: sent as `Authorization: Bearer ...`; None reads `OPENAI_API_KEY`; "" sends none.
        timeout_s, max_retries, backoff_s, max_connections, call_timeout_s: passed to `HttpClient`
            (`timeout_s` is per attempt; `call_timeout_s` bounds a request's attempts and backoff
            sleeps together; a completion is resent only when it cannot have reached the server
            or the server asked for it, see `thinkahead.models.http`).
        tokenizer: an optional Hugging Face tokenizer (or a model spec naming one) used by `render` (its chat
            template), `count_tokens`, `encode` and token scoring (the ids scored are its ids); without it prompts
            are rendered as plain "role: content" blocks, tokens are estimated, and scoring asks the server's
            `/tokenize`.
        extra_body: extra fields merged into every completions request (e.g. vLLM/SGLang sampling
            extensions such as `{"skip_special_tokens": False}`).

    A request's JSON-schema grammar goes to the server as its `response_format` (vLLM and SGLang
    enforce it while decoding); other grammar kinds have no portable field and are refused.
    """

    grammar_kinds = ("json_schema",)
    STOP_FIELDS = ("stop_reason", "matched_stop")  # vLLM's, SGLang's: which stop string ended the text

    def __init__(
        self,
        model: str,
        base_url: str = "http://localhost:8000/v1",
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        tokenizer: Any = None,
        backoff_s: float = 0.5,
        max_connections: int = 64,
        extra_body: Mapping[str, Any] | None = None,
        call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        self.model = model
        self.name = model
        self.tokenizer = resolve_tokenizer(tokenizer)
        self.extra_body: dict[str, Any] = dict(extra_body or {})
        self.reports_stops = False  # whether the server says which stop string ended a text (STOP_FIELDS)
        self.client = HttpClient(
            base_url,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_connections=max_connections,
            headers=bearer_headers(api_key, "OPENAI_API_KEY"),
            call_timeout_s=call_timeout_s,
        )
        self.scorer = RemoteScorer(self)

    def __repr__(self) -> str:
        return f"OpenAIModel({self.model!r}, base_url={self.client.base_url!r})"

    # -- LanguageModel ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> Completion:
        prompt = prompt_text(self, request)
        payload: dict[str, Any] = {
            **self.extra_body,
            "model": self.model,
            "prompt": prompt,
            "max_tokens": request.max_new_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if request.stop:
            payload["stop"] = list(request.stop)
        if request.seed is not None:
            payload["seed"] = request.seed
        if request.grammar is not None:
            self.check_grammar(request.grammar)
            payload["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": plain_schema(request.grammar), "strict": True}}
        start = time.perf_counter()
        if request.stop and not self.reports_stops:
            return await self._generate_cut(request, payload, prompt, start)
        try:
            reply = await self.client.post_json("/completions", payload)
        except ModelServerError as exc:
            if exc.status != 400 or "response_format" not in payload:
                raise
            # a server that does not take `response_format` on completions: from now on this model
            # enforces no grammar (callers check and repair its replies), and this request goes again
            log.info("%s refused response_format (%s); its replies are checked instead", self.model, exc)
            self.grammar_kinds = ()
            del payload["response_format"]
            reply = await self.client.post_json("/completions", payload)
        elapsed = time.perf_counter() - start
        choice = self._first_choice(reply)
        text = choice.get("text")
        if not isinstance(text, str):
            raise ModelServerError(f"completions reply has no text in choices[0]: {choice!r}"[:500])
        finish = self._finish(choice.get("finish_reason"), request)
        self.reports_stops = self.reports_stops or any(f in choice for f in self.STOP_FIELDS)
        matched = choice.get("matched_stop", choice.get("stop_reason"))
        # Servers report a stop *token id* (an int) when an EOS-like token ended the text; only a
        # stop string is a `matched_stop` in our sense.
        matched_stop = matched if finish == "stop" and isinstance(matched, str) else None
        usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return observed(Completion(
            text=text,
            finish_reason=finish,
            matched_stop=matched_stop,
            prompt_tokens=_int(usage.get("prompt_tokens"), self.count_tokens(prompt)),
            completion_tokens=_int(usage.get("completion_tokens"), self.count_tokens(text)),
            cached_tokens=_int(cached, 0),
            time_s=elapsed,
            model=str(reply.get("model") or self.model),
        ))

    async def _generate_cut(self, request: GenerationRequest, payload: dict[str, Any], prompt: str,
                            start: float) -> Completion:
        """The generation streamed without server-side stop strings, cut at the first of `request.stop` that
        the text holds (the stream closed there), so the stop string that ended it is known."""
        payload = {k: v for k, v in payload.items() if k != "stop"} | {"stream": True}
        text, finish, matched, first_s, events_read = "", None, None, None, 0
        longest = max(len(s) for s in request.stop)
        async with contextlib.aclosing(self.client.stream_lines("/completions", payload)) as events:
            async for event in events:
                events_read += 1
                try:
                    chunk = json.loads(event)
                except ValueError as exc:
                    raise ModelServerError(f"a completions stream event is not JSON: {event!r}"[:500]) from exc
                choice = self._first_choice(chunk if isinstance(chunk, dict) else {})
                self.reports_stops = self.reports_stops or any(f in choice for f in self.STOP_FIELDS)
                piece = choice.get("text") or ""
                if not isinstance(piece, str):
                    raise ModelServerError(f"a completions stream chunk has no text: {choice!r}"[:500])
                if piece and first_s is None:
                    first_s = time.perf_counter() - start
                searched = max(0, len(text) - longest + 1)  # a stop string may straddle two chunks
                text += piece
                hit = first_stop(text, request.stop, searched)
                if hit is not None:
                    text, finish, matched = text[:hit[0]], "stop", hit[1]
                    break  # closing the stream ends the generation on the server
                if choice.get("finish_reason") is not None:
                    finish = choice["finish_reason"]
        if not events_read:
            raise ModelServerError(f"{self.model}: a streamed /completions request got no server-sent events (the "
                                   "server must stream completions to say where a stop string ended a text)")
        finish = self._finish(finish, request)
        return observed(Completion(
            text=text, finish_reason=finish, matched_stop=matched, prompt_tokens=self.count_tokens(prompt),
            completion_tokens=self.count_tokens(text), time_s=time.perf_counter() - start,
            first_token_s=first_s if first_s is not None else 0.0,
            model=self.model))

    @staticmethod
    def _finish(finish: Any, request: GenerationRequest) -> str:
        if finish not in ("stop", "length"):
            raise ModelServerError(
                f"generation ended with finish_reason={finish!r} (expected 'stop' or 'length')"
                f" for request {request.request_id or '?'}"
            )
        return finish

    async def next_token_logprobs(self, prompt: str, top_k: int = 20) -> dict[str, float]:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        payload = {
            **self.extra_body,
            "model": self.model,
            "prompt": prompt,
            "max_tokens": 1,
            "logprobs": top_k,
            "temperature": 0,
        }
        reply = await self.client.post_json("/completions", payload)
        choice = self._first_choice(reply)
        logprobs = choice.get("logprobs")
        top = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if isinstance(content, list) and content and isinstance(content[0], dict):
            # llama-server answers /v1/completions logprobs in the chat shape: content[0].top_logprobs
            # is a list of {id, token, bytes, logprob}
            rows = content[0].get("top_logprobs")
            if isinstance(rows, list) and all(isinstance(r, dict) for r in rows):
                top = [{str(r.get("token")): r.get("logprob") for r in reversed(rows)}]
        if not isinstance(top, list) or not top or not isinstance(top[0], dict):
            raise ModelServerError(f"completions reply has no logprobs.top_logprobs[0]: {logprobs!r}"[:500])
        try:
            ranked = sorted(((str(t), float(lp)) for t, lp in top[0].items()), key=lambda kv: -kv[1])
        except (TypeError, ValueError) as exc:
            raise ModelServerError(f"top_logprobs[0] is not token -> number: {top[0]!r}"[:500]) from exc
        return dict(ranked[:top_k])

    # -- token scores (thinkahead.models.remote_scores) --------------------------------------------

    @property
    def scores_tokens(self) -> bool:
        """True until a probe of the server found no way to score tokens (`probe_scores` decides)."""
        return self.scorer.may_score

    async def probe_scores(self) -> str:
        """The method the server scores tokens by ("echo" or "llama"), probed once; `ScoresUnavailable`
        (naming the model, the URL and each probe's answer) where it takes none."""
        return await self.scorer.probe()

    async def continuation_scores(self, prompt: str, continuation: str) -> list[TokenScore]:
        return await self.scorer.continuation(prompt, continuation)

    async def continuation_logprobs(self, prompt: str, continuation: str) -> list[float]:
        return [t.logprob for t in await self.scorer.continuation(prompt, continuation)]

    async def token_logprobs(self, token_ids: list[int], start: int, top_k: int = 0) -> list[TokenLogprob]:
        if not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {top_k!r}")
        scored = await self.scorer.score([int(t) for t in token_ids], start, max(1, top_k))
        return [TokenLogprob(t.token_id, t.text, t.logprob, t.top[:top_k]) for t in scored]

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"OpenAIModel {self.model!r}.encode needs a tokenizer (pass tokenizer=)")
        return encode_prompt(self.tokenizer, text)

    def decode_tokens(self, token_ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            raise ValueError(f"OpenAIModel {self.model!r}.decode_tokens needs a tokenizer (pass tokenizer=)")
        return [self.tokenizer.decode([int(t)]) for t in token_ids]

    def render(self, messages: list[dict[str, str]], continue_final: bool = False) -> str:
        if self.tokenizer is not None:
            return render_chat(self.tokenizer, messages, continue_final)
        return render_plain(messages, continue_final)

    def count_tokens(self, text: str) -> int:
        if self.tokenizer is None:
            return super().count_tokens(text)
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    async def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Wait until the server lists its models (`GET /models`), e.g. after launching it."""
        await self.client.wait_healthy("/models", timeout_s=timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()

    # -- helpers ---------------------------------------------------------------------------------

    @staticmethod
    def _first_choice(reply: dict[str, Any]) -> dict[str, Any]:
        choices = reply.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ModelServerError(f"completions reply has no choices: {reply!r}"[:500])
        return choices[0]


def first_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """(where, which) for the stop string that occurs first in `text` at or after `start` (the longer of two at
    one place, as a server matching them in order would end at the earlier), or None."""
    hits = [(text.find(s, start), -len(s), s) for s in stops if s and text.find(s, start) >= 0]
    if not hits:
        return None
    at, _, stop = min(hits)
    return at, stop


def _int(value: Any, default: int) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


__all__ = ["OpenAIModel", "ModelServerError"]
