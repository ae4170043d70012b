"""Policies around a router: `arbitrage` routes each step before drafting it (Arbitrage); `collect`
writes both models' steps as router training pairs.

Neither keeps state between steps: the router is a pure function of the step's features, and a
`collect` run builds its judge over its own large model at `start`. Pairs from concurrent runs (or
processes) may go to one file: each pair is one whole-line append (`append_pairs`).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from thinkahead.step_spec.base import (
    Policy,
    PolicyOptions,
    ScoreMode,
    discard,
    outcome,
    threshold_field,
    write_step,
)
from thinkahead.step_spec.state import StepContext, StepOutcome
from thinkahead.verifiers.judge import LLMJudge
from thinkahead.verifiers.router_labels import agreement_label

try:  # whole-line appends across processes; within one process the lock below suffices
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

ROUTER_TOP_K = 20  # next-token candidates the router's entropy feature is computed over
DEFAULT_ROUTER = "trained"  # shipped: trained on the packaged pair's step pairs (verifiers/routers/)


async def router_features(ctx: StepContext, top_k: int = ROUTER_TOP_K):
    """What an Arbitrage router sees before the step is drafted (one small-model forward)."""
    from thinkahead.verifiers.router_features import RouterFeatures, entropy_from_logprobs, opens_with_reflection

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


class ArbitrageOptions(PolicyOptions):
    """arbitrage's settings."""

    router: str = Field(default=DEFAULT_ROUTER, description="'trained' (shipped, for the packaged "
                        "models), 'heuristic', or the path of a router JSON from `thinkahead router train`")


class Arbitrage(Policy):
    """A router decides before drafting whether the large model writes this step.

    `router`: a name or path (see `load_router`), or a router object (`route(features) -> (tier, p)`).
    """

    name = "arbitrage"
    Options = ArbitrageOptions

    def __init__(self, router: Any = None, top_k: int = ROUTER_TOP_K, **options: Any) -> None:
        from thinkahead.verifiers.router import load_router

        if router is None or isinstance(router, (str, os.PathLike)):
            super().__init__(**options, **({} if router is None else {"router": os.fspath(router)}))
            self.router = load_router(self.options.router)
        else:
            super().__init__(**options)
            self.router = router
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"arbitrage top_k must be an int >= 1, got {top_k!r}")
        self.top_k = top_k

    async def decide(self, ctx: StepContext) -> StepOutcome:
        t0 = time.perf_counter()
        tier, p = self.router.route(await router_features(ctx, self.top_k))
        out = outcome(await write_step(ctx, tier), "routed", route_p=p)
        out.time_s = time.perf_counter() - t0
        return out


class CollectOptions(PolicyOptions):
    """collect's settings."""

    pairs_path: Path = Field(description="JSONL file the step pairs are appended to")
    problem_id: str = ""
    threshold: float = threshold_field()
    score_mode: ScoreMode = "expected"


class CollectPairs(Policy):
    """Router training data: both models write each step, the judge scores both, a pair is saved.

    The better-scored step is kept (the small one on ties), so the reasoning stays on track; each
    pair goes to `pairs_path` (JSONL, one whole-line append per pair) with the features the router will see.
    """

    name = "collect"
    Options = CollectOptions
    options: CollectOptions

    def __init__(self, pairs_path: str | os.PathLike[str], **options: Any) -> None:
        super().__init__(pairs_path=pairs_path, **options)

    def start(self, ctx: StepContext) -> CollectRun:
        return CollectRun(self.options, LLMJudge(ctx.large, self.options.threshold, self.options.score_mode))


@dataclass(slots=True)
class CollectRun:
    """One run of `collect`: its judge, over the run's large model."""

    options: CollectOptions
    judge: LLMJudge

    async def next_step(self, ctx: StepContext) -> StepOutcome:
        from thinkahead.verifiers.router_pairs import PairedStep

        t0 = time.perf_counter()
        features = await router_features(ctx)
        small, large = await write_step(ctx, "small"), await write_step(ctx, "large")
        messages = ctx.messages()
        small_v, large_v = await self.judge.judge(messages, small.step.text), await self.judge.judge(messages, large.step.text)
        labelled = await agreement_label(ctx.large, messages, small.step.text)
        pair = PairedStep(
            problem_id=self.options.problem_id, step_index=ctx.index, features=features,
            small_text=small.step.text, large_text=large.step.text,
            small_score=small_v.score, large_score=large_v.score, **(labelled[0] if labelled else {}),
        )
        append_pairs(self.options.pairs_path, [pair])
        keep, drop, score = (small, large, small_v.score) if pair.small_kept else (large, small, large_v.score)
        checks = 2 + (0 if labelled is None else labelled[1].judge_calls)
        out = discard(outcome(keep, "collected", score=score, judge_calls=checks), drop)
        out.time_s = time.perf_counter() - t0
        return out

    async def close(self) -> None:
        return None


_append_lock = threading.Lock()


def append_pairs(path: str | os.PathLike[str], pairs: Iterable[Any]) -> int:
    """Append `PairedStep`s to a JSONL file, each line in one write, so that concurrent writers
    (runs, threads, processes) never interleave or tear lines; returns how many."""
    from thinkahead.verifiers.router_pairs import PairedStep

    lines = []
    for pair in pairs:
        if not isinstance(pair, PairedStep):
            raise ValueError(f"expected PairedStep, got {type(pair).__name__}")
        lines.append((json.dumps(pair.to_json(), ensure_ascii=False) + "\n").encode("utf-8"))
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _append_lock:
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            for line in lines:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
        finally:
            os.close(fd)  # releases the flock
    return len(lines)
