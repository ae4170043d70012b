"""Step graphs: build a graph of typed nodes over a `networkx.DiGraph`, then `compile()` it.

A run carries a *state*: a dict of named values. Every node reads some keys and writes one key
(its `output`, by default its name). Edges are dependencies: a node runs once all its
predecessors are done, so independent nodes run in parallel. Node kinds:

- `think`: a reasoning segment run by a step policy (small model drafts, large model judges);
- `generate`: one model call with a prompt template filled from the state;
- `tool`: a Python callable (sync or async) of the state; a sync one runs in a thread of its own,
  off the event loop, so a slow tool never stalls the other runs;
- `fork` / `join`: an explicit parallel split and its merge (`join` waits for all branches, or
  with `first=True` for the first one, and the losing branches are cancelled);
- `loop`: a bounded cycle. Its `body` successor starts the body; edges from the body back to the
  loop close the cycle; the `exit` successor runs when the condition fails or the bound is hit
  (`add_cycle` wires a chain body and the exit in one call).

Each node's settings are a typed, frozen record of its kind (`thinkahead.orchestrator.nodes`:
`ThinkSpec`, `GenerateSpec`, ...), checked when the node is added: a bad one is refused at once
with the node and the field named (`node 'think': max_steps must be > 0, got 0`). `compile()`
checks every node's spec again, then the whole graph and names the problem precisely: unknown nodes, nodes or END
unreachable from START, cycles that do not pass through a loop, a read of a key nothing writes
before it, two parallel nodes writing the same key. Nothing runs before the graph is valid.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import networkx as nx
from thinkahead.orchestrator.nodes import (
    NODE_KINDS,
    ForkSpec,
    GenerateSpec,
    GraphError,
    JoinSpec,
    LoopSpec,
    Node,
    NodeSpec,
    ThinkSpec,
    ToolSpec,
    template_fields,
)

AnswerExtractor = Callable[[str], str | None]
"""Reads the final answer out of a reasoning text; None when it finds none."""

START = "__start__"
END = "__end__"

__all__ = [
    "END", "NODE_KINDS", "START", "AnswerExtractor", "CompiledGraph", "GraphError", "Node", "StepGraph",
    "first_join_branches", "template_fields",
]


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or name in (START, END):
        raise GraphError(f"node name must be a non-empty string other than START/END, got {name!r}")


class StepGraph:
    """A graph under construction. Add nodes and edges, then `compile()`.

    >>> g = StepGraph(inputs=["question"])
    >>> g.add_generate("answer", "Q: {question}\\nA:", tier="small")
    >>> g.add_edge(START, "answer"); g.add_edge("answer", END)
    >>> compiled = g.compile()
    """

    def __init__(self, name: str = "graph", inputs: Iterable[str] = ("input",), output: str | None = None, *,
                 answer_extractor: AnswerExtractor | None = None) -> None:
        if answer_extractor is not None and not callable(answer_extractor):
            raise GraphError(f"graph {name!r}: answer_extractor must be a function of the reasoning text, "
                             f"got {type(answer_extractor).__name__}")
        self.name = name
        self.inputs = tuple(inputs)
        self.output = output
        self.answer_extractor = answer_extractor
        self.nodes: dict[str, Node] = {}
        self.edges: list[tuple[str, str, str | None]] = []  # (source, target, label)

    # ------------------------------------------------------------------ building

    def _add(self, name: str, spec: NodeSpec, output: str | None, inputs: Iterable[str]) -> StepGraph:
        """Add a node once its name, typed spec, inputs and output are valid (`GraphError` names the field)."""
        _check_name(name)
        if name in self.nodes:
            raise GraphError(f"node {name!r} is already in the graph")
        if isinstance(inputs, str):
            raise GraphError(f"node {name!r}: inputs must be a list of state keys, got the string {inputs!r}")
        node = Node(name, output, tuple(inputs), spec)
        node.check()
        self.nodes[name] = node
        return self

    def add_think(
        self,
        name: str,
        problem: str = "{input}",
        *,
        output: str | None = None,
        policy: Any = None,
        system: str | None = None,
        max_steps: int | None = None,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        seed: int | None = None,
    ) -> StepGraph:
        """A reasoning segment: the step policy (the runtime's, or `policy`) solves `problem`.

        `problem` is a template over the state. The output is the final answer: what the graph's
        `answer_extractor` reads out of the reasoning (e.g. the boxed answer), else the text after
        the reasoning (the last step, or the forced answer); `<output>_reasoning` holds the whole
        chain; the steps go to the trace. `max_steps` / `max_tokens` (None: the runtime's step
        budget) must be > 0.
        """
        spec = ThinkSpec(system=system, temperature=temperature, problem=problem, policy=policy, max_steps=max_steps,
                         max_tokens=max_tokens, seed=seed)
        spec.check(name)
        return self._add(name, spec, output or name, spec.reads())

    def add_generate(
        self,
        name: str,
        prompt: str | Callable[[dict[str, Any]], str | list[dict[str, str]]],
        *,
        tier: str = "large",
        output: str | None = None,
        inputs: Iterable[str] | None = None,
        system: str | None = None,
        max_tokens: int = 256,
        stop: list[str] | None = None,
        temperature: float = 0.0,
        strip: bool = True,
        session: str | None = None,
        grammar: Any = None,
    ) -> StepGraph:
        """One model call. `prompt` is a template over the state, or a function of the state
        returning the user text or a whole message list (then declare its `inputs`).

        The output is the completion's text, stripped of surrounding whitespace unless
        `strip=False`: a loop that feeds the text back verbatim (a ReAct transcript) keeps each
        turn's prompt an exact extension of the last one, so caches continue instead of rebuilding.
        Each generate node is its own agent session unless nodes name the same `session` (one
        conversation written by several nodes, e.g. a first answer and its later fixes). `grammar` (a
        `GrammarSpec` or a function of the state returning one) constrains the output where the
        model enforces that kind of grammar, and is left out where it does not."""
        spec = GenerateSpec(system=system, temperature=temperature, prompt=prompt, tier=tier,  # type: ignore[arg-type]
                            max_tokens=max_tokens, stop=_stops(stop), strip=strip, session=name if session is None else session,
                            grammar=grammar)
        spec.check(name)
        return self._add(name, spec, output or name, spec.reads() if isinstance(prompt, str) else (inputs or ()))

    def add_tool(
        self, name: str, fn: Callable[[dict[str, Any]], Any], *, inputs: Iterable[str] = (), output: str | None = None
    ) -> StepGraph:
        """A Python callable of the state (sync or async); its return value is written to `output`.

        A synchronous callable runs in a worker thread (off the event loop, on a copy of the state),
        so it must not need the running loop; an async one runs on the loop.
        """
        return self._add(name, ToolSpec(fn), output or name, inputs)

    def add_fork(self, name: str) -> StepGraph:
        """An explicit parallel split: all its successors start together."""
        return self._add(name, ForkSpec(), None, ())

    def add_join(
        self, name: str, *, first: bool = False, merge: Callable[[list[Any]], Any] | None = None,
        output: str | None = None, decided: Callable[[list[Any], int], bool] | None = None,
    ) -> StepGraph:
        """Merge parallel branches: the outputs of its predecessors as a list (or `merge(list)`).

        With `first=True` it runs as soon as one branch finishes, with that branch's output, and
        the other branches are cancelled. With `decided`, it runs as soon as
        `decided(outputs of the finished branches, how many are still running)` is true (the rest cannot
        change what `merge` gives), merges the finished branches' outputs and cancels the others.
        """
        return self._add(name, JoinSpec(first, merge, decided), output or name, ())

    def add_loop(
        self, name: str, *, max_iters: int, condition: Callable[[dict[str, Any]], bool] | None = None,
        inputs: Iterable[str] = (),
    ) -> StepGraph:
        """A bounded cycle: runs its body while `condition(state)` holds, at most `max_iters` (> 0) times."""
        return self._add(name, LoopSpec(max_iters, condition), f"{name}_iterations", inputs)

    def add_cycle(self, loop: str, body: str | Iterable[str], exit_to: str) -> StepGraph:
        """The edges of a loop whose body is a chain: `loop -body-> body[0] -> ... -> body[-1] -> loop`,
        then `loop -exit-> exit_to`."""
        steps = [body] if isinstance(body, str) else list(body)
        if not steps:
            raise GraphError(f"loop {loop!r}: add_cycle needs at least one body node")
        self.add_edge(loop, steps[0], "body")
        self.add_sequence(*steps, loop)
        return self.add_edge(loop, exit_to, "exit")

    def add_edge(self, source: str, target: str, label: str | None = None) -> StepGraph:
        """A dependency `source -> target`. Out of a loop, label one edge "body" and one "exit"."""
        if label not in (None, "body", "exit"):
            raise GraphError(f"edge {source} -> {target}: label must be 'body', 'exit' or None, got {label!r}")
        self.edges.append((source, target, label))
        return self

    def add_sequence(self, *names: str) -> StepGraph:
        """Edges along `names` in order: add_sequence(START, "a", "b", END)."""
        for a, b in itertools.pairwise(names):
            self.add_edge(a, b)
        return self

    # ------------------------------------------------------------------ compiling

    def compile(self) -> CompiledGraph:
        """Validate the graph and return its runnable form; `GraphError` names what is wrong."""
        for name, node in self.nodes.items():  # every node's typed spec, also of nodes put in `nodes` by hand
            if not isinstance(node, Node) or node.name != name:
                raise GraphError(f"node {name!r}: graph.nodes must map each name to its Node, got {node!r}")
            node.check()
        g = nx.DiGraph()
        g.add_node(START)
        g.add_node(END)
        for name in self.nodes:
            g.add_node(name)
        for source, target, label in self.edges:
            for end in (source, target):
                if end not in g:
                    raise GraphError(f"edge {source} -> {target}: unknown node {end!r}")
            if source == END or target == START:
                raise GraphError(f"edge {source} -> {target}: nothing runs after END or before START")
            if g.has_edge(source, target):
                raise GraphError(f"edge {source} -> {target} is defined twice")
            if label is not None and not isinstance(getattr(self.nodes.get(source), "spec", None), LoopSpec):
                raise GraphError(f"edge {source} -> {target}: only edges out of a loop node take a label")
            g.add_edge(source, target, label=label)

        bodies, back_edges = self._loop_structure(g)
        dag = g.copy()
        dag.remove_edges_from(back_edges)
        try:
            cycle = nx.find_cycle(dag, START) if START in dag else None
        except nx.NetworkXNoCycle:
            cycle = None
        if cycle is None:
            try:
                cycle = nx.find_cycle(dag)
            except nx.NetworkXNoCycle:
                cycle = None
        if cycle:
            path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
            raise GraphError(f"unbounded cycle {path}: cycles must pass through a loop node (add_loop)")

        reachable = nx.descendants(g, START) | {START}
        for name in self.nodes:
            if name not in reachable:
                raise GraphError(f"node {name!r} is unreachable from START")
        if END not in reachable:
            raise GraphError("END is unreachable from START: add an edge into END")
        leads_to_end = nx.ancestors(g, END) | {END}
        for name in self.nodes:
            if name not in leads_to_end:
                raise GraphError(f"node {name!r} never reaches END (a dead end)")

        owner = _loop_owners(bodies)
        self._check_joins(dag)
        self._check_inputs(dag, owner)
        self._check_writers(dag)
        output = self.output or self._default_output(g)
        return CompiledGraph(self, g, dag, bodies, owner, output)

    def _loop_structure(self, g: nx.DiGraph) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
        """Each loop's body (nodes on a path body-start ~> loop) and the back edges into loops."""
        bodies: dict[str, set[str]] = {}
        back: list[tuple[str, str]] = []
        for name, node in self.nodes.items():
            if not isinstance(node.spec, LoopSpec):
                continue
            out = {t: g.edges[name, t]["label"] for t in g.successors(name)}
            starts = [t for t, lab in out.items() if lab == "body"]
            exits = [t for t, lab in out.items() if lab == "exit"]
            if len(starts) != 1 or len(exits) != 1 or len(out) != 2:
                raise GraphError(
                    f"loop {name!r} needs exactly two out-edges: one labelled 'body' and one 'exit' "
                    f"(has {sorted(out.items(), key=str)})"
                )
            start = starts[0]
            if start == END:
                raise GraphError(f"loop {name!r}: the body cannot start at END")
            # body = nodes reachable from the body start that lead back to the loop
            sub = g.subgraph(n for n in g if n != name)
            reach = nx.descendants(sub, start) | {start}
            back_sources = {n for n in reach if g.has_edge(n, name)}
            if not back_sources:
                raise GraphError(f"loop {name!r}: no edge leads from its body back to it")
            body = {n for n in reach if any(nx.has_path(sub, n, b) for b in back_sources)}
            if END in body:
                raise GraphError(f"loop {name!r}: END cannot be inside a loop body")
            for n in body:
                for p in g.predecessors(n):
                    if p not in body and p != name:
                        raise GraphError(f"edge {p} -> {n} enters the body of loop {name!r} from outside it")
                for s in g.successors(n):
                    if s not in body and s != name:
                        raise GraphError(
                            f"edge {n} -> {s} leaves the body of loop {name!r}; leave through the loop's 'exit' edge"
                        )
            bodies[name] = body
            back.extend((b, name) for b in back_sources)
        return bodies, back

    def _check_joins(self, dag: nx.DiGraph) -> None:
        for name, node in self.nodes.items():
            if not isinstance(node.spec, JoinSpec):
                continue
            preds = list(dag.predecessors(name))
            if len(preds) < 2:
                raise GraphError(f"join {name!r} needs at least two incoming branches, has {len(preds)}")
            if node.spec.early:
                branch = first_join_branches(dag, name)
                for n in branch:
                    for s in dag.successors(n):
                        if s not in branch and s != name:
                            raise GraphError(
                                f"node {n!r} is in a branch of join {name!r}, which may cancel it, but also feeds "
                                f"{s!r}; a cancelled branch must not feed anything else"
                            )

    def _check_inputs(self, dag: nx.DiGraph, owner: dict[str, str]) -> None:
        for name, node in self.nodes.items():
            before = nx.ancestors(dag, name)
            written = set(self.inputs)
            for a in before:
                if a in self.nodes:
                    written.update(self.nodes[a].writes())
            if name in owner:  # inside a loop: values from earlier iterations count too
                loop = owner[name]
                for n in [loop, *self._body_of(loop, owner)]:
                    written.update(self.nodes[n].writes())
            for key in node.inputs:
                if key not in written:
                    raise GraphError(
                        f"node {name!r} reads {key!r}, which is neither a graph input {list(self.inputs)} "
                        "nor written by a node that runs before it"
                    )

    @staticmethod
    def _body_of(loop: str, owner: dict[str, str]) -> list[str]:
        return [n for n, o in owner.items() if o == loop]

    def _check_writers(self, dag: nx.DiGraph) -> None:
        by_key: dict[str, list[str]] = {}
        for name, node in self.nodes.items():
            if node.output:
                by_key.setdefault(node.output, []).append(name)
        for key, writers in by_key.items():
            for i, a in enumerate(writers):
                for b in writers[i + 1:]:
                    if not (nx.has_path(dag, a, b) or nx.has_path(dag, b, a)):
                        raise GraphError(f"nodes {a!r} and {b!r} can run in parallel and both write {key!r}")

    def _default_output(self, g: nx.DiGraph) -> str | None:
        feeders = [p for p in g.predecessors(END) if p != START]
        outputs = [self.nodes[p].output for p in feeders if self.nodes[p].output]
        return outputs[0] if len(outputs) == 1 else None

    # ------------------------------------------------------------------ export

    def to_mermaid(self) -> str:
        """The graph as Mermaid flowchart text (for docs and traces)."""
        shapes = {
            "think": ('["', '"]'), "generate": ('("', '")'), "tool": ('[/"', '"/]'),
            "fork": ('{{"', '"}}'), "join": ('{{"', '"}}'), "loop": ('{"', '"}'),
        }
        lines = ["flowchart TD", f'    {_mid(START)}(["start"])', f'    {_mid(END)}(["end"])']
        for name, node in self.nodes.items():
            left, right = shapes[node.kind]
            spec, detail = node.spec, node.kind
            if isinstance(spec, GenerateSpec):
                detail += f" ({spec.tier})"
            elif isinstance(spec, LoopSpec):
                detail += f" (max {spec.max_iters})"
            elif isinstance(spec, JoinSpec) and spec.first:
                detail += " (first)"
            lines.append(f"    {_mid(name)}{left}{name}<br/>{detail}{right}")
        for source, target, label in self.edges:
            arrow = f" -->|{label}| " if label else " --> "
            lines.append(f"    {_mid(source)}{arrow}{_mid(target)}")
        return "\n".join(lines) + "\n"


def _stops(stop: Any) -> Any:
    """`stop` as a tuple of strings (one string is one stop); anything else is left for the check to name."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop) if isinstance(stop, (list, tuple)) else stop


def _mid(name: str) -> str:
    """A Mermaid-safe node id."""
    return "n_" + "".join(c if c.isalnum() else "_" for c in name)


def _loop_owners(bodies: dict[str, set[str]]) -> dict[str, str]:
    """Each body node's innermost loop (the loop with the smallest body that holds it)."""
    owner: dict[str, str] = {}
    for loop, body in sorted(bodies.items(), key=lambda kv: -len(kv[1])):
        for n in body:
            owner[n] = loop
    return owner


def first_join_branches(dag: nx.DiGraph, join: str) -> set[str]:
    """Nodes in the branches of a join: its ancestors that are not ancestors of every branch."""
    preds = list(dag.predecessors(join))
    anc = [nx.ancestors(dag, p) | {p} for p in preds]
    common = set.intersection(*[a - {p} for a, p in zip(anc, preds)]) if anc else set()
    return set().union(*anc) - common


@dataclass
class CompiledGraph:
    """A validated graph, ready for the runtime; `regions` are what the scheduler walks."""

    graph: StepGraph
    full: nx.DiGraph
    dag: nx.DiGraph
    bodies: dict[str, set[str]]
    owner: dict[str, str]
    output: str | None

    @property
    def name(self) -> str:
        return self.graph.name

    @property
    def answer_extractor(self) -> AnswerExtractor | None:
        """How `think` nodes read their answer out of the reasoning (the workflow's choice; None: no extraction)."""
        return self.graph.answer_extractor

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.graph.inputs

    def node(self, name: str) -> Node:
        return self.graph.nodes[name]

    def region(self, loop: str | None) -> set[str]:
        """The nodes scheduled directly by `loop`'s body (None: the top level), nested bodies excluded."""
        return {n for n in self.dag if n not in (START, END) and self.owner.get(n) == loop}

    def to_mermaid(self) -> str:
        return self.graph.to_mermaid()
