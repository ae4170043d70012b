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
        """A run read back from its JSON record, whose shape is checked first (`check_record`)."""
        check_record(data)
        return cls(**data)


_Check = tuple[str, Callable[[Any], bool]]
_TEXT: _Check = ("a string", lambda v: isinstance(v, str))
_OBJECT: _Check = ("an object", lambda v: isinstance(v, dict))
_LIST: _Check = ("a list", lambda v: isinstance(v, list))
_INT: _Check = ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
_NUMBER: _Check = ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
_NUMBER_OR_NULL: _Check = ("a number or null", lambda v: v is None or _NUMBER[1](v))
_TEXT_OR_NULL: _Check = ("a string or null", lambda v: v is None or isinstance(v, str))
_NUMBERS: _Check = ("an object of numbers", lambda v: isinstance(v, dict) and all(map(_NUMBER[1], v.values())))
_ANY: _Check = ("any JSON value", lambda v: True)
_RECORD: dict[str, _Check] = {"id": _TEXT, "workflow": _TEXT, "status": _TEXT, "outputs": _OBJECT, "input": _OBJECT,
                              "cost": _OBJECT, "trace": _LIST, "error": _TEXT_OR_NULL, "meta": _OBJECT}
"""A run record's fields and their JSON types (`answer` may be any JSON value)."""
_COST: dict[str, _Check] = {"tokens": _NUMBERS, "spec": _NUMBERS, "accept_length": _NUMBER_OR_NULL}
"""`cost` entries that are not plain numbers (`CostMeter.snapshot`); every other entry is a number."""
_EVENT: dict[str, _Check] = {"run_id": _TEXT, "kind": _TEXT, "node": _TEXT_OR_NULL, "t": _NUMBER, "data": _OBJECT}
_EVENT_DATA: dict[str, dict[str, _Check]] = {
    "step": {"index": _INT, "author": _TEXT, "verdict": _TEXT},
    "node_end": {"status": _TEXT},
}
"""Per event kind, the `data` entries every such event has."""
_DATA_TYPES: dict[str, _Check] = {"text": _TEXT, "score": _NUMBER_OR_NULL, "tokens": _NUMBERS, "time_s": _NUMBER,
                                  "judge_calls": _NUMBER}
"""`data` entries of any event that, when present, have this type (what the trace view and summaries read)."""


def _expect(where: str, value: Any, check: _Check) -> None:
    what, ok = check
    if not ok(value):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"{where} must be {what}, got {type(value).__name__} {shown}")


def check_record(data: dict[str, Any]) -> None:
    """ValueError naming the field unless `data` has the shape of a `RunResult.to_dict()` record."""
    missing = [k for k in ("id", "workflow", "status") if k not in data]
    if missing:
        raise ValueError(f"run record lacks {missing}")
    unknown = sorted(set(data) - set(RunResult.__dataclass_fields__))
    if unknown:
        raise ValueError(f"unknown run record field(s) {unknown}")
    for key, check in _RECORD.items():
        if key in data:
            _expect(key, data[key], check)
    if data["status"] not in RUN_STATUSES:
        raise ValueError(f"status must be one of {', '.join(RUN_STATUSES)}, got {data['status']!r}")
    for key, value in data.get("cost", {}).items():
        _expect(f"cost.{key}", value, _COST.get(key, _NUMBER))
    for i, event in enumerate(data.get("trace", [])):
        _expect(f"trace[{i}]", event, _OBJECT)
        for key, check in _EVENT.items():
            if key not in event:
                raise ValueError(f"trace[{i}] lacks {key!r}")
            _expect(f"trace[{i}].{key}", event[key], check)
        if event["kind"] not in EVENT_KINDS:
            raise ValueError(f"trace[{i}].kind must be one of {', '.join(EVENT_KINDS)}, got {event['kind']!r}")
        needed = _EVENT_DATA.get(event["kind"], {})
        for key, value in event["data"].items():
            _expect(f"trace[{i}].data.{key}", value, needed.get(key) or _DATA_TYPES.get(key, _ANY))
        for key in needed.keys() - event["data"].keys():
            raise ValueError(f"trace[{i}] ({event['kind']}) lacks data.{key}")


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
