"""A bench report sets each step policy against the line from `small` to `large`: how far above it the policy's
accuracy lies at its speed, and whether its whole interval clears it; the plot draws the line."""

from __future__ import annotations

from dataclasses import dataclass

from thinkahead.evals.report import markdown_report, plot_pareto, tradeoff_line
from thinkahead.orchestrator.summary import BatchSummary


@dataclass(frozen=True)
class Col:
    label: str


def summary(correct: int, runs: int, seconds: float) -> BatchSummary:
    return BatchSummary(runs=runs, statuses={"ok": runs}, checked=runs, correct=correct, wall_s=seconds * runs)


def test_the_line_from_small_to_large_and_who_clears_it(tmp_path) -> None:
    rows = [(Col("large"), summary(60, 100, 10.0)), (Col("small"), summary(30, 100, 4.0)),
            (Col("good"), summary(95, 100, 6.0)), (Col("meh"), summary(42, 100, 6.0))]
    line = tradeoff_line(rows)
    assert abs(line(4.0) - 0.30) < 1e-9 and abs(line(10.0) - 0.60) < 1e-9 and abs(line(6.0) - 0.40) < 1e-9
    assert abs(line(30.0) - 0.60) < 1e-9 and abs(line(1.0) - 0.30) < 1e-9  # flat beyond its ends
    report = markdown_report(rows, None, 100)
    assert "| good | +0.550 | yes |" in report  # 0.95 at 6 s against the line's 0.40; its interval clears it
    assert "| meh | +0.020 | no |" in report  # above the line, but its interval reaches below
    assert "| large | +" not in report and "| small | +" not in report
    assert plot_pareto(rows, tmp_path / "p.png").stat().st_size > 0
    assert tradeoff_line(rows[2:]) is None and "Against the line" not in markdown_report(rows[2:], None, 100)
