"""`thinkahead generate` end to end on a tiny model saved to a directory, with resume."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from thinkahead.cli import main
from thinkahead.cli.generate import generation_log


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


def test_generate_checks_every_file_before_a_model_loads(model_dir, tmp_path) -> None:
    prompts = tmp_path / "in.jsonl"
    prompts.write_bytes(b'{"id": "a", "prompt": "w5 w6"}\n')
    base = ["generate", "-i", str(prompts), "-m", str(model_dir), "--dtype", "float32", "--max-new-tokens", "4"]

    def run(*extra: str):
        return CliRunner().invoke(main, [*base, *extra])

    missing = run("--cache-file", str(tmp_path / "no-folder" / "suffix.cache"))
    assert missing.exit_code == 2 and "folder" in missing.output and "does not exist" in missing.output
    truncated = tmp_path / "truncated.cache"
    good = tmp_path / "good.cache"
    assert run("--cache-file", str(good)).exit_code == 0 and good.stat().st_size > 0
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    for bad in (truncated, prompts):  # half a cache; a file that is no cache at all
        r = run("--cache-file", str(bad))
        assert r.exit_code == 2 and "not a readable suffix cache" in r.output and "Loading weights" not in r.output
    assert prompts.read_bytes() == b'{"id": "a", "prompt": "w5 w6"}\n'
    r = CliRunner().invoke(main, ["generate", "-i", str(prompts), "-o", str(prompts), "-m", str(model_dir)])
    assert r.exit_code == 2 and "is the input file" in r.output
    r = CliRunner().invoke(main, ["generate", "w5", "-m", "gguf:/nowhere/m.gguf"])
    assert r.exit_code == 2 and "--model: cannot resolve model spec" in r.output
    bad_bytes = tmp_path / "bad.jsonl"
    bad_bytes.write_bytes(b'{"id": "a", "prompt": "w5"}\n{"id": "b", "prompt": "caf\xe9"}\n')
    r = CliRunner().invoke(main, ["generate", "-i", str(bad_bytes), "-m", str(model_dir)])
    assert r.exit_code == 2 and f"{bad_bytes}:2: not UTF-8" in r.output
    r = CliRunner().invoke(main, ["generate", "w5", "-m", str(model_dir), "--max-draft", "0"])  # was a traceback
    assert r.exit_code == 2 and "--max-draft" in r.output and "Traceback" not in r.output


def test_a_cache_of_another_vocabulary_is_refused(model_dir, tmp_path) -> None:
    from thinkahead.token_spec.suffix_cache import SuffixCache

    cache = SuffixCache()
    cache.start_request("r", [5, 6, 7])
    cache.extend("r", [8, 100_000])  # an id far outside the tiny model's vocabulary
    cache.stop_request("r")
    path = tmp_path / "other.cache"
    cache.save(path)
    r = CliRunner().invoke(main, ["generate", "w5 w6", "-m", str(model_dir), "--dtype", "float32",
                                  "--cache-file", str(path)])
    assert r.exit_code == 2 and "token id 100000, outside" in r.output


@pytest.mark.parametrize("drafter", ["combined", "hybrid"])
def test_generate_runs_on_gguf_blocks(drafter, model_dir, tmp_path, monkeypatch) -> None:
    """dtype gguf (the default "auto" on the packaged models): the model's embedding is looked up from its
    blocks and has no `.weight` (was an AttributeError before any generation)."""
    from transformers import AutoTokenizer

    from thinkahead.models.engine.weights import gguf_native, load as weights
    from tests.test_gguf_native import tiny_config, write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    monkeypatch.setattr(weights, "load_causal_lm",
                        lambda spec, dtype: (gguf_native.build_model(path, tiny_config()), tokenizer))
    out = tmp_path / "out.jsonl"
    draft = ["--draft-model", str(model_dir)] if drafter == "hybrid" else []
    r = CliRunner().invoke(main, ["generate", "w5 w6 w7 w5 w6", "-m", str(model_dir), "--drafter", drafter, *draft,
                                  "--max-new-tokens", "8", "-o", str(out)])
    assert r.exit_code == 0, r.output
    rows = list(generation_log(out))
    assert len(rows) == 1 and 0 < len(rows[0]["token_ids"]) <= 8 and rows[0]["stats"]["spec_verify_ct"] >= 1


def test_a_torn_output_line_is_moved_aside_and_the_next_record_is_whole(model_dir, tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    args = ["generate", "w5 w6 w7", "w8 w9", "-o", str(out), "-m", str(model_dir), "--dtype", "float32",
            "--max-new-tokens", "4"]
    assert CliRunner().invoke(main, args[:2] + args[3:]).exit_code == 0  # the first prompt only
    with open(out, "ab") as f:
        f.write(b'{"id": "2", "prompt": "w8 w9", "te')  # a kill mid-write
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "moved to" in r.output
    assert [row["id"] for row in generation_log(out)] == ["1", "2"]
    assert (tmp_path / "out.jsonl.torn").read_bytes() == b'{"id": "2", "prompt": "w8 w9", "te\n'
    r = CliRunner().invoke(main, [*args[:-2], "--max-new-tokens", "5"])  # other settings: refused by name
    assert r.exit_code == 2 and "max_new_tokens: 4 -> 5" in r.output


@pytest.mark.slow
def test_generate_killed_at_random_points_resumes_with_every_id_once(model_dir, tmp_path) -> None:
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    rng = random.Random(0)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": " ".join(f"w{5 + (i * 7 + j) % 90}"
                                                                             for j in range(12))}) + "\n"
                               for i in range(40)))
    out, cache = tmp_path / "out.jsonl", tmp_path / "suffix.cache"
    cmd = [sys.executable, "-c", "from thinkahead.cli import main; main()", "generate", "-i", str(prompts),
           "-o", str(out), "-m", str(model_dir), "--dtype", "float32", "--max-new-tokens", "24",
           "--cache-file", str(cache)]

    def complete_lines() -> bytes:
        data = out.read_bytes() if out.exists() else b""
        return data[: data.rfind(b"\n") + 1]

    kills = 0
    while kills < 20:
        before = complete_lines()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and len(complete_lines()) <= len(before):
            time.sleep(0.005)  # wait until this process has written something, then kill it at a random point
        if proc.poll() is not None:
            break  # the batch finished before the kill
        time.sleep(rng.uniform(0, 0.05))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        assert complete_lines().startswith(before)  # no earlier line changed
    subprocess.run(cmd, check=True, timeout=300, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ids = [row["id"] for row in generation_log(out)]
    assert sorted(ids) == sorted(f"p{i}" for i in range(40))  # every id exactly once
    assert kills >= 10, "most kills should land mid-batch"
