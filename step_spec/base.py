"""What every step policy is made of: the spec/run contract, options, and writing one step.

A policy object (`Policy`) is a stateless spec: its settings, validated by its pydantic `Options`
model, and nothing that changes while runs use it. One spec serves every run at once; each run
calls `policy.start(ctx)` once and steps with the per-run object it gets back (`PolicyRun`), which
owns whatever a run keeps between steps (a lookahead task, a judge over the run's own models).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from thinkahead.models.base import Completion, GenerationRequest, LanguageModel
from thinkahead.step_spec.segment import Step, cut_step, stop_strings
from thinkahead.step_spec.state import StepContext, StepOutcome, Tier

ScoreMode = Literal["greedy", "expected"]  # a 0-9 judge's score: the likeliest digit, or the expectation
SCORE_MODES: tuple[str, ...] = get_args(ScoreMode)
JUDGE_THRESHOLD = 7.0  # a 0-9 judge accepts a step scoring at least this


def threshold_field(default: float = JUDGE_THRESHOLD) -> Any:
    return Field(default=default, ge=0, le=9, description="accept a step the judge scores at least this (0-9)")


class PolicyOptions(BaseModel):
    """The settings of one policy, as a user writes them in a config file: unknown ones are errors."""

    model_config = ConfigDict(extra="forbid")


class NoOptions(PolicyOptions):
    """A policy without settings."""


def validated(options: type[PolicyOptions], policy: str, values: dict[str, Any]) -> PolicyOptions:
    """`values` checked by `options`; a ValueError naming the policy and each bad setting otherwise."""
    try:
        return options(**values)
    except ValidationError as exc:
        known = ", ".join(options.model_fields) or "none"
        problems = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err["loc"]) or "(options)"
            if err["type"] == "extra_forbidden":
                problems.append(f"unknown option {where!r} (its options: {known})")
            else:
                message = str(err["msg"]).removeprefix("Value error, ")
                got = f"{err.get('input')!r:.60}"
                problems.append(f"{where}: {message}" + ("" if got in message else f" (got {got})"))
        raise ValueError(f"policy {policy!r}: " + "; ".join(problems)) from None


class PolicyRun(Protocol):
    """One run's stepper: decides the next step of that run; `close` ends what it left running."""

    async def next_step(self, ctx: StepContext) -> StepOutcome: ...

    async def close(self) -> None: ...


class StepPolicy(Protocol):
    """A policy spec shared by runs: `start` gives each run its own `PolicyRun`."""

    name: str

    def start(self, ctx: StepContext) -> PolicyRun: ...


def check_policy_models(policy: Any, small: LanguageModel, large: LanguageModel) -> None:
    """`policy.check_models(small, large)` where the policy has it (a user's policy object may not)."""
    check = getattr(policy, "check_models", None)
    if check is not None:
        check(small, large)


def is_step_policy(obj: object) -> bool:
    """Whether `obj` can step runs: a `StepPolicy` (`start(ctx)`), or an object written before
    `start` existed that has only `next_step(ctx)` (and keeps no per-run state)."""
    return callable(getattr(obj, "start", None)) or callable(getattr(obj, "next_step", None))


class Policy:
    """Base of the built-in policies: validated options, no per-run state.

    A policy whose decisions need nothing from earlier steps implements `decide(ctx)` and inherits
    `start` (a `StatelessRun`); one that keeps state per run overrides `start`. The settings read
    as attributes (`policy.threshold`).
    """

    name: str = ""
    Options: ClassVar[type[PolicyOptions]] = NoOptions

    def __init__(self, **options: Any) -> None:
        self.options = validated(self.Options, self.name, options)

    def __getattr__(self, key: str) -> Any:
        options = self.__dict__.get("options")
        if options is not None and key in type(options).model_fields:
            return getattr(options, key)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    def check_models(self, small: LanguageModel, large: LanguageModel) -> None:
        """Refuse (ValueError, naming the setting) a model pair these settings cannot run on; called
        when a step loop or a runtime is built, before any step."""

    def start(self, ctx: StepContext) -> PolicyRun:
        return StatelessRun(self.decide)

    async def decide(self, ctx: StepContext) -> StepOutcome:
        raise NotImplementedError(f"policy {self.name!r} keeps per-run state: step through start(ctx)")

    async def next_step(self, ctx: StepContext) -> StepOutcome:
        """Step by hand without `start`: the run's stepper lives on `ctx` (one per context and policy),
        never on this shared spec; a pending lookahead is left to the caller's event loop."""
        run = ctx.policy_runs.get(self)
        if run is None:
            run = ctx.policy_runs[self] = self.start(ctx)
        return await run.next_step(ctx)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.options!r})"


