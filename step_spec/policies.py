"""Step policies: who writes the next reasoning step, and whether a cheap draft is kept.

Every policy implements `next_step(ctx) -> StepOutcome`:
- `large`, `small`: baselines, one model writes everything;
- `specreason`: the small model drafts, the large model judges it 0-9 in one forward pass; below
  the threshold the large model rewrites the step (SpecReason). `judge="agreement"` replaces the
  judge prompt by the large model re-reading the step (`AgreementVerifier`): a failed step keeps
  its text up to the first token the large model disagrees with, and the large model writes the
  rest ("repaired"). With `repair="token"` the large model only puts its own token in place of
  the failing one (read from the same verify pass) and the small model drafts on, up to
  `max_corrections` times per step ("corrected"). With `lookahead`, the small model drafts step i+1
  while step i is being judged, and the guess is dropped if step i is rejected;
- `arbitrage`: a router decides before drafting whether the large model should write (Arbitrage);
- `reflect`: the small model writes; a step that opens with a reflection cue ("wait", ...) is
  handed to the large model (Speculative Thinking).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

from thinkahead.models.base import Completion, GenerationRequest
from thinkahead.step_spec.segment import Step, closes_step, cut_step, stop_strings
from thinkahead.step_spec.state import StepContext, StepOutcome
from thinkahead.verifiers.judge import LLMJudge

POLICY_NAMES = ("large", "small", "specreason", "arbitrage", "reflect")
JUDGES = ("llm", "agreement")  # specreason's verifier: the 0-9 judge prompt, or token agreement
REPAIRS = ("step", "token")  # after a failed agreement check: the large model finishes the step, or fixes one token


class StepPolicy(Protocol):
    name: str

    async def next_step(self, ctx: StepContext) -> StepOutcome: ...


@dataclass(slots=True)
class Written:
    """A step one model wrote: the cut step and the generation that produced it."""

    step: Step
    completion: Completion
    tier: str

    @property
    def tokens(self) -> int:
        return self.completion.completion_tokens


async def write_step(ctx: StepContext, tier: str, messages: list[dict[str, str]] | None = None) -> Written:
    """Let the `tier` model write one step continuing `messages` (default: the context's)."""
    model = ctx.model(tier)
    messages = messages if messages is not None else ctx.messages()
    request = GenerationRequest(
        messages=messages,
        continue_final=messages[-1]["role"] == "assistant",
        max_new_tokens=ctx.segment.max_step_tokens,
        stop=stop_strings(ctx.segment),
        speculative=ctx.speculative,
        temperature=ctx.temperature,
        seed=ctx.seed,
        session_id=ctx.session_id,
    )
    completion = await model.generate(request)
    raw = completion.text + (completion.matched_stop or "")  # put the delimiter (or </think>) back
    step = cut_step(raw, ctx.segment, hit_token_cap=completion.finish_reason == "length")
    return Written(step, completion, tier)


def outcome(written: Written, verdict: str, **extra) -> StepOutcome:
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
        spec=dict(c.spec),
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


class SingleModel:
    """Baseline: one model writes every step."""

    def __init__(self, tier: str) -> None:
        if tier not in ("small", "large"):
            raise ValueError(f"tier must be 'small' or 'large', got {tier!r}")
        self.tier = tier
        self.name = tier

    async def next_step(self, ctx: StepContext) -> StepOutcome:
        return outcome(await write_step(ctx, self.tier), "baseline")


class SpecReason:
    """Small model drafts, large model judges; rewrite by the large model below `threshold`."""

    name = "specreason"

    def __init__(
        self,
        threshold: float = 7.0,
        score_mode: str = "greedy",
        first_large_steps: int = 0,
        lookahead: bool = False,
        verifier=None,
        judge: str = "llm",
        margin: float = 1.0,
        word_margin: float | None = None,
        repair: str = "step",
        max_corrections: int = 8,
    ) -> None:
        if first_large_steps < 0:
            raise ValueError(f"first_large_steps must be >= 0, got {first_large_steps}")
        if judge not in JUDGES:
            raise ValueError(f"specreason judge must be one of {', '.join(JUDGES)}, got {judge!r}")
        if repair not in REPAIRS:
            raise ValueError(f"specreason repair must be one of {', '.join(REPAIRS)}, got {repair!r}")
        if not isinstance(max_corrections, int) or max_corrections < 1:
            raise ValueError(f"max_corrections must be an int >= 1, got {max_corrections!r}")
        self.judge = judge
        self.margin = margin
        self.word_margin = word_margin
        self.repair = repair
        self.max_corrections = max_corrections
        self.threshold = threshold
        self.score_mode = score_mode
        self.first_large_steps = first_large_steps
        self.lookahead = lookahead
        self._judge = verifier  # any StepVerifier (LLM judge, PRM); default: the large model as LLM judge
        self._ahead: tuple[str, asyncio.Task[Written]] | None = None  # (reasoning it continues, draft task)

    def judge_for(self, ctx: StepContext):
        """The verifier given at construction, else one over this run's large model."""
        from thinkahead.verifiers.prm import AgreementVerifier

        built = (LLMJudge, AgreementVerifier)
        if self._judge is None or (isinstance(self._judge, built) and self._judge.model is not ctx.large):
            if self.judge == "agreement":
                self._judge = AgreementVerifier(ctx.large, self.margin, self.word_margin)  # type: ignore[arg-type]
            else:
                self._judge = LLMJudge(ctx.large, self.threshold, self.score_mode)  # type: ignore[arg-type]
        return self._judge

    async def next_step(self, ctx: StepContext) -> StepOutcome:
        if ctx.index < self.first_large_steps:
            return outcome(await write_step(ctx, "large"), "forced")
        t0 = time.perf_counter()
        draft = await self._draft(ctx)
        messages = ctx.messages()
        judge = self.judge_for(ctx)
        if self.lookahead and not (draft.step.ends_thinking or draft.step.kind in ("final", "empty")):
            # guess that the draft passes: draft the following step while the judge works
            guess = _with_reasoning(ctx, ctx.reasoning + draft.step.text)
            self._ahead = (ctx.reasoning + draft.step.text, asyncio.create_task(write_step(ctx, "small", guess)))
        verdict = await judge.judge(messages, draft.step.text)
        keep = int(verdict.details.get("keep_chars", 0))
        if verdict.accept:
            out = outcome(draft, "accepted", score=verdict.score, judge_calls=1)
        elif self.repair == "token" and verdict.correction:
            await self._drop_lookahead()
            out = await self._correct(ctx, draft, verdict)
        elif keep > 0:
            await self._drop_lookahead()
            out = await self._repair(ctx, draft, draft.step.text[:keep], verdict.score)
        else:
            await self._drop_lookahead()
            out = discard(outcome(await write_step(ctx, "large"), "rejected", score=verdict.score, judge_calls=1), draft)
        out.time_s = time.perf_counter() - t0
        return out

    async def _repair(self, ctx: StepContext, draft: Written, kept: str, score: float) -> StepOutcome:
        """The large model finishes the step from the kept start of the draft."""
        rest = await write_step(ctx, "large", _with_reasoning(ctx, ctx.reasoning + kept))
        out = discard(outcome(rest, "repaired", score=score, judge_calls=1), draft)
        out.text = kept + out.text
        out.discarded = draft.step.text[len(kept):]  # only the part the large model replaced
        return out

    async def _correct(self, ctx: StepContext, draft: Written, verdict) -> StepOutcome:
        """Token repair: the large model's own token replaces the first failing one, the small model
        drafts the rest of the step from there, and the large model checks again; after
        `max_corrections` fixes the large model writes what is left of the step."""
        judge = self.judge_for(ctx)
        text, last, tokens, checks, score = "", draft, {"small": draft.tokens, "large": 0}, 1, verdict.score
        discarded = []
        for fixes in range(self.max_corrections + 1):
            keep = int(verdict.details.get("keep_chars", 0))
            discarded.append(last.step.text[keep:])
            text += last.step.text[:keep]
            if fixes == self.max_corrections or not verdict.correction:  # the large model finishes the step
                last = await write_step(ctx, "large", _with_reasoning(ctx, ctx.reasoning + text))
                tokens["large"] += last.tokens
                break
            text += verdict.correction
            tokens["large"] += 1  # the corrected token, read off the verify pass
            if closes_step(text, ctx.segment):  # the large model's token ended the step
                step = cut_step(text, ctx.segment)
                out = self._corrected(step.text, last, tokens, checks, score, discarded)
                out.kind, out.ends_response = step.kind, step.ends_thinking
                return out
            last = await write_step(ctx, "small", _with_reasoning(ctx, ctx.reasoning + text))
            tokens["small"] += last.tokens
            verdict = await judge.judge(_with_reasoning(ctx, ctx.reasoning + text), last.step.text)
            checks += verdict.judge_calls
            score = min(score, verdict.score)
            if verdict.accept:
                break
        return self._corrected(text + last.step.text, last, tokens, checks, score, discarded)

    @staticmethod
    def _corrected(text: str, last: Written, tokens: dict[str, int], checks: int, score: float,
                   discarded: list[str]) -> StepOutcome:
        out = outcome(last, "corrected", score=score, judge_calls=checks)
        out.text, out.tokens = text, tokens  # the author is whoever wrote the last piece
        out.discarded = "".join(discarded)
        return out

    async def _draft(self, ctx: StepContext) -> Written:
        """The small model's draft: the lookahead guess when it continues exactly this reasoning."""
        if self._ahead is not None:
            reasoning, task = self._ahead
            self._ahead = None
            if reasoning == ctx.reasoning:
                return await task
            task.cancel()
        return await write_step(ctx, "small")

    async def _drop_lookahead(self) -> None:
        if self._ahead is not None:
            _, task = self._ahead
            self._ahead = None
            task.cancel()
            try:
                await task  # a worker thread cannot be interrupted: let it finish, then forget it
            except (asyncio.CancelledError, Exception):
                pass


def _with_reasoning(ctx: StepContext, reasoning: str) -> list[dict[str, str]]:
    out = [{"role": "system", "content": ctx.system}] if ctx.system else []
    return out + [{"role": "user", "content": ctx.problem}, {"role": "assistant", "content": reasoning}]


class Arbitrage:
    """A router decides before drafting whether the large model writes this step."""

    name = "arbitrage"

    def __init__(self, router=None, top_k: int = 20) -> None:
        from thinkahead.verifiers.router import HeuristicRouter

        self.router = router if router is not None else HeuristicRouter()
        self.top_k = top_k

    async def next_step(self, ctx: StepContext) -> StepOutcome:
        t0 = time.perf_counter()
        tier, p = self.router.route(await router_features(ctx, self.top_k))
        out = outcome(await write_step(ctx, tier), "routed", route_p=p)
        out.time_s = time.perf_counter() - t0
        return out


async def router_features(ctx: StepContext, top_k: int = 20):
    """What an Arbitrage router sees before the step is drafted (one small-model forward)."""
    from thinkahead.verifiers.router import RouterFeatures, entropy_from_logprobs, opens_with_reflection

    prompt = ctx.small.render(ctx.messages(), continue_final=bool(ctx.steps))
    logprobs = await ctx.small.next_token_logprobs(prompt, top_k)
    prev = ctx.steps[-1] if ctx.steps else None
    return RouterFeatures(
        step_index=ctx.index,
        prev_score=prev.score if prev is not None else None,
        small_entropy=entropy_from_logprobs(logprobs),
        prev_step_tokens=sum(prev.tokens.values()) if prev is not None else 0,
        prev_had_reflection=opens_with_reflection(prev.text) if prev is not None else False,
        problem_tokens=ctx.small.count_tokens(ctx.problem),
    )


class CollectPairs:
    """Router training data: both models write each step, the judge scores both, a pair is saved.

    The better-scored step is kept (the small one on ties), so the reasoning stays on track; each
    pair goes to `pairs_path` (JSONL, flushed per line) with the features the router will see.
    """

    name = "collect"

    def __init__(self, pairs_path, problem_id: str = "", threshold: float = 7.0, score_mode: str = "expected") -> None:
        self.pairs_path = pairs_path
        self.problem_id = problem_id
        self.threshold = threshold
        self.score_mode = score_mode

    async def next_step(self, ctx: StepContext) -> StepOutcome:
        from thinkahead.verifiers.router import PairedStep, write_pairs

        t0 = time.perf_counter()
        features = await router_features(ctx)
        small, large = await write_step(ctx, "small"), await write_step(ctx, "large")
        judge = LLMJudge(ctx.large, self.threshold, self.score_mode)  # type: ignore[arg-type]
        messages = ctx.messages()
        small_v, large_v = await judge.judge(messages, small.step.text), await judge.judge(messages, large.step.text)
        write_pairs(self.pairs_path, [PairedStep(
            problem_id=self.problem_id, step_index=ctx.index, features=features,
            small_text=small.step.text, large_text=large.step.text,
            small_score=small_v.score, large_score=large_v.score,
        )])
        keep, drop, score = (small, large, small_v.score) if small_v.score >= large_v.score else (large, small, large_v.score)
        out = discard(outcome(keep, "collected", score=score, judge_calls=2), drop)
        out.time_s = time.perf_counter() - t0
        return out


class Reflect:
    """The small model writes; steps opening with a reflection cue go to the large model."""

    name = "reflect"

    async def next_step(self, ctx: StepContext) -> StepOutcome:
        from thinkahead.verifiers.router import opens_with_reflection

        draft = await write_step(ctx, "small")
        if not opens_with_reflection(draft.step.text):
            return outcome(draft, "baseline")
        return discard(outcome(await write_step(ctx, "large"), "reflection"), draft)


def make_policy(name: str, **options) -> StepPolicy:
    """A policy by name; options go to its constructor (e.g. threshold=5 for specreason)."""
    if name in ("large", "small"):
        if options:
            raise ValueError(f"policy {name!r} takes no options, got {sorted(options)}")
        return SingleModel(name)
    if name == "specreason":
        return SpecReason(**options)
    if name == "arbitrage":
        from thinkahead.verifiers.router import load_router

        router = options.pop("router", None)
        return Arbitrage(load_router(router) if isinstance(router, str) else router, **options)
    if name == "reflect":
        if options:
            raise ValueError(f"policy 'reflect' takes no options, got {sorted(options)}")
        return Reflect()
    raise ValueError(f"unknown step policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")


__all__ = [
    "POLICY_NAMES", "Arbitrage", "Reflect", "SingleModel", "SpecReason", "StepPolicy", "make_policy", "write_step",
]
