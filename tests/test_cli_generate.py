"""`thinkahead generate` end to end on a tiny model saved to a directory, with resume."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from thinkahead.cli import main
from thinkahead.generate import generation_log


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def test_generate_writes_results_and_resumes(model_dir, tmp_path) -> None:
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(
        json.dumps({"id": "a", "prompt": "w5 w6 w7 w8 w5 w6 w7"}) + "\n"
        + json.dumps({"id": "b", "prompt": "w9 w10 w11 w9 w10"}) + "\n"
    )
    out = tmp_path / "out.jsonl"
    cache = tmp_path / "suffix.cache"
    args = ["generate", "-i", str(prompts), "-o", str(out), "-m", str(model_dir), "--dtype", "float32",
            "--max-new-tokens", "12", "--cache-file", str(cache)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    rows = list(generation_log(out))
    assert [row["id"] for row in rows] == ["a", "b"]
    assert all(len(row["token_ids"]) == 12 and row["stats"]["spec_verify_ct"] >= 1 for row in rows)
    assert cache.exists()
    r = CliRunner().invoke(main, args)  # everything is done: nothing is regenerated
    assert r.exit_code == 0 and "2 of 2 already" in r.output
    assert len(list(generation_log(out))) == 2


def test_generate_reports_bad_input_with_line_numbers(model_dir, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "w5"}\n{"id": "b", "text": 3}\n')
    r = CliRunner().invoke(main, ["generate", "-i", str(bad), "-m", str(model_dir)])
    assert r.exit_code != 0 and "bad.jsonl:2" in r.output
    r = CliRunner().invoke(main, ["generate", "-m", str(model_dir)])
    assert r.exit_code != 0 and "give prompts" in r.output
