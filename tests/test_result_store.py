"""The JSONL result store: durable appends, torn lines, latest-wins, and a killed batch that resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from thinkahead.orchestrator.store import ResultStore
from thinkahead.orchestrator.trace import RunResult

BATCH_SCRIPT = r"""
import asyncio, sys
from thinkahead.models import ScriptedModel
from thinkahead.orchestrator import END, START, ResultStore, Runtime, StepGraph
from thinkahead.step_spec.policies import make_policy

async def slow_upper(state):
    await asyncio.sleep(float(sys.argv[2]))
    return state["question"].upper()

g = StepGraph(inputs=["question"])
g.add_tool("upper", slow_upper)
g.add_sequence(START, "upper", END)
rt = Runtime(ScriptedModel(), ScriptedModel(), make_policy("large"), concurrency=2)
with ResultStore(sys.argv[1]) as store:
    asyncio.run(rt.map(g, [(f"id{i}", f"task {i}") for i in range(10)], store=store))
"""


def run_record(rid: str, status: str = "ok", answer: str = "a") -> RunResult:
    return RunResult(id=rid, workflow="w", status=status, answer=answer)


def test_append_then_read_back(tmp_path):
    path = tmp_path / "runs.jsonl"
    with ResultStore(path) as store:
        store.append(run_record("1"))
        store.append(run_record("2", status="error"))
        store.append(run_record("2", answer="b"))  # a retry that succeeded supersedes the error
        store.append(run_record("3", status="error"))
    store = ResultStore(path)
    assert [r.id for r in store] == ["1", "2", "2", "3"]
    assert store.latest()["2"].answer == "b"
    assert store.done_ids() == {"1", "2"}  # errors run again on resume


def store_with_torn_tail(tmp_path):
    """A store holding run "1" and, after it, the first bytes of a second record (a write cut short)."""
    path = tmp_path / "runs.jsonl"
    with ResultStore(path) as store:
        store.append(run_record("1"))
    torn = b'{"id": "2", "workflow": "w", "sta'
    with open(path, "ab") as f:
        f.write(torn)
    return path, torn


def test_reading_skips_a_torn_last_line_and_never_changes_the_file(tmp_path):
    path, torn = store_with_torn_tail(tmp_path)
    before = path.read_bytes()
    store = ResultStore(path)
    assert [r.id for r in store] == ["1"] and store.torn_bytes == len(torn)
    assert store.done_ids() == {"1"}
    assert path.read_bytes() == before  # reading never changes a file
    assert not (tmp_path / "runs.jsonl.torn").exists()


def test_a_writer_moves_a_torn_tail_aside_before_appending(tmp_path):
    path, torn = store_with_torn_tail(tmp_path)
    with ResultStore(path) as store:
        store.append(run_record("2"))
        assert store.moved_torn_to == tmp_path / "runs.jsonl.torn"
    assert [r.id for r in ResultStore(path)] == ["1", "2"]
    assert (tmp_path / "runs.jsonl.torn").read_bytes() == torn + b"\n"  # the cut bytes are kept


def test_a_torn_line_is_reported_once_by_the_command_line_not_again_by_a_warning(tmp_path, caplog):
    """The reader's and the writer's log lines were warnings, shown beside the CLI's own line: twice."""
    from click.testing import CliRunner

    from thinkahead.cli import main

    path, torn = store_with_torn_tail(tmp_path)
    with caplog.at_level("INFO"):
        shown = CliRunner().invoke(main, ["trace", str(path)])
        with ResultStore(path) as store:
            store.append(run_record("2"))
    assert shown.exit_code == 0, shown.output
    assert [line for line in shown.output.splitlines() if "unterminated" in line] == [
        f"{path}: skipped an unterminated last line ({len(torn)} bytes; a write cut short)"]
    levels = {r.levelname for r in caplog.records if "unterminated" in r.getMessage()}
    assert levels == {"INFO"}  # (reads and the move, for whoever logs at INFO)


def test_a_writer_creates_the_files_own_folder_only(tmp_path):
    """It made every missing folder up to the root; a file on the way said only "File exists"."""
    ResultStore(tmp_path / "new" / "runs.jsonl").append(run_record("1"))
    assert [r.id for r in ResultStore(tmp_path / "new" / "runs.jsonl")] == ["1"]
    with pytest.raises(ValueError, match=r"folder .*/missing does not exist \(only the file's own folder, deeper, is"):
        ResultStore(tmp_path / "missing" / "deeper" / "runs.jsonl").open_for_append()
    assert not (tmp_path / "missing").exists()
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    for path in (plain / "runs.jsonl", plain / "a" / "b" / "runs.jsonl"):
        with pytest.raises(ValueError, match=f"cannot write {path}: {plain} is not a folder"):
            ResultStore(path).open_for_append()
    assert plain.read_text() == "x"


