"""The records a step loop passes around: the context a policy sees and the outcome it returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from thinkahead.models.base import TIERS, LanguageModel, Tier  # Tier: who writes a step
from thinkahead.step_spec.segment import SegmentConfig
from thinkahead.token_spec.stats import SpecStats

__all__ = ["TIERS", "StepContext", "StepOutcome", "Tier", "check_tier"]


@dataclass(slots=True)
class StepOutcome:
    """One reasoning step: what it says, who wrote it, why, and what it cost.

    `tokens` counts generated tokens per tier, discarded drafts included; `verdict` is one of
    "baseline" (a one-model policy), "accepted" / "rejected" (judged), "repaired" (judged, the
    draft kept up to the first disagreeing token, the large model wrote the rest), "corrected" (the
    large model put its own token where the draft first failed and the small model drafted on), "forced" (the first steps
    go to the large model), "routed" (a router's choice), "confident" (a draft kept unchecked: the small model
    was sure of every number in it), "reflection" (handed over on a cue),
    "collected" (router training: both wrote, the better one kept), "final" (the forced final answer).
    `lookahead_hit`: the step's draft is the guess the small model wrote while the previous step was judged.
    """

    text: str
    author: str
    verdict: str
    kind: str = "step"
    score: float | None = None
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    time_s: float = 0.0
    judge_calls: int = 0
    discarded: str | None = None  # the draft that was thrown away, if any
    route_p: float | None = None  # router's probability that the large model is better
    ends_response: bool = False  # the model ended its answer (end-of-turn token or </think>)
    spec: SpecStats = field(default_factory=SpecStats)  # token-level speculation of the kept generation
    lookahead_hit: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["spec"] = self.spec.spec_dict()
        return out


@dataclass
class StepContext:
    """What a policy sees: the problem, the steps so far, both models and the segmentation."""

    problem: str
    small: LanguageModel
    large: LanguageModel
    segment: SegmentConfig = field(default_factory=SegmentConfig)
    system: str | None = None
    steps: list[StepOutcome] = field(default_factory=list)
    speculative: bool = True  # token-level speculation inside every generation
    temperature: float = 0.0
    seed: int | None = None
    session_id: str | None = None  # each step's prompt extends the last: one agent session per chain
    token_room: int | None = None  # tokens the run's budget has left (None: unbounded); a step writes at most these
    # per-run steppers of policies stepped by hand (`policy.next_step(ctx)` without `start`), by policy
    policy_runs: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def index(self) -> int:
        """Index of the step about to be written."""
        return len(self.steps)

    @property
    def reasoning(self) -> str:
        return "".join(s.text for s in self.steps)

    def model(self, tier: str) -> LanguageModel:
        check_tier(tier)
        return self.small if tier == "small" else self.large

    def messages(self) -> list[dict[str, str]]:
        """The conversation so far; the reasoning is a partial assistant message to continue."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        out.append({"role": "user", "content": self.problem})
        if self.steps:
            out.append({"role": "assistant", "content": self.reasoning})
        return out


def check_tier(tier: object) -> Tier:
    """`tier` if it names a tier; ValueError otherwise."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
    return tier  # type: ignore[return-value]
