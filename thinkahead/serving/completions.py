"""`POST /v1/completions`: the legacy text API on the plain models, enough for lm-evaluation-harness
and for thinkahead's own `openai:` backend (generation, and judges reading next-token logprobs).

`prompt` is a string, a list of strings, a list of token ids or a list of such lists (one choice
per prompt and sample); `echo` returns the prompt before the completion and, with `logprobs`,
scores the prompt's tokens too (the first has none): the numbers are the model's own
`token_logprobs`, computed as `continuation_logprobs` computes them. Generation from token-id
prompts starts from their decoded text. `stream` sends `text_completion` chunks as the model decodes
(the echoed prompt first, each piece with its logprobs, then a chunk with the finish reason, the
usage with `stream_options.include_usage`, and `[DONE]`); choices stream one after another.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from thinkahead.models.base import Completion, GenerationRequest, LanguageModel, TokenLogprob
from thinkahead.serving.asgi import RequestError, Responder, unsupported
from thinkahead.serving.chat import Spent, can_score, sampled_request
from thinkahead.serving.limits import check_context
from thinkahead.serving.schemas import CompletionRequest, Prompt, check_token_id, prompt_tokens

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise RequestError(400, "'prompt' must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]


def check_vocabulary(prompt: Prompt, tokenizer: Any, model_name: str) -> None:
    """A 400 naming the first token id of `prompt` that the model's tokenizer does not hold (it
    would decode to nothing, or fail); the schema has checked the ids' type and sign."""
    vocab_size = len(tokenizer) if tokenizer is not None else 0
    for where, token in prompt_tokens(prompt):
        try:
            check_token_id(token, where, vocab_size)
        except ValueError as exc:
            raise RequestError(400, f"{exc} of model {model_name!r}", param="prompt") from None