def test_a_resume_reads_the_store_once(tmp_path, monkeypatch):
    """`open_for_append` keeps each run's last status as it checks the file; `done_ids` of the open store
    answers from it (and from what was appended since) without reading the file again."""
    path = tmp_path / "runs.jsonl"
    with ResultStore(path) as store:
        for rid, status in (("1", "ok"), ("2", "error"), ("3", "ok"), ("3", "error"), ("4", "budget")):
            store.append(run_record(rid, status=status))
    reads = []
    lines = ResultStore._lines
    monkeypatch.setattr(ResultStore, "_lines", lambda self: reads.append(self.path) or lines(self))
    seen = []
    with ResultStore(path) as store:
        store.open_for_append(seen.append)
        assert [(r.id, r.status) for r in seen] == [("1", "ok"), ("2", "error"), ("3", "ok"), ("3", "error"),
                                                    ("4", "budget")]
        assert store.done_ids() == {"1", "4"}  # the last record of an id wins
        store.append(run_record("2"))  # the retry of a failed run
        store.append(run_record("1", status="error"))
        assert store.done_ids() == {"2", "4"}
        store.open_for_append()  # idempotent: reads nothing
        assert reads == [path]
    assert ResultStore(path).done_ids() == {"2", "4"}  # a closed store reads the file: the same answer
    assert reads == [path, path]


def test_a_file_that_is_not_a_store_is_neither_changed_nor_written(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"a\nb")
    with pytest.raises(ValueError, match=r"f.txt:1: not a run record"):
        ResultStore(path).latest()
    with pytest.raises(ValueError, match=r"f.txt:1: not a run record"):
        ResultStore(path).append(run_record("1"))
    assert path.read_bytes() == b"a\nb"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b'{"id": "1", "question": "q"}\n{"id": "2", "question": "r"}')
    with pytest.raises(ValueError, match=r"tasks.jsonl:1: not a run record"):
        ResultStore(tasks).append(run_record("1"))
    assert tasks.read_bytes() == b'{"id": "1", "question": "q"}\n{"id": "2", "question": "r"}'


def test_a_store_records_its_configuration_and_refuses_another(tmp_path):
    path = tmp_path / "runs.jsonl"
    config = {"policy": {"name": "specreason", "threshold": 7.0}, "workflow": "cot"}
    with ResultStore(path, config=config) as store:
        store.append(run_record("1"))
    with ResultStore(path, config=config) as store:  # the same settings resume
        store.append(run_record("2"))
    other = {"policy": {"name": "small", "threshold": 7.0}, "workflow": "cot"}
    with pytest.raises(ValueError, match=r"policy.name: 'specreason' -> 'small'.*new file"):
        ResultStore(path, config=other).open_for_append()
    assert [r.id for r in ResultStore(path)] == ["1", "2"]
    legacy = tmp_path / "legacy.jsonl"
    legacy.write_text(json.dumps(run_record("1").to_dict()) + "\n")
    assert [r.id for r in ResultStore(legacy)] == ["1"]  # readable
    with pytest.raises(ValueError, match="no recorded configuration"):
        ResultStore(legacy, config=config).open_for_append()


def test_two_writers_of_one_store_are_refused_not_interleaved(tmp_path):
    path = tmp_path / "runs.jsonl"
    with ResultStore(path) as first:
        first.append(run_record("1"))
        with pytest.raises(ValueError, match="being written by another run"):
            ResultStore(path).append(run_record("2"))
        first.append(run_record("3"))
    with ResultStore(path) as again:  # the lock goes with the writer
        again.append(run_record("4"))
    assert [r.id for r in ResultStore(path)] == ["1", "3", "4"]


def test_a_store_in_an_unwritable_place_fails_before_anything_runs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot write"):
        ResultStore(blocker / "runs.jsonl").open_for_append()


def test_a_corrupt_line_is_reported_with_its_number(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(run_record("1").to_dict()) + "\nnot json\n")
    with pytest.raises(ValueError, match=r"runs.jsonl:2: not a run record"):
        ResultStore(path).done_ids()


def test_a_directory_is_not_a_store(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        ResultStore(tmp_path)


def test_a_killed_batch_resumes_without_losing_or_duplicating_results(tmp_path):
    path = tmp_path / "runs.jsonl"
    cmd = [sys.executable, "-c", BATCH_SCRIPT, str(path)]
    proc = subprocess.Popen([*cmd, "0.3"])
    deadline = time.time() + 60
    while time.time() < deadline:
        if path.exists() and len(list(ResultStore(path))) >= 3:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = [r.id for r in ResultStore(path)]
    assert 3 <= len(before) < 10, "the kill should land mid-batch"
    subprocess.run([*cmd, "0.0"], check=True, timeout=120)
    records = list(ResultStore(path))
    ids = [r.id for r in records]
    assert sorted(ids) == sorted(f"id{i}" for i in range(10))  # every run exactly once
    assert ids[: len(before)] == before  # finished results kept as they were
    assert all(r.status == "ok" and r.answer == f"TASK {r.id[2:]}" for r in records)


def test_wilson_interval_holds_the_observed_rate_even_at_the_edges():
    from thinkahead.orchestrator.summary import wilson_interval

    for successes, n in ((6, 6), (0, 4), (3, 5), (1, 1), (49, 50)):
        lo, hi = wilson_interval(successes, n)
        assert 0.0 <= lo <= successes / n <= hi <= 1.0
    assert wilson_interval(6, 6)[1] == 1.0 and wilson_interval(0, 4)[0] == 0.0
    lo, hi = wilson_interval(3, 5)
    assert round(lo, 3) == 0.231 and round(hi, 3) == 0.882
    with pytest.raises(ValueError, match="n must be positive"):
        wilson_interval(0, 0)
