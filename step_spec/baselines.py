"""Policies that need no judge: one model writes everything (`large`, `small`), or the small model
writes and hands steps that open with a reflection cue to the large model (`reflect`, Speculative
Thinking). None keeps state between steps."""

from __future__ import annotations

from typing import Any

from thinkahead.step_spec.base import Policy, discard, outcome, write_step
from thinkahead.step_spec.state import StepContext, StepOutcome, Tier, check_tier


class SingleModel(Policy):
    """Baseline: one model writes every step; the policy is named after its tier."""

    def __init__(self, tier: Tier, **options: Any) -> None:
        self.tier: Tier = check_tier(tier)
        self.answer_tier: Tier = self.tier  # a forced final answer is this model's too
        self.name = tier
        super().__init__(**options)

    async def decide(self, ctx: StepContext) -> StepOutcome:
        return outcome(await write_step(ctx, self.tier), "baseline")


class Reflect(Policy):
    """The small model writes; steps opening with a reflection cue go to the large model."""

    name = "reflect"

    async def decide(self, ctx: StepContext) -> StepOutcome:
        from thinkahead.verifiers.router_features import opens_with_reflection

        draft = await write_step(ctx, "small")
        if not opens_with_reflection(draft.step.text):
            return outcome(draft, "baseline")
        return discard(outcome(await write_step(ctx, "large"), "reflection"), draft)
