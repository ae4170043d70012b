"""The runtime: runs compiled step graphs, many at once, under budgets, with traces.

One `Runtime` holds the models (a small and a large tier), the step policy for `think` nodes and
the limits. `run(graph, inputs)` runs one graph: every node starts as soon as its predecessors are
done (independent nodes overlap), loops run their body while their condition holds, a join that
fires early (first to finish, or decided) cancels the branches still running. `map(graph, items)` runs a batch with a
concurrency limit, writes each finished run to a `ResultStore` at once and skips runs the store
already holds. A failing node ends its run with status "error"; it never takes the batch down.
Synchronous tool nodes run in a thread of their own (`call_in_thread`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
from thinkahead.orchestrator.budget import (
    BudgetExceeded,
    Meter,
    MeteredModel,
    RetryPolicy,
    RunBudget,
)
from thinkahead.orchestrator.graph import (
    CompiledGraph,
    StepGraph,
    first_join_branches,
)
from thinkahead.orchestrator.nodes import (
    GenerateSpec,
    JoinSpec,
    LoopSpec,
    Node,
    ThinkSpec,
    ToolSpec,
)
from thinkahead.orchestrator.store import ResultStore
from thinkahead.orchestrator.threads import ToolTimeoutError, call_in_thread  # noqa: F401 - ToolTimeoutError: re-exported
from thinkahead.orchestrator.trace import (
    Listener,
    RunResult,
    TraceEvent,
    Tracer,
    jsonable,
)
from thinkahead.step_spec.loop import StepBudget, StepLoop
from thinkahead.step_spec.policies import StepPolicy, check_policy_models
from thinkahead.step_spec.segment import SegmentConfig

from thinkahead.models.base import GenerationRequest, LanguageModel, grammar_fits
from thinkahead.models.errors import ThinkaheadError

_run_ids = itertools.count()
log = logging.getLogger(__name__)


@dataclass
class _Run:
    """Everything one run of a graph touches."""

    graph: CompiledGraph
    state: dict[str, Any]
    tracer: Tracer
    meter: Meter
    models: dict[str, MeteredModel]
    session: str | None = None  # a caller's session that outlives this run (a multi-turn agent)
    sessions: set[str] = field(default_factory=set)
    joined: dict[str, list[str]] = field(default_factory=dict)  # an early join -> the branches it merged

    def session_id(self, node: str) -> str:
        """The agent session of a node: its prompts grow turn by turn (within the run, or across
        the runs of the caller's `session`)."""
        sid = f"{self.session or self.tracer.run_id}/{node}"
        self.sessions.add(sid)
        return sid


class NodeError(ThinkaheadError, RuntimeError):
    """A node failed; the message names the node and the cause."""


class Runtime:
    """Runs step graphs with two model tiers and a step policy."""

    def __init__(
        self,
        small: LanguageModel,
        large: LanguageModel,
        policy: StepPolicy,
        *,
        segment: SegmentConfig | None = None,
        step_budget: StepBudget | None = None,
        budget: RunBudget | None = None,
        batch_budget: RunBudget | None = None,
        concurrency: int = 4,
        retry: RetryPolicy | None = None,
        speculative: bool = True,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        check_policy_models(policy, small, large)
        self.models = {"small": small, "large": large}
        self.policy = policy
        self.segment = segment or SegmentConfig()
        self.step_budget = step_budget or StepBudget()
        self.budget = budget or RunBudget()
        self.batch_meter = Meter(batch_budget or RunBudget(), scope="batch")
        self.concurrency = concurrency
        self.retry = retry or RetryPolicy()
        self.speculative = speculative

    # ------------------------------------------------------------------ one run

    async def run(
        self,
        graph: StepGraph | CompiledGraph,
        inputs: Mapping[str, Any] | str,
        run_id: str | None = None,
        listeners: list[Listener] | None = None,
        meta: dict[str, Any] | None = None,
        session: str | None = None,
    ) -> RunResult:
        """Run `graph` on `inputs` (a dict of its input keys, or a string for a single input).

        `session` names a conversation that continues over several runs (an agent calling again
        with a longer history): the models keep its drafting state between runs, and drop it
        after their idle timeout. Without it, a run's sessions end with the run.
        """
        compiled = graph.compile() if isinstance(graph, StepGraph) else graph
        state = _initial_state(compiled, inputs)
        run_id = run_id or f"run-{next(_run_ids)}"
        meter = Meter(self.budget, scope="run", parent=self.batch_meter)
        tracer = Tracer(run_id, listeners)
        models = {tier: MeteredModel(m, tier, meter, self.retry) for tier, m in self.models.items()}
        run = _Run(compiled, state, tracer, meter, models, session)
        tracer.emit("run_start", workflow=compiled.name, inputs=jsonable(state))
        log.info("run %s started (workflow %s)", run_id, compiled.name)
        status, error = "ok", None
        try:
            if self.budget.max_wall_s is not None:
                async with asyncio.timeout(self.budget.max_wall_s):
                    await self._run_region(run, None)
            else:
                await self._run_region(run, None)
        except BudgetExceeded as exc:
            status, error = "budget", str(exc)
        except TimeoutError:
            status, error = "budget", f"run budget max_wall_s={self.budget.max_wall_s:g} exhausted"
        except asyncio.CancelledError:
            status, error = "cancelled", "the run was cancelled"
            raise
        except Exception as exc:  # noqa: BLE001 - a failed run is a result, not a crash
            status, error = "error", f"{exc}" if isinstance(exc, NodeError) else f"{type(exc).__name__}: {exc}"
        finally:
            if status != "ok":
                tracer.emit("error", status=status, error=error)
            cost = meter.snapshot()
            tracer.emit("run_end", status=status, cost=cost)
            if status == "ok":
                log.info("run %s ended ok in %.2f s (%s tokens)", run_id, cost.get("wall_s", 0.0), cost.get("tokens"))
            else:  # budget stops, failures and cancellations are worth a warning in the logs
                log.warning("run %s ended %s: %s", run_id, status, error)
            await self._end_sessions(run)
        answer = state.get(compiled.output) if compiled.output else None
        outputs = {k: jsonable(v) for k, v in state.items() if k not in compiled.inputs}
        return RunResult(
            id=run_id, workflow=compiled.name, status=status, answer=jsonable(answer), outputs=outputs,
            input={k: jsonable(state[k]) for k in compiled.inputs}, cost=cost,
            trace=[e.to_dict() for e in tracer.events], error=error, meta=dict(meta or {}),
        )

    async def _end_sessions(self, run: _Run) -> None:
        """A finished run's agent sessions will not continue: let the models drop them."""
        if run.session is not None:
            return
        models = {id(m): m for m in self.models.values()}.values()
        await asyncio.gather(*(m.end_session(sid) for m in models for sid in run.sessions), return_exceptions=True)

    async def _run_region(self, run: _Run, loop: str | None) -> None:
        """Run the nodes of one region (the top level or one loop body) in dependency order."""
        g = run.graph
        region = g.region(loop)
        deps = {n: [p for p in g.dag.predecessors(n) if p in region] for n in region}
        pending, done = set(region), set()
        running: dict[asyncio.Task, str] = {}
        early = {n for n in region if isinstance(spec := g.node(n).spec, JoinSpec) and spec.early}
        try:
            while pending or running:
                for name in sorted(pending):
                    arrived = [p for p in deps[name] if p in done]
                    if len(arrived) < len(deps[name]) and not (name in early and self._decided(run, name, arrived)):
                        continue
                    pending.discard(name)
                    if name in early:  # (each time it fires: a loop's next iteration may join other branches)
                        self._cancel_branches(run, name, arrived, pending, running)
                        run.joined[name] = arrived
                    running[asyncio.create_task(self._run_node(run, name))] = name
                if not running:
                    if pending:
                        raise RuntimeError(f"nodes {sorted(pending)} can never start")  # compile() prevents this
                    break
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    name = running.pop(task)
                    if task.cancelled():
                        continue
                    task.result()  # re-raises the node's failure
                    done.add(name)
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    @staticmethod
    def _decided(run: _Run, join: str, finished: list[str]) -> bool:
        """Whether a join that may run early can run now, with the branches `finished` (in their order)."""
        spec, g = run.graph.node(join).spec, run.graph
        if spec.first or not finished:
            return bool(finished)
        outputs = [run.state.get(g.node(p).output) for p in finished if g.node(p).output]
        try:
            return bool(spec.decided(outputs, len(list(g.dag.predecessors(join))) - len(finished)))
        except Exception as exc:
            raise NodeError(f"node {join!r} (join): its `decided` failed: {type(exc).__name__}: {exc}") from exc

    def _cancel_branches(self, run: _Run, join: str, finished: list[str], pending: set[str], running: dict) -> None:
        """A join fired before all its branches finished: stop every other branch, running or not yet started."""
        dag = run.graph.dag
        losers = first_join_branches(dag, join).difference(*(nx.ancestors(dag, f) | {f} for f in finished))
        why = (f"{finished[0]!r} finished first at {join!r}" if run.graph.node(join).spec.first
               else f"{join!r} was decided by {', '.join(map(repr, finished))}")
        for task, name in list(running.items()):
            if name in losers:
                task.cancel()
                run.tracer.emit("node_end", name, status="cancelled", reason=why)
        for name in list(pending):
            if name in losers:
                pending.discard(name)
                run.tracer.emit("node_end", name, status="skipped", reason=why)

    async def _run_node(self, run: _Run, name: str) -> None:
        node = run.graph.node(name)
        before = run.meter.snapshot()
        run.tracer.emit("node_start", name, kind=node.kind)
        t0 = time.perf_counter()
        try:
            extra = await self._execute(run, node)
        except (BudgetExceeded, asyncio.CancelledError, NodeError):
            raise
        except Exception as exc:
            run.tracer.emit("node_end", name, status="error", error=f"{type(exc).__name__}: {exc}")
            raise NodeError(f"node {name!r} ({node.kind}) failed: {type(exc).__name__}: {exc}") from exc
        after = run.meter.snapshot()
        cost = {
            "tokens": {t: after["tokens"].get(t, 0) - before["tokens"].get(t, 0) for t in after["tokens"]},
            "model_calls": after["model_calls"] - before["model_calls"],
        }
        output = run.state.get(node.output) if node.output else None
        run.tracer.emit("node_end", name, status="ok", time_s=round(time.perf_counter() - t0, 6), cost=cost,
                        output=_preview(output), **(extra or {}))

    async def _execute(self, run: _Run, node: Node) -> dict[str, Any] | None:
        spec = node.spec
        if isinstance(spec, GenerateSpec):
            return await self._generate(run, node, spec)
        if isinstance(spec, ThinkSpec):
            return await self._think(run, node, spec)
        if isinstance(spec, ToolSpec):
            return await self._tool(run, node, spec)
        if isinstance(spec, JoinSpec):
            return self._join(run, node, spec)
        if isinstance(spec, LoopSpec):
            return await self._loop(run, node, spec)
        return None  # fork: a pure split

    @staticmethod
    async def _tool(run: _Run, node: Node, spec: ToolSpec) -> None:
        # a synchronous tool runs in a thread: it never stalls the other runs on this loop
        view, fn = dict(run.state), spec.fn
        value = fn(view) if inspect.iscoroutinefunction(fn) else await call_in_thread(fn, view, name=f"tool node {node.name!r}")
        if inspect.isawaitable(value):
            value = await value
        run.state[node.output] = value

    @staticmethod
    def _join(run: _Run, node: Node, spec: JoinSpec) -> dict[str, Any] | None:
        g = run.graph
        branches = run.joined.get(node.name) or list(g.dag.predecessors(node.name))
        if spec.first:
            value = run.state.get(g.node(branches[0]).output)
            run.state[node.output] = spec.merge([value]) if spec.merge else value
            return {"winner": branches[0]}
        values = [run.state.get(g.node(p).output) for p in branches if g.node(p).output]
        run.state[node.output] = spec.merge(values) if spec.merge else values
        total = len(list(g.dag.predecessors(node.name)))
        return {"decided_by": len(branches), "of": total} if len(branches) < total else None

    async def _loop(self, run: _Run, node: Node, spec: LoopSpec) -> dict[str, Any]:
        iters = 0
        run.state[node.output] = 0
        while iters < spec.max_iters and (spec.condition is None or spec.condition(dict(run.state))):
            await self._run_region(run, node.name)
            iters += 1
            run.state[node.output] = iters
        return {"iterations": iters, "bounded": iters >= spec.max_iters}

    async def _generate(self, run: _Run, node: Node, spec: GenerateSpec) -> dict[str, Any]:
        prompt = spec.prompt
        content = prompt.format_map(run.state) if isinstance(prompt, str) else prompt(dict(run.state))
        if isinstance(content, str):
            messages = [{"role": "system", "content": spec.system}] if spec.system else []
            messages.append({"role": "user", "content": content})
        else:
            messages = content
        model, grammar = run.models[spec.tier], spec.grammar(dict(run.state)) if callable(spec.grammar) else spec.grammar
        request = GenerationRequest(
            messages=messages, continue_final=messages[-1]["role"] == "assistant", max_new_tokens=spec.max_tokens,
            stop=list(spec.stop), temperature=spec.temperature, speculative=self.speculative,
            session_id=run.session_id(spec.session), grammar=grammar if grammar_fits(model, grammar) else None)
        completion = await model.generate(request)
        run.state[node.output] = completion.text.strip() if spec.strip else completion.text
        return {"model": spec.tier, "finish_reason": completion.finish_reason, "spec": completion.spec.spec_dict(),
                "model_time_s": round(completion.time_s, 6)}

    async def _think(self, run: _Run, node: Node, spec: ThinkSpec) -> dict[str, Any]:
        budget = self.step_budget
        limits = {k: v for k, v in (("max_steps", spec.max_steps), ("max_tokens", spec.max_tokens)) if v is not None}
        if limits:
            budget = budget.model_copy(update=limits)
        loop = StepLoop(
            run.models["small"], run.models["large"], spec.policy or self.policy, self.segment, budget,
            system=spec.system, speculative=self.speculative, temperature=spec.temperature, seed=spec.seed,
            session_id=run.session_id(node.name),
        )
        problem = spec.problem.format_map(run.state)
        result = None
        index = 0
        async for item in loop.stream(problem):
            if hasattr(item, "author"):
                run.tracer.emit("step", node.name, index=index, author=item.author, verdict=item.verdict,
                                score=item.score, tokens=dict(item.tokens), time_s=round(item.time_s, 6),
                                judge_calls=item.judge_calls, kind=item.kind, text=item.text, spec=item.spec.spec_dict())
                index += 1
            else:
                result = item
        extract = run.graph.answer_extractor  # the workflow's: the runtime knows no answer format
        answer = (extract(result.reasoning) if extract is not None else None) or result.answer.strip()
        run.state[node.output] = answer
        run.state[node.output + "_reasoning"] = result.reasoning
        return {"stop_reason": result.stop_reason, "steps": len(result.steps), "small_share": round(result.small_share, 4)}

    # ------------------------------------------------------------------ batches

    async def map(
        self,
        graph: StepGraph | CompiledGraph | Callable[[str], StepGraph | CompiledGraph],
        items: Iterable[tuple[str, Mapping[str, Any] | str] | tuple[str, Mapping[str, Any] | str, dict]],
        store: ResultStore | None = None,
        on_result: Callable[[RunResult], None] | None = None,
        listeners: list[Listener] | None = None,
        annotate: Callable[[RunResult], None] | None = None,
    ) -> list[RunResult]:
        """Run a batch of `(id, inputs[, meta])`; at most `concurrency` runs at once.

        Runs already finished in `store` are skipped; each new result is appended to it the
        moment it finishes (after `annotate(result)`, e.g. grading against a reference, has
        filled its `meta`). A batch budget that runs out stops new runs from starting. `graph`
        may be a function of the run id, for batches whose tasks each need their own graph (e.g.
        an agent whose tools hold that task's environment).
        """
        shared = graph.compile() if isinstance(graph, StepGraph) else graph

        def graph_for(run_id: str) -> CompiledGraph:
            if isinstance(shared, CompiledGraph):
                return shared
            built = shared(run_id)
            return built.compile() if isinstance(built, StepGraph) else built
        self.batch_meter = Meter(self.batch_meter.budget, scope="batch")  # budgets count per batch
        if store is not None:
            store.open_for_append()  # refuses a file that is not a store, or one of another configuration
        skip = store.done_ids() if store is not None else set()
        gate = asyncio.Semaphore(self.concurrency)
        results: list[RunResult] = []
        seen: set[str] = set()

        async def one(run_id: str, inputs: Any, meta: dict) -> None:
            async with gate:
                try:
                    self.batch_meter.check()
                except BudgetExceeded:
                    return
                try:
                    compiled = graph_for(run_id)
                except ValueError as exc:
                    result = RunResult(id=run_id, workflow="?", status="error", error=f"building the graph failed: {exc}",
                                       meta=meta)
                else:
                    result = await self.run(compiled, inputs, run_id=run_id, listeners=listeners, meta=meta)
                if annotate is not None:
                    annotate(result)
                cut_by_batch = result.status == "budget" and (result.error or "").startswith("batch")
                if store is not None and not cut_by_batch:  # runs cut by the batch budget run again on resume
                    store.append(result)
                results.append(result)
                if on_result is not None:
                    on_result(result)

        tasks = []
        for item in items:
            if not isinstance(item, tuple) or len(item) not in (2, 3):
                raise ValueError(f"batch items must be (id, inputs) or (id, inputs, meta) tuples, got {item!r}")
            run_id, inputs, meta = str(item[0]), item[1], (item[2] if len(item) == 3 else {})
            if run_id in seen:
                raise ValueError(f"duplicate run id {run_id!r} in the batch")
            seen.add(run_id)
            if run_id in skip:
                continue
            tasks.append(asyncio.create_task(one(run_id, inputs, meta)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return results

    async def stream(self, graph: StepGraph | CompiledGraph, inputs: Mapping[str, Any] | str,
                     run_id: str | None = None, session: str | None = None) -> AsyncIterator[TraceEvent | RunResult]:
        """Yield each trace event as it happens, then the `RunResult`."""
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(self.run(graph, inputs, run_id=run_id, listeners=[queue.put_nowait], session=session))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (event := await queue.get()) is not None:
                yield event
            yield task.result()
        finally:
            if not task.done():
                task.cancel()


def _initial_state(graph: CompiledGraph, inputs: Mapping[str, Any] | str) -> dict[str, Any]:
    if isinstance(inputs, str):
        if len(graph.inputs) != 1:
            raise ValueError(f"graph {graph.name!r} takes inputs {list(graph.inputs)}; pass a dict, not a string")
        return {graph.inputs[0]: inputs}
    if not isinstance(inputs, Mapping):
        raise ValueError(f"inputs must be a dict or a string, got {type(inputs).__name__}")
    missing = [k for k in graph.inputs if k not in inputs]
    if missing:
        raise ValueError(f"graph {graph.name!r} needs inputs {missing} (got {sorted(inputs)})")
    return dict(inputs)


def _preview(value: Any, limit: int = 200) -> Any:
    """A short form of a node's output for its trace event."""
    if isinstance(value, str):
        return value if len(value) <= limit else value[:limit] + "..."
    return jsonable(value)
