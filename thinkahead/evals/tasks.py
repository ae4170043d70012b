"""Reading a batch of tasks from JSONL, with every bad line reported by its line number.

Each line is a JSON object with the question under "question" (or "problem", "prompt", "input"),
an optional "id" (default: "line-N") and an optional reference answer under "answer" (or
"reference"); other keys are passed to the workflow as extra inputs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUESTION_KEYS = ("question", "problem", "prompt", "input")
REFERENCE_KEYS = ("answer", "reference")


@dataclass(slots=True)
class Task:
    id: str
    inputs: dict[str, Any]
    reference: str | None = None
    line: int = 0


@dataclass
class BadLine:
    line: int
    reason: str


@dataclass
class TaskFile:
    tasks: list[Task] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)


def read_tasks(path: str | os.PathLike[str], limit: int | None = None) -> TaskFile:
    """All good tasks (at most `limit`) and all bad lines of `path` (undecodable bytes included)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"input file {path} does not exist")
    out = TaskFile()
    seen: dict[str, int] = {}
    with open(path, "rb") as f:  # lines end at b"\n" only, as editors and `wc -l` count them
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if limit is not None and len(out.tasks) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                out.bad.append(BadLine(lineno, f"not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})"))
                continue
            task, why = _parse(line, lineno)
            if task is None:
                out.bad.append(BadLine(lineno, why))
            elif task.id in seen:
                out.bad.append(BadLine(lineno, f"duplicate id {task.id!r} (first on line {seen[task.id]})"))
            else:
                seen[task.id] = lineno
                out.tasks.append(task)
    return out


def _parse(line: str, lineno: int) -> tuple[Task | None, str]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:  # the line is one JSON text, so the error's offset is its column
        return None, f"not valid JSON ({exc.msg} at column {exc.pos + 1})"
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    key = next((k for k in QUESTION_KEYS if k in record), None)
    if key is None:
        return None, f"no question: expected one of the keys {', '.join(QUESTION_KEYS)}"
    question = record[key]
    if not isinstance(question, str) or not question.strip():
        return None, f"{key!r} must be a non-empty string"
    rid = record.get("id", f"line-{lineno}")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        return None, f"'id' must be a string or an integer, got {rid!r}"
    ref_key = next((k for k in REFERENCE_KEYS if k in record), None)
    reference = record[ref_key] if ref_key else None
    if reference is not None and not isinstance(reference, (str, int, float)):
        return None, f"{ref_key!r} must be a string or a number"
    extra = {k: v for k, v in record.items() if k not in ("id", key, ref_key)}
    inputs = {"question": question, **extra}
    return Task(str(rid), inputs, None if reference is None else str(reference), lineno), ""
