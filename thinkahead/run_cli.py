"""`thinkahead run` (a batch of tasks through a workflow) and `thinkahead trace` (one run's steps)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from thinkahead.model_registry import DTYPES
from thinkahead.orchestrator.summary import BatchSummary, fmt, fmt_interval

POLICIES = ("large", "small", "specreason", "arbitrage", "reflect")

EXIT_OK, EXIT_RUNS_FAILED, EXIT_INPUT = 0, 1, 2  # docs/cli.md "Exit codes"


class InputError(click.ClickException):
    """A usage or input problem the user can fix (a bad file, value or path): exit code 2, no usage text."""

    exit_code = EXIT_INPUT


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (through links and relative paths)."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def open_store(path: Path, config: dict[str, Any] | None, inputs: tuple[Path, ...] = ()):
    """A result store checked for writing (recognised, same configuration, writable) before any model loads."""
    from thinkahead.orchestrator.store import LogError, ResultStore

    for source in inputs:
        if source is not None and same_file(path, source):
            raise InputError(f"-o {path} is the input file; write results to another file")
    try:
        store = ResultStore(path, config=config)
        store.open_for_append()
    except LogError as exc:
        raise InputError(str(exc)) from None
    if store.moved_torn_to is not None:
        click.echo(f"{path}: a torn last line (a write cut short) was moved to {store.moved_torn_to}", err=True)
    return store


def orchestrator_options(fn):
    """The options `run`, `bench` and `serve` share: models, policy, budgets, config file."""
    options = [
        click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     default=None, help="YAML/TOML/JSON orchestrator config; the options below override it."),
        click.option("--small", default=None, help="Small (drafting) model spec [qwen2.5-coder-0.5b]."),
        click.option("--large", default=None, help="Large (judging) model spec [qwen2.5-coder-1.5b]."),
        click.option("--dtype", type=click.Choice(list(DTYPES)), default=None, help="Local model dtype [int8]."),
        click.option("--threshold", type=float, default=None, help="specreason: accept drafts scoring at least this [7]."),
        click.option("--judge", type=click.Choice(["llm", "agreement"]), default=None,
                     help="specreason's verifier: the large model's 0-9 judge prompt, or token agreement (the large "
                          "model re-reads the step; a digit it disagrees with by more than --margin fails it) [llm]."),
        click.option("--margin", type=float, default=None, help="Agreement judge: nats a checked drafted token may "
                     "trail the large model's own choice [1.0]."),
        click.option("--word-margin", type=float, default=None,
                     help="Agreement judge: also check tokens without digits, failing one that trails the large "
                          "model's choice by more than this many nats [unchecked]."),
        click.option("--repair", type=click.Choice(["step", "token"]), default=None,
                     help="Agreement judge, on a failed check: the large model finishes the step, or puts its own "
                          "token in place of the failing one and the small model drafts on [step]."),
        click.option("--max-steps", type=int, default=None, help="Steps per reasoning chain [16]."),
        click.option("--max-tokens", type=int, default=None, help="Generated tokens per reasoning chain [1024]."),
        click.option("--step-tokens", type=int, default=None, help="Token cap per step [128]."),
        click.option("--no-token-spec", is_flag=True, help="Turn token-level speculation off (the plain baseline)."),
        click.option("--record", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="Append every generation's token ids to this JSONL (replay it with `thinkahead simulate`)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def build_settings(config_path, small, large, dtype, threshold, max_steps, max_tokens, step_tokens, no_token_spec,
                   record=None, judge=None, margin=None, word_margin=None, repair=None, **extra: Any) -> dict[str, Any]:
    """An `OrchestratorConfig` as a dict: the file's values, overridden by the options given."""
    from pydantic import ValidationError

    from thinkahead.config import OrchestratorConfig, explain

    try:
        config = OrchestratorConfig.from_file(config_path) if config_path else OrchestratorConfig()
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    data = config.model_dump()
    for tier, spec in (("small", small), ("large", large)):
        if spec is not None:
            data[tier]["spec"] = spec
        if dtype is not None:
            data[tier]["dtype"] = dtype
        if record is not None:
            data[tier]["record"] = str(record)
    for key, value in (("threshold", threshold), ("judge", judge), ("margin", margin), ("word_margin", word_margin),
                       ("repair", repair)):
        if value is not None:
            data["policy"][key] = value
    if max_steps is not None:
        data["steps"]["max_steps"] = max_steps
    if max_tokens is not None:
        data["steps"]["max_tokens"] = max_tokens
    if step_tokens is not None:
        data["segment"]["max_step_tokens"] = step_tokens
    if no_token_spec:
        data["token_spec"] = False
    for key, value in extra.items():
        if value is not None:
            if key == "policy":
                data["policy"]["name"] = value
            else:
                data[key] = value
    try:
        OrchestratorConfig.model_validate(data)
    except ValidationError as exc:
        raise InputError(explain(exc, "options")) from None
    return data


