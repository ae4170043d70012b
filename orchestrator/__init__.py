"""The step-graph runtime: graphs (networkx), the async runtime, budgets, traces and the result store."""

from thinkahead.orchestrator.budget import BudgetExceeded, Meter, RetryPolicy, RunBudget
from thinkahead.orchestrator.graph import END, START, CompiledGraph, GraphError, StepGraph
from thinkahead.orchestrator.runtime import Runtime
from thinkahead.orchestrator.store import ResultStore
from thinkahead.orchestrator.trace import RunResult, TraceEvent

__all__ = [
    "END", "START", "BudgetExceeded", "CompiledGraph", "GraphError", "Meter", "ResultStore", "RetryPolicy",
    "RunBudget", "RunResult", "Runtime", "StepGraph", "TraceEvent",
]
