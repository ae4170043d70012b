"""`specreason`: the small model drafts each step, the large model judges it (SpecReason).

The large model scores a draft 0-9 in one forward pass; below the threshold it rewrites the step.
`judge="agreement"` replaces the judge prompt by the large model re-reading the step
(`AgreementVerifier`): a failed step keeps its text up to the first token the large model disagrees
with, and the large model writes the rest ("repaired"). With `repair="token"` the large model only
puts its own token in place of the failing one (read from the same verify pass) and the small
model drafts on, up to `max_corrections` times per step ("corrected"). With `lookahead`, the small
model drafts step i+1 while step i is being judged, and the guess is dropped if step i is rejected.
With `gate_logprob`, a draft whose every token with digits the small model itself gave at least that
log-probability is kept unchecked ("confident"; the decoder's own per-token log-probabilities, so
the gate costs nothing). With `pre_router`, a router sends some steps to the large model before
anything is drafted ("routed").

`SpecReason` is the shared spec; each run's `SpecReasonRun` owns that run's lookahead task and its
judge, built over the run's own large model (so judge calls are charged to the run that made them).
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any, Literal, get_args

from pydantic import Field, ValidationInfo, field_validator

from thinkahead.models.base import LanguageModel
from thinkahead.step_spec.base import (
    Policy,
    PolicyOptions,
    ScoreMode,
    Written,
    cancel,
    discard,
    outcome,
    threshold_field,
    with_reasoning,
    write_step,
)
from thinkahead.step_spec.routing import router_features
from thinkahead.step_spec.segment import closes_step, cut_step
from thinkahead.step_spec.state import StepContext, StepOutcome
from thinkahead.verifiers.base import StepVerifier
from thinkahead.verifiers.judge import LLMJudge, Verdict
from thinkahead.verifiers.router_labels import own_confidence

Judge = Literal["llm", "agreement"]  # the 0-9 judge prompt, or token agreement
Repair = Literal["step", "token"]  # after a failed agreement check: the large model finishes the step, or fixes one token
JUDGES: tuple[str, ...] = get_args(Judge)
# The confidence gate's default: picked on GSM8K train problems for 85% recall of the steps the 1.5B
# model's agreement check fails (0.5B drafts; docs/results/router_eval.md); None checks every draft.
DEFAULT_GATE_LOGPROB = -0.1
REPAIRS: tuple[str, ...] = get_args(Repair)


class SpecReasonOptions(PolicyOptions):
    """specreason's settings."""

    threshold: float = threshold_field()
    score_mode: ScoreMode = "greedy"
    judge: Judge = Field(default="agreement", description="token agreement, or the 0-9 judge prompt")
    margin: float = Field(default=1.0, gt=0, lt=50, description="agreement: nats a checked token may trail the "
                          "large model's choice")
    word_margin: float | None = Field(default=None, gt=0, lt=50, description="agreement: the same for other tokens "
                                      "(None: unchecked)")
    repair: Repair = Field(default="step", description="agreement failure: the large model finishes the step, or "
                           "fixes one token")
    max_corrections: int = Field(default=8, ge=1, description="token repair: fixes per step before the large model "
                                 "finishes it")
    first_large_steps: int = Field(default=0, ge=0, description="the first N steps go to the large model")
    pre_router: str | None = Field(default=None, description="a step router (name or path, as arbitrage's) that "
                                   "hands a step to the large model before the small model drafts it")
    gate_logprob: float | None = Field(default=DEFAULT_GATE_LOGPROB, lt=0, description="keep a draft unchecked when every token "
                                       "with digits has at least this log-probability under the small model")
    lookahead: bool = Field(default=False, description="draft the next step while this one is judged")

    @field_validator("judge", "repair", mode="before")
    @classmethod
    def _known_choice(cls, value: Any, info: ValidationInfo) -> Any:
        choices = {"judge": JUDGES, "repair": REPAIRS}[info.field_name]
        if value not in choices:
            raise ValueError(f"specreason {info.field_name} must be one of {', '.join(choices)}, got {value!r}")
        return value


def scoring_needs(options: SpecReasonOptions) -> dict[str, str]:
    """The tiers whose model must score tokens under `options` -> the setting that needs it and how to
    drop it: the agreement check reads the large model's scores, the confidence gate the small model's."""
    needs = {}
    if options.judge == "agreement":
        needs["large"] = "judge 'agreement' needs token scores from the large model (judge 'llm' does not: --judge llm)"
    if options.gate_logprob is not None:
        needs["small"] = ("gate_logprob needs token log-probabilities from the small model (set it to null: "
                          "--gate-logprob off)")
    return needs


