"""An append-only JSONL store of finished runs: a killed batch resumes where it stopped.

Each finished run is one line, written and flushed (and fsynced) the moment it finishes, so a
killed process loses at most the runs that were in flight. On open, a torn last line (the process
died mid-write) is cut off. When an id appears more than once the last record wins, so a failed
run that is retried later supersedes its error record.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from thinkahead.orchestrator.trace import RunResult

log = logging.getLogger(__name__)

DONE_STATUSES = ("ok", "budget")  # "error" and "cancelled" runs are run again on resume


class ResultStore:
    """Runs stored one JSON object per line in `path`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"result store {self.path} is a directory, not a .jsonl file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.torn_bytes = self._cut_torn_tail()
        self._file = None

    def _cut_torn_tail(self) -> int:
        """Drop an unterminated last line (a write cut short by a kill); returns the bytes dropped."""
        if not self.path.exists():
            return 0
        with open(self.path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            pos = size - 1
            while pos > 0:  # scan back to the last newline
                step = min(4096, pos)
                f.seek(pos - step)
                chunk = f.read(step)
                idx = chunk.rfind(b"\n")
                if idx >= 0:
                    pos = pos - step + idx + 1
                    break
                pos -= step
            f.truncate(pos)
            log.warning("result store %s: dropped a torn last line (%d bytes)", self.path, size - pos)
            return size - pos

    def __iter__(self) -> Iterator[RunResult]:
        """Every stored record in file order (superseded ones included)."""
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield RunResult.from_dict(json.loads(line))
                except (json.JSONDecodeError, ValueError, TypeError) as exc:
                    raise ValueError(f"{self.path}:{lineno}: not a run record ({exc})") from exc

    def latest(self) -> dict[str, RunResult]:
        """The last record of every id."""
        return {r.id: r for r in self}

    def done_ids(self) -> set[str]:
        """Ids whose last record finished (status ok or budget); these are skipped on resume."""
        return {rid for rid, r in self.latest().items() if r.status in DONE_STATUSES}

    def append(self, result: RunResult) -> None:
        """Write one run and make it durable before returning."""
        line = json.dumps(result.to_dict(), ensure_ascii=False, default=repr) + "\n"
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
