"""Budgets, metering, deadlines and retries around every model call of a run.

Each run gets a `Meter` (chained to the batch's meter), and its models are wrapped in
`MeteredModel`, so every call of every node (step policies and judges included) is counted once
with the requests it really took, checked against the run's and the batch's limits before it
starts, and bounded by a deadline: the sooner of `max_call_s` from its start and the end of the
run's and the batch's `max_wall_s` (a call cut by a wall-time limit ends its run as "budget").

Retries: a call has one retry layer. Server backends retry inside their HTTP client, which knows
what is safe to send again (`thinkahead.models.http`), and report it through the call's
`model_call` scope; `MeteredModel` never retries such a call. It retries (`RetryPolicy`) only calls
no transport handled, i.e. in-process backends that failed in a way that may pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field
from thinkahead.token_spec.stats import SpecStats

from thinkahead.models.base import (
    CallScope,
    Completion,
    GenerationRequest,
    LanguageModel,
    model_call,
)
from thinkahead.models.errors import ThinkaheadError
from thinkahead.models.http import ModelServerError

_DEADLINE_SLACK_S = 0.01  # a call that fails this close to a wall-time deadline was cut by it
_GRACE_S = 0.25  # the backend ends a call at its deadline; MeteredModel cancels it this much later


class RunBudget(BaseModel, extra="forbid"):
    """Limits of a run (or of a whole batch); None means unlimited."""

    max_tokens: int | None = Field(default=None, gt=0, description="generated tokens, all models")
    max_model_calls: int | None = Field(default=None, gt=0, description="generations and judge calls")
    max_wall_s: float | None = Field(default=None, gt=0, description="wall-clock seconds")
    max_call_s: float | None = Field(
        default=None, gt=0,
        description="wall-clock seconds of one model call, all attempts included (None: the backend's own limit)",
    )


class BudgetExceeded(ThinkaheadError):
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
    model_calls: int = 0  # calls that returned (generations and judge calls)
    judge_calls: int = 0
    failed_calls: int = 0  # calls that raised
    attempts: int = 0  # requests tried for all calls (returned, failed or cancelled), resends included
    retries: int = 0  # of those, resends
    spec: SpecStats = field(default_factory=SpecStats)  # token-level speculation of every call, summed

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
        if b.max_wall_s is not None and time.perf_counter() - self.started >= b.max_wall_s:
            raise self.wall_exceeded()
        if self.parent is not None:
            self.parent.check()

    def wall_exceeded(self) -> BudgetExceeded:
        """The error of this meter's spent `max_wall_s`."""
        used = round(time.perf_counter() - self.started, 3)
        return BudgetExceeded(self.scope, "max_wall_s", self.budget.max_wall_s or 0.0, used)

    def call_deadline(self) -> tuple[float | None, Meter | None]:
        """When a model call starting now must end (`time.monotonic()`; None: no limit), and the
        meter whose `max_wall_s` sets that time (None when `max_call_s` does)."""
        now, elapsed_at = time.monotonic(), time.perf_counter()
        best: float | None = None
        source: Meter | None = None
        for meter in self._chain():
            b = meter.budget
            if b.max_call_s is not None and (best is None or now + b.max_call_s < best):
                best, source = now + b.max_call_s, None
            if b.max_wall_s is not None:
                end = now + b.max_wall_s - (elapsed_at - meter.started)
                if best is None or end < best:
                    best, source = end, meter
        return best, source

    def record_call(
        self, tier: str, completion: Completion | None, judge: bool = False, attempts: int = 1, retries: int = 0
    ) -> None:
        """A call that returned, after `attempts` requests (`retries` of them resends)."""
        for meter in self._chain():
            meter.model_calls += 1
            meter.judge_calls += judge
            meter.attempts += attempts
            meter.retries += retries
            if completion is not None:
                meter.tokens[tier] = meter.tokens.get(tier, 0) + completion.completion_tokens
                meter.prompt_tokens += completion.prompt_tokens
                meter.cached_tokens += completion.cached_tokens
                meter.spec += completion.spec

    def record_unfinished_call(self, attempts: int, retries: int, failed: bool) -> None:
        """A call that raised (`failed`) or was cancelled: the requests it sent still count."""
        for meter in self._chain():
            meter.attempts += attempts
            meter.retries += retries
            meter.failed_calls += failed

    def _chain(self) -> Iterator[Meter]:
        meter: Meter | None = self
        while meter is not None:
            yield meter
            meter = meter.parent

    def snapshot(self) -> dict[str, Any]:
        """The cost so far as plain data (a run result's `cost`)."""
        return {
            "tokens": dict(self.tokens),
            "total_tokens": self.total_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "model_calls": self.model_calls,
            "judge_calls": self.judge_calls,
            "failed_calls": self.failed_calls,
            "attempts": self.attempts,
            "retries": self.retries,
            "spec": self.spec.counters(),
            "accept_length": round(self.spec.spec_accept_length, 3) if self.spec.speculated else None,
            "wall_s": round(time.perf_counter() - self.started, 4),
        }