async def probe_scores(options: Any, small: Any, large: Any, agreement: bool = True) -> None:
    """Ask each model whose token scores `options` need, and whose server decides whether it gives them
    (`probe_scores`: once per model), whether it does: a ValueError naming the setting, the model and what was
    probed where it does not. `agreement`: False where a verifier of the caller's own replaces the agreement
    check (it brings its own requirements). A server that cannot be reached raises its own error."""
    needs = scoring_needs(options)
    if not agreement:
        needs.pop("large", None)
    for tier, why in needs.items():
        probe = getattr(small if tier == "small" else large, "probe_scores", None)
        if probe is None:
            continue
        try:
            await probe()
        except ValueError as exc:  # ScoresUnavailable: the model, its URL and what was probed
            raise ValueError(f"specreason: {why}, and {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a server error goes on as it is (retries), saying what asked
            exc.add_note(f"asked because specreason's {why}")
            raise


class SpecReason(Policy):
    """Small model drafts, large model judges; rewrite by the large model below `threshold`.

    `verifier`: any `StepVerifier` (LLM judge, PRM) instead of the one the settings describe; a run
    sees it over its own large model when it was built over the model that run's large model wraps.
    """

    name = "specreason"
    Options = SpecReasonOptions
    options: SpecReasonOptions

    def __init__(self, verifier: StepVerifier | None = None, **options: Any) -> None:
        from thinkahead.verifiers.router import load_router

        super().__init__(**options)
        self.verifier = verifier
        self.router = None if self.options.pre_router is None else load_router(self.options.pre_router)

    def check_models(self, small: LanguageModel, large: LanguageModel) -> None:
        needs = scoring_needs(self.options)
        if self.verifier is not None:
            needs.pop("large", None)  # a given verifier brings its own requirements
        for tier, model in (("large", large), ("small", small)):
            if tier in needs and not model.scores_tokens:
                raise ValueError(f"specreason: {needs[tier]}, and {model.name} ({type(model).__name__}) cannot "
                                 "score tokens")

    def make_verifier(self, large: LanguageModel) -> StepVerifier:
        """The verifier the settings describe, over `large`."""
        from thinkahead.verifiers.agreement import AgreementVerifier

        o = self.options
        if o.judge == "agreement":
            return AgreementVerifier(large, o.margin, o.word_margin)
        return LLMJudge(large, o.threshold, o.score_mode)

    def verifier_for(self, ctx: StepContext) -> StepVerifier:
        """One run's verifier: the given one, seen over the run's large model; else the settings' one."""
        from thinkahead.verifiers.agreement import AgreementVerifier

        given = self.verifier
        if given is None:
            return self.make_verifier(ctx.large)
        model = getattr(given, "model", None)
        if model is None or model is ctx.large:
            return given
        if model is getattr(ctx.large, "inner", None):  # the run's metered view of the verifier's model
            bound = copy.copy(given)
            bound.model = ctx.large  # type: ignore[attr-defined]
            return bound
        if isinstance(given, (LLMJudge, AgreementVerifier)):  # a built-in judge over another model
            return self.make_verifier(ctx.large)
        return given

    def start(self, ctx: StepContext) -> SpecReasonRun:
        return SpecReasonRun(self.options, self.verifier_for(ctx), self.router)


class SpecReasonRun:
    """One run of `SpecReason`: its judge, its router and its lookahead guess."""

    __slots__ = ("options", "verifier", "router", "_ahead", "_probed")

    def __init__(self, options: SpecReasonOptions, verifier: StepVerifier, router: Any = None) -> None:
        self.options = options
        self.verifier = verifier
        self.router = router  # shared and stateless (a pure function of the step's features)
        self._ahead: tuple[str, asyncio.Task[Written]] | None = None  # (reasoning it continues, draft task)
        self._probed = False

    @property
    def _gated(self) -> bool:
        """Whether the confidence gate reads the drafts' token log-probabilities (asked of the small model)."""
        return self.options.gate_logprob is not None

    async def next_step(self, ctx: StepContext) -> StepOutcome:
        if not self._probed:
            await self._probe_scores(ctx)
            self._probed = True
        if ctx.index < self.options.first_large_steps:
            return outcome(await write_step(ctx, "large"), "forced")
        t0 = time.perf_counter()
        out = await self._routed(ctx) or await self._drafted(ctx)
        out.time_s = time.perf_counter() - t0
        return out

    async def _probe_scores(self, ctx: StepContext) -> None:
        """Before the run's first step: a model whose scores this run needs and whose server decides whether it
        gives them (`OpenAIModel.probe_scores`, probed once per model) is asked now, and refused by name here
        rather than at its first judge call."""
        from thinkahead.verifiers.agreement import AgreementVerifier

        await probe_scores(self.options, ctx.small, ctx.large, agreement=isinstance(self.verifier, AgreementVerifier))

    async def _routed(self, ctx: StepContext) -> StepOutcome | None:
        """The pre-router's choice: the large model writes the step undrafted ("routed"), or None."""
        if self.router is None:
            return None
        tier, p = self.router.route(await router_features(ctx))
        if tier != "large":
            return None
        await self._drop_lookahead()
        return outcome(await write_step(ctx, "large"), "routed", route_p=p)

    async def _drafted(self, ctx: StepContext) -> StepOutcome:
        """The small model's draft, kept unchecked when it is confident, else checked and kept, repaired,
        corrected or rewritten."""
        o = self.options
        draft, hit = await self._draft(ctx)
        messages = ctx.messages()
        if o.gate_logprob is not None:
            confidence = await own_confidence(ctx.small, messages, draft.completion, draft.step.text)
            if confidence.min_digit_logprob >= o.gate_logprob:  # the small model is sure of every number
                out = outcome(draft, "confident")
                out.lookahead_hit = hit
                return out
        if o.lookahead and not (draft.step.ends_thinking or draft.step.kind in ("final", "empty")):
            # guess that the draft passes: draft the following step while the judge works
            guess = with_reasoning(ctx, ctx.reasoning + draft.step.text)
            self._ahead = (ctx.reasoning + draft.step.text,
                           asyncio.create_task(write_step(ctx, "small", guess, logprobs=self._gated)))
        verdict = await self.verifier.judge(messages, draft.step.text)
        keep = verdict.details.get("keep_chars", 0)
        if verdict.accept:
            out = outcome(draft, "accepted", score=verdict.score, judge_calls=1)
        else:
            await self._drop_lookahead()
            if o.repair == "token" and verdict.correction:
                out = await self._correct(ctx, draft, verdict)
            elif keep > 0:
                out = await self._repair(ctx, draft, draft.step.text[:keep], verdict.score)
            else:
                rewrite = await write_step(ctx, "large")
                out = discard(outcome(rewrite, "rejected", score=verdict.score, judge_calls=1), draft)
        out.lookahead_hit = hit
        return out

    async def close(self) -> None:
        await self._drop_lookahead()

    async def _repair(self, ctx: StepContext, draft: Written, kept: str, score: float) -> StepOutcome:
        """The large model finishes the step from the kept start of the draft."""
        rest = await write_step(ctx, "large", with_reasoning(ctx, ctx.reasoning + kept))
        out = discard(outcome(rest, "repaired", score=score, judge_calls=1), draft)
        out.text = kept + out.text
        out.discarded = draft.step.text[len(kept):]  # only the part the large model replaced
        return out

    async def _correct(self, ctx: StepContext, draft: Written, verdict: Verdict) -> StepOutcome:
        """Token repair: the large model's own token replaces the first failing one, the small model
        drafts the rest of the step from there, and the large model checks again; after
        `max_corrections` fixes the large model writes what is left of the step."""
        text, last, tokens, checks, score = "", draft, {"small": draft.tokens, "large": 0}, 1, verdict.score
        discarded = []
        for fixes in range(self.options.max_corrections + 1):
            keep = verdict.details.get("keep_chars", 0)
            discarded.append(last.step.text[keep:])
            text += last.step.text[:keep]
            if fixes == self.options.max_corrections or not verdict.correction:  # the large model finishes the step
                last = await write_step(ctx, "large", with_reasoning(ctx, ctx.reasoning + text))
                tokens["large"] += last.tokens
                break
            text += verdict.correction
            tokens["large"] += 1  # the corrected token, read off the verify pass
            if closes_step(text, ctx.segment):  # the large model's token ended the step
                step = cut_step(text, ctx.segment)
                out = _corrected(step.text, last, tokens, checks, score, discarded)
                out.kind, out.ends_response = step.kind, step.ends_thinking
                return out
            last = await write_step(ctx, "small", with_reasoning(ctx, ctx.reasoning + text))
            tokens["small"] += last.tokens
            verdict = await self.verifier.judge(with_reasoning(ctx, ctx.reasoning + text), last.step.text)
            checks += verdict.judge_calls
            score = min(score, verdict.score)
            if verdict.accept:
                break
        return _corrected(text + last.step.text, last, tokens, checks, score, discarded)

    async def _draft(self, ctx: StepContext) -> tuple[Written, bool]:
        """The small model's draft, and whether it is the lookahead guess (it continues exactly this reasoning)."""
        if self._ahead is not None:
            reasoning, task = self._ahead
            self._ahead = None
            if reasoning == ctx.reasoning:
                return await task, True
            await cancel(task)
        return await write_step(ctx, "small", logprobs=self._gated), False

    async def _drop_lookahead(self) -> None:
        if self._ahead is not None:
            _, task = self._ahead
            self._ahead = None
            await cancel(task)


def _corrected(text: str, last: Written, tokens: dict[str, int], checks: int, score: float,
               discarded: list[str]) -> StepOutcome:
    out = outcome(last, "corrected", score=score, judge_calls=checks)
    out.text, out.tokens = text, tokens  # the author is whoever wrote the last piece
    out.discarded = "".join(discarded)
    return out
