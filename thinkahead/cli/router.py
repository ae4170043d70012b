"""`thinkahead router train`: fit an Arbitrage router on collected step pairs."""

from __future__ import annotations

import json
from pathlib import Path

import click

from thinkahead.verifiers.router_pairs import LABEL_RULES


@click.group()
def router() -> None:
    """Arbitrage step routers."""


@router.command("train")
@click.argument("pairs", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Router JSON to write.")
@click.option("--label", "rule", type=click.Choice(LABEL_RULES), default="judge", show_default=True,
              help="judge: large score - small score > margin (the paper's rule); agreement: the large model's "
                   "token agreement check failed the small step.")
@click.option("--margin", type=float, default=1.0, show_default=True, help="Judge label: large score - small score > margin.")
@click.option("--features", default=None, help="Comma-separated router features (default: all; pre-draft ones for agreement).")
@click.option("--holdout-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="Hold out every k-th problem (sorted ids) to pick the threshold and report ROC AUC; 0: no split.")
@click.option("--threshold", type=float, default=None,
              help="Route to large at this probability [default: best on the held-out problems, else 0.5].")
def router_train(pairs: Path, out: Path, rule: str, margin: float, features: str | None, holdout_every: int,
                 threshold: float | None) -> None:
    """Fit a logistic router on PAIRS (from `thinkahead reason --policy collect`)."""
    from thinkahead.verifiers.router_pairs import train_router

    names = None if features is None else tuple(f.strip() for f in features.split(",") if f.strip())
    if threshold is None and holdout_every == 0:
        threshold = 0.5
    try:
        report = train_router(pairs, out, margin=margin, threshold=threshold, rule=rule, features=names,
                              holdout_every=holdout_every)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(report, default=str))
