"""`thinkahead run` and `thinkahead trace` end to end on a tiny model directory (both tiers)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from thinkahead.cli import main
from thinkahead.orchestrator.store import ResultStore


def write_tasks(path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def model_args(model_dir) -> list[str]:
    return ["--small", str(model_dir), "--large", str(model_dir), "--dtype", "float32",
            "--max-steps", "2", "--step-tokens", "6", "--max-tokens", "24"]


def base_args(model_dir, out) -> list[str]:
    return [*model_args(model_dir), "-o", str(out)]


def test_run_reports_bad_lines_writes_results_resumes_and_traces(tiny_model_dir, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, [
        json.dumps({"id": "a", "question": "w5 w6 w7", "answer": "3"}),
        "{not json",
        json.dumps({"id": "b", "question": "w9 w10 w11"}),
        json.dumps({"id": "c", "text": "no question key"}),
        json.dumps({"id": "a", "question": "duplicate"}),
    ])
    out = tmp_path / "runs.jsonl"
    result = CliRunner().invoke(main, ["run", str(tasks), "--policy", "specreason", *base_args(tiny_model_dir, out)])
    assert result.exit_code == 0, result.output
    assert f"{tasks}:2: not valid JSON" in result.output
    assert f"{tasks}:4: no question" in result.output
    assert f"{tasks}:5: duplicate id 'a' (first on line 1)" in result.output
    records = ResultStore(out).latest()
    assert sorted(records) == ["a", "b"]
    assert all(r.status == "ok" and r.steps() for r in records.values())
    assert records["a"].meta["reference"] == "3" and records["a"].meta["correct"] is False
    assert "cot/specreason" in result.output and "small share" in result.output  # the summary table

    again = CliRunner().invoke(main, ["run", str(tasks), "--policy", "specreason", *base_args(tiny_model_dir, out)])
    assert again.exit_code == 0, again.output
    assert "resuming: 2 of 2 tasks already" in again.output and "nothing to run" in again.output
    assert "loading" not in again.output and "models ready" not in again.output  # no model loads for nothing
    assert "cot/specreason" in again.output  # the summary of what is there
    assert len(list(ResultStore(out))) == 2  # nothing ran twice

    shown = CliRunner().invoke(main, ["trace", str(out), "--id", "a"])
    assert shown.exit_code == 0, shown.output
    first_step = records["a"].steps()[0]["data"]
    assert f"step  0 {first_step['author']:<5} {first_step['verdict']:<10}" in shown.output
    spec = records["a"].cost["spec"]  # who drafted the run's tokens
    assert (f"drafts: {spec['spec_num_proposed_drafts']} tokens proposed, {spec['spec_num_correct_drafts']} "
            f"accepted; model-free") in shown.output
    missing = CliRunner().invoke(main, ["trace", str(out), "--id", "zzz"])
    assert missing.exit_code != 0 and "no run 'zzz'" in missing.output


def test_bad_lines_can_be_fatal(tiny_model_dir, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, [json.dumps({"question": "w5"}), "[1, 2]"])
    out = tmp_path / "runs.jsonl"
    result = CliRunner().invoke(main, ["run", str(tasks), "--on-bad-line", "fail", *base_args(tiny_model_dir, out)])
    assert result.exit_code != 0
    assert f"{tasks}:2: expected a JSON object, got list" in result.output
    assert "nothing was run" in result.output
    assert not out.exists() or out.read_text() == ""


def test_bad_config_values_are_usage_errors(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, [json.dumps({"question": "w5"})])
    config = tmp_path / "c.yaml"
    config.write_text("policy: {name: specreason, treshold: 5}\n")
    result = CliRunner().invoke(main, ["run", str(tasks), "-o", str(tmp_path / "o.jsonl"), "--config", str(config)])
    assert result.exit_code == 2
    assert "treshold" in result.output and "Extra inputs are not permitted" in result.output


def test_bench_writes_a_report_and_a_plot_and_resumes(tiny_model_dir, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, [json.dumps({"id": str(i), "question": f"w{5 + i} w6", "answer": "1"}) for i in range(2)])
    out_dir = tmp_path / "bench"
    args = ["bench", str(tasks), "--policies", "large,specreason", "--thresholds", "3,7", "--judges", "llm", "-o", str(out_dir),
            *model_args(tiny_model_dir)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = (out_dir / "report.md").read_text()
    for label in ("| large |", "| specreason@3 |", "| specreason@7 |"):
        assert label in report
    assert (out_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((out_dir / "report.json").read_text())
    assert [row["config"] for row in data["rows"]] == ["large", "specreason@3", "specreason@7"]
    assert all(row["runs"] == 2 and row["checked"] == 2 for row in data["rows"])
    stores = sorted(p.name for p in out_dir.glob("runs-*.jsonl"))
    assert stores == ["runs-large.jsonl", "runs-specreason_3.jsonl", "runs-specreason_7.jsonl"]
    again = CliRunner().invoke(main, args)  # resumes: no run is repeated
    assert again.exit_code == 0, again.output
    assert all(len(list(ResultStore(out_dir / s))) == 2 for s in stores)


def test_bench_compares_judges_and_labels_the_token_repair(tiny_model_dir, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, [json.dumps({"id": "0", "question": "w5 w6", "answer": "1"})])
    out_dir = tmp_path / "bench"
    args = ["bench", str(tasks), "--policies", "specreason", "--judges", "llm,agreement", "--word-margin", "0.1",
            "--margin", "0.1", "--repair", "token", "-o", str(out_dir), *model_args(tiny_model_dir)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads((out_dir / "report.json").read_text())
    assert [row["config"] for row in data["rows"]] == ["specreason", "specreason-agreement+token"]
    run = ResultStore(out_dir / "runs-specreason-agreement+token.jsonl").latest()["0"]
    verdicts = {e["data"]["verdict"] for e in run.trace if e["kind"] == "step"}
    assert "corrected" in verdicts  # random weights disagree with themselves at 0.1 nats somewhere
    bad = CliRunner().invoke(main, [*args[:-len(model_args(tiny_model_dir))], "--repair", "word"])
    assert bad.exit_code == 2 and "word" in bad.output
    # the two stores side by side again, read back by `compare` (as for runs made on different days)
    judge_store, fix_store = out_dir / "runs-specreason.jsonl", out_dir / "runs-specreason-agreement+token.jsonl"
    merged = CliRunner().invoke(main, ["compare", f"judge={judge_store}", f"fix={fix_store}", "--tasks", str(tasks),
                                       "-o", str(tmp_path / "merged")])
    assert merged.exit_code == 0, merged.output
    rows = json.loads((tmp_path / "merged" / "report.json").read_text())["rows"]
    assert [(r["config"], r["runs"]) for r in rows] == [("judge", 1), ("fix", 1)]
    assert [r["accuracy"] for r in rows] == [row["accuracy"] for row in data["rows"]]
    more = tmp_path / "more.jsonl"
    write_tasks(more, [json.dumps({"id": i, "question": "q"}) for i in ("0", "1")])
    for bad_args, message in ((["judge"], "expected LABEL=STORE.jsonl"), ([f"a={tmp_path / 'none.jsonl'}"], "no run store"),
                              ([f"a={judge_store}", f"a={fix_store}"], "labels must differ"),
                              ([f"a={judge_store}", "--tasks", str(more)], "a misses 1")):
        failed = CliRunner().invoke(main, ["compare", *bad_args, "-o", str(tmp_path / "x")])
        assert failed.exit_code == 2 and message in failed.output, failed.output


def test_bench_runs_a_named_suite_with_its_checker(tiny_model_dir, tmp_path):
    out_dir = tmp_path / "suite"
    args = ["bench", "--suite", "countdown-20", "--limit", "2", "--policies", "small", "-o", str(out_dir),
            *model_args(tiny_model_dir)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = (out_dir / "report.md").read_text()
    assert report.startswith("# thinkahead bench: countdown-20")
    records = ResultStore(out_dir / "runs-small.jsonl").latest()
    assert len(records) == 2
    assert all(r.meta["correct"] is False for r in records.values())  # random weights solve no puzzle
    both = CliRunner().invoke(main, ["bench", str(tmp_path / "x.jsonl"), "--suite", "gsm8k-50", "-o", str(out_dir)])
    assert both.exit_code == 2 and "either INPUT.jsonl or --suite" in both.output
    unknown = CliRunner().invoke(main, ["bench", "--suite", "gsm9k", "-o", str(out_dir)])
    assert unknown.exit_code == 2 and "unknown suite 'gsm9k'" in unknown.output


def test_recorded_generations_replay_in_the_simulator(tiny_model_dir, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    write_tasks(tasks, [json.dumps({"id": str(i), "question": f"w{5 + i} w6 w7"}) for i in range(2)])
    recording = tmp_path / "tokens.jsonl"
    ran = CliRunner().invoke(main, ["run", str(tasks), "--policy", "small", "--record", str(recording),
                                    *base_args(tiny_model_dir, tmp_path / "runs.jsonl")])
    assert ran.exit_code == 0, ran.output
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    records = [r for r in lines if not r.get("end")]
    runs = ResultStore(tmp_path / "runs.jsonl").latest()
    assert len(records) == sum(r.cost["model_calls"] for r in runs.values())
    assert {r["session_id"] for r in records} == {"0/answer", "1/answer"}  # one session per reasoning chain
    assert all(r["prompt_ids"] and r["output_ids"] for r in records)
    assert sorted(r["session_id"] for r in lines if r.get("end")) == ["0/answer", "1/answer"]  # ended with the run

    from thinkahead.token_spec.recording import read_sessions

    sessions = read_sessions(recording)
    assert sorted(len(s) for s in sessions) == sorted(r.cost["model_calls"] for r in runs.values())
    # The same tasks again (another configuration, same run ids): new sessions, not continuations.
    again = CliRunner().invoke(main, ["run", str(tasks), "--policy", "small", "--record", str(recording),
                                      *base_args(tiny_model_dir, tmp_path / "runs-again.jsonl")])
    assert again.exit_code == 0, again.output
    assert sorted(len(s) for s in read_sessions(recording)) == sorted([len(s) for s in sessions] * 2)
    recording.write_text("\n".join(json.dumps(r) for r in lines) + "\n")  # back to the first run only
    shown = CliRunner().invoke(main, ["simulate", str(recording), "--drafters", "suffix,combined"])
    assert shown.exit_code == 0, shown.output
    assert f"2 sessions, {len(records)} generations" in shown.output
    lines = {line.split()[0]: line.split() for line in shown.output.splitlines()[2:]}
    assert set(lines) == {"suffix", "combined"} and all(float(v[1]) >= 1.0 for v in lines.values())
    both = CliRunner().invoke(main, ["simulate", str(recording), str(recording), "--drafters", "suffix"])
    assert both.exit_code == 0 and f"4 sessions, {2 * len(records)} generations" in both.output  # files add up
    bad = CliRunner().invoke(main, ["simulate", str(recording), "--drafters", "eagle"])
    assert bad.exit_code == 2 and "unknown ['eagle']" in bad.output
