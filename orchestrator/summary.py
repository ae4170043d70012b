"""Batch summaries: the numbers a user wants after a batch (accuracy, cost, speculation).

Computed from `RunResult`s alone (live during a batch, or later from a result store), so the CLI's
summary table, `bench` reports and the progress line all agree.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from thinkahead.orchestrator.trace import RunResult


@dataclass
class BatchSummary:
    """Aggregates over a batch of runs; rates are None when nothing was there to measure."""

    runs: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    checked: int = 0  # runs with a reference answer
    correct: int = 0
    wall_s: float = 0.0  # summed run wall time
    tokens: dict[str, int] = field(default_factory=dict)
    model_calls: int = 0
    judge_calls: int = 0
    steps: int = 0
    small_steps: int = 0
    judged: int = 0  # steps the judge scored (specreason)
    accepted: int = 0  # judged drafts kept
    spec_verify: float = 0.0
    spec_tokens: float = 0.0  # tokens the speculating calls produced (accept length x verify steps, per run)

    def add(self, result: RunResult) -> None:
        self.runs += 1
        self.statuses[result.status] = self.statuses.get(result.status, 0) + 1
        if "correct" in result.meta:
            self.checked += 1
            self.correct += bool(result.meta["correct"])
        cost = result.cost or {}
        self.wall_s += cost.get("wall_s", 0.0)
        for tier, n in cost.get("tokens", {}).items():
            self.tokens[tier] = self.tokens.get(tier, 0) + n
        self.model_calls += cost.get("model_calls", 0)
        self.judge_calls += cost.get("judge_calls", 0)
        spec = cost.get("spec", {})
        verify = spec.get("spec_verify_ct", 0)
        self.spec_verify += verify
        if cost.get("accept_length") is not None:  # SpecStats.spec_accept_length, the one definition
            self.spec_tokens += cost["accept_length"] * verify
        else:  # a record without it: accepted drafts plus the bonus token of each verify step
            self.spec_tokens += spec.get("spec_num_correct_drafts", 0) + verify
        for event in result.trace:
            if event["kind"] == "step":
                self.add_step(event["data"])

    def add_step(self, data: dict[str, Any]) -> None:
        if data.get("verdict") == "final":
            return
        self.steps += 1
        self.small_steps += data.get("author") == "small"
        if data.get("verdict") in ("accepted", "rejected", "repaired"):
            self.judged += 1
            self.accepted += data["verdict"] == "accepted"

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.checked if self.checked else None

    @property
    def accuracy_ci(self) -> tuple[float, float] | None:
        """95% Wilson interval of the accuracy."""
        if not self.checked:
            return None
        return wilson_interval(self.correct, self.checked)

    @property
    def small_share(self) -> float | None:
        return self.small_steps / self.steps if self.steps else None

    @property
    def accept_rate(self) -> float | None:
        """Share of judged small-model drafts that were kept."""
        return self.accepted / self.judged if self.judged else None

    @property
    def accept_length(self) -> float | None:
        """Token-level: tokens per verify step over every run (`SpecStats.spec_accept_length`, weighted by verify steps)."""
        return self.spec_tokens / self.spec_verify if self.spec_verify else None

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens.values())

    @property
    def ms_per_token(self) -> float | None:
        """Wall time per generated token, all models together."""
        return self.wall_s / self.total_tokens * 1e3 if self.total_tokens else None

    @property
    def mean_wall_s(self) -> float | None:
        return self.wall_s / self.runs if self.runs else None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("accuracy", "accuracy_ci", "small_share", "accept_rate", "accept_length", "total_tokens", "mean_wall_s",
                     "ms_per_token"):
            out[name] = getattr(self, name)
        return out


def summarize(results: Iterable[RunResult]) -> BatchSummary:
    summary = BatchSummary()
    for r in results:
        summary.add(r)
    return summary


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (good at small n and near 0 or 1)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # the interval always holds p itself (rounding put the upper bound at 0.9999... for 6 of 6)
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for a table; "-" for None."""
    return "-" if value is None else f"{value:.{digits}f}"


def fmt_interval(interval: tuple[float, float] | None) -> str:
    """An interval for a table, e.g. 0.33-0.70; "-" for None."""
    return "-" if interval is None else f"{interval[0]:.2f}-{interval[1]:.2f}"
