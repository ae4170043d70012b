"""Policies side by side on one data set: a resumable matrix of runs, a markdown report and a plot.

Every configuration (policy x threshold x token speculation) runs the same tasks with the same
loaded models; each has its own result store under the output folder, so an interrupted bench
resumes where it stopped. Suffix caches are cleared between configurations so none starts warmer
than another. `compare_stores` puts run stores of earlier benches (other flags, other days) into
one report over the same tasks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from thinkahead.batch_input import Task
from thinkahead.orchestrator.store import ResultStore
from thinkahead.orchestrator.summary import BatchSummary, fmt, fmt_interval, summarize
from thinkahead.orchestrator.trace import RunResult

log = logging.getLogger(__name__)


class Column(Protocol):
    """A report column: anything with a label (a `BenchConfig`, or a `StoredColumn`)."""

    @property
    def label(self) -> str: ...


@dataclass(frozen=True)
class StoredColumn:
    """A column read back from a run store rather than run by this bench."""

    label: str
    path: Path


@dataclass(frozen=True)
class BenchConfig:
    """One column of the matrix."""

    policy: str
    threshold: float | None = None
    token_spec: bool = True
    judge: str = "llm"  # specreason's verifier ("agreement": thresholds do not apply)
    repair: str = "step"  # agreement: the large model finishes a failed step, or fixes one token ("token")

    @property
    def label(self) -> str:
        name = f"{self.policy}-agreement" if self.policy == "specreason" and self.judge == "agreement" else self.policy
        name = f"{name}+token" if self.repair == "token" else name
        name = name if self.threshold is None else f"{name}@{self.threshold:g}"
        return name if self.token_spec else f"{name}/no-token-spec"


def matrix(policies: list[str], thresholds: list[float], token_spec: str, judges: tuple[str, ...] = ("llm",),
           repair: str = "step") -> list[BenchConfig]:
    """Every policy with token speculation "on", "off" or "both"; specreason once per judge, and
    with the LLM judge once per threshold; `repair` applies to the agreement judge."""
    if token_spec not in ("on", "off", "both"):
        raise ValueError(f"token_spec must be 'on', 'off' or 'both', got {token_spec!r}")
    from thinkahead.step_spec.policies import JUDGES

    unknown = [j for j in judges if j not in JUDGES]
    if not judges or unknown:
        raise ValueError(f"judges must be among {', '.join(JUDGES)}, got {list(judges)}")
    specs = {"on": [True], "off": [False], "both": [True, False]}[token_spec]
    out = []
    for policy in policies:
        for spec in specs:
            if policy != "specreason":
                out.append(BenchConfig(policy, None, spec))
                continue
            for judge in judges:
                sweep = thresholds if judge == "llm" and thresholds else [None]
                fix = repair if judge == "agreement" else "step"
                out.extend(BenchConfig(policy, t, spec, judge, fix) for t in sweep)
    return out


@dataclass
class BenchReport:
    rows: list[tuple[Column, BatchSummary]] = field(default_factory=list)
    markdown: Path | None = None
    plot: Path | None = None
    warmth_plot: Path | None = None
    json: Path | None = None


def _clear_caches(models) -> None:
    for model in {id(m): m for m in models}.values():
        for attr in ("suffix_cache", "prefix_pool"):
            cache = getattr(model, attr, None)
            if cache is not None and hasattr(cache, "clear"):
                cache.clear()


def run_bench(
    tasks: list[Task],
    configs: list[BenchConfig],
    settings: dict[str, Any],
    out_dir: Path,
    annotate: Callable[[RunResult], None] | None = None,
    on_result: Callable[[BenchConfig, RunResult], None] | None = None,
    graph: Callable[[str], Any] | None = None,
    title: str | None = None,
) -> BenchReport:
    """Run every configuration over `tasks` (resuming each from its store) and write the report.

    `graph(run_id)` builds each task's graph when tasks need their own (a suite's workflow
    options per task); by default every task runs the settings' workflow.
    """
    from thinkahead.config import OrchestratorConfig
    from thinkahead.sdk import Orchestrator

    plans = []  # every store is checked (kind, configuration, writable) before the models load
    try:
        for config in configs:
            cfg = json.loads(json.dumps(settings))
            cfg["policy"]["name"] = config.policy
            if config.threshold is not None:
                cfg["policy"]["threshold"] = config.threshold
            cfg["policy"]["judge"] = config.judge
            cfg["policy"]["repair"] = config.repair
            cfg["token_spec"] = config.token_spec
            store = ResultStore(store_path(out_dir, config), OrchestratorConfig.model_validate(cfg).store_identity())
            plans.append((config, cfg, store))
            store.open_for_append()
        base = Orchestrator(config=settings)
        small, large = base.small, base.large  # load the models once for every configuration
        report = BenchReport()
        items = [(t.id, t.inputs, {"reference": t.reference} if t.reference is not None else {}) for t in tasks]
        ids = {t.id for t in tasks}
        for config, cfg, store in plans:
            orch = Orchestrator(small, large, config=cfg)
            _clear_caches([small, large])
            asyncio.run(orch.map(items, graph, store=store, annotate=annotate,
                                 on_result=(lambda r, c=config: on_result(c, r)) if on_result else None))
            store.close()
            results = [r for rid, r in ResultStore(store.path).latest().items() if rid in ids]
            report.rows.append((config, summarize(results)))
    finally:
        for _, _, store in plans:
            store.close()
    report.markdown = out_dir / "report.md"
    report.markdown.write_text(markdown_report(report.rows, settings, len(tasks), title))
    report.json = out_dir / "report.json"
    report.json.write_text(json.dumps({"settings": settings, "rows": [
        {"config": c.label, **s.to_dict()} for c, s in report.rows]}, indent=1, default=str))
    report.plot = plot_pareto(report.rows, out_dir / "report.png")
    report.warmth_plot = plot_warmth(out_dir, configs, {t.id for t in tasks}, out_dir / "report_warmth.png")
    return report


def store_path(out_dir: Path, config: BenchConfig) -> Path:
    return out_dir / f"runs-{config.label.replace('/', '_').replace('@', '_')}.jsonl"


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
    return "\n".join(lines)


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
    if ax.get_legend_handles_labels()[0]:  # a legend beside the plot: labels of nearby points never overlap
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.set_xlabel("seconds per task")
    ax.set_ylabel("accuracy")
    ax.set_title("accuracy vs time")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_warmth(out_dir: Path, configs: list[BenchConfig], ids: set[str], path: Path) -> Path | None:
    """Token-level acceptance (tokens per verify step) against how many runs warmed the caches before."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    drawn = False
    for config in configs:
        if not config.token_spec:
            continue
        runs = [r for r in ResultStore(store_path(out_dir, config)) if r.id in ids and r.cost.get("accept_length")]
        if not runs:
            continue
        ax.plot(range(len(runs)), [r.cost["accept_length"] for r in runs], marker=".", label=config.label)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("runs finished before (cache warmth)")
    ax.set_ylabel("tokens per verify step")
    ax.set_title("token-level acceptance vs cache warmth")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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

