"""Policies side by side on one data set: a resumable matrix of runs, a markdown report and a plot.

Every configuration (policy x threshold x token speculation) runs the same tasks with the same
loaded models; each has its own result store under the output folder, so an interrupted bench
resumes where it stopped. Suffix caches are cleared between configurations so none starts warmer
than another. Reports: `thinkahead.evals.report`; stores of earlier benches put side by side:
`thinkahead.evals.compare`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinkahead.config import default
from thinkahead.evals.report import Column, finish_plot, markdown_report, plot_pareto
from thinkahead.evals.tasks import Task
from thinkahead.orchestrator.store import ResultStore
from thinkahead.orchestrator.summary import BatchSummary, summarize
from thinkahead.orchestrator.trace import RunResult
from thinkahead.step_spec.specreason import JUDGES, REPAIRS, Judge, Repair

log = logging.getLogger(__name__)


def _default_judge() -> Judge:
    return default("policy.judge")


def _default_repair() -> Repair:
    return default("policy.repair")


@dataclass(frozen=True)
class BenchConfig:
    """One column of the matrix. `judge`: specreason's verifier ("agreement": thresholds do not
    apply); `repair`: after a failed agreement check the large model finishes the step, or fixes
    one token ("token"). Both default to the config's (`policy.judge`, `policy.repair`)."""

    policy: str
    threshold: float | None = None
    token_spec: bool = True
    judge: Judge = field(default_factory=_default_judge)
    repair: Repair = field(default_factory=_default_repair)

    @property
    def label(self) -> str:
        name = f"{self.policy}-agreement" if self.policy == "specreason" and self.judge == "agreement" else self.policy
        name = f"{name}+token" if self.repair == "token" else name
        name = name if self.threshold is None else f"{name}@{self.threshold:g}"
        return name if self.token_spec else f"{name}/no-token-spec"


def matrix(policies: list[str], thresholds: list[float], token_spec: str, judges: tuple[str, ...] | None = None,
           repair: str | None = None) -> list[BenchConfig]:
    """Every policy with token speculation "on", "off" or "both"; specreason once per judge, and
    with the LLM judge once per threshold; `repair` applies to the agreement judge (the other
    judges keep the default repair). `judges` / `repair` None: the config's defaults."""
    if token_spec not in ("on", "off", "both"):
        raise ValueError(f"token_spec must be 'on', 'off' or 'both', got {token_spec!r}")
    judges = (_default_judge(),) if judges is None else judges
    unknown = [j for j in judges if j not in JUDGES]
    if not judges or unknown:
        raise ValueError(f"judges must be among {', '.join(JUDGES)}, got {list(judges)}")
    repair = _default_repair() if repair is None else repair
    if repair not in REPAIRS:
        raise ValueError(f"repair must be one of {', '.join(REPAIRS)}, got {repair!r}")
    specs = {"on": [True], "off": [False], "both": [True, False]}[token_spec]
    out = []
    for policy in policies:
        for spec in specs:
            if policy != "specreason":
                out.append(BenchConfig(policy, None, spec))
                continue
            for judge in judges:
                sweep = thresholds if judge == "llm" and thresholds else [None]
                fix = repair if judge == "agreement" else _default_repair()
                out.extend(BenchConfig(policy, t, spec, judge, fix) for t in sweep)  # type: ignore[arg-type]
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
    ax.legend(fontsize=8)
    return finish_plot(fig, ax, path, xlabel="runs finished before (cache warmth)", ylabel="tokens per verify step",
                       title="token-level acceptance vs cache warmth")
