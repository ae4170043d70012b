"""StepGraph building and compile-time validation: every error names the node or edge at fault."""

from __future__ import annotations

import re

import pytest
from thinkahead.orchestrator.graph import (
    END,
    START,
    GraphError,
    StepGraph,
    template_fields,
)


def _tool(state):
    return 1


def tool_graph(*names: str) -> StepGraph:
    """A graph holding one tool node of each name; the edges are the test's."""
    g = StepGraph()
    for name in names:
        g.add_tool(name, _tool)
    return g


def refused(g: StepGraph, match: str) -> None:
    """`compile` refuses `g` with a GraphError matching `match`."""
    with pytest.raises(GraphError, match=match):
        g.compile()


def test_template_fields_reads_named_keys_once():
    assert template_fields("Q: {question} D: {draft} again {question} {obs[0]}") == ("question", "draft", "obs")
    with pytest.raises(GraphError, match="positional field"):
        template_fields("bad {}")


def test_a_valid_sequence_compiles_and_names_its_output():
    g = StepGraph(inputs=["question"])
    g.add_generate("answer", "Q: {question}", tier="small")
    g.add_sequence(START, "answer", END)
    compiled = g.compile()
    assert compiled.output == "answer"
    assert compiled.region(None) == {"answer"}


def test_unknown_node_in_an_edge():
    g = tool_graph("a")
    g.add_sequence(START, "a", "b", END)
    refused(g, r"edge a -> b: unknown node 'b'")


def test_duplicate_node_and_reserved_names():
    g = StepGraph()
    g.add_tool("a", _tool)
    with pytest.raises(GraphError, match="already in the graph"):
        g.add_tool("a", _tool)
    with pytest.raises(GraphError, match="START/END"):
        g.add_tool(END, _tool)


def test_unreachable_end():
    g = tool_graph("a")
    g.add_edge(START, "a")
    refused(g, "a never reaches END|END is unreachable")


def test_node_unreachable_from_start():
    g = tool_graph("a", "orphan")
    g.add_sequence(START, "a", END)
    g.add_edge("orphan", END)
    refused(g, "node 'orphan' is unreachable from START")


def test_unbounded_cycle_is_named():
    g = tool_graph("a", "b")
    g.add_sequence(START, "a", "b", "a")
    g.add_edge("b", END)
    refused(g, r"unbounded cycle (a -> b -> a|b -> a -> b).*loop node")


def test_loop_needs_body_and_exit_edges_and_a_bound():
    with pytest.raises(GraphError, match="max_iters"):
        StepGraph().add_loop("l", max_iters=0)
    g = tool_graph("a").add_loop("l", max_iters=2)
    g.add_edge(START, "l")
    g.add_edge("l", "a")  # unlabelled
    g.add_edge("a", "l")
    g.add_edge("a", END)
    refused(g, "loop 'l' needs exactly two out-edges")


def test_edges_may_not_enter_or_leave_a_loop_body_sideways():
    g = tool_graph("body", "after").add_loop("l", max_iters=2)
    g.add_edge(START, "l")
    g.add_edge("l", "body", "body")
    g.add_edge("body", "l")
    g.add_edge("l", "after", "exit")
    g.add_edge("body", "after")
    g.add_edge("after", END)
    refused(g, "edge body -> after leaves the body of loop 'l'")


def test_missing_input_is_named():
    g = StepGraph(inputs=["question"])
    g.add_generate("a", "{question} {draft}")
    g.add_sequence(START, "a", END)
    refused(g, r"node 'a' reads 'draft'")


def test_input_written_only_by_a_later_node_is_missing():
    g = StepGraph(inputs=["question"])
    g.add_generate("a", "{b}")
    g.add_generate("b", "{question}")
    g.add_sequence(START, "a", "b", END)
    refused(g, r"node 'a' reads 'b'")


