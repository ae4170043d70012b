"""The result store: finished runs in a `JsonlLog` of kind "runs", so a killed batch resumes where it stopped.

Each finished run is one line, written and fsynced the moment it finishes, so a killed process
loses at most the runs that were in flight. When an id appears more than once the last record
wins, so a failed run that is retried later supersedes its error record. Reading never changes
the file; see `thinkahead.orchestrator.jsonl` for the header, torn tails and configuration checks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from thinkahead.orchestrator.jsonl import JsonlLog, LogError
from thinkahead.orchestrator.trace import RunResult

DONE_STATUSES = ("ok", "budget")  # "error" and "cancelled" runs are run again on resume
STORE_KIND = "runs"

__all__ = ["DONE_STATUSES", "LogError", "ResultStore"]


class ResultStore(JsonlLog):
    """Runs stored one JSON object per line in `path`, written under `config` (None: unchecked)."""

    def __init__(self, path: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> None:
        super().__init__(path, STORE_KIND, RunResult.from_dict, config)

    def __iter__(self) -> Iterator[RunResult]:
        return super().__iter__()

    def latest(self) -> dict[str, RunResult]:
        """The last record of every id."""
        return {r.id: r for r in self}

    def done_ids(self) -> set[str]:
        """Ids whose last record finished (status ok or budget); these are skipped on resume."""
        return {rid for rid, r in self.latest().items() if r.status in DONE_STATUSES}

    def append(self, result: RunResult) -> None:
        """Write one run and make it durable before returning."""
        self.append_record(result.to_dict())

    def __enter__(self) -> ResultStore:
        return self
