"""docs/results/ is generated from bench/results/ by bench/results_docs.py: every suite has a page, none is stale."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs" / "results"


@pytest.fixture(scope="module")
def results_docs():
    spec = importlib.util.spec_from_file_location("results_docs", ROOT / "bench" / "results_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


@pytest.fixture(scope="module")
def generated(results_docs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("results")
    assert results_docs.main(["--out", str(out)]) == 0
    return out


def test_every_suite_folder_with_a_report_gets_a_page(generated):
    suites = sorted(p.name for p in RESULTS.iterdir() if (p / "report.md").is_file())
    assert suites, "no suite folders found in bench/results"
    index = (generated / "README.md").read_text()
    for suite in suites:
        page = generated / f"{suite}.md"
        assert page.is_file(), f"no page for bench/results/{suite}"
        assert f"]({suite}.md)" in index, f"the index does not link {suite}.md"
        # the page carries the suite's report table
        table = [line for line in (RESULTS / suite / "report.md").read_text().splitlines() if line.startswith("| ")]
        assert table and all(line in page.read_text() for line in table)


def test_committed_pages_are_up_to_date(generated):
    fresh = {p.name: p.read_text() for p in generated.glob("*.md")}
    committed = {p.name: p.read_text() for p in DOCS.glob("*.md")} if DOCS.is_dir() else {}
    missing, extra = sorted(set(fresh) - set(committed)), sorted(set(committed) - set(fresh))
    stale = sorted(n for n in set(fresh) & set(committed) if fresh[n] != committed[n])
    assert not (missing or extra or stale), (
        f"docs/results is out of date (missing {missing}, no source {extra}, stale {stale}); "
        "run: python bench/results_docs.py")


def test_links_in_the_pages_resolve(generated):
    link = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
    for page in generated.glob("*.md"):
        for target in link.findall(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            # links are written for docs/results/, whatever folder the pages were generated into
            assert (DOCS / target).resolve().exists(), f"{page.name}: dangling link {target}"


def test_check_mode_reports_a_stale_folder(results_docs, tmp_path):
    assert results_docs.main(["--check", "--out", str(tmp_path)]) == 1
    assert results_docs.main(["--out", str(tmp_path)]) == 0
    assert results_docs.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "gsm8k-50.md").write_text("edited by hand\n")
    assert results_docs.main(["--check", "--out", str(tmp_path)]) == 1


def test_json_results_render_as_tables(results_docs):
    text = results_docs.render_json({"machine": "x", "a": {"k": 1}, "b": {"k": 2.5}, "rows": [{"n": 1, "s": 0.5}]})
    assert "- machine: x" in text
    assert "|  | `a` | `b` |" in text and "| k | 1 | 2.5 |" in text
    assert "| n | s |" in text and "| 1 | 0.5 |" in text
