"""The Python SDK: `Orchestrator` ties models, a step policy and workflows to the runtime.

```python
from thinkahead import Orchestrator

orch = Orchestrator(small="qwen2.5-coder-0.5b", large="qwen2.5-coder-1.5b", policy="specreason")
result = orch.run_sync("cot", "What is 17 * 23?")
print(result.answer, result.cost["tokens"])
```

Models load on first use; a spec used for both tiers loads once. Any `LanguageModel` instance
can stand in for a spec (an `OpenAIModel`, a `ScriptedModel` in tests). The orchestrator is a context
manager (`with` or `async with`) that closes its models at the end; `run_sync` and `map_sync` work in
code with a running event loop too (Jupyter), and `run(..., raise_on_error=True)` raises
`thinkahead.errors.RunFailed` for a failed run instead of returning it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from thinkahead.config import OrchestratorConfig, explain
from thinkahead.errors import RunFailed
from thinkahead.models.base import LanguageModel
from thinkahead.models.loader import check_hub_model_local
from thinkahead.orchestrator.graph import CompiledGraph, StepGraph
from thinkahead.orchestrator.runtime import Runtime
from thinkahead.orchestrator.store import ResultStore
from thinkahead.orchestrator.trace import RunResult, TraceEvent
from thinkahead.step_spec.base import is_step_policy
from thinkahead.step_spec.state import TIERS

Workflow = str | StepGraph | CompiledGraph | None
BatchWorkflow = Workflow | Callable[[str], StepGraph | CompiledGraph]  # a graph per run id
T = TypeVar("T")
log = logging.getLogger(__name__)


def run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to the end from synchronous code: in a new event loop, or, where this thread already
    runs one (Jupyter, an async framework), in a worker thread with its own loop, waiting for it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="thinkahead-sync") as pool:
        return pool.submit(asyncio.run, coro).result()


class Orchestrator:
    """Runs workflows with a small and a large model under a step policy."""

    def __init__(
        self,
        small: str | LanguageModel | None = None,
        large: str | LanguageModel | None = None,
        policy: Any = None,
        *,
        config: OrchestratorConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
        **settings: Any,
    ) -> None:
        if isinstance(config, (str, os.PathLike)):
            config = OrchestratorConfig.from_file(config)
        base = config.model_dump() if isinstance(config, OrchestratorConfig) else dict(config or {})
        self._instances: dict[str, LanguageModel] = {}
        for tier, value in zip(TIERS, (small, large)):
            if isinstance(value, LanguageModel):
                self._instances[tier] = value
            elif value is not None:
                base[tier] = value
        self._policy = None
        if isinstance(policy, (str, Mapping, BaseModel)):
            base["policy"] = policy  # a registered policy's name or settings, validated with the config
        elif is_step_policy(policy):
            self._policy = policy  # a policy object: `start(ctx)` (or, written before it, `next_step(ctx)`)
        elif policy is not None:
            raise ValueError(f"policy must be a policy name, its settings (a mapping) or a policy object with "
                             f"start(ctx), got {type(policy).__name__} {policy!r:.60}")
        base.update(settings)
        try:
            self.config = OrchestratorConfig.model_validate(base)
        except ValidationError as exc:  # one line per problem, not pydantic's report
            raise ValueError(explain(exc, "Orchestrator")) from None
        for tier in TIERS:
            if tier not in self._instances:
                check_hub_model_local(getattr(self.config, tier).spec)
        self._runtime: Runtime | None = None
        self._graphs: dict[tuple[str, tuple], CompiledGraph] = {}

    @classmethod
    def from_config(cls, path: str | os.PathLike[str], **settings: Any) -> Orchestrator:
        """An orchestrator from a YAML/TOML/JSON file; `settings` override fields of the file."""
        return cls(config=OrchestratorConfig.from_file(path), **settings)

    # ------------------------------------------------------------------ parts

    @property
    def runtime(self) -> Runtime:
        """The runtime, built (and the models loaded) on first use."""
        if self._runtime is None:
            c = self.config
            small, large = self._load_models()
            self._runtime = Runtime(
                small, large, self._policy or c.policy.build(), segment=c.segment, step_budget=c.steps,
                budget=c.budget, batch_budget=c.batch_budget, concurrency=c.concurrency, retry=c.retry,
                speculative=c.token_spec,
            )
        return self._runtime

    def _load_models(self) -> tuple[LanguageModel, LanguageModel]:
        from thinkahead.models.loader import load_pair

        c = self.config
        return load_pair(self._instances.get("small", c.small.spec), self._instances.get("large", c.large.spec),
                         c.small.options(), c.large.options())

    @property
    def small(self) -> LanguageModel:
        return self.runtime.models["small"]

    @property
    def large(self) -> LanguageModel:
        return self.runtime.models["large"]

    def workflow(self, workflow: Workflow = None, **options: Any) -> CompiledGraph:
        """A compiled workflow: a built-in name (default: the config's) or your own graph."""
        if isinstance(workflow, CompiledGraph):
            return workflow
        if isinstance(workflow, StepGraph):
            return workflow.compile()
        from thinkahead.workflows import build_workflow

        name = workflow or self.config.workflow
        if not options and name == self.config.workflow:
            options = dict(self.config.workflow_options)
        key = (name, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in self._graphs:
            self._graphs[key] = build_workflow(name, **options).compile()
        return self._graphs[key]

    # ------------------------------------------------------------------ running

    async def run(self, workflow: Workflow, input: Mapping[str, Any] | str, *, id: str | None = None,
                  session: str | None = None, raise_on_error: bool = False) -> RunResult:
        """Run one workflow on one input (a string, or a dict of the workflow's inputs).

        `session` names an agent conversation that calls again and again with a growing history:
        drafting state carries over between its runs (suffix trees extended, not rebuilt).
        `raise_on_error`: a run that ends in error raises `RunFailed` (with the result) instead of
        being returned; a run a budget cut short is still returned (status "budget").
        """
        result = await self.runtime.run(self.workflow(workflow), input, run_id=id, session=session)
        if result.status == "error":
            log.warning("run %s (%s) failed: %s", result.id, result.workflow, result.error)
            if raise_on_error:
                raise RunFailed(result)
        return result

    def run_sync(self, workflow: Workflow, input: Mapping[str, Any] | str, *, id: str | None = None,
                 session: str | None = None, raise_on_error: bool = False) -> RunResult:
        """`run` from synchronous code (a running event loop, as in Jupyter, is fine too)."""
        return run_coroutine(self.run(workflow, input, id=id, session=session, raise_on_error=raise_on_error))

    async def map(
        self,
        batch: Iterable[Any],
        workflow: BatchWorkflow = None,
        *,
        store: str | os.PathLike[str] | ResultStore | None = None,
        on_result: Callable[[RunResult], None] | None = None,
        listeners: list[Callable[[TraceEvent], None]] | None = None,
        annotate: Callable[[RunResult], None] | None = None,
    ) -> list[RunResult]:
        """Run a batch: items are inputs (ids are their positions) or `(id, input[, meta])` tuples.

        With `store`, each result is appended to that JSONL file as it finishes and runs already
        there are skipped, so a killed batch resumes where it stopped.
        """
        items = []
        for i, item in enumerate(batch):
            items.append(item if isinstance(item, tuple) else (str(i), item))
        owned = store is not None and not isinstance(store, ResultStore)
        if owned:
            identity = self.config.store_identity()
            if isinstance(workflow, str):
                identity["workflow"] = workflow
            result_store = ResultStore(store, config=identity)
        else:
            result_store = store
        try:
            graph = workflow if callable(workflow) and not isinstance(workflow, StepGraph) else self.workflow(workflow)
            return await self.runtime.map(graph, items, store=result_store, on_result=on_result,
                                          listeners=listeners, annotate=annotate)
        finally:
            if owned:
                result_store.close()

    def map_sync(self, batch: Iterable[Any], workflow: Workflow = None, **kwargs: Any) -> list[RunResult]:
        """`map` from synchronous code (a running event loop, as in Jupyter, is fine too)."""
        return run_coroutine(self.map(batch, workflow, **kwargs))

    async def stream(self, workflow: Workflow, input: Mapping[str, Any] | str, *, id: str | None = None,
                     session: str | None = None) -> AsyncIterator[TraceEvent | RunResult]:
        """Each trace event (node starts and ends, every reasoning step) as it happens, then the result."""
        async for item in self.runtime.stream(self.workflow(workflow), input, run_id=id, session=session):
            yield item

    def as_tool(self, workflow: Workflow = None, input_key: str = "question") -> Callable[[dict], Any]:
        """This orchestrator as a tool node of another graph: reads `input_key`, returns the answer.

        A failed inner run raises, so the outer node fails with the inner error in its trace.
        """
        async def tool(state: dict) -> Any:
            result = await self.run(workflow, state[input_key])
            if not result.ok:
                raise RuntimeError(f"inner workflow {result.workflow!r} ended {result.status}: {result.error}")
            return result.answer

        return tool

    def __enter__(self) -> Orchestrator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Orchestrator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def close(self) -> None:
        """`aclose` from synchronous code."""
        run_coroutine(self.aclose())

    async def aclose(self) -> None:
        """Release the models' connections and memory."""
        if self._runtime is not None:
            seen = set()
            for model in self._runtime.models.values():
                if id(model) not in seen:
                    seen.add(id(model))
                    await model.aclose()
