"""Evaluation data and suites: benchmark tasks read at run time from the PyPI packages that ship them.

- `load_suite(name) -> Suite`: a named, reproducible benchmark (`SUITES`): tasks, workflow, checker.
- `load_tasks(source, n, offset, seed)`: tasks of one source (`LOADERS`: gsm8k, math500, humaneval,
  spider, countdown, game24, bfcl) as `thinkahead.evals.tasks.Task`.
- `get_eval_checker(name)`: the answer checker of a suite or source (`CHECKERS`).

Data access (installed package or a wheel fetched once) is `thinkahead.evals.data`.
"""

from __future__ import annotations

from thinkahead.evals.checkers import CHECKERS, get_eval_checker
from thinkahead.evals.loaders import LOADERS, Loader, load_tasks
from thinkahead.evals.suites import SUITES, Suite, SuiteSpec, load_suite

__all__ = ["CHECKERS", "LOADERS", "SUITES", "Loader", "Suite", "SuiteSpec", "get_eval_checker", "load_suite",
           "load_tasks"]
