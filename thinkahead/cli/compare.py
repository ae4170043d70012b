"""`thinkahead compare`: one report over run stores that earlier `bench` or `run` commands wrote."""

from __future__ import annotations

from pathlib import Path

import click

from thinkahead.cli.options import output_errors


@click.command()
@click.argument("columns", metavar="LABEL=STORE.jsonl...", nargs=-1, required=True)
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for report.md, report.json and report.png.")
@click.option("--tasks", "tasks_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Only the runs whose ids this task JSONL lists (every store must hold them all) "
                   "[the ids all stores share].")
@click.option("--title", default=None, help="Report title.")
def compare(columns: tuple[str, ...], out_dir: Path, tasks_path: Path | None, title: str | None) -> None:
    """Put configurations run separately (other flags, other days) side by side over the same tasks."""
    from thinkahead.evals.tasks import read_tasks
    from thinkahead.evals.compare import StoredColumn, compare_stores

    parsed = []
    for column in columns:
        label, sep, path = column.partition("=")
        if not sep or not label.strip() or not path.strip():
            raise click.UsageError(f"bad column {column!r}: expected LABEL=STORE.jsonl")
        parsed.append(StoredColumn(label.strip(), Path(path.strip())))
    ids = None
    if tasks_path is not None:
        try:
            ids = {t.id for t in read_tasks(tasks_path).tasks}
        except ValueError as exc:
            raise click.UsageError(f"--tasks: {exc}") from exc
    try:
        with output_errors(out_dir):  # the folder cannot be made or written, a store is corrupt: one line, exit 2
            report = compare_stores(parsed, out_dir, ids, title)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(report.markdown.read_text() if report.markdown else "")
