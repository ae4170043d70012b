"""The step loop: reason about one problem step by step under a policy, until an answer or a budget.

Each run starts its own stepper from the shared policy spec (`policy.start(ctx)`, once per run) and
closes it when the run ends, so one policy object serves any number of concurrent runs.

Stops when a step holds a final answer (`\\boxed{}`, "Answer:"), the model ends its reply or its
thinking, a step repeats an earlier one, or a budget runs out (steps, generated tokens, large-model
calls). When the reasoning stops without an answer, the policy's answer tier (normally the large model) is
asked for one directly.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator

from pydantic import BaseModel, Field

from thinkahead.models.base import GenerationRequest, LanguageModel
from thinkahead.step_spec.base import PolicyRun, StatelessRun, StepPolicy, check_policy_models
from thinkahead.step_spec.segment import SegmentConfig, has_final_answer, is_repeated
from thinkahead.step_spec.state import TIERS, StepContext, StepOutcome, Tier, check_tier

FORCE_ANSWER = "\n\nTherefore, the final answer is \\boxed{"


class StepBudget(BaseModel, extra="forbid"):
    """Limits of one reasoning run; None means unlimited."""

    max_steps: int = Field(default=16, gt=0)
    max_tokens: int | None = Field(default=1024, gt=0)
    max_large_calls: int | None = Field(default=None, ge=0)
    final_answer_tokens: int = Field(default=24, gt=0)


@dataclass
class ReasoningResult:
    """The outcome of a run: the full reasoning, the answer text, every step and the cost."""

    problem: str
    reasoning: str
    answer: str  # the final-answer part (the last step, or the forced answer)
    steps: list[StepOutcome]
    stop_reason: str  # "answer", "end", "repetition", "max_steps", "max_tokens", "max_large_calls"
    tokens: dict[str, int] = field(default_factory=dict)
    judge_calls: int = 0
    large_calls: int = 0
    time_s: float = 0.0

    @property
    def small_share(self) -> float:
        """Share of kept steps written by the small model."""
        steps = [s for s in self.steps if s.verdict != "final"]
        return sum(s.author == "small" for s in steps) / len(steps) if steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["steps"] = [s.to_dict() for s in self.steps]  # each step's speculation stats as their dict
        out["small_share"] = self.small_share
        return out


def answer_tier(policy: StepPolicy) -> Tier:
    """Who writes a forced final answer under `policy`: its `answer_tier`, else the large model."""
    return check_tier(getattr(policy, "answer_tier", "large"))


class StepLoop:
    """Runs a `StepPolicy` over a problem with two models."""

    def __init__(
        self,
        small: LanguageModel,
        large: LanguageModel,
        policy: StepPolicy,
        segment: SegmentConfig | None = None,
        budget: StepBudget | None = None,
        system: str | None = None,
        speculative: bool = True,
        temperature: float = 0.0,
        seed: int | None = None,
        session_id: str | None = None,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        check_policy_models(policy, small, large)
        self.small, self.large, self.policy = small, large, policy
        self.temperature, self.seed, self.session_id = temperature, seed, session_id
        self.segment = segment or SegmentConfig()
        self.budget = budget or StepBudget()
        self.system = system
        self.speculative = speculative

    async def run(self, problem: str) -> ReasoningResult:
        result = None
        async for item in self.stream(problem):
            if isinstance(item, ReasoningResult):
                result = item
        if result is None:  # stream always ends with the result
            raise RuntimeError("step loop ended without a result")
        return result

    async def stream(self, problem: str) -> AsyncIterator[StepOutcome | ReasoningResult]:
        """Yields each step as it is decided, then the `ReasoningResult`."""
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError("problem must be a non-empty string")
        t0 = time.perf_counter()
        ctx = StepContext(problem, self.small, self.large, self.segment, self.system, speculative=self.speculative,
                          temperature=self.temperature, seed=self.seed, session_id=self.session_id)
        stop = None
        stepper = start_run(self.policy, ctx)
        try:
            while stop is None:
                stop = self._budget_stop(ctx)
                if stop is not None:
                    break
                ctx.token_room = self._token_room(ctx)
                step = await stepper.next_step(ctx)
                previous = [s.text for s in ctx.steps]
                ctx.steps.append(step)
                yield step
                if has_final_answer(step.text):
                    stop = "answer"
                elif step.ends_response:
                    stop = "end"
                elif is_repeated(step.text, previous):
                    stop = "repetition"
                elif step.kind == "empty" and len(ctx.steps) > 1 and ctx.steps[-2].kind == "empty":
                    stop = "end"
        finally:
            await stepper.close()  # e.g. a lookahead guess the run will not use
        if not has_final_answer(ctx.reasoning):
            final = await self._force_answer(ctx)
            ctx.steps.append(final)
            yield final
        yield self._result(ctx, stop, time.perf_counter() - t0)

    def _token_room(self, ctx: StepContext) -> int | None:
        """Tokens `max_tokens` leaves for the next step (None: no token budget)."""
        if self.budget.max_tokens is None:
            return None
        return self.budget.max_tokens - sum(sum(s.tokens.values()) for s in ctx.steps)

    def _budget_stop(self, ctx: StepContext) -> str | None:
        b = self.budget
        if len(ctx.steps) >= b.max_steps:
            return "max_steps"
        if b.max_tokens is not None and sum(sum(s.tokens.values()) for s in ctx.steps) >= b.max_tokens:
            return "max_tokens"
        if b.max_large_calls is not None and _large_calls(ctx.steps) >= b.max_large_calls:
            return "max_large_calls"
        return None

    async def _force_answer(self, ctx: StepContext) -> StepOutcome:
        """Ask for the boxed answer right after the reasoning so far.

        The policy's answer tier writes it (`answer_tier`: the large model unless a policy names
        another, e.g. `small`). Generation stops at each `}`; while the braces opened inside the box
        are not all closed (`\\boxed{\\frac{1}{2}}`) it goes on, within `final_answer_tokens`.
        """
        tier = answer_tier(self.policy)
        model = ctx.model(tier)
        messages = ctx.messages()
        reasoning = (messages[-1]["content"] if messages[-1]["role"] == "assistant" else "").rstrip()
        head = messages[:-1] if messages[-1]["role"] == "assistant" else messages
        answer, tokens, time_s, depth = "", 0, 0.0, 1
        while tokens < self.budget.final_answer_tokens:
            request = GenerationRequest(
                messages=head + [{"role": "assistant", "content": reasoning + FORCE_ANSWER + answer}],
                continue_final=True,
                max_new_tokens=self.budget.final_answer_tokens - tokens,
                stop=["}"],
                speculative=self.speculative,
                session_id=ctx.session_id,
            )
            c = await model.generate(request)
            answer += c.text
            tokens += c.completion_tokens
            time_s += c.time_s
            depth += c.text.count("{") - c.text.count("}") - 1
            if c.matched_stop != "}" or depth <= 0 or c.completion_tokens == 0:
                break  # the model ended, ran out of tokens, or closed the box
            answer += "}"
        out = StepOutcome(text=FORCE_ANSWER.lstrip("\n") + answer + "}", author=tier, verdict="final", kind="final",
                          time_s=time_s)
        out.tokens[tier] += tokens
        return out

    def _result(self, ctx: StepContext, stop: str | None, elapsed: float) -> ReasoningResult:
        tokens = dict.fromkeys(TIERS, 0)
        for s in ctx.steps:
            for tier, n in s.tokens.items():
                tokens[tier] = tokens.get(tier, 0) + n
        last = ctx.steps[-1].text if ctx.steps else ""
        return ReasoningResult(
            problem=ctx.problem,
            reasoning=ctx.reasoning,
            answer=last,
            steps=ctx.steps,
            stop_reason=stop or "end",
            tokens=tokens,
            judge_calls=sum(s.judge_calls for s in ctx.steps),
            large_calls=_large_calls(ctx.steps),
            time_s=elapsed,
        )


def start_run(policy: StepPolicy | Any, ctx: StepContext) -> PolicyRun:
    """The run's own stepper: `policy.start(ctx)`; an object with only `next_step` (a policy written
    before `start` existed) steps as it is and must keep no per-run state."""
    start = getattr(policy, "start", None)
    if start is not None:
        return start(ctx)
    if not hasattr(policy, "next_step"):
        raise ValueError(f"a step policy needs start(ctx) (or next_step(ctx)), got {type(policy).__name__}")
    return StatelessRun(policy.next_step)


def _large_calls(steps: list[StepOutcome]) -> int:
    """Large-model calls: steps it wrote plus judge calls."""
    return sum(1 for s in steps if s.author == "large") + sum(s.judge_calls for s in steps)
