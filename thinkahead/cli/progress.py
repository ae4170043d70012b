"""The live status line of a batch and the summary table printed after it."""

from __future__ import annotations

import sys
import time

from thinkahead.orchestrator.summary import BatchSummary, fmt, fmt_interval


class Progress:
    """A live status line: runs done, accuracy, step accept rate, small share, tokens per second."""

    def __init__(self, total: int, stream=sys.stderr, min_interval_s: float = 0.5) -> None:
        self.total, self.stream, self.min_interval_s = total, stream, min_interval_s
        self.summary = BatchSummary()
        self.live = BatchSummary()  # steps seen so far, in-flight runs included
        self.started = time.perf_counter()
        self.last_draw = 0.0
        self.tty = stream.isatty()

    def on_event(self, event) -> None:
        if event.kind == "step":
            self.live.add_step(event.data)
            for tier, n in event.data.get("tokens", {}).items():
                self.live.tokens[tier] = self.live.tokens.get(tier, 0) + n
            self.draw()

    def on_result(self, result) -> None:
        self.summary.add(result)
        self.draw(force=True, result=result)

    def line(self) -> str:
        s, elapsed = self.summary, time.perf_counter() - self.started
        rate = self.live.total_tokens / elapsed if elapsed > 0 else 0.0
        parts = [f"[{s.runs}/{self.total}]", f"ok {s.statuses.get('ok', 0)}"]
        failed = s.runs - s.statuses.get("ok", 0)
        if failed:
            parts.append(f"failed {failed}")
        if s.checked:
            parts.append(f"acc {fmt(s.accuracy)}")
        parts += [f"accept {fmt(self.live.accept_rate)}", f"small share {fmt(self.live.small_share)}",
                  f"{rate:.1f} tok/s", f"{elapsed:.0f}s"]
        return " | ".join(parts)

    def draw(self, force: bool = False, result=None) -> None:
        now = time.perf_counter()
        if not force and now - self.last_draw < self.min_interval_s:
            return
        self.last_draw = now
        if self.tty:
            self.stream.write("\r\033[K" + self.line())
        elif result is not None:  # logs: one line per finished run
            self.stream.write(f"{self.line()}  <- {result.id}: {result.status}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def summary_table(rows: list[tuple[str, BatchSummary]]) -> str:
    """An aligned plain-text table, one row per (label, summary)."""
    header = ("", "runs", "ok", "acc", "95% CI", "s/run", "small tok", "large tok", "small share", "accept",
              "judge calls", "tok/verify")
    lines = [header]
    for label, s in rows:
        lines.append((
            label, str(s.runs), str(s.statuses.get("ok", 0)), fmt(s.accuracy),
            fmt_interval(s.accuracy_ci), fmt(s.mean_wall_s, 1), str(s.tokens.get("small", 0)),
            str(s.tokens.get("large", 0)), fmt(s.small_share), fmt(s.accept_rate), str(s.judge_calls),
            fmt(s.accept_length),
        ))
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in lines)
