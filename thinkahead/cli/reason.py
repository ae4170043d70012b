"""`thinkahead reason` (step-level speculation on one problem) and `thinkahead router train`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

from thinkahead.models.weights import DTYPES
from thinkahead.step_spec.loop import StepBudget
from thinkahead.step_spec.policies import ALL_POLICY_NAMES, DEFAULT_POLICY

POLICIES = ALL_POLICY_NAMES  # every registered policy, `collect` included


@click.command()
@click.argument("problem")
@click.option("--small", "small_spec", default="qwen2.5-coder-0.5b", show_default=True, help="Small (drafting) model spec.")
@click.option("--large", "large_spec", default="qwen2.5-coder-1.5b", show_default=True, help="Large (judging) model spec.")
@click.option("--policy", type=click.Choice(POLICIES), default=DEFAULT_POLICY, show_default=True)
@click.option("--threshold", type=float, default=7.0, show_default=True, help="specreason: accept drafts scoring at least this.")
@click.option("--score-mode", type=click.Choice(["greedy", "expected"]), default="greedy", show_default=True)
@click.option("--judge", type=click.Choice(["llm", "agreement"]), default="llm", show_default=True,
              help="specreason's verifier: the 0-9 judge prompt, or token agreement (a disagreeing digit fails a step).")
@click.option("--margin", type=float, default=1.0, show_default=True, help="agreement: nats a checked token may trail the large model's choice.")
@click.option("--word-margin", type=float, default=None,
              help="agreement: also check tokens without digits, at this many nats [unchecked].")
@click.option("--repair", type=click.Choice(["step", "token"]), default="step", show_default=True,
              help="agreement, on a failed check: the large model finishes the step, or fixes one token and the small model goes on.")
@click.option("--first-large", type=int, default=0, show_default=True, help="specreason: the first N steps go to the large model.")
@click.option("--router", default="heuristic", show_default=True, help="arbitrage: 'heuristic' or a trained router JSON.")
@click.option("--pairs", type=click.Path(dir_okay=False, path_type=Path), default=None, help="collect: JSONL file to append step pairs to.")
@click.option("--max-steps", type=int, default=StepBudget.model_fields["max_steps"].default, show_default=True)
@click.option("--max-tokens", type=int, default=StepBudget.model_fields["max_tokens"].default, show_default=True)
@click.option("--step-tokens", type=int, default=128, show_default=True, help="Token cap per step.")
@click.option("--no-token-spec", is_flag=True, help="Turn off token-level speculation (the plain baseline).")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="int8", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def reason(problem, small_spec, large_spec, policy, threshold, score_mode, judge, margin, word_margin, repair, first_large, router, pairs,
           max_steps, max_tokens, step_tokens, no_token_spec, dtype, as_json) -> None:
    """Reason about PROBLEM step by step: the small model drafts, the large model judges or rewrites."""
    from thinkahead.models import LocalModel
    from thinkahead.step_spec.loop import StepLoop
    from thinkahead.step_spec.policies import CollectPairs, make_policy
    from thinkahead.step_spec.segment import SegmentConfig

    if policy == "collect" and pairs is None:
        raise click.UsageError("--policy collect needs --pairs FILE.jsonl")
    try:
        if policy == "specreason":
            step_policy = make_policy(policy, threshold=threshold, score_mode=score_mode, judge=judge, margin=margin,
                                      word_margin=word_margin, repair=repair, first_large_steps=first_large)
        elif policy == "arbitrage":
            step_policy = make_policy(policy, router=router)
        elif policy == "collect":
            step_policy = CollectPairs(pairs)
        else:
            step_policy = make_policy(policy)
        budget = StepBudget(max_steps=max_steps, max_tokens=max_tokens)
        segment = SegmentConfig(max_step_tokens=step_tokens)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    small, large = LocalModel(small_spec, dtype=dtype), LocalModel(large_spec, dtype=dtype)
    loop = StepLoop(small, large, step_policy, segment, budget, speculative=not no_token_spec)
    result = asyncio.run(loop.run(problem))
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=1))
        return
    for i, s in enumerate(result.steps):
        score = f" score {s.score:.1f}" if s.score is not None else ""
        click.echo(f"--- step {i}: {s.author} ({s.verdict}{score}), {sum(s.tokens.values())} tokens, {s.time_s:.1f}s")
        click.echo(s.text.rstrip())
    click.echo(f"=== stop: {result.stop_reason}; tokens {result.tokens}; small share {result.small_share:.2f}; "
               f"judge calls {result.judge_calls}; {result.time_s:.1f}s")
