"""The CLI's files and inputs: reading never changes a file, bad input is a one-line message with
exit code 2 before any model loads, a store refuses another configuration, failed runs exit 1."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from thinkahead.cli import main
from thinkahead.orchestrator.store import ResultStore


def model_args(model_dir) -> list[str]:
    return ["--small", str(model_dir), "--large", str(model_dir), "--dtype", "float32",
            "--max-steps", "2", "--step-tokens", "6", "--max-tokens", "24"]


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def no_model_loaded(result) -> bool:
    return "loading" not in result.output and "models ready" not in result.output


def test_trace_reads_a_file_without_changing_it(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"a\nb")
    result = invoke("trace", path)
    assert result.exit_code == 2 and f"{path}:1: not a run record" in result.output
    assert path.read_bytes() == b"a\nb"


def test_run_refuses_its_input_as_output_and_leaves_it_whole(tiny_model_dir, tmp_path):
    tasks = tmp_path / "t.jsonl"
    content = b'{"id": "1", "question": "w5 w6"}\n{"id": "2", "question": "w7 w8"}'  # no final newline
    tasks.write_bytes(content)
    result = invoke("run", tasks, "-o", tasks, *model_args(tiny_model_dir))
    assert result.exit_code == 2 and "is the input file" in result.output and no_model_loaded(result)
    assert tasks.read_bytes() == content
    link = tmp_path / "link.jsonl"
    link.symlink_to(tasks)
    result = invoke("run", tasks, "-o", link, *model_args(tiny_model_dir))
    assert result.exit_code == 2 and "is the input file" in result.output
    other_file = tmp_path / "other.jsonl"  # a file that is not a store: refused by name, never written
    other_file.write_bytes(content)
    result = invoke("run", tasks, "-o", other_file, *model_args(tiny_model_dir))
    assert result.exit_code == 2 and f"{other_file}:1: not a run record" in result.output and no_model_loaded(result)
    assert other_file.read_bytes() == content


def test_bad_bytes_and_bad_json_are_reported_on_their_own_lines_and_skipped(tiny_model_dir, tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_bytes(
        b'{"id": "a", "question": "w5 w6"}\n'
        b'{"id": "b", "question": "caf\xe9"}\n'  # Latin-1, not UTF-8
        b'{"id": "c", "question": "w7\rw8"}\n'  # a raw carriage return inside a string
        b'{"id": "d", "question": "w9" x}\n'
        b'{"id": "e", "question": "w10 w11"}\n'
    )
    out = tmp_path / "runs.jsonl"
    result = invoke("run", tasks, "-o", out, "--policy", "large", *model_args(tiny_model_dir))
    assert result.exit_code == 0, result.output
    assert f"{tasks}:2: not UTF-8 (byte 0xe9 at column 29) (skipped)" in result.output
    assert f"{tasks}:3: not valid JSON (Invalid control character" in result.output
    assert f"{tasks}:4: not valid JSON (Expecting ',' delimiter at column 30)" in result.output
    assert sorted(ResultStore(out).latest()) == ["a", "e"]
    fatal = invoke("run", tasks, "-o", tmp_path / "other.jsonl", "--on-bad-line", "fail", *model_args(tiny_model_dir))
    assert fatal.exit_code == 2 and "3 bad input line(s)" in fatal.output and no_model_loaded(fatal)


def test_a_store_is_resumed_only_under_its_own_configuration(tiny_model_dir, tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "a", "question": "w5 w6"}) + "\n" + json.dumps({"id": "b", "question": "w7"}) + "\n")
    out = tmp_path / "runs.jsonl"
    first = invoke("run", tasks, "-o", out, "--policy", "specreason", "--limit", "1", *model_args(tiny_model_dir))
    assert first.exit_code == 0, first.output
    before = out.read_bytes()
    other = invoke("run", tasks, "-o", out, "--policy", "small", *model_args(tiny_model_dir))
    assert other.exit_code == 2 and no_model_loaded(other)
    assert "policy.name: 'specreason' -> 'small'" in other.output and "new store" in other.output
    assert out.read_bytes() == before
    same = invoke("run", tasks, "-o", out, "--policy", "specreason", "--concurrency", "2", *model_args(tiny_model_dir))
    assert same.exit_code == 0 and "resuming: 1 of 2" in same.output  # concurrency does not change results
    assert sorted(ResultStore(out).latest()) == ["a", "b"]


@pytest.mark.parametrize("option, value, message", [
    ("--small", "no-such-model", "small.spec: cannot resolve model spec 'no-such-model'"),
    ("--large", "gguf:/nowhere/x.gguf", "GGUF file /nowhere/x.gguf does not exist"),
])
def test_a_bad_model_spec_is_one_line_before_any_model_loads(tiny_model_dir, tmp_path, option, value, message):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"question": "w5"}) + "\n")
    args = model_args(tiny_model_dir)
    args[args.index(option) + 1] = value
    result = invoke("run", tasks, "-o", tmp_path / "runs.jsonl", *args)
    assert result.exit_code == 2 and message in result.output and no_model_loaded(result)
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1
    assert not (tmp_path / "runs.jsonl").exists()


def test_config_values_are_checked_when_the_config_is_read(tiny_model_dir, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(f"small: {{spec: {tiny_model_dir}, dtype: int4, drafter: telepathy}}\nlarge: {tiny_model_dir}\n")
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"question": "w5"}) + "\n")
    result = invoke("run", tasks, "-o", tmp_path / "runs.jsonl", "--config", config)
    assert result.exit_code == 2 and no_model_loaded(result)
    assert f"config file {config}: small.dtype: unknown dtype 'int4'" in result.output
    assert f"config file {config}: small.drafter: unknown drafter 'telepathy'" in result.output


def test_an_unwritable_store_and_a_corrupt_store_fail_before_any_model_loads(tiny_model_dir, tmp_path):
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"question": "w5"}) + "\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result = invoke("run", tasks, "-o", blocker / "runs.jsonl", *model_args(tiny_model_dir))
    assert result.exit_code == 2 and "cannot write" in result.output and no_model_loaded(result)
    out = tmp_path / "runs.jsonl"
    assert invoke("run", tasks, "-o", out, *model_args(tiny_model_dir)).exit_code == 0
    lines = out.read_text().splitlines()
    out.write_text("\n".join([lines[0], "{corrupt", *lines[1:]]) + "\n")
    result = invoke("run", tasks, "-o", out, *model_args(tiny_model_dir))
    assert result.exit_code == 2 and f"{out}:2: not a run record" in result.output and no_model_loaded(result)


def test_failed_runs_exit_1_after_the_summary(tiny_model_dir, tmp_path, monkeypatch):
    from thinkahead.models.local import LocalModel

    real = LocalModel.generate

    async def generate(self, request):  # a model failure on one task only
        if "BOOM" in repr(request):
            raise RuntimeError("injected model failure")
        return await real(self, request)

    monkeypatch.setattr(LocalModel, "generate", generate)
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "good", "question": "w5 w6"}) + "\n"
                     + json.dumps({"id": "bad", "question": "w9 BOOM"}) + "\n")
    out = tmp_path / "runs.jsonl"
    result = invoke("run", tasks, "-o", out, "--policy", "large", *model_args(tiny_model_dir))
    assert result.exit_code == 1, result.output
    assert "cot/large" in result.output and "1 run(s) failed (bad)" in result.output  # the summary still prints
    assert {rid: r.status for rid, r in ResultStore(out).latest().items()} == {"good": "ok", "bad": "error"}


def _a_store(path) -> None:
    from thinkahead.orchestrator.trace import RunResult

    with ResultStore(path) as store:
        store.append(RunResult(id="0", workflow="cot", status="ok", answer="1", cost={"tokens": {"small": 3}, "wall_s": 0.5}))


@pytest.mark.parametrize("where", ["under a file", "a folder the system refuses", "under a missing /proc entry"])
def test_compare_to_an_unwritable_folder_is_one_line_and_exit_2(tiny_model_dir, tmp_path, where):
    """As `run` and `generate` for the same paths (one handler, `options.output_errors`); it was a
    NotADirectoryError / PermissionError / FileNotFoundError traceback with exit 1."""
    import sys

    if where != "under a file" and not sys.platform.startswith("linux"):
        pytest.skip("/sys and /proc are Linux")
    store = tmp_path / "runs.jsonl"
    _a_store(store)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = {"under a file": blocker / "report", "a folder the system refuses": "/sys/thinkahead-report",
           "under a missing /proc entry": "/proc/thinkahead-none/report"}[where]
    result = invoke("compare", f"a={store}", "-o", out)
    assert result.exit_code == 2, result.output
    assert "cannot write" in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1
    assert blocker.read_text() == "x"
    # the same path as a store of `run` is refused in the same words
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"question": "w5"}) + "\n")
    run = invoke("run", tasks, "-o", f"{out}.jsonl", *model_args(tiny_model_dir))
    assert run.exit_code == 2 and "cannot write" in run.output and no_model_loaded(run), run.output


_STEP = {"run_id": "1", "kind": "step", "node": "reason", "t": 0.5,
         "data": {"index": 0, "author": "small", "verdict": "accepted", "score": 8, "tokens": {"small": 4},
                  "time_s": 0.1, "text": "Add."}}


@pytest.mark.parametrize("fields, named", [
    ({"steps": "abc", "cost": "z"}, "['steps']"),
    ({"cost": "z"}, "cost must be an object, got str 'z'"),
    ({"cost": {"wall_s": "z"}}, "cost.wall_s must be a number"),
    ({"cost": {"tokens": 5}}, "cost.tokens must be an object of numbers"),
    ({"trace": "abc"}, "trace must be a list"),
    ({"trace": [_STEP, "abc"]}, "trace[1] must be an object"),
    ({"trace": [{**_STEP, "t": "soon"}]}, "trace[0].t must be a number"),
    ({"trace": [{**_STEP, "data": {**_STEP["data"], "index": "first"}}]}, "trace[0].data.index must be an integer"),
    ({"trace": [{**_STEP, "data": {"index": 0, "verdict": "accepted"}}]}, "trace[0] (step) lacks data.author"),
    ({"trace": [{**_STEP, "kind": "teleport"}]}, "trace[0].kind must be one of"),
    ({"status": "done"}, "status must be one of ok, error, budget, cancelled"),
    ({"error": 5}, "error must be a string or null"),
    ({"meta": []}, "meta must be an object"),
])
def test_a_record_of_the_wrong_shape_is_refused_naming_file_line_and_field(tmp_path, fields, named):
    """Records were checked for id, status and workflow only: `"cost": "z"` made `trace --id` an
    AttributeError traceback. Now every command that reads the store refuses it as a corrupt line."""
    path = tmp_path / "runs.jsonl"
    _a_store(path)
    good = json.loads(path.read_text().splitlines()[1])
    path.write_text(path.read_text() + json.dumps({**good, "id": "1", **fields}) + "\n")
    before = path.read_bytes()
    for args in (["trace", path, "--id", "1"], ["trace", path], ["compare", f"a={path}", "-o", tmp_path / "r"]):
        result = invoke(*args)
        assert result.exit_code == 2, result.output
        assert f"{path}:3: not a run record" in result.output and named in result.output, result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert path.read_bytes() == before


def test_a_well_formed_record_with_steps_is_shown(tmp_path):
    path = tmp_path / "runs.jsonl"
    _a_store(path)
    good = json.loads(path.read_text().splitlines()[1])
    path.write_text(path.read_text() + json.dumps({**good, "id": "1", "trace": [_STEP]}) + "\n")
    result = invoke("trace", path, "--id", "1")
    assert result.exit_code == 0 and "step  0 small accepted   score 8 4 tok" in result.output, result.output


def test_trace_of_an_unreadable_file_is_one_line(tmp_path):
    """`trace /proc/self/mem` was an OSError traceback (EIO on read)."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc is Linux")
    result = invoke("trace", "/proc/self/mem")
    assert result.exit_code == 2 and "cannot read /proc/self/mem" in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
