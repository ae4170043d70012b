"""Traces and run results: what happened in a run, step by step, and what it cost.

A `Tracer` records `TraceEvent`s (run, node and step events) and hands each one to the
listeners as it happens (streaming). A `RunResult` holds a run's answer, its trace and its cost,
and round-trips through JSON for the result store.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

EVENT_KINDS = ("run_start", "node_start", "node_end", "step", "error", "run_end")
RUN_STATUSES = ("ok", "error", "budget", "cancelled")


@dataclass(slots=True)
class TraceEvent:
    """One thing that happened in a run; `t` is seconds since the run started."""

    run_id: str
    kind: str
    node: str | None
    t: float
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "kind": self.kind, "node": self.node, "t": self.t, "data": self.data}


Listener = Callable[[TraceEvent], None]


class Tracer:
    """Collects a run's events and forwards each to the listeners."""

    __slots__ = ("run_id", "events", "listeners", "started")

    def __init__(self, run_id: str, listeners: list[Listener] | None = None) -> None:
        self.run_id = run_id
        self.events: list[TraceEvent] = []
        self.listeners = list(listeners or [])
        self.started = time.perf_counter()

    def emit(self, kind: str, node: str | None = None, /, **data: Any) -> TraceEvent:
        event = TraceEvent(self.run_id, kind, node, round(time.perf_counter() - self.started, 6), data)
        self.events.append(event)
        for listener in self.listeners:
            listener(event)
        return event


@dataclass
class RunResult:
    """A finished run: status, answer, the final state's outputs, cost and trace.

    `status` is "ok", "error" (a node failed; `error` says which and why), "budget" (a run or
    batch limit ran out; `error` names it) or "cancelled".
    """

    id: str
    workflow: str
    status: str
    answer: Any = None
    outputs: dict[str, Any] = field(default_factory=dict)
    input: dict[str, Any] = field(default_factory=dict)
    cost: dict[str, Any] = field(default_factory=dict)
    trace: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. the reference answer and correctness

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def steps(self) -> list[dict[str, Any]]:
        """The step events of the trace, in order."""
        return [e for e in self.trace if e["kind"] == "step"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        missing = {"id", "workflow", "status"} - set(known)
        if missing:
            raise ValueError(f"run record lacks {sorted(missing)}")
        return cls(**known)


def jsonable(value: Any) -> Any:
    """`value` as JSON data: containers recursively, objects with `to_dict`, else their repr."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "to_dict"):
        return jsonable(value.to_dict())
    return repr(value)