class RetryPolicy(BaseModel, extra="forbid"):
    """Retries of a failed call to a backend without its own retry layer (in-process models):
    `attempts` in all, sleeping `backoff_s * factor**i` between. Server backends retry in their
    HTTP client (`max_retries`), and their calls are not retried again here."""

    attempts: int = Field(default=3, ge=1)
    backoff_s: float = Field(default=0.5, ge=0)
    factor: float = Field(default=2.0, ge=1)


def is_retryable(exc: BaseException) -> bool:
    """Failures that may pass on another try: lost connections, timeouts, 5xx and 429 replies."""
    if isinstance(exc, ModelServerError):
        return exc.status is None or exc.status == 429 or exc.status >= 500
    return isinstance(exc, (ConnectionError, TimeoutError))


class MeteredModel(LanguageModel):
    """A model seen through a run's meter: every call is budget-checked, bounded, counted, and
    retried where no layer below retried it."""

    def __init__(self, inner: LanguageModel, tier: str, meter: Meter, retry: RetryPolicy) -> None:
        self.inner, self.tier, self.meter, self.retry = inner, tier, meter, retry
        self.name = inner.name

    @property
    def scores_tokens(self) -> bool:
        return self.inner.scores_tokens

    @property
    def grammar_kinds(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.inner.grammar_kinds

    @property
    def grammar_guaranteed(self) -> bool:  # type: ignore[override]
        return self.inner.grammar_guaranteed

    def check_grammar(self, spec) -> None:
        self.inner.check_grammar(spec)

    async def _call(self, fn, *args, judge: bool = False):
        delay = self.retry.backoff_s
        attempts = retries = 0
        for attempt in range(self.retry.attempts):
            self.meter.check()
            deadline, wall = self.meter.call_deadline()
            started = time.monotonic()
            cap = None if deadline is None else deadline - started + _GRACE_S
            scope = None
            try:
                with model_call(deadline) as scope:
                    async with asyncio.timeout(cap):  # the backstop for backends that ignore the deadline
                        result = await fn(*args)
            except asyncio.CancelledError:
                self.meter.record_unfinished_call(attempts + _tried(scope), retries + _resent(scope), failed=False)
                raise
            except Exception as exc:  # noqa: BLE001 - filtered by is_retryable
                attempts, retries = attempts + _tried(scope), retries + _resent(scope)
                cut = deadline is not None and time.monotonic() >= deadline - _DEADLINE_SLACK_S
                final = (cut or (scope is not None and scope.retried) or attempt + 1 >= self.retry.attempts
                         or not is_retryable(exc))
                if final:
                    self.meter.record_unfinished_call(attempts, retries, failed=True)
                    if cut and wall is not None:
                        raise wall.wall_exceeded() from exc
                    if cut and isinstance(exc, TimeoutError):
                        raise TimeoutError(f"model call passed its deadline ({deadline - started:.3g} s after it"
                                           " started, max_call_s)") from exc
                    raise
                retries += 1
                await asyncio.sleep(delay)
                delay *= self.retry.factor
                continue
            attempts, retries = attempts + _tried(scope), retries + _resent(scope)
            completion = result if isinstance(result, Completion) else None
            self.meter.record_call(self.tier, completion, judge, attempts=attempts, retries=retries)
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

    async def token_logprobs(self, token_ids: list[int], start: int, top_k: int = 0):
        return await self._call(self.inner.token_logprobs, token_ids, start, top_k, judge=True)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def render(self, messages: list[dict[str, str]], continue_final: bool = False) -> str:
        return self.inner.render(messages, continue_final)

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)

    def decode_tokens(self, token_ids: list[int]) -> list[str]:
        return self.inner.decode_tokens(token_ids)

    def __getattr__(self, name: str) -> Any:  # tokenizer, suffix_cache, ... of the wrapped model
        return getattr(self.inner, name)


def _tried(scope: CallScope | None) -> int:
    """Requests one try of a call took: what its transport counted, else one (an in-process call)."""
    return scope.attempts if scope is not None and scope.retried else 1


def _resent(scope: CallScope | None) -> int:
    return 0 if scope is None else scope.retries