def quiet_loading() -> None:
    """No per-tensor progress bars from transformers while GGUF weights convert."""
    from functools import partialmethod

    import tqdm
    from transformers.utils import logging as hf_logging

    # transformers' GGUF converter draws a bar per tensor with plain tqdm, which ignores its switch
    tqdm.tqdm.__init__ = partialmethod(tqdm.tqdm.__init__, disable=True)
    hf_logging.disable_progress_bar()


def load_models(orch) -> None:
    """Load both models now (quietly), so the progress clock starts with the first run."""
    quiet_loading()
    c = orch.config
    click.echo(f"loading {c.small.spec} and {c.large.spec} ({c.large.dtype}) ...", err=True)
    t0 = time.perf_counter()
    orch.runtime  # noqa: B018 - builds the runtime, which loads the models
    click.echo(f"models ready in {time.perf_counter() - t0:.0f}s", err=True)


def grader(checker_name: str):
    """Fills `meta["correct"]` of a run that has a reference answer."""
    from thinkahead.verifiers.checkers import get_checker

    if checker_name == "none":
        return None
    checker = get_checker(checker_name)

    def annotate(result) -> None:
        reference = result.meta.get("reference")
        if reference is None:
            return
        answer = result.answer if isinstance(result.answer, str) else ("" if result.answer is None else str(result.answer))
        try:
            result.meta["correct"] = bool(checker.check(answer, reference))
        except ValueError:
            result.meta["correct"] = False

    return annotate


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


