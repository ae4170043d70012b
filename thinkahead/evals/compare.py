"""`compare_stores`: one report over run stores that earlier benches or runs wrote (other flags, other
days), restricted to the tasks they all hold."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from thinkahead.evals.bench import BenchReport
from thinkahead.evals.report import markdown_report, plot_pareto
from thinkahead.orchestrator.store import ResultStore
from thinkahead.orchestrator.summary import summarize


@dataclass(frozen=True)
class StoredColumn:
    """A column read back from a run store rather than run by this bench."""

    label: str
    path: Path


def compare_stores(columns: list[StoredColumn], out_dir: Path, ids: set[str] | None = None,
                   title: str | None = None) -> BenchReport:
    """One report (markdown, JSON, Pareto plot) over run stores written earlier, restricted to `ids`
    (default: the ids every store holds, so each column covers the same tasks)."""
    if not columns:
        raise ValueError("compare needs at least one LABEL=STORE.jsonl column")
    labels = [c.label for c in columns]
    if len(set(labels)) != len(labels):
        raise ValueError(f"column labels must differ, got {labels}")
    latest = {}
    for c in columns:
        if not c.path.is_file():
            raise ValueError(f"no run store at {c.path} (column {c.label!r})")
        latest[c.label] = {rid: r for rid, r in ResultStore(c.path).latest().items() if ids is None or rid in ids}
    if ids is not None:
        missing = {label: len(ids - set(runs)) for label, runs in latest.items()}
        if any(missing.values()):
            raise ValueError("stores lack some of the tasks: " + ", ".join(f"{k} misses {v}" for k, v in missing.items() if v))
    common = set.intersection(*(set(runs) for runs in latest.values()))
    if not common:
        raise ValueError("the stores have no task in common")
    out_dir.mkdir(parents=True, exist_ok=True)
    report = BenchReport()
    report.rows = [(c, summarize(r for rid, r in latest[c.label].items() if rid in common)) for c in columns]
    report.markdown = out_dir / "report.md"
    report.markdown.write_text(markdown_report(report.rows, None, len(common), title))
    report.json = out_dir / "report.json"
    report.json.write_text(json.dumps({"stores": {c.label: str(c.path) for c in columns}, "ids": sorted(common), "rows": [
        {"config": c.label, **s.to_dict()} for c, s in report.rows]}, indent=1, default=str))
    report.plot = plot_pareto(report.rows, out_dir / "report.png")
    return report
