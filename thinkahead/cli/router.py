"""`thinkahead router train`: fit an Arbitrage router on collected step pairs."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.group()
def router() -> None:
    """Arbitrage step routers."""


@router.command("train")
@click.argument("pairs", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Router JSON to write.")
@click.option("--margin", type=float, default=1.0, show_default=True, help="Label: large score - small score > margin.")
@click.option("--threshold", type=float, default=0.5, show_default=True, help="Route to large at this probability.")
def router_train(pairs: Path, out: Path, margin: float, threshold: float) -> None:
    """Fit a logistic router on PAIRS (from `thinkahead reason --policy collect`)."""
    from thinkahead.verifiers.router_pairs import train_router

    try:
        report = train_router(pairs, out, margin=margin, threshold=threshold)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(report, default=str))
