"""The one base class of thinkahead's own exceptions.

`except ThinkaheadError` catches every error the library raises on purpose (a bad graph, a model
server that failed, a corrupt log, a spent budget, a failed run with `raise_on_error=True`), and
lets programming errors (`TypeError`, ...) through. Each subclass keeps its older base too
(`GraphError` is still a `ValueError`), so existing `except` clauses keep working.
"""

from __future__ import annotations

from typing import Any

from thinkahead.models.errors import ModelFileError, ThinkaheadError  # defined low, so that every layer can subclass it


class RunFailed(ThinkaheadError):
    """A run that ended in error, raised by `Orchestrator.run(..., raise_on_error=True)`; `result`
    is the `RunResult` (its trace says which node failed and why)."""

    def __init__(self, result: Any) -> None:
        super().__init__(f"run {result.id} ({result.workflow}) ended {result.status}: {result.error}")
        self.result = result


__all__ = ["ModelFileError", "RunFailed", "ThinkaheadError"]
