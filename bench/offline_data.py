"""Benchmark data read from PyPI packages that ship it: a re-export of `thinkahead.evals.data`.

The reader lives in the installed package so that `thinkahead bench --suite` can load data at run
time; the bench scripts keep importing it from here.
"""

from __future__ import annotations

from thinkahead.evals.data import (  # noqa: F401 - re-exported for the bench scripts and tests
    PACKAGES,
    DataUnavailableError,
    bfcl,
    bfcl_answers,
    gsm8k,
    humaneval,
    math500,
    read_package_file,
    spider_dev,
    spider_tables,
    wheel_path,
)
