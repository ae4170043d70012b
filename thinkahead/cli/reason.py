"""`thinkahead reason` (step-level speculation on one problem) and `thinkahead router train`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import click

from thinkahead.cli.options import DRAFTER_HELP, GateLogprob, gate_setting, model_file_errors
from thinkahead.config import default
from thinkahead.models.engine.weights.load import DTYPES
from thinkahead.token_spec.names import DRAFTER_CHOICES
from thinkahead.step_spec.policies import ALL_POLICY_NAMES, JUDGES, REPAIRS, SCORE_MODES, policy_entry

POLICIES = ALL_POLICY_NAMES  # every registered policy, `collect` included

def _shown(option: str, policy: str = "specreason") -> str:
    """A policy option's default as `--help` shows it, in brackets (the registry's options model holds it)."""
    value = policy_entry(policy).options.model_fields[option].default
    return f"[{value:g}]" if isinstance(value, float) else f"[{value}]"


@click.command()
@click.argument("problem")
@click.option("--small", "small_spec", default=default("small.spec"), show_default=True, help="Small (drafting) model spec.")
@click.option("--large", "large_spec", default=default("large.spec"), show_default=True, help="Large (judging) model spec.")
@click.option("--policy", type=click.Choice(POLICIES), default=default("policy.name"), show_default=True)
@click.option("--threshold", type=float, default=None,
              help=f"specreason, collect: accept drafts scoring at least this {_shown('threshold')}.")
@click.option("--score-mode", type=click.Choice(SCORE_MODES), default=None,
              help=f"How the judge's 0-9 score is read {_shown('score_mode')}, collect {_shown('score_mode', 'collect')}.")
@click.option("--judge", type=click.Choice(JUDGES), default=None,
              help="specreason's verifier: the 0-9 judge prompt, or token agreement (a disagreeing digit fails a step) "
                   f"{_shown('judge')}.")
@click.option("--margin", type=float, default=None,
              help=f"agreement: nats a checked token may trail the large model's choice {_shown('margin')}.")
@click.option("--word-margin", type=float, default=None,
              help="agreement: also check tokens without digits, at this many nats [unchecked].")
@click.option("--repair", type=click.Choice(REPAIRS), default=None,
              help="agreement, on a failed check: the large model finishes the step, or fixes one token and the small "
                   f"model goes on {_shown('repair')}.")
@click.option("--first-large", "first_large_steps", type=int, default=None,
              help=f"specreason: the first N steps go to the large model {_shown('first_large_steps')}.")
@click.option("--router", default=None,
              help=f"arbitrage: 'trained', 'heuristic' or a router JSON {_shown('router', 'arbitrage')}.")
@click.option("--pre-router", default=None, help="specreason: a router (as --router) that hands steps to the large "
              "model before they are drafted [none].")
@click.option("--gate-logprob", type=GateLogprob(), default=None, help="specreason: keep a draft unchecked when every "
              f"token with digits has at least this log-probability under the small model; 'off' checks every draft "
              f"{_shown('gate_logprob')}.")
@click.option("--pairs", "pairs_path", type=click.Path(dir_okay=False, path_type=Path), default=None, help="collect: JSONL file to append step pairs to.")
@click.option("--max-steps", type=int, default=default("steps.max_steps"), show_default=True)
@click.option("--max-tokens", type=int, default=default("steps.max_tokens"), show_default=True)
@click.option("--step-tokens", type=int, default=default("segment.max_step_tokens"), show_default=True,
              help="Token cap per step.")
@click.option("--no-token-spec", is_flag=True, help="Turn off token-level speculation (the plain baseline).")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=default("large.dtype"), show_default=True)
@click.option("--drafter", type=click.Choice(DRAFTER_CHOICES), default=default("large.drafter"),
              help=DRAFTER_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def reason(problem, small_spec, large_spec, policy, max_steps, max_tokens, step_tokens, no_token_spec, dtype, drafter,
           as_json, **policy_options) -> None:  # the rest are the policies' options (`policy_entry(name).options`)
    """Reason about PROBLEM step by step: the small model drafts, the large model judges or rewrites."""
    from thinkahead.models.loader import load_pair
    from thinkahead.step_spec.loop import StepBudget, StepLoop
    from thinkahead.step_spec.segment import SegmentConfig

    if policy == "collect" and policy_options["pairs_path"] is None:
        raise click.UsageError("--policy collect needs --pairs FILE.jsonl")
    given = {key: value for key, value in policy_options.items() if value is not None}
    if "gate_logprob" in given:
        given["gate_logprob"] = gate_setting(given["gate_logprob"])
    try:
        step_policy = policy_entry(policy).build(given)  # the policy reads the options it has; its defaults the rest
        budget = StepBudget(max_steps=max_steps, max_tokens=max_tokens)
        segment = SegmentConfig(max_step_tokens=step_tokens)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        with model_file_errors():
            small, large = load_pair(small_spec, large_spec, {"dtype": dtype}, {"dtype": dtype, "drafter": drafter})
    except ValueError as exc:  # a spec that does not resolve, a drafter the pair cannot run
        raise click.UsageError(str(exc)) from exc
    try:
        loop = StepLoop(small, large, step_policy, segment, budget, speculative=not no_token_spec)
    except ValueError as exc:  # the policy cannot run on these models (it says which setting to change)
        raise click.UsageError(str(exc)) from exc
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