@click.command()
@click.argument("input_path", metavar="INPUT.jsonl", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-w", "--workflow", default=None, help="Workflow: cot, react, refine, vote, pipeline, codefix (needs a suite's tests) [cot].")
@click.option("--policy", type=click.Choice(POLICIES), default=None, help="Step policy [specreason].")
@click.option("-o", "--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Result store (JSONL); runs already in it are skipped (resume).")
@click.option("--limit", type=int, default=None, help="Only the first N tasks.")
@click.option("--concurrency", type=int, default=None, help="Runs in flight at once [1].")
@click.option("--checker", type=click.Choice(["math", "exact", "none"]), default="math", show_default=True,
              help="How answers are graded against a reference answer.")
@click.option("--on-bad-line", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
              help="Bad input lines: report and skip them, or stop before running anything.")
@orchestrator_options
def run(input_path, workflow, policy, out, limit, concurrency, checker, on_bad_line, **options) -> None:
    """Run every task of INPUT.jsonl through a workflow; results go to --out as they finish.

    Each line: {"id": ..., "question": ..., "answer": optional reference}.
    """
    from thinkahead.batch_input import read_tasks
    from thinkahead.orchestrator.store import DONE_STATUSES, ResultStore
    from thinkahead.orchestrator.summary import summarize
    from thinkahead.sdk import Orchestrator

    if limit is not None and limit < 1:
        raise click.UsageError("--limit must be at least 1")
    if same_file(out, input_path):
        raise InputError(f"-o {out} is the input file; write results to another file")
    try:
        tasks = read_tasks(input_path, limit=limit)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    for bad in tasks.bad:
        click.echo(f"{input_path}:{bad.line}: {bad.reason}" + (" (skipped)" if on_bad_line == "skip" else ""), err=True)
    if tasks.bad and on_bad_line == "fail":
        raise InputError(f"{len(tasks.bad)} bad input line(s) in {input_path}; nothing was run")
    if not tasks.tasks:
        raise InputError(f"no valid tasks in {input_path}")
    settings = build_settings(**options, workflow=workflow, policy=policy, concurrency=concurrency)
    orch = Orchestrator(config=settings)
    store = open_store(out, orch.config.store_identity(), (input_path,))
    try:
        done = store.done_ids()
    except ValueError as exc:
        store.close()
        raise InputError(str(exc)) from exc
    todo = [t for t in tasks.tasks if t.id not in done]
    if done:
        click.echo(f"resuming: {len(tasks.tasks) - len(todo)} of {len(tasks.tasks)} tasks already in {out}", err=True)
    load_models(orch)
    progress = Progress(len(todo))
    items = [(t.id, t.inputs, {"reference": t.reference} if t.reference is not None else {}) for t in todo]
    try:
        asyncio.run(orch.map(items, store=store, on_result=progress.on_result, listeners=[progress.on_event],
                             annotate=grader(checker)))
    except KeyboardInterrupt:
        progress.close()
        raise click.ClickException(f"interrupted; finished runs are in {out}, run the same command to resume")
    finally:
        store.close()
    progress.close()
    ids = {t.id for t in tasks.tasks}
    results = [r for rid, r in ResultStore(out).latest().items() if rid in ids]
    click.echo(summary_table([(f"{orch.config.workflow}/{orch.config.policy.name}", summarize(results))]))
    click.echo(f"results: {out}")
    failed = [r.id for r in results if r.status not in DONE_STATUSES]
    if failed:
        click.echo(f"{len(failed)} run(s) failed ({', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''}); "
                   f"`thinkahead trace {out} --id ID` shows why, and the same command runs them again", err=True)
        sys.exit(EXIT_RUNS_FAILED)


@click.command()
@click.argument("results_path", metavar="OUT.jsonl", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--id", "run_id", default=None, help="The run to show (default: list the runs).")
@click.option("--full", is_flag=True, help="Print whole step texts, not one-line previews.")
@click.option("--json", "as_json", is_flag=True, help="Print the run's record as JSON.")
def trace(results_path, run_id, full, as_json) -> None:
    """Show one run's steps: who wrote each, scores, tokens and time."""
    from thinkahead.orchestrator.store import ResultStore

    store = ResultStore(results_path)
    try:
        runs = store.latest()
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    if store.torn_bytes:
        click.echo(f"{results_path}: skipped an unterminated last line ({store.torn_bytes} bytes; a write cut short)",
                   err=True)
    if run_id is None:
        for r in runs.values():
            click.echo(f"{r.id}\t{r.status}\t{r.answer!r}")
        return
    if run_id not in runs:
        known = ", ".join(list(runs)[:10]) + (" ..." if len(runs) > 10 else "")
        raise click.ClickException(f"no run {run_id!r} in {results_path}; runs: {known}")
    r = runs[run_id]
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=1, ensure_ascii=False))
        return
    click.echo(f"run {r.id}  workflow {r.workflow}  status {r.status}  answer {r.answer!r}")
    if r.error:
        click.echo(f"error: {r.error}")
    if "correct" in r.meta:
        click.echo(f"reference {r.meta.get('reference')!r}  correct {r.meta['correct']}")
    cost = r.cost
    click.echo(f"cost: tokens {cost.get('tokens')}  model calls {cost.get('model_calls')}  "
               f"judge calls {cost.get('judge_calls')}  tok/verify {fmt(cost.get('accept_length'))}  "
               f"{cost.get('wall_s', 0):.2f}s")
    for e in r.trace:
        d = e["data"]
        if e["kind"] == "node_end":
            extra = f"  {d['time_s']:.2f}s" if "time_s" in d else ""
            click.echo(f"[{e['t']:8.2f}s] node {e['node']}: {d.get('status')}{extra}")
        elif e["kind"] == "step":
            score = "" if d.get("score") is None else f" score {d['score']:g}"
            tokens = sum(d.get("tokens", {}).values())
            text = d.get("text", "").strip()
            text = text if full else (text.replace("\n", " ")[:100] + ("..." if len(text) > 100 else ""))
            click.echo(f"[{e['t']:8.2f}s]   step {d['index']:>2} {d['author']:<5} {d['verdict']:<10}{score} "
                       f"{tokens} tok {d.get('time_s', 0):.2f}s | {text}")
        elif e["kind"] == "error":
            click.echo(f"[{e['t']:8.2f}s] {d.get('status')}: {d.get('error')}")


@click.command()
@click.argument("input_path", metavar="[INPUT.jsonl]", required=False,
                type=click.Path(dir_okay=False, path_type=Path))
@click.option("--suite", default=None, help="A named suite instead of INPUT.jsonl: gsm8k-50, math500-30, humaneval-20, "
              "agentic-refine, agentic-codefix, agentic-pipeline, tools-bfcl-20, countdown-20, game24-20.")
@click.option("-w", "--workflow", default=None, help="Workflow: cot, react, refine, vote, pipeline, codefix [cot, or the suite's].")
@click.option("--policies", default="large,small,specreason", show_default=True, help="Comma-separated step policies.")
@click.option("--thresholds", default="", help="specreason thresholds to sweep, e.g. 5,7,9 (default: the config's).")
@click.option("--judges", default="", help="specreason verifiers to compare, e.g. llm,agreement (default: --judge).")
@click.option("--token-spec", "token_spec", type=click.Choice(["on", "off", "both"]), default="on", show_default=True,
              help="Token-level speculation in every configuration, none, or each configuration both ways.")
@click.option("-o", "--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Folder for the run stores, report.md, report.json and the plots (resumable).")
@click.option("--limit", type=int, default=None, help="Only the first N tasks.")
@click.option("--checker", type=click.Choice(["math", "exact"]), default="math", show_default=True,
              help="Grading of INPUT.jsonl answers (a suite brings its own checker).")
@orchestrator_options
def bench(input_path, suite, workflow, policies, thresholds, judges, token_spec, out_dir, limit, checker, **options) -> None:
    """Run step policies side by side on INPUT.jsonl or a --suite; write a markdown report and plots."""
    from thinkahead.benchmark import matrix, run_bench
    from thinkahead.orchestrator.jsonl import LogError

    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if not names or unknown:
        raise click.UsageError(f"--policies: unknown {unknown or '(none given)'}; choose from {', '.join(POLICIES)}")
    if (input_path is None) == (suite is None):
        raise click.UsageError("give either INPUT.jsonl or --suite NAME")
    try:
        sweep = [float(t) for t in thresholds.split(",") if t.strip()]
        tasks, annotate, graph, title, suite_workflow = _bench_tasks(input_path, suite, limit, checker, workflow)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    settings = build_settings(**options, workflow=workflow or suite_workflow)
    try:
        configs = matrix(names, sweep, token_spec, tuple(j.strip() for j in judges.split(",") if j.strip())
                         or (settings["policy"]["judge"],), settings["policy"]["repair"])
    except ValueError as exc:
        raise click.UsageError(f"--judges: {exc}") from exc

    def progress(config, result) -> None:
        click.echo(f"{config.label}: {result.id} {result.status} answer={result.answer!r}"
                   + (f" correct={result.meta['correct']}" if "correct" in result.meta else ""), err=True)

    quiet_loading()
    try:
        report = run_bench(tasks, configs, settings, out_dir, annotate=annotate, on_result=progress, graph=graph,
                           title=title)
    except LogError as exc:
        raise InputError(str(exc)) from None
    click.echo(summary_table([(c.label, s) for c, s in report.rows]))
    plots = [str(p) for p in (report.plot, report.warmth_plot) if p]
    click.echo(f"report: {report.markdown}" + (f", plots: {', '.join(plots)}" if plots else ""))


def _bench_tasks(input_path, suite_name, limit, checker, workflow):
    """(tasks, annotate, per-task graph builder or None, title, the suite's workflow) for `bench`."""
    if suite_name is None:
        from thinkahead.batch_input import read_tasks

        parsed = read_tasks(input_path, limit=limit)
        for bad in parsed.bad:
            click.echo(f"{input_path}:{bad.line}: {bad.reason} (skipped)", err=True)
        if not parsed.tasks:
            raise ValueError(f"no valid tasks in {input_path}")
        return parsed.tasks, grader(checker), None, None, None
    from thinkahead.evals.suites import load_suite
    from thinkahead.workflows import build_workflow

    suite = load_suite(suite_name, limit=limit)
    by_id = {t.id: t for t in suite.tasks}

    def annotate(result) -> None:
        task = by_id[result.id]
        result.meta["correct"] = suite.grade(task, result.answer, result.outputs)

    def graph(run_id: str):
        if workflow is not None and workflow != suite.workflow:  # the suite's options belong to its own workflow
            return build_workflow(workflow)
        return build_workflow(suite.workflow, **suite.workflow_options(by_id[run_id]))

    return suite.tasks, annotate, graph, f"{suite.name} ({suite.spec.description})", suite.workflow
