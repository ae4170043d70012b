"""`SGLangModel`: a `LanguageModel` over a running SGLang server's native API (`POST /generate`).

`OpenAIModel` also talks to SGLang (through `/v1/completions`); this backend uses the native API
because it carries what the orchestrator needs and the OpenAI surface hides:

* `meta_info` on every reply: prompt/completion/cached token counts and, when the server runs a
  speculative algorithm (NGRAM, EAGLE, STANDALONE, our SUFFIX plugin), its stats under the names
  the local backend uses too (`spec_verify_ct`, `spec_num_correct_drafts`, `spec_num_proposed_drafts`;
  `spec_accept_length` and `spec_accept_rate` are recomputed from them by `SpecStats`, as SGLang does);
* judge calls that keep the radix prefix cache: SGLang reuses no cached prefix beyond
  `logprob_start_len` (`Req._compute_max_prefix_len` in `sglang/srt/managers/schedule_batch.py`),
  so `next_token_logprobs` sends the prompt as token ids with `logprob_start_len = len(ids) - 1`:
  the judge prompt, which extends the generation prompt, is prefilled only past the shared prefix;
* token ids in, so generation and judge calls tokenize identically (the radix cache matches
  tokens, not text). With a local `tokenizer` prompts are encoded here (and chat messages
  rendered with its template); without one, generation sends text and the judge asks the
  server's own `POST /tokenize` for the ids, which is what `/generate` would compute from the text.

Written against SGLang 0.5.23 (request and reply shapes: see `tests/fake_sglang.py`). Transport,
pooling, retries with backoff (only of what is safe to resend), deadlines and errors come from
`thinkahead.models.http.HttpClient`.
`GenerationRequest.speculative` cannot be honoured per request (speculation is a server setting);
`request_id` is not sent (SGLang requires rids unique among live requests, which a retried call
would break); `session_id` is not sent either: SGLang's sessions must be opened first
(`/open_session`), and the radix cache already reuses a continued conversation's prefix.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from thinkahead.models.base import (
    Completion, GenerationRequest, LanguageModel, TokenLogprob, TokenScore, encode_prompt, observed, prompt_text,
    render_chat, render_plain, resolve_tokenizer,
)
from thinkahead.models.http import DEFAULT_CALL_TIMEOUT_S, HttpClient, ModelServerError, bearer_headers
from thinkahead.token_spec.grammar import plain_schema
from thinkahead.token_spec.stats import SPEC_COUNTERS, SpecStats

FINISH_TYPES = ("stop", "length")


class SGLangModel(LanguageModel):
    """A model served by SGLang (`python -m sglang.launch_server`), through `/generate`.

    Args:
        base_url: the server's root, e.g. "http://127.0.0.1:30000" (not its /v1 path); SGLang's
            router in front of many servers works the same way.
        model: a display name for traces; default "sglang@HOST:PORT".
        tokenizer: a Hugging Face tokenizer, or a model spec whose tokenizer is loaded
            (`thinkahead.models.registry` forms: registry name, `hf:ORG/NAME`, a directory, a
            .gguf file). It renders chat messages with the model's template, counts tokens, and
            encodes prompts here. Without one, messages are rendered as plain "role: content"
            blocks: pass the served model's tokenizer for chat models.
        timeout_s, max_retries, backoff_s, max_connections, call_timeout_s: passed to
            `HttpClient` (`timeout_s` is per attempt, between bytes; long generations stream bytes
            only with `stream`; `call_timeout_s` bounds a request's attempts and backoff sleeps,
            the whole stream included). `/generate` is resent only when it cannot have reached
            the server or the server asked for it; `/tokenize` is resent like a GET.
        api_key: sent as `Authorization: Bearer ...` (SGLang's `--api-key`); None reads
            `SGLANG_API_KEY`; "" sends none.
        stream: generate through a streamed `/generate` (records time to first token).
        incremental_stream: the server runs with `--incremental-streaming-output` (events carry
            deltas rather than the text so far).
        sampling_extra: extra `sampling_params` fields for every generation (e.g.
            `{"skip_special_tokens": False}`); SGLang rejects unknown fields with HTTP 400.
        extra_body: extra top-level `/generate` fields (e.g. `{"lora_path": "adapter"}`).
    """

    grammar_kinds = ("json_schema", "regex", "ebnf")  # SGLang's sampling_params json_schema / regex / ebnf

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:30000",
        model: str | None = None,
        *,
        tokenizer: Any = None,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_connections: int = 256,
        api_key: str | None = None,
        stream: bool = False,
        incremental_stream: bool = False,
        sampling_extra: Mapping[str, Any] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        if base_url.rstrip("/").endswith("/v1"):
            raise ValueError(f"base_url is the SGLang server's root (http://HOST:PORT), not its /v1 path: {base_url!r}")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"model must be a non-empty string or None, got {model!r}")
        self.tokenizer = resolve_tokenizer(tokenizer)
        self.client = HttpClient(
            base_url,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_connections=max_connections,
            headers=bearer_headers(api_key, "SGLANG_API_KEY"),
            call_timeout_s=call_timeout_s,
        )
        self.name = model or f"sglang@{urlparse(self.client.base_url).netloc}"
        self.stream = bool(stream)
        self.incremental_stream = bool(incremental_stream)
        self.sampling_extra: dict[str, Any] = dict(sampling_extra or {})
        self.extra_body: dict[str, Any] = dict(extra_body or {})

    def __repr__(self) -> str:
        return f"SGLangModel({self.client.base_url!r}, model={self.name!r})"

    # -- LanguageModel ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> Completion:
        prompt = prompt_text(self, request)
        sampling: dict[str, Any] = {
            **self.sampling_extra,
            "max_new_tokens": request.max_new_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if request.stop:
            sampling["stop"] = list(request.stop)
        if request.seed is not None:
            sampling["sampling_seed"] = request.seed  # SGLang's name; its schema rejects "seed"
        if request.grammar is not None:  # SGLang's own constrained decoding (xgrammar by default)
            self.check_grammar(request.grammar)
            spec = request.grammar
            sampling[spec.kind] = json.dumps(plain_schema(spec)) if spec.kind == "json_schema" else spec.source
        payload: dict[str, Any] = {**self.extra_body, **self._prompt_field(prompt), "sampling_params": sampling}
        start = time.perf_counter()
        if self.stream:
            reply, first_token_s = await self._generate_streamed(payload, start)
        else:
            reply, first_token_s = await self.client.post_json("/generate", payload), 0.0
        return observed(self._completion(reply, prompt, time.perf_counter() - start, first_token_s))

    async def next_token_logprobs(self, prompt: str, top_k: int = 20) -> dict[str, float]:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        ids = await self.prompt_ids(prompt)
        payload = {
            **self.extra_body,
            "input_ids": ids,
            "sampling_params": {**self.sampling_extra, "max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "top_logprobs_num": top_k,
            # prefix reuse stops at logprob_start_len: keep it at the prompt's end (radix cache hit)
            "logprob_start_len": len(ids) - 1,
            "return_text_in_logprobs": True,
        }
        meta = _meta(await self.client.post_json("/generate", payload))
        rows = meta.get("output_top_logprobs")
        if not isinstance(rows, list) or not rows or not isinstance(rows[0], list):
            raise ModelServerError(f"/generate reply has no output_top_logprobs[0]: {rows!r}"[:500])
        out: dict[str, float] = {}
        for entry in rows[0]:
            logprob, text = self._logprob_entry(entry)
            if text not in out or logprob > out[text]:  # two ids can decode alike; keep the likelier
                out[text] = logprob
        return dict(sorted(out.items(), key=lambda kv: -kv[1])[:top_k])

    async def continuation_logprobs(self, prompt: str, continuation: str) -> list[float]:
        meta = await self._score_continuation(prompt, continuation, top=False)
        return [self._logprob_entry(e, need_text=False)[0] for e in meta["input_token_logprobs"]]

    async def token_logprobs(self, token_ids: list[int], start: int, top_k: int = 0) -> list[TokenLogprob]:
        """Each of `token_ids[start:]` scored after the ones before it, with its `top_k` likeliest alternatives: one
        prefill on `/generate` (`input_token_logprobs`, `input_top_logprobs` from `logprob_start_len`)."""
        ids = list(token_ids)
        if not 0 < start < len(ids) or not all(_is_int(t) for t in ids) or top_k < 0:
            raise ValueError(f"scoring needs token ids, 0 < start < len(token_ids) and top_k >= 0, got {start}, {top_k}")
        meta = await self._prefill_logprobs(ids, start, top_k, text=True)
        tops = meta.get("input_top_logprobs") if top_k else None
        out = []
        for i, entry in enumerate(meta["input_token_logprobs"]):
            logprob, text = self._logprob_entry(entry)
            top: list[tuple[int, str, float]] = []
            for alt in (tops[i] or []) if tops is not None else []:
                alt_logprob, alt_text = self._logprob_entry(alt)
                if not _is_int(alt[1]):
                    raise ModelServerError(f"input_top_logprobs entry {alt!r} has no token id"[:300])
                top.append((alt[1], alt_text, alt_logprob))
            top.sort(key=lambda alt: -alt[2])
            out.append(TokenLogprob(ids[start + i], text, logprob, top[:top_k]))
        return out

    async def continuation_scores(self, prompt: str, continuation: str) -> list[TokenScore]:
        meta = await self._score_continuation(prompt, continuation, top=True)
        out = []
        for entry, row in zip(meta["input_token_logprobs"], meta["input_top_logprobs"]):
            logprob, text = self._logprob_entry(entry)
            best, best_text = max((self._logprob_entry(e) for e in row or []), default=(logprob, text))
            out.append(TokenScore(text, logprob, max(logprob, best), text if logprob >= best else best_text))
        return out

    async def _score_continuation(self, prompt: str, continuation: str, top: bool) -> dict[str, Any]:
        """One prefill of prompt + continuation with input logprobs from the continuation on."""
        from thinkahead.token_spec.names import common_prefix_len

        if not isinstance(continuation, str) or not continuation:
            raise ValueError("scoring a continuation needs a non-empty continuation")
        prompt_ids = await self.prompt_ids(prompt)
        ids = await self.prompt_ids(prompt + continuation)
        start = common_prefix_len(prompt_ids, ids)  # the boundary token may merge across the two
        if start == 0 or start >= len(ids):
            raise ValueError("scoring a continuation needs a non-empty prompt and continuation")
        return await self._prefill_logprobs(ids, start, 1 if top else 0, text=top)

    async def _prefill_logprobs(self, ids: list[int], start: int, top_k: int, text: bool) -> dict[str, Any]:
        """`meta_info` of one `/generate` prefill of `ids` scoring each token from `start` on (with its `top_k`
        alternatives, and the tokens' texts where `text`), checked to hold a score (and a top row) for each."""
        payload = {
            **self.extra_body,
            "input_ids": ids,
            "sampling_params": {**self.sampling_extra, "max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": start,
            **({"top_logprobs_num": top_k} if top_k else {}),
            **({"return_text_in_logprobs": True} if text else {}),
        }
        meta = _meta(await self.client.post_json("/generate", payload))
        entries, count = meta.get("input_token_logprobs"), len(ids) - start
        if not isinstance(entries, list) or len(entries) != count:
            raise ModelServerError(f"/generate reply has {len(entries) if isinstance(entries, list) else 'no'} "
                                   f"input_token_logprobs, expected {count}")
        tops = meta.get("input_top_logprobs")
        if top_k and (not isinstance(tops, list) or len(tops) != count):
            raise ModelServerError(f"/generate reply has no input_top_logprobs for the {count} scored tokens")
        return meta

    def render(self, messages: list[dict[str, str]], continue_final: bool = False) -> str:
        if self.tokenizer is not None:
            return render_chat(self.tokenizer, messages, continue_final)
        return render_plain(messages, continue_final)

    def count_tokens(self, text: str) -> int:
        if self.tokenizer is None:
            return super().count_tokens(text)
        return len(self.encode(text)) if text else 0

    async def aclose(self) -> None:
        await self.client.aclose()

    # -- server ----------------------------------------------------------------------------------

    async def wait_ready(self, timeout_s: float = 600.0, interval_s: float = 1.0) -> None:
        """Poll `GET /health` until it answers 200 (a launching server answers 503 while loading)."""
        await self.client.wait_healthy("/health", timeout_s=timeout_s, interval_s=interval_s)

    async def model_info(self) -> dict[str, Any]:
        """`GET /model_info` (`model_path`, `served_model_name`, ...); servers before it have
        only the older `/get_model_info`, tried when the first answers 404."""
        try:
            return await self.client.get_json("/model_info")
        except ModelServerError as exc:
            if exc.status != 404:
                raise
        return await self.client.get_json("/get_model_info")

    # -- tokens ----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of raw prompt text with the local tokenizer (a BOS only where it wants one)."""
        if self.tokenizer is None:
            raise ValueError("SGLangModel.encode needs a tokenizer (pass tokenizer=)")
        return encode_prompt(self.tokenizer, text)

    async def prompt_ids(self, prompt: str) -> list[int]:
        """The ids `/generate` sees for `prompt`: the local tokenizer's, else the server's `/tokenize`."""
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("the prompt must be a non-empty string")
        if self.tokenizer is not None:
            ids = self.encode(prompt)
        else:
            reply = await self.client.post_json("/tokenize", {"prompt": prompt}, idempotent=True)
            ids = reply.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ModelServerError(f"/tokenize reply has no token list: {reply!r}"[:500])
        if not ids:
            raise ValueError(f"the prompt {prompt[:40]!r} has no tokens")
        return ids

    def _prompt_field(self, prompt: str) -> dict[str, Any]:
        if self.tokenizer is not None:
            return {"input_ids": self.encode(prompt)}
        return {"text": prompt}

    def _logprob_entry(self, entry: Any, need_text: bool = True) -> tuple[float, str]:
        """(logprob, token text) of one `[logprob, token_id, text]` entry."""
        if not isinstance(entry, list) or len(entry) < 2 or not _is_number(entry[0]):
            raise ModelServerError(f"malformed logprob entry {entry!r} (expected [logprob, token_id, text])"[:300])
        logprob = float(entry[0])
        if not math.isfinite(logprob):
            logprob = -1e30
        text = entry[2] if len(entry) > 2 else None
        if not isinstance(text, str) and need_text:
            if self.tokenizer is None or not isinstance(entry[1], int):
                raise ModelServerError(f"logprob entry {entry!r} has no token text (server without a tokenizer?)")
            text = self.tokenizer.decode([entry[1]])
        return logprob, text or ""

    # -- replies ---------------------------------------------------------------------------------

    async def _generate_streamed(self, payload: dict[str, Any], start: float) -> tuple[dict[str, Any], float]:
        """Run a streamed `/generate`; return the reply it adds up to and the time to first token."""
        text, ids, meta = "", [], None
        first_token_s = 0.0
        async for event in self.client.stream_lines("/generate", {**payload, "stream": True}):
            try:
                data = json.loads(event)
            except json.JSONDecodeError as exc:
                raise ModelServerError(f"/generate stream sent a non-JSON event: {event[:200]!r}") from exc
            if not isinstance(data, dict):
                raise ModelServerError(f"/generate stream sent {event[:200]!r}")
            if "error" in data:
                err = data["error"]
                message = err.get("message") if isinstance(err, dict) else err
                status = err.get("code") if isinstance(err, dict) else None
                raise ModelServerError(f"/generate stream failed: {message}", status=status if isinstance(status, int)
                                       else None, url=self.client.url("/generate"))
            chunk_text = data.get("text") or ""
            chunk_ids = data.get("output_ids") or []
            if self.incremental_stream:
                text, ids = text + chunk_text, ids + list(chunk_ids)
            else:
                text, ids = chunk_text, list(chunk_ids)
            if not first_token_s and (chunk_text or chunk_ids):
                first_token_s = time.perf_counter() - start
            meta = data.get("meta_info")
        if meta is None:
            raise ModelServerError("/generate stream ended without a reply", url=self.client.url("/generate"))
        return {"text": text, "output_ids": ids, "meta_info": meta}, first_token_s

    def _completion(self, reply: dict[str, Any], prompt: str, elapsed: float, first_token_s: float) -> Completion:
        text = reply.get("text")
        if not isinstance(text, str):
            raise ModelServerError(f"/generate reply has no text: {reply!r}"[:500])
        meta = _meta(reply)
        finish = meta.get("finish_reason")
        if not isinstance(finish, dict) or not isinstance(finish.get("type"), str):
            raise ModelServerError(f"/generate reply has no finish_reason (unfinished generation?): {finish!r}")
        if finish["type"] not in FINISH_TYPES:
            message = finish.get("message") or finish["type"]
            status = finish.get("status_code")
            raise ModelServerError(
                f"generation ended with finish_reason {finish['type']!r}: {message}",
                status=status if isinstance(status, int) else None, url=self.client.url("/generate"),
            )
        matched = finish.get("matched")
        # EOS ends a generation with the matched token id (an int); only a stop string is a matched_stop
        matched_stop = matched if finish["type"] == "stop" and isinstance(matched, str) else None
        ids = reply.get("output_ids")
        token_ids = [int(i) for i in ids] if isinstance(ids, list) and all(_is_int(i) for i in ids) else []
        prompt_tokens = _int(meta.get("prompt_tokens"), self.count_tokens(prompt))
        completion_tokens = _int(meta.get("completion_tokens"), len(token_ids) or self.count_tokens(text))
        cached_tokens = _int(meta.get("cached_tokens"), 0)
        return Completion(
            text=text,
            token_ids=token_ids,
            finish_reason=finish["type"],
            matched_stop=matched_stop,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
            time_s=elapsed,
            first_token_s=first_token_s,
            model=self.name,
            spec=spec_stats(meta, completion_tokens, prompt_tokens, cached_tokens),
        )


def spec_stats(meta: Mapping[str, Any], completion_tokens: int | None = None, prompt_tokens: int | None = None,
               cached_tokens: int | None = None) -> SpecStats:
    """The speculative stats of a meta_info, typed; all zero when the server runs no speculative algorithm.

    The token counts default to the meta_info's own. SGLang's derived fields (`spec_accept_length`,
    `spec_accept_rate`) are `SpecStats` properties, computed from the counters as SGLang computes
    them; histograms are left out.
    """
    counts = {k: int(meta[k]) for k in SPEC_COUNTERS if _is_number(meta.get(k))}
    if not counts:
        return SpecStats()
    return SpecStats(
        prompt_tokens=_int(meta.get("prompt_tokens"), 0) if prompt_tokens is None else prompt_tokens,
        completion_tokens=_int(meta.get("completion_tokens"), 0) if completion_tokens is None else completion_tokens,
        cached_tokens=_int(meta.get("cached_tokens"), 0) if cached_tokens is None else cached_tokens,
        **counts,
    )


def _meta(reply: dict[str, Any]) -> dict[str, Any]:
    meta = reply.get("meta_info")
    if not isinstance(meta, dict):
        raise ModelServerError(f"/generate reply has no meta_info: {reply!r}"[:500])
    return meta


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int(value: Any, default: int) -> int:
    return int(value) if _is_number(value) else default


__all__ = ["SGLangModel", "ModelServerError", "spec_stats"]
