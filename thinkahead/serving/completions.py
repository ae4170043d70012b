"""`POST /v1/completions`: the legacy text API on the plain models, enough for lm-evaluation-harness
and for thinkahead's own `openai:` backend (generation, and judges reading next-token logprobs).

`prompt` is a string, a list of strings, a list of token ids or a list of such lists (one choice
per prompt and sample); `echo` returns the prompt before the completion and, with `logprobs`,
scores the prompt's tokens too (the first has none): the numbers are the model's own
`token_logprobs`, computed as `continuation_logprobs` computes them. Generation from token-id
prompts starts from their decoded text.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from thinkahead.models.base import GenerationRequest, LanguageModel
from thinkahead.serving.asgi import RequestError, Responder, unsupported
from thinkahead.serving.chat import DEFAULT_TEMPERATURE, Spent, can_score, reproducible_speculation
from thinkahead.serving.limits import check_context
from thinkahead.serving.schemas import CompletionRequest

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


class CompletionJob:
    def __init__(self, model: LanguageModel, req: CompletionRequest) -> None:
        self.model, self.req = model, req
        if req.stream:
            raise unsupported("stream", "on /v1/completions (use /v1/chat/completions to stream)")
        if req.logprobs is not None and not can_score(model):
            raise unsupported("logprobs", f"by model {model.name!r} (its backend cannot score tokens)")
        if req.max_tokens == 0 and not req.echo:
            raise RequestError(400, "'max_tokens' may be 0 only with 'echo': true", param="max_tokens")
        self.prompts = prompts_of(req)
        tokenizer = getattr(model, "tokenizer", None)
        if any(isinstance(p, list) for p in self.prompts) and tokenizer is None:
            raise unsupported("prompt", f"as token ids by model {model.name!r} (it has no tokenizer)")
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

    async def _choice(self, index: int, prompt: str | list[int], text: str, sample: int) -> dict[str, Any]:
        req = self.req
        out_text, out_ids, finish, matched = "", [], "length", None
        if self.max_new > 0:
            temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
            c = await self.model.generate(GenerationRequest(
                prompt=text, max_new_tokens=self.max_new, temperature=temperature,
                top_p=1.0 if req.top_p is None else req.top_p, stop=req.stops,
                seed=None if req.seed is None else req.seed + sample, session_id=req.session_id,
                speculative=reproducible_speculation(req.seed, temperature)))
            self.spent.add(c)
            out_text, out_ids, finish, matched = c.text, list(c.token_ids), c.finish_reason, c.matched_stop
            self.completion_tokens += c.completion_tokens
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
        tokens, values, tops = [], [], []
        if req.echo:
            first = model.tokenizer.decode([prompt_ids[0]])
            tokens, values, tops = [first], [None], [None]
        for t in scored:
            tokens.append(t.text)
            values.append(t.logprob)
            top: dict[str, float] = {}
            for _, alt, lp in t.top:
                top.setdefault(alt, lp)
            tops.append(top if req.logprobs else {t.text: t.logprob})
        offsets, at = [], 0 if req.echo else len(text)
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


async def answer_completions(job: CompletionJob, out: Responder, model_name: str) -> dict[str, Any]:
    choices = await job.run()
    prompt = sum(job.prompt_tokens)
    completion = job.completion_tokens
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": job.spent.cached_tokens}}
    await out.json(200, {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                         "model": model_name, "choices": choices, "usage": usage,
                         "thinkahead": {"model": job.model.name, **job.spent.to_dict()}})
    return usage
