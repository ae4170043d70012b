"""Built-in workflows: each is a `StepGraph` builder with defaults that users can copy and change."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thinkahead.orchestrator.graph import StepGraph
from thinkahead.workflows.codefix import codefix
from thinkahead.workflows.cot import cot
from thinkahead.workflows.pipeline import pipeline
from thinkahead.workflows.react import react
from thinkahead.workflows.refine import refine
from thinkahead.workflows.vote import vote

WORKFLOWS: dict[str, Callable[..., StepGraph]] = {
    "cot": cot, "react": react, "refine": refine, "vote": vote, "pipeline": pipeline, "codefix": codefix,
}

QUESTION_ONLY = tuple(name for name in WORKFLOWS if name != "codefix")
"""Workflows that run from a question alone (codefix also needs the task's tests)."""

__all__ = ["QUESTION_ONLY", "WORKFLOWS", "build_workflow", "codefix", "cot", "pipeline", "react", "refine", "vote"]


def build_workflow(name: str, **options: Any) -> StepGraph:
    """The built-in workflow `name` with `options` passed to its builder."""
    if name not in WORKFLOWS:
        raise ValueError(f"unknown workflow {name!r}; built-in workflows: {', '.join(WORKFLOWS)}")
    try:
        return WORKFLOWS[name](**options)
    except TypeError as exc:
        raise ValueError(f"bad options for workflow {name!r}: {exc}") from exc
