"""`thinkahead trace`: one run's steps from a result store (read-only)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from thinkahead.cli.options import InputError
from thinkahead.orchestrator.summary import fmt


@click.command()
@click.argument("results_path", metavar="OUT.jsonl", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--id", "run_id", default=None, help="The run to show (default: list the runs).")
@click.option("--full", is_flag=True, help="Print whole step texts, not one-line previews.")
@click.option("--json", "as_json", is_flag=True, help="Print the run's record as JSON.")
def trace(results_path, run_id, full, as_json) -> None:
    """Show one run's steps: who wrote each, scores, tokens and time."""
    from thinkahead.orchestrator.store import ResultStore

    store = ResultStore(results_path)
    try:
        runs = store.latest()
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    if store.torn_bytes:
        click.echo(f"{results_path}: skipped an unterminated last line ({store.torn_bytes} bytes; a write cut short)",
                   err=True)
    if run_id is None:
        for r in runs.values():
            click.echo(f"{r.id}\t{r.status}\t{r.answer!r}")
        return
    if run_id not in runs:
        known = ", ".join(list(runs)[:10]) + (" ..." if len(runs) > 10 else "")
        raise click.ClickException(f"no run {run_id!r} in {results_path}; runs: {known}")
    r = runs[run_id]
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=1, ensure_ascii=False))
        return
    click.echo(f"run {r.id}  workflow {r.workflow}  status {r.status}  answer {r.answer!r}")
    if r.error:
        click.echo(f"error: {r.error}")
    if "correct" in r.meta:
        click.echo(f"reference {r.meta.get('reference')!r}  correct {r.meta['correct']}")
    cost = r.cost
    click.echo(f"cost: tokens {cost.get('tokens')}  model calls {cost.get('model_calls')}  "
               f"judge calls {cost.get('judge_calls')}  tok/verify {fmt(cost.get('accept_length'))}  "
               f"{cost.get('wall_s', 0):.2f}s")
    spec = cost.get("spec") or {}
    if spec.get("spec_num_proposed_drafts"):
        proposed, by_model = spec["spec_num_proposed_drafts"], spec.get("model_drafts", 0)
        by_head = spec.get("head_drafts", 0)
        head = (f", in rounds the draft head drafted {by_head} ({spec.get('head_correct_drafts', 0)} accepted)"
                if by_head else "")
        click.echo(f"drafts: {proposed} tokens proposed, {spec['spec_num_correct_drafts']} accepted; model-free "
                   f"{proposed - by_model - by_head}, by the small model {by_model} "
                   f"({spec.get('model_correct_drafts', 0)} accepted){head}")
    for e in r.trace:
        d = e["data"]
        if e["kind"] == "node_end":
            extra = f"  {d['time_s']:.2f}s" if "time_s" in d else ""
            click.echo(f"[{e['t']:8.2f}s] node {e['node']}: {d.get('status')}{extra}")
        elif e["kind"] == "step":
            score = "" if d.get("score") is None else f" score {d['score']:g}"
            tokens = sum(d.get("tokens", {}).values())
            text = d.get("text", "").strip()
            text = text if full else (text.replace("\n", " ")[:100] + ("..." if len(text) > 100 else ""))
            click.echo(f"[{e['t']:8.2f}s]   step {d['index']:>2} {d['author']:<5} {d['verdict']:<10}{score} "
                       f"{tokens} tok {d.get('time_s', 0):.2f}s | {text}")
        elif e["kind"] == "error":
            click.echo(f"[{e['t']:8.2f}s] {d.get('status')}: {d.get('error')}")