@dataclass(slots=True)
class StatelessRun:
    """The per-run stepper of a policy that keeps nothing between steps: each step is `step(ctx)`
    (a policy's `decide`, or the `next_step` of a policy written before `start` existed)."""

    step: Callable[[StepContext], Awaitable[StepOutcome]]

    async def next_step(self, ctx: StepContext) -> StepOutcome:
        return await self.step(ctx)

    async def close(self) -> None:
        return None


@dataclass(slots=True)
class Written:
    """A step one model wrote: the cut step and the generation that produced it."""

    step: Step
    completion: Completion
    tier: Tier

    @property
    def tokens(self) -> int:
        return self.completion.completion_tokens


def step_tokens(ctx: StepContext) -> int:
    """The most tokens one step may write: the segment's cap, within what the run's budget has left."""
    cap = ctx.segment.max_step_tokens
    return cap if ctx.token_room is None else max(1, min(cap, ctx.token_room))


async def write_step(ctx: StepContext, tier: Tier, messages: list[dict[str, str]] | None = None, *,
                     logprobs: bool = False) -> Written:
    """Let the `tier` model write one step continuing `messages` (default: the context's); `logprobs` keeps its
    tokens' log-probabilities in the completion (the confidence gate reads them)."""
    model = ctx.model(tier)
    messages = messages if messages is not None else ctx.messages()
    request = GenerationRequest(
        messages=messages,
        continue_final=messages[-1]["role"] == "assistant",
        max_new_tokens=step_tokens(ctx),
        stop=stop_strings(ctx.segment),
        speculative=ctx.speculative,
        temperature=ctx.temperature,
        seed=ctx.seed,
        session_id=ctx.session_id,
        logprobs=logprobs,
    )
    completion = await model.generate(request)
    raw = completion.text_with_stop  # the step through its delimiter (or </think>)
    step = cut_step(raw, ctx.segment, hit_token_cap=completion.finish_reason == "length")
    return Written(step, completion, tier)


def outcome(written: Written, verdict: str, **extra: Any) -> StepOutcome:
    """A `StepOutcome` for a kept step; token counts of discarded work are added by the caller."""
    c = written.completion
    ends = written.step.ends_thinking or (c.finish_reason == "stop" and c.matched_stop is None)
    out = StepOutcome(
        text=written.step.text,
        author=written.tier,
        verdict=verdict,
        kind=written.step.kind,
        time_s=c.time_s,
        ends_response=ends,
        spec=c.spec,
        **extra,
    )
    out.tokens[written.tier] += written.tokens
    return out


def discard(out: StepOutcome, draft: Written) -> StepOutcome:
    """Account for a draft that was written and thrown away."""
    out.tokens[draft.tier] += draft.tokens
    out.time_s += draft.completion.time_s
    out.discarded = draft.step.text
    return out


def with_reasoning(ctx: StepContext, reasoning: str) -> list[dict[str, str]]:
    """The context's conversation with `reasoning` as the partial assistant message."""
    out = [{"role": "system", "content": ctx.system}] if ctx.system else []
    return out + [{"role": "user", "content": ctx.problem}, {"role": "assistant", "content": reasoning}]


async def cancel(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait until it is over (a worker thread cannot be interrupted: let it finish)."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():  # the caller itself is being cancelled
            raise
    except Exception:  # noqa: BLE001 - the result is dropped either way
        pass
