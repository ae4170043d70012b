"""StepGraph building and compile-time validation: every error names the node or edge at fault."""

from __future__ import annotations

import pytest

from thinkahead.orchestrator.graph import END, START, GraphError, StepGraph, template_fields


def _tool(state):
    return 1


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
    g = StepGraph()
    g.add_tool("a", _tool)
    g.add_sequence(START, "a", "b", END)
    with pytest.raises(GraphError, match=r"edge a -> b: unknown node 'b'"):
        g.compile()


def test_duplicate_node_and_reserved_names():
    g = StepGraph()
    g.add_tool("a", _tool)
    with pytest.raises(GraphError, match="already in the graph"):
        g.add_tool("a", _tool)
    with pytest.raises(GraphError, match="START/END"):
        g.add_tool(END, _tool)


def test_unreachable_end():
    g = StepGraph()
    g.add_tool("a", _tool)
    g.add_edge(START, "a")
    with pytest.raises(GraphError, match="a never reaches END|END is unreachable"):
        g.compile()


def test_node_unreachable_from_start():
    g = StepGraph()
    g.add_tool("a", _tool)
    g.add_tool("orphan", _tool)
    g.add_sequence(START, "a", END)
    g.add_edge("orphan", END)
    with pytest.raises(GraphError, match="node 'orphan' is unreachable from START"):
        g.compile()


def test_unbounded_cycle_is_named():
    g = StepGraph()
    g.add_tool("a", _tool)
    g.add_tool("b", _tool)
    g.add_sequence(START, "a", "b", "a")
    g.add_edge("b", END)
    with pytest.raises(GraphError, match=r"unbounded cycle (a -> b -> a|b -> a -> b).*loop node"):
        g.compile()


def test_loop_needs_body_and_exit_edges_and_a_bound():
    with pytest.raises(GraphError, match="max_iters"):
        StepGraph().add_loop("l", max_iters=0)
    g = StepGraph()
    g.add_loop("l", max_iters=2)
    g.add_tool("a", _tool)
    g.add_edge(START, "l")
    g.add_edge("l", "a")  # unlabelled
    g.add_edge("a", "l")
    g.add_edge("a", END)
    with pytest.raises(GraphError, match="loop 'l' needs exactly two out-edges"):
        g.compile()


def test_edges_may_not_enter_or_leave_a_loop_body_sideways():
    g = StepGraph()
    g.add_loop("l", max_iters=2)
    g.add_tool("body", _tool)
    g.add_tool("after", _tool)
    g.add_edge(START, "l")
    g.add_edge("l", "body", "body")
    g.add_edge("body", "l")
    g.add_edge("l", "after", "exit")
    g.add_edge("body", "after")
    g.add_edge("after", END)
    with pytest.raises(GraphError, match="edge body -> after leaves the body of loop 'l'"):
        g.compile()


def test_missing_input_is_named():
    g = StepGraph(inputs=["question"])
    g.add_generate("a", "{question} {draft}")
    g.add_sequence(START, "a", END)
    with pytest.raises(GraphError, match=r"node 'a' reads 'draft'"):
        g.compile()


def test_input_written_only_by_a_later_node_is_missing():
    g = StepGraph(inputs=["question"])
    g.add_generate("a", "{b}")
    g.add_generate("b", "{question}")
    g.add_sequence(START, "a", "b", END)
    with pytest.raises(GraphError, match=r"node 'a' reads 'b'"):
        g.compile()


def test_parallel_writers_of_one_key():
    g = StepGraph()
    g.add_tool("a", _tool, output="x")
    g.add_tool("b", _tool, output="x")
    g.add_edge(START, "a")
    g.add_edge(START, "b")
    g.add_edge("a", END)
    g.add_edge("b", END)
    with pytest.raises(GraphError, match="'a' and 'b' can run in parallel and both write 'x'"):
        g.compile()


def test_join_needs_two_branches_and_first_finish_branches_must_be_closed():
    g = StepGraph()
    g.add_tool("a", _tool)
    g.add_join("j")
    g.add_sequence(START, "a", "j", END)
    with pytest.raises(GraphError, match="join 'j' needs at least two incoming branches"):
        g.compile()

    g = StepGraph()
    g.add_fork("f")
    g.add_tool("a", _tool)
    g.add_tool("b", _tool)
    g.add_tool("leak", _tool, inputs=["a"])
    g.add_join("j", first=True)
    g.add_edge(START, "f")
    g.add_sequence("f", "a", "j")
    g.add_sequence("f", "b", "j")
    g.add_edge("a", "leak")
    g.add_edge("leak", END)
    g.add_edge("j", END)
    with pytest.raises(GraphError, match="node 'a' is in a first-finish branch of join 'j' but also feeds 'leak'"):
        g.compile()


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