def test_parallel_writers_of_one_key():
    g = StepGraph()
    g.add_tool("a", _tool, output="x")
    g.add_tool("b", _tool, output="x")
    g.add_edge(START, "a")
    g.add_edge(START, "b")
    g.add_edge("a", END)
    g.add_edge("b", END)
    refused(g, "'a' and 'b' can run in parallel and both write 'x'")


def test_join_needs_two_branches_and_first_finish_branches_must_be_closed():
    g = tool_graph("a").add_join("j")
    g.add_sequence(START, "a", "j", END)
    refused(g, "join 'j' needs at least two incoming branches")

    g = tool_graph("a", "b").add_fork("f")
    g.add_tool("leak", _tool, inputs=["a"])
    g.add_join("j", first=True)
    g.add_edge(START, "f")
    g.add_sequence("f", "a", "j")
    g.add_sequence("f", "b", "j")
    g.add_edge("a", "leak")
    g.add_edge("leak", END)
    g.add_edge("j", END)
    refused(g, "node 'a' is in a branch of join 'j', which may cancel it, but also feeds 'leak'")


def test_bad_tier_and_bad_prompt():
    with pytest.raises(GraphError, match="tier must be one of"):
        StepGraph().add_generate("a", "x", tier="medium")
    with pytest.raises(GraphError, match="prompt must be a template string or a callable"):
        StepGraph().add_generate("a", 42)


def test_mermaid_shows_every_node_and_labelled_edge():
    from thinkahead.workflows import refine

    text = refine(rounds=3).to_mermaid()
    assert text.startswith("flowchart TD\n")
    for name in ("solve", "first_critique", "rounds", "rewrite", "critique", "answer"):
        assert f"n_{name}" in text
    assert "n_rounds -->|body| n_rewrite" in text
    assert "n_rounds -->|exit| n_answer" in text
    assert "loop (max 3)" in text


# --------------------------------------------------------------------------- typed node specs


@pytest.mark.parametrize(("add", "message"), [
    (lambda g: g.add_think("think", "{input}", max_steps=0), "node 'think': max_steps must be > 0, got 0"),
    (lambda g: g.add_think("think", "{input}", max_tokens=-5), "node 'think': max_tokens must be > 0, got -5"),
    (lambda g: g.add_think("think", "{input}", max_steps=2.5), "node 'think': max_steps must be an int or None, got float"),
    (lambda g: g.add_think("think", "{input}", temperature=-0.1), "node 'think': temperature must be >= 0, got -0.1"),
    (lambda g: g.add_think("think", "{input}", seed="7"), "node 'think': seed must be an int or None, got str"),
    (lambda g: g.add_think("think", "{input}", policy="specreason"),
     "node 'think': policy must be a step policy (with start(ctx)), got str"),
    (lambda g: g.add_think("think", "{input}", system=3), "node 'think': system must be a string or None, got int"),
    (lambda g: g.add_think("think", "solve {}"), "node 'think': problem: prompt template 'solve {}' has a positional"),
    (lambda g: g.add_generate("gen", "{input}", max_tokens=0), "node 'gen': max_tokens must be > 0, got 0"),
    (lambda g: g.add_generate("gen", "{input}", max_tokens=True), "node 'gen': max_tokens must be an int, got bool"),
    (lambda g: g.add_generate("gen", "{input}", stop=["ok", ""]), "node 'gen': stop must be a list of non-empty strings"),
    (lambda g: g.add_generate("gen", "{input}", stop=5), "node 'gen': stop must be a list of non-empty strings, got 5"),
    (lambda g: g.add_generate("gen", "{input}", strip="no"), "node 'gen': strip must be True or False, got 'no'"),
    (lambda g: g.add_generate("gen", "{input}", session=""), "node 'gen': session must be a non-empty string, got ''"),
    (lambda g: g.add_generate("gen", "{input}", temperature=-1), "node 'gen': temperature must be >= 0, got -1"),
    (lambda g: g.add_generate("gen", "{input}", output=3), "node 'gen': output must be a non-empty string, got 3"),
    (lambda g: g.add_tool("t", _tool, inputs="question"),
     "node 't': inputs must be a list of state keys, got the string 'question'"),
    (lambda g: g.add_tool("t", _tool, inputs=["ok", 3]), "node 't': inputs must be state keys (non-empty strings), got 3"),
    (lambda g: g.add_join("j", first=1), "node 'j': first must be True or False, got 1"),
    (lambda g: g.add_join("j", merge="max"), "node 'j': merge must be callable, got str"),
    (lambda g: g.add_loop("l", max_iters=0), "node 'l': max_iters must be > 0, got 0"),
    (lambda g: g.add_loop("l", max_iters=2, condition=True), "node 'l': condition must be callable, got bool"),
])
def test_a_bad_node_setting_is_refused_when_added_naming_node_and_field(add, message):
    g = StepGraph()
    with pytest.raises(GraphError, match=re.escape(message)):
        add(g)
    assert g.nodes == {}  # nothing half-added