class CompletionJob:
    def __init__(self, model: LanguageModel, req: CompletionRequest) -> None:
        self.model, self.req = model, req
        if req.logprobs is not None and not can_score(model):
            raise unsupported("logprobs", f"by model {model.name!r} (its backend cannot score tokens)")
        if req.max_tokens == 0 and not req.echo:
            raise RequestError(400, "'max_tokens' may be 0 only with 'echo': true", param="max_tokens")
        self.prompts = prompts_of(req)
        tokenizer = getattr(model, "tokenizer", None)
        if any(isinstance(p, list) for p in self.prompts) and tokenizer is None:
            raise unsupported("prompt", f"as token ids by model {model.name!r} (it has no tokenizer)")
        check_vocabulary(req.prompt, tokenizer, model.name)
        self.texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in self.prompts]
        self.max_new = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
        self.prompt_tokens = []
        for i, (p, text) in enumerate(zip(self.prompts, self.texts)):
            n = len(p) if isinstance(p, list) else model.count_tokens(text)
            if n == 0:
                raise RequestError(400, f"prompt {i} is empty", param="prompt")
            check_context(n, self.max_new or None, model.context_length, param="prompt")
            self.prompt_tokens.append(n)
        self.spent = Spent()
        self.completion_tokens = 0

    async def run(self) -> list[dict[str, Any]]:
        req, choices = self.req, []
        for p, (prompt, text) in enumerate(zip(self.prompts, self.texts)):
            for i in range(req.n):
                choices.append(await self._choice(p * req.n + i, prompt, text, i))
        return choices

    def _request(self, text: str, sample: int) -> GenerationRequest:
        return sampled_request(self.req, text, self.max_new, sample)

    def _spend(self, c: Completion) -> None:
        self.spent.add(c)
        self.completion_tokens += c.completion_tokens

    async def stream(self) -> AsyncIterator[dict[str, Any]]:
        """The choices' chunk entries (`index`, `text`, `logprobs`, `finish_reason`) as they are decoded."""
        req = self.req
        for p, (prompt, text) in enumerate(zip(self.prompts, self.texts)):
            for i in range(req.n):
                index, at = p * req.n + i, 0 if req.echo else len(text)
                if req.echo:
                    logprobs = None if req.logprobs is None else await self._logprobs(prompt, text, [], False)
                    yield {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
                    at = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) if logprobs else len(text)
                if self.max_new == 0:
                    yield {"index": index, "text": "", "logprobs": None, "finish_reason": "length"}
                    continue
                async for item in self.model.stream(self._request(text, i), top_logprobs=req.logprobs):
                    if isinstance(item, Completion):
                        self._spend(item)
                        yield {"index": index, "text": "", "logprobs": None, "finish_reason": item.finish_reason}
                        continue
                    logprobs = None
                    if item.logprobs is not None:  # offsets as the whole reply counts them: by token texts
                        logprobs = legacy_logprobs(item.logprobs, bool(req.logprobs), at)
                        at += sum(len(t.text) for t in item.logprobs)
                    yield {"index": index, "text": item.text, "logprobs": logprobs, "finish_reason": None}

    async def _choice(self, index: int, prompt: str | list[int], text: str, sample: int) -> dict[str, Any]:
        req = self.req
        out_text, out_ids, finish, matched = "", [], "length", None
        if self.max_new > 0:
            c = await self.model.generate(self._request(text, sample))
            self._spend(c)
            out_text, out_ids, finish, matched = c.text, list(c.token_ids), c.finish_reason, c.matched_stop
        choice: dict[str, Any] = {"index": index, "text": (text if req.echo else "") + out_text,
                                  "finish_reason": finish, "logprobs": None}
        if req.logprobs is not None:
            choice["logprobs"] = await self._logprobs(prompt, text, out_ids, matched is not None)
        return choice

    async def _logprobs(self, prompt: str | list[int], text: str, out_ids: list[int], cut: bool) -> dict[str, Any]:
        model, req = self.model, self.req
        stops = set(getattr(model, "stop_token_ids", ()))
        if out_ids and (out_ids[-1] in stops or cut):
            out_ids = out_ids[:-1]
        prompt_ids = prompt if isinstance(prompt, list) else model.encode(text)
        ids = prompt_ids + out_ids
        start = 1 if req.echo else len(prompt_ids)
        scored = await model.token_logprobs(ids, start, req.logprobs or 0) if start < len(ids) else []
        first = model.tokenizer.decode([prompt_ids[0]]) if req.echo else None
        return legacy_logprobs(scored, bool(req.logprobs), 0 if req.echo else len(text), first)


def legacy_logprobs(scored: list[TokenLogprob], with_top: bool, at: int, first: str | None = None) -> dict[str, Any]:
    """The `logprobs` object of /v1/completions for scored tokens whose text starts at offset `at`;
    `first`: an echoed prompt's first token, which has no score."""
    tokens: list[str] = [] if first is None else [first]
    values: list[float | None] = [] if first is None else [None]
    tops: list[dict[str, float] | None] = [] if first is None else [None]
    for t in scored:
        tokens.append(t.text)
        values.append(t.logprob)
        top: dict[str, float] = {}
        for _, alt, lp in t.top:
            top.setdefault(alt, lp)
        tops.append(top if with_top else {t.text: t.logprob})
    offsets = []
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def completion_usage(job: CompletionJob) -> dict[str, Any]:
    prompt, completion = sum(job.prompt_tokens), job.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": job.spent.cached_tokens}}


async def answer_completions(job: CompletionJob, out: Responder, model_name: str) -> dict[str, Any]:
    """Run `job` and send its `text_completion` (or its chunks); returns the usage, for metrics."""
    base = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": model_name}
    if not job.req.stream:
        choices = await job.run()
        usage = completion_usage(job)
        await out.json(200, {**base, "choices": choices, "usage": usage,
                             "thinkahead": {"model": job.model.name, **job.spent.to_dict()}})
        return usage
    await out.start_events()
    async for choice in job.stream():
        await out.event({**base, "choices": [choice]})
    usage = completion_usage(job)
    if job.req.stream_options is not None and job.req.stream_options.include_usage:
        await out.event({**base, "choices": [], "usage": usage,
                         "thinkahead": {"model": job.model.name, **job.spent.to_dict()}})
    await out.done()
    return usage
