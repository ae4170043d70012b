"""The result store: finished runs in a `JsonlLog` of kind "runs", so a killed batch resumes where it stopped.

Each finished run is one line, written and fsynced the moment it finishes, so a killed process
loses at most the runs that were in flight. When an id appears more than once the last record
wins, so a failed run that is retried later supersedes its error record. Reading never changes
the file; see `thinkahead.orchestrator.jsonl` for the header, torn tails and configuration checks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
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
        # while open for append (and so locked: no other writer), each id's last status: the file is read
        # once, by `open_for_append`, and `done_ids` answers from here
        self._status: dict[str, str] | None = None

    def open_for_append(self, on_record: Callable[[RunResult], None] | None = None) -> None:
        """`JsonlLog.open_for_append`, keeping each run's last status for `done_ids` as the check reads them."""
        if self._status is not None:
            return
        status: dict[str, str] = {}

        def keep(result: RunResult) -> None:
            status[result.id] = result.status
            if on_record is not None:
                on_record(result)

        super().open_for_append(keep)
        self._status = status

    def __iter__(self) -> Iterator[RunResult]:
        return super().__iter__()

    def latest(self) -> dict[str, RunResult]:
        """The last record of every id."""
        return {r.id: r for r in self}

    def done_ids(self) -> set[str]:
        """Ids whose last record finished (status ok or budget); these are skipped on resume. An open
        store answers from what `open_for_append` read and what was appended since; a closed one reads the file."""
        if self._status is not None:
            return {rid for rid, status in self._status.items() if status in DONE_STATUSES}
        return {rid for rid, r in self.latest().items() if r.status in DONE_STATUSES}

    def append(self, result: RunResult) -> None:
        """Write one run and make it durable before returning."""
        self.append_record(result.to_dict())
        if self._status is not None:
            self._status[result.id] = result.status

    def close(self) -> None:
        super().close()
        self._status = None  # closed, the file may change under us: read it again

    def __enter__(self) -> ResultStore:
        return self
