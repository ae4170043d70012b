"""`thinkahead run`: a batch of tasks through a workflow; results go to a resumable store."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from thinkahead.cli.options import (
    EXIT_RUNS_FAILED,
    POLICIES,
    InputError,
    build_settings,
    grader,
    load_models,
    open_store,
    orchestrator_options,
)
from thinkahead.cli.progress import Progress, summary_table
from thinkahead.config import default
from thinkahead.workflows import WORKFLOWS
from thinkahead.verifiers.grading import CHECKER_NAMES


@click.command()
@click.argument("input_path", metavar="INPUT.jsonl", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-w", "--workflow", default=None,
              help=f"Workflow: {', '.join(WORKFLOWS)} (codefix needs a suite's tests) [{default('workflow')}].")
@click.option("--policy", type=click.Choice(POLICIES), default=None, help=f"Step policy [{default('policy.name')}].")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Result store (JSONL); runs already in it are skipped (resume).")
@click.option("--limit", type=int, default=None, help="Only the first N tasks.")
@click.option("--concurrency", type=int, default=None, help=f"Runs in flight at once [{default('concurrency')}].")
@click.option("--checker", type=click.Choice([*CHECKER_NAMES, "none"]), default="math", show_default=True,
              help="How answers are graded against a reference answer.")
@click.option("--on-bad-line", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
              help="Bad input lines: report and skip them, or stop before running anything.")
@orchestrator_options
def run(input_path, workflow, policy, out, limit, concurrency, checker, on_bad_line, **options) -> None:
    """Run every task of INPUT.jsonl through a workflow; results go to --out as they finish.

    Each line: {"id": ..., "question": ..., "answer": optional reference}.
    """
    from thinkahead.evals.tasks import read_tasks
    from thinkahead.orchestrator.store import DONE_STATUSES, ResultStore
    from thinkahead.orchestrator.summary import summarize
    from thinkahead.sdk import Orchestrator

    if limit is not None and limit < 1:
        raise click.UsageError("--limit must be at least 1")
    try:
        tasks = read_tasks(input_path, limit=limit)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    for bad in tasks.bad:
        click.echo(f"{input_path}:{bad.line}: {bad.reason}" + (" (skipped)" if on_bad_line == "skip" else ""), err=True)
    if tasks.bad and on_bad_line == "fail":
        raise InputError(f"{len(tasks.bad)} bad input line(s) in {input_path}; nothing was run")
    if not tasks.tasks:
        raise InputError(f"no valid tasks in {input_path}")
    settings = build_settings(**options, workflow=workflow, policy=policy, concurrency=concurrency)
    orch = Orchestrator(config=settings)
    store = open_store(out, orch.config.store_identity(), (input_path,))
    done = store.done_ids()  # from the one read `open_store` made; the runtime skips the same ids
    todo = [t for t in tasks.tasks if t.id not in done]
    if done:
        click.echo(f"resuming: {len(tasks.tasks) - len(todo)} of {len(tasks.tasks)} tasks already in {out}", err=True)
    if not todo:  # nothing to run: no model is loaded
        store.close()
        click.echo(f"nothing to run: every task is in {out}", err=True)
    else:
        load_models(orch)
        progress = Progress(len(todo))
        items = [(t.id, t.inputs, {"reference": t.reference} if t.reference is not None else {}) for t in todo]
        try:
            asyncio.run(orch.map(items, store=store, on_result=progress.on_result, listeners=[progress.on_event],
                                 annotate=grader(checker)))
        except KeyboardInterrupt:
            progress.close()
            raise click.ClickException(f"interrupted; finished runs are in {out}, run the same command to resume")
        finally:
            store.close()
        progress.close()
    ids = {t.id for t in tasks.tasks}
    results = [r for rid, r in ResultStore(out).latest().items() if rid in ids]
    click.echo(summary_table([(f"{orch.config.workflow}/{orch.config.policy.name}", summarize(results))]))
    click.echo(f"results: {out}")
    failed = [r.id for r in results if r.status not in DONE_STATUSES]
    if failed:
        click.echo(f"{len(failed)} run(s) failed ({', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''}); "
                   f"`thinkahead trace {out} --id ID` shows why, and the same command runs them again", err=True)
        sys.exit(EXIT_RUNS_FAILED)
