"""Budgets, metering and retries around every model call of a run.

Each run gets a `Meter` (chained to the batch's meter), and its models are wrapped in
`MeteredModel`, so every call of every node (step policies and judges included) is counted once,
checked against the run's and the batch's limits before it starts, and retried with backoff when
the server failed in a way that may pass.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from thinkahead.models.base import Completion, GenerationRequest, LanguageModel

SPEC_KEYS = ("spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts")


class RunBudget(BaseModel, extra="forbid"):
    """Limits of a run (or of a whole batch); None means unlimited."""

    max_tokens: int | None = Field(default=None, gt=0, description="generated tokens, all models")
    max_model_calls: int | None = Field(default=None, gt=0, description="generations and judge calls")
    max_wall_s: float | None = Field(default=None, gt=0, description="wall-clock seconds")


class BudgetExceeded(Exception):
    """A run or batch hit a limit; `scope` is "run" or "batch", `limit` the field that ran out."""

    def __init__(self, scope: str, limit: str, value: float, used: float) -> None:
        super().__init__(f"{scope} budget {limit}={value:g} exhausted (used {used:g})")
        self.scope, self.limit, self.value, self.used = scope, limit, value, used


@dataclass
class Meter:
    """What a run (or a batch) has spent, checked against its budget."""

    budget: RunBudget = field(default_factory=RunBudget)
    scope: str = "run"
    parent: Meter | None = None
    started: float = field(default_factory=time.perf_counter)
    tokens: dict[str, int] = field(default_factory=dict)  # generated tokens per tier
    prompt_tokens: int = 0
    cached_tokens: int = 0
    model_calls: int = 0
    judge_calls: int = 0
    retries: int = 0
    spec: dict[str, float] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())

    def check(self) -> None:
        """Raise `BudgetExceeded` if this meter or a parent has nothing left for another call."""
        b = self.budget
        if b.max_tokens is not None and self.total_tokens >= b.max_tokens:
            raise BudgetExceeded(self.scope, "max_tokens", b.max_tokens, self.total_tokens)
        if b.max_model_calls is not None and self.model_calls >= b.max_model_calls:
            raise BudgetExceeded(self.scope, "max_model_calls", b.max_model_calls, self.model_calls)
        if b.max_wall_s is not None and (used := time.perf_counter() - self.started) >= b.max_wall_s:
            raise BudgetExceeded(self.scope, "max_wall_s", b.max_wall_s, round(used, 3))
        if self.parent is not None:
            self.parent.check()

    def record_call(self, tier: str, completion: Completion | None, judge: bool = False) -> None:
        meter: Meter | None = self
        while meter is not None:
            meter.model_calls += 1
            meter.judge_calls += judge
            if completion is not None:
                meter.tokens[tier] = meter.tokens.get(tier, 0) + completion.completion_tokens
                meter.prompt_tokens += completion.prompt_tokens
                meter.cached_tokens += completion.cached_tokens
                for key in SPEC_KEYS:
                    if key in completion.spec:
                        meter.spec[key] = meter.spec.get(key, 0) + completion.spec[key]
            meter = meter.parent

    def record_retry(self) -> None:
        meter: Meter | None = self
        while meter is not None:
            meter.retries += 1
            meter = meter.parent

    def snapshot(self) -> dict[str, Any]:
        """The cost so far as plain data (a run result's `cost`)."""
        verify = self.spec.get("spec_verify_ct", 0)
        accepted = self.spec.get("spec_num_correct_drafts", 0)
        return {
            "tokens": dict(self.tokens),
            "total_tokens": self.total_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "model_calls": self.model_calls,
            "judge_calls": self.judge_calls,
            "retries": self.retries,
            "spec": dict(self.spec),
            # tokens per verify step, SGLang's spec_accept_length: accepted drafts + the bonus token
            "accept_length": round((accepted + verify) / verify, 3) if verify else None,
            "wall_s": round(time.perf_counter() - self.started, 4),
        }


class RetryPolicy(BaseModel, extra="forbid"):
    """Retries of a failed model call: `attempts` in all, sleeping `backoff_s * factor**i` between."""

    attempts: int = Field(default=3, ge=1)
    backoff_s: float = Field(default=0.5, ge=0)
    factor: float = Field(default=2.0, ge=1)


def is_retryable(exc: BaseException) -> bool:
    """Failures that may pass on another try: lost connections, timeouts, 5xx and 429 replies."""
    status = getattr(exc, "status", None)
    if type(exc).__name__ == "ModelServerError":
        return status is None or status == 429 or status >= 500
    return isinstance(exc, (ConnectionError, TimeoutError))


class MeteredModel(LanguageModel):
    """A model seen through a run's meter: every call is budget-checked, counted and retried."""

    def __init__(self, inner: LanguageModel, tier: str, meter: Meter, retry: RetryPolicy) -> None:
        self.inner, self.tier, self.meter, self.retry = inner, tier, meter, retry
        self.name = inner.name

    async def _call(self, fn, *args, judge: bool = False):
        delay = self.retry.backoff_s
        for attempt in range(self.retry.attempts):
            self.meter.check()
            try:
                result = await fn(*args)
            except Exception as exc:  # noqa: BLE001 - filtered by is_retryable
                if attempt + 1 >= self.retry.attempts or not is_retryable(exc):
                    raise
                self.meter.record_retry()
                await asyncio.sleep(delay)
                delay *= self.retry.factor
                continue
            self.meter.record_call(self.tier, result if isinstance(result, Completion) else None, judge)
            return result
        raise RuntimeError("unreachable")  # pragma: no cover

    async def generate(self, request: GenerationRequest) -> Completion:
        return await self._call(self.inner.generate, request)

    async def next_token_logprobs(self, prompt: str, top_k: int = 20) -> dict[str, float]:
        return await self._call(self.inner.next_token_logprobs, prompt, top_k, judge=True)

    async def continuation_logprobs(self, prompt: str, continuation: str) -> list[float]:
        return await self._call(self.inner.continuation_logprobs, prompt, continuation, judge=True)

    async def continuation_scores(self, prompt: str, continuation: str):
        return await self._call(self.inner.continuation_scores, prompt, continuation, judge=True)

    def render(self, messages: list[dict[str, str]], continue_final: bool = False) -> str:
        return self.inner.render(messages, continue_final)

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)

    def __getattr__(self, name: str) -> Any:  # tokenizer, suffix_cache, ... of the wrapped model
        return getattr(self.inner, name)
