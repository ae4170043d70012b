"""`thinkahead bench`: step policies side by side on a task file or a named suite, with a report."""

from __future__ import annotations

from pathlib import Path

import click

from thinkahead.cli.options import POLICIES, build_settings, grader, orchestrator_options, output_errors, quiet_loading
from thinkahead.cli.progress import summary_table
from thinkahead.config import default
from thinkahead.workflows import WORKFLOWS
from thinkahead.verifiers.grading import CHECKER_NAMES


@click.command()
@click.argument("input_path", metavar="[INPUT.jsonl]", required=False,
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--suite", default=None, help="A named suite instead of INPUT.jsonl: gsm8k-50, math500-30, humaneval-20, "
              "agentic-refine, agentic-codefix, agentic-pipeline, tools-bfcl-20, countdown-20, game24-20.")
@click.option("-w", "--workflow", default=None,
              help=f"Workflow: {', '.join(WORKFLOWS)} [{default('workflow')}, or the suite's].")
@click.option("--policies", default="large,small,specreason", show_default=True, help="Comma-separated step policies.")
@click.option("--thresholds", default="", help="specreason thresholds to sweep, e.g. 5,7,9 (default: the config's).")
@click.option("--judges", default="", help="specreason verifiers to compare, e.g. llm,agreement (default: --judge).")
@click.option("--token-spec", "token_spec", type=click.Choice(["on", "off", "both"]), default="on", show_default=True,
              help="Token-level speculation in every configuration, none, or each configuration both ways.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for the run stores, report.md, report.json and the plots (resumable).")
@click.option("--limit", type=int, default=None, help="Only the first N tasks.")
@click.option("--checker", type=click.Choice(CHECKER_NAMES), default="math", show_default=True,
              help="Grading of INPUT.jsonl answers (a suite brings its own checker).")
@orchestrator_options
def bench(input_path, suite, workflow, policies, thresholds, judges, token_spec, out_dir, limit, checker, **options) -> None:
    """Run step policies side by side on INPUT.jsonl or a --suite; write a markdown report and plots."""
    from thinkahead.evals.bench import matrix, run_bench

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if not names or unknown:
        raise click.UsageError(f"--policies: unknown {unknown or '(none given)'}; choose from {', '.join(POLICIES)}")
    if (input_path is None) == (suite is None):
        raise click.UsageError("give either INPUT.jsonl or --suite NAME")
    try:
        sweep = [float(t) for t in thresholds.split(",") if t.strip()]
        tasks, annotate, graph, title, suite_workflow = _bench_tasks(input_path, suite, limit, checker, workflow)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    settings = build_settings(**options, workflow=workflow or suite_workflow, reads=names)
    try:
        configs = matrix(names, sweep, token_spec, tuple(j.strip() for j in judges.split(",") if j.strip())
                         or (settings["policy"]["judge"],), settings["policy"]["repair"])
    except ValueError as exc:
        raise click.UsageError(f"--judges: {exc}") from exc

    def progress(config, result) -> None:
        click.echo(f"{config.label}: {result.id} {result.status} answer={result.answer!r}"
                   + (f" correct={result.meta['correct']}" if "correct" in result.meta else ""), err=True)

    quiet_loading()
    with output_errors(out_dir):
        report = run_bench(tasks, configs, settings, out_dir, annotate=annotate, on_result=progress, graph=graph,
                           title=title)
    click.echo(summary_table([(c.label, s) for c, s in report.rows]))
    plots = [str(p) for p in (report.plot, report.warmth_plot) if p]
    click.echo(f"report: {report.markdown}" + (f", plots: {', '.join(plots)}" if plots else ""))


def _bench_tasks(input_path, suite_name, limit, checker, workflow):
    """(tasks, annotate, per-task graph builder or None, title, the suite's workflow) for `bench`."""
    if suite_name is None:
        from thinkahead.evals.tasks import read_tasks

        parsed = read_tasks(input_path, limit=limit)
        for bad in parsed.bad:
            click.echo(f"{input_path}:{bad.line}: {bad.reason} (skipped)", err=True)
        if not parsed.tasks:
            raise ValueError(f"no valid tasks in {input_path}")
        return parsed.tasks, grader(checker), None, None, None
    from thinkahead.evals.suites import load_suite
    from thinkahead.workflows import build_workflow

    suite = load_suite(suite_name, limit=limit)
    by_id = {t.id: t for t in suite.tasks}

    def annotate(result) -> None:
        task = by_id[result.id]
        result.meta["correct"] = suite.grade(task, result.answer, result.outputs)

    def graph(run_id: str):
        if workflow is not None and workflow != suite.workflow:  # the suite's options belong to its own workflow
            return build_workflow(workflow)
        return build_workflow(suite.workflow, **suite.workflow_options(by_id[run_id]))

    return suite.tasks, annotate, graph, f"{suite.name} ({suite.spec.description})", suite.workflow
