"""`OpenAIModel`: a `LanguageModel` over any OpenAI-compatible server (vLLM, SGLang, llama.cpp, ...).

It uses the legacy `POST /completions` API, not chat completions, because the step loop continues
raw text: a prompt rendered once (with the model's chat template when a tokenizer is given, see
`render`) and then extended step by step, including partial assistant messages. Chat completions
would re-template every call and cannot continue an open assistant message portably.

Server extensions are read where present: `stop_reason` (vLLM) or `matched_stop` (SGLang) give
`Completion.matched_stop`; `usage.prompt_tokens_details.cached_tokens` gives `cached_tokens`.
Token-level speculation (`GenerationRequest.speculative`) is the server's business and is not sent.
Transport, retries and errors come from `thinkahead.models.http.HttpClient`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from thinkahead.models.base import (
    Completion,
    GenerationRequest,
    LanguageModel,
    observed,
    prompt_text,
    render_chat,
    render_plain,
    resolve_tokenizer,
)
from thinkahead.models.http import DEFAULT_CALL_TIMEOUT_S, HttpClient, ModelServerError, bearer_headers
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
        tokenizer: an optional Hugging Face tokenizer used by `render` (its chat template) and
            `count_tokens`; without it prompts are rendered as plain "role: content" blocks and
            tokens are estimated.
        extra_body: extra fields merged into every completions request (e.g. vLLM/SGLang sampling
            extensions such as `{"skip_special_tokens": False}`).

    A request's JSON-schema grammar goes to the server as its `response_format` (vLLM and SGLang
    enforce it while decoding); other grammar kinds have no portable field and are refused.
    """

    grammar_kinds = ("json_schema",)

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
        self.client = HttpClient(
            base_url,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_connections=max_connections,
            headers=bearer_headers(api_key, "OPENAI_API_KEY"),
            call_timeout_s=call_timeout_s,
        )

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
        finish = choice.get("finish_reason")
        if finish not in ("stop", "length"):
            raise ModelServerError(
                f"generation ended with finish_reason={finish!r} (expected 'stop' or 'length')"
                f" for request {request.request_id or '?'}"
            )
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
        if not isinstance(top, list) or not top or not isinstance(top[0], dict):
            raise ModelServerError(f"completions reply has no logprobs.top_logprobs[0]: {logprobs!r}"[:500])
        try:
            ranked = sorted(((str(t), float(lp)) for t, lp in top[0].items()), key=lambda kv: -kv[1])
        except (TypeError, ValueError) as exc:
            raise ModelServerError(f"top_logprobs[0] is not token -> number: {top[0]!r}"[:500]) from exc
        return dict(ranked[:top_k])

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


def _int(value: Any, default: int) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


__all__ = ["OpenAIModel", "ModelServerError"]