def test_node_specs_are_typed_frozen_records():
    import dataclasses

    from thinkahead.orchestrator.nodes import (
        GenerateSpec,
        JoinSpec,
        LoopSpec,
        ThinkSpec,
    )

    g = StepGraph(inputs=["question"])
    g.add_think("think", "{question}", max_steps=3, seed=1)
    g.add_generate("gen", "{think}", tier="small", stop="\n\n", max_tokens=32)
    g.add_loop("again", max_iters=2)
    g.add_join("j", first=True)
    think, gen = g.nodes["think"], g.nodes["gen"]
    assert isinstance(think.spec, ThinkSpec) and think.kind == "think"
    assert (think.spec.problem, think.spec.max_steps, think.spec.max_tokens, think.spec.seed) == ("{question}", 3, None, 1)
    assert think.inputs == ("question",) and think.writes() == ("think", "think_reasoning")
    assert isinstance(gen.spec, GenerateSpec)
    assert (gen.spec.tier, gen.spec.stop, gen.spec.max_tokens, gen.spec.session) == ("small", ("\n\n",), 32, "gen")
    assert isinstance(g.nodes["again"].spec, LoopSpec) and g.nodes["again"].spec.max_iters == 2
    assert isinstance(g.nodes["j"].spec, JoinSpec) and g.nodes["j"].spec.first is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        think.spec.max_steps = 0
    with pytest.raises(AttributeError):  # slots: no stray settings
        object.__setattr__(gen.spec, "max_tokns", 8)


def test_compile_checks_every_node_spec_again():
    from thinkahead.orchestrator.nodes import Node, ThinkSpec

    g = StepGraph(inputs=["question"])
    g.add_think("think", "{question}")
    g.add_sequence(START, "think", END)
    g.compile()
    bad = ThinkSpec(system=None, temperature=0.0, problem="{question}", policy=None, max_steps=0, max_tokens=None,
                    seed=None)  # built by hand, past add_think's check
    g.nodes["think"] = Node("think", "think", ("question",), bad)
    refused(g, "node 'think': max_steps must be > 0, got 0")
    g.nodes["think"] = Node("other", "think", ("question",), bad)
    refused(g, "node 'think': graph.nodes must map each name to its Node")


def test_add_cycle_wires_a_chain_body_and_the_exit():
    g = tool_graph("a", "b", "after").add_loop("l", max_iters=2)
    g.add_edge(START, "l")
    g.add_cycle("l", ["a", "b"], "after")
    g.add_edge("after", END)
    assert g.edges[1:-1] == [("l", "a", "body"), ("a", "b", None), ("b", "l", None), ("l", "after", "exit")]
    assert g.compile().bodies == {"l": {"a", "b"}}
    with pytest.raises(GraphError, match="loop 'l': add_cycle needs at least one body node"):
        g.add_cycle("l", [], "after")
