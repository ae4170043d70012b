"""A bench report: the markdown table over columns of run summaries, and the accuracy-vs-time plot."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from thinkahead.orchestrator.summary import BatchSummary, fmt, fmt_interval

log = logging.getLogger(__name__)


class Column(Protocol):
    """A report column: anything with a label (a `BenchConfig`, or a `StoredColumn`)."""

    @property
    def label(self) -> str: ...


def markdown_report(rows: list[tuple[Column, BatchSummary]], settings: dict[str, Any] | None, n_tasks: int,
                    title: str | None = None) -> str:
    """The report table; without `settings` (stored columns) the header names each column's store."""
    if settings is not None:
        about = (f"{n_tasks} tasks, workflow `{settings.get('workflow')}`, small `{settings['small']['spec']}`, "
                 f"large `{settings['large']['spec']}` ({settings['large'].get('dtype')}).")
    else:
        about = f"{n_tasks} tasks; columns read from run stores: " + ", ".join(
            f"{c.label} `{getattr(c, 'path', '?')}`" for c, _ in rows) + "."
    lines = [
        f"# thinkahead bench{': ' + title if title else ''}", "", about, "",
        "| config | runs | ok | accuracy | 95% CI | s/run | ms/token | small tok | large tok | small share | accept rate | judge calls | tok/verify |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, s in rows:
        lines.append(
            f"| {config.label} | {s.runs} | {s.statuses.get('ok', 0)} | {fmt(s.accuracy)} | "
            f"{fmt_interval(s.accuracy_ci)} | {fmt(s.mean_wall_s, 1)} | {fmt(s.ms_per_token, 0)} | {s.tokens.get('small', 0)} | "
            f"{s.tokens.get('large', 0)} | {fmt(s.small_share)} | {fmt(s.accept_rate)} | {s.judge_calls} | {fmt(s.accept_length)} |"
        )
    lines += ["", "s/run: mean wall time per task; ms/token: wall time per generated token (all models); small share: kept steps written by the small model; accept rate: "
              "judged small-model drafts kept; tok/verify: tokens per verify step of token-level speculation.", ""]
    line = tradeoff_line(rows)
    if line is not None:
        lines += ["Against the line from `small` to `large` (what mixing their answers at random buys at each speed): "
                  "accuracy above it, the line's accuracy at the config's s/run subtracted, and whether the config's "
                  "whole 95% interval clears it.", "", "| config | above the line | beyond its interval |", "|---|---|---|"]
        for config, s in rows:
            if config.label in LINE_ENDS or s.accuracy is None or s.mean_wall_s is None:
                continue
            at = line(s.mean_wall_s)
            lines.append(f"| {config.label} | {s.accuracy - at:+.3f} | {'yes' if s.accuracy_ci[0] > at else 'no'} |")
        lines.append("")
    return "\n".join(lines)


LINE_ENDS = ("small", "large")  # the columns whose line a step policy has to beat


def tradeoff_line(rows: list[tuple[Column, BatchSummary]]) -> Any:
    """Accuracy as a function of seconds per task on the line from the `small` column to the `large` one, flat
    beyond them (slower than the slower one, run that one; faster than the faster one, nothing mixes to it);
    None unless both ran at different speeds."""
    ends = {c.label: s for c, s in rows if c.label in LINE_ENDS and s.accuracy is not None and s.mean_wall_s}
    if len(ends) < 2 or ends["small"].mean_wall_s == ends["large"].mean_wall_s:
        return None
    (x0, y0), (x1, y1) = sorted((ends[k].mean_wall_s, ends[k].accuracy) for k in LINE_ENDS)
    return lambda x: y0 + (y1 - y0) * (min(max(x, x0), x1) - x0) / (x1 - x0)


def plot_pareto(rows: list[tuple[Column, BatchSummary]], path: Path) -> Path | None:
    """Accuracy (with 95% intervals) against seconds per task; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'thinkahead[bench]'); no plot written")
        return None
    fig, ax = plt.subplots(figsize=(8.4, 4.4))
    markers = "osD^vP*Xhp<>"  # with the colour cycle, no two of 12+ points look alike
    for i, (config, s) in enumerate(rows):
        if s.accuracy is None or s.mean_wall_s is None:
            continue
        lo, hi = s.accuracy_ci
        ax.errorbar(s.mean_wall_s, s.accuracy, yerr=[[s.accuracy - lo], [hi - s.accuracy]], fmt=markers[i % len(markers)],
                    capsize=3, label=config.label)
    line = tradeoff_line(rows)
    if line is not None:
        xs = [s.mean_wall_s for _, s in rows if s.mean_wall_s is not None]
        ends = [s.mean_wall_s for c, s in rows if c.label in LINE_ENDS]
        at = sorted({min(xs), max(xs), *ends})
        ax.plot(at, [line(x) for x in at], linestyle="--", color="grey", linewidth=1, label="small-large line")
    if ax.get_legend_handles_labels()[0]:  # a legend beside the plot: labels of nearby points never overlap
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return finish_plot(fig, ax, path, xlabel="seconds per task", ylabel="accuracy", title="accuracy vs time")


def finish_plot(fig: Any, ax: Any, path: Path, *, xlabel: str, ylabel: str, title: str, grid: bool = True,
                dpi: int = 120) -> Path:
    """Label `ax` (and grid it), lay `fig` out, write it to `path` and close it: how every plot here ends."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if grid:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
