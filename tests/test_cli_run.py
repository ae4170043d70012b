"""`thinkahead run` and `thinkahead trace` end to end on a tiny model directory (both tiers)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from thinkahead.cli import main
from thinkahead.orchestrator.store import ResultStore


def write_tasks(path, lines: list[str]) -> None:
    path.write_text("\n".join(lines) + "\n")


def base_args(model_dir, out) -> list[str]:
    return ["--small", str(model_dir), "--large", str(model_dir), "--dtype", "float32", "-o", str(out),
            "--max-steps", "2", "--step-tokens", "6", "--max-tokens", "24"]


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

    again = CliRunner().invoke(main, ["run", str(tasks), *base_args(tiny_model_dir, out)])
    assert again.exit_code == 0, again.output
    assert "resuming: 2 of 2 tasks already" in again.output
    assert len(out.read_text().splitlines()) == 2  # nothing ran twice

    shown = CliRunner().invoke(main, ["trace", str(out), "--id", "a"])
    assert shown.exit_code == 0, shown.output
    first_step = records["a"].steps()[0]["data"]
    assert f"step  0 {first_step['author']:<5} {first_step['verdict']:<10}" in shown.output
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
