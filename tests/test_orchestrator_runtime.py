"""The runtime: parallel branches overlap, loops, first-finish joins, budgets, retries, failures, streaming."""

from __future__ import annotations

import asyncio
import time

import pytest

from thinkahead.models import ScriptedModel
from thinkahead.models.http import ModelServerError
from thinkahead.orchestrator import END, START, RetryPolicy, RunBudget, Runtime, StepGraph
from thinkahead.orchestrator.trace import RunResult, TraceEvent
from thinkahead.step_spec.policies import make_policy

from tests.llm_judge import LLM_JUDGE

FAST_RETRY = RetryPolicy(attempts=3, backoff_s=0.001)


def runtime(small=None, large=None, policy="large", **kw) -> Runtime:
    small = small or ScriptedModel(outputs=["small says \\boxed{1}"])
    large = large or ScriptedModel(outputs=["large says \\boxed{2}"], logprobs=[{"9": -0.1}])
    return Runtime(small, large, make_policy(policy, **(LLM_JUDGE if policy == "specreason" else {})), retry=kw.pop("retry", FAST_RETRY), **kw)


def sleeper(name: str, seconds: float, log: list):
    async def tool(state):
        log.append((name, "start", time.perf_counter()))
        await asyncio.sleep(seconds)
        log.append((name, "end", time.perf_counter()))
        return name

    return tool


def fan_out(n: int, seconds: float, log: list, first: bool = False) -> StepGraph:
    g = StepGraph(inputs=["question"], output="merged")
    g.add_fork("fork")
    g.add_join("merged", first=first)
    g.add_edge(START, "fork")
    for i in range(n):
        delay = seconds if i == 0 or not first else 1.0 + i  # with first=True, b0 wins by far
        g.add_tool(f"b{i}", sleeper(f"b{i}", delay, log))
        g.add_edge("fork", f"b{i}")
        g.add_edge(f"b{i}", "merged")
    g.add_edge("merged", END)
    return g


def test_parallel_branches_really_overlap():
    log: list = []
    t0 = time.perf_counter()
    result = asyncio.run(runtime().run(fan_out(3, 0.3, log), {"question": "q"}))
    elapsed = time.perf_counter() - t0
    assert result.ok and result.answer == ["b0", "b1", "b2"]
    starts = [t for _, kind, t in log if kind == "start"]
    ends = [t for _, kind, t in log if kind == "end"]
    assert max(starts) < min(ends)  # every branch started before any finished
    assert elapsed < 0.8  # serial would be 0.9 s


def test_model_calls_of_parallel_nodes_overlap():
    large = ScriptedModel(outputs=["x"], delay_s=0.3)
    g = StepGraph(inputs=["question"], output="both")
    g.add_generate("a", "A {question}")
    g.add_generate("b", "B {question}")
    g.add_join("both")
    g.add_edge(START, "a"), g.add_edge(START, "b"), g.add_edge("a", "both"), g.add_edge("b", "both")
    g.add_edge("both", END)
    t0 = time.perf_counter()
    result = asyncio.run(runtime(large=large).run(g, "q"))
    assert result.ok and result.answer == ["x", "x"]
    assert time.perf_counter() - t0 < 0.55
    assert sorted(large.generated_prompts()) == [large.render([{"role": "user", "content": "A q"}]),
                                                large.render([{"role": "user", "content": "B q"}])]


def test_first_finish_join_cancels_the_losers():
    log: list = []
    t0 = time.perf_counter()
    result = asyncio.run(runtime().run(fan_out(3, 0.05, log, first=True), {"question": "q"}))
    assert result.ok and result.answer == "b0"
    assert time.perf_counter() - t0 < 0.8  # the losers would sleep 2 s and 3 s
    assert [n for n, kind, _ in log if kind == "end"] == ["b0"]
    cancelled = {e["node"] for e in result.trace if e["kind"] == "node_end" and e["data"].get("status") == "cancelled"}
    assert cancelled == {"b1", "b2"}
    join_end = next(e for e in result.trace if e["kind"] == "node_end" and e["node"] == "merged")
    assert join_end["data"]["winner"] == "b0"


def test_loop_runs_its_body_while_the_condition_holds_and_stops_at_the_bound():
    def count(state):
        return state.get("n", 0) + 1

    def build(limit: int, stop_at: int) -> StepGraph:
        g = StepGraph(inputs=["question"], output="n")
        g.add_loop("again", max_iters=limit, condition=lambda s: s.get("n", 0) < stop_at)
        g.add_tool("inc", count, output="n")
        g.add_edge(START, "again")
        g.add_edge("again", "inc", "body")
        g.add_edge("inc", "again")
        g.add_edge("again", END, "exit")
        return g

    rt = runtime()
    stopped = asyncio.run(rt.run(build(10, 3), "q"))
    assert stopped.answer == 3 and stopped.outputs["again_iterations"] == 3
    bounded = asyncio.run(rt.run(build(4, 100), "q"))
    assert bounded.answer == 4
    loop_end = next(e for e in bounded.trace if e["kind"] == "node_end" and e["node"] == "again")
    assert loop_end["data"]["bounded"] is True


def test_model_call_budget_stops_the_run_with_a_named_limit():
    from thinkahead.workflows import refine

    critic = ScriptedModel(outputs=["There is a mistake."])
    rt = runtime(small=critic, budget=RunBudget(max_model_calls=3))
    result = asyncio.run(rt.run(refine(rounds=5), "q"))
    assert result.status == "budget"
    assert "max_model_calls=3" in result.error
    assert result.cost["model_calls"] == 3


def test_token_budget_and_wall_time_budget():
    large = ScriptedModel(outputs=["one two three four five"])
    g = StepGraph(inputs=["question"], output="b")
    g.add_generate("a", "{question}")
    g.add_generate("b", "{a}")
    g.add_sequence(START, "a", "b", END)
    result = asyncio.run(runtime(large=large, budget=RunBudget(max_tokens=5)).run(g, "q"))
    assert result.status == "budget" and "max_tokens=5" in result.error
    assert result.cost["total_tokens"] == 5

    slow = ScriptedModel(outputs=["x"], delay_s=2.0)
    t0 = time.perf_counter()
    result = asyncio.run(runtime(large=slow, budget=RunBudget(max_wall_s=0.2)).run(g, "q"))
    assert result.status == "budget" and "max_wall_s" in result.error
    assert time.perf_counter() - t0 < 1.0


def test_retryable_failures_are_retried_with_backoff():
    large = ScriptedModel(outputs=["fine"], failures=[ModelServerError("busy", status=503), ConnectionError("reset")])
    g = StepGraph(inputs=["question"])
    g.add_generate("a", "{question}")
    g.add_sequence(START, "a", END)
    result = asyncio.run(runtime(large=large).run(g, "q"))
    assert result.ok and result.answer == "fine"
    assert result.cost["retries"] == 2 and result.cost["model_calls"] == 1
    assert [c.kind for c in large.calls] == ["failed", "failed", "generate"]


def test_a_non_retryable_failure_ends_the_run_with_the_node_named():
    large = ScriptedModel(outputs=["fine"], failures=[ModelServerError("bad request", status=400)])
    g = StepGraph(inputs=["question"])
    g.add_generate("ask", "{question}")
    g.add_sequence(START, "ask", END)
    result = asyncio.run(runtime(large=large).run(g, "q"))
    assert result.status == "error"
    assert "node 'ask' (generate) failed" in result.error and "bad request" in result.error
    assert [c.kind for c in large.calls] == ["failed"]


def test_retries_give_up_after_the_last_attempt():
    large = ScriptedModel(outputs=["fine"], failures=[TimeoutError("t")] * 3)
    g = StepGraph(inputs=["question"])
    g.add_generate("ask", "{question}")
    g.add_sequence(START, "ask", END)
    result = asyncio.run(runtime(large=large).run(g, "q"))
    assert result.status == "error" and "TimeoutError" in result.error
    assert len(large.calls) == 3


def test_batch_runs_concurrently_up_to_the_limit_and_failures_stay_local():
    state = {"now": 0, "peak": 0}

    async def work(s):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        if s["question"] == "boom":
            raise RuntimeError("tool exploded")
        return s["question"].upper()

    g = StepGraph(inputs=["question"])
    g.add_tool("work", work)
    g.add_sequence(START, "work", END)
    items = [(str(i), q) for i, q in enumerate(["a", "b", "boom", "c", "d", "e", "f"])]
    results = asyncio.run(runtime(concurrency=3).map(g, items))
    by_id = {r.id: r for r in results}
    assert state["peak"] == 3
    assert by_id["2"].status == "error" and "tool exploded" in by_id["2"].error
    assert [by_id[str(i)].answer for i in (0, 1, 3, 4, 5, 6)] == ["A", "B", "C", "D", "E", "F"]


def test_batch_budget_stops_new_runs():
    large = ScriptedModel(outputs=["x"])
    g = StepGraph(inputs=["question"])
    g.add_generate("a", "{question}")
    g.add_sequence(START, "a", END)
    rt = runtime(large=large, concurrency=1, batch_budget=RunBudget(max_model_calls=3))
    results = asyncio.run(rt.map(g, [(str(i), "q") for i in range(6)]))
    assert [r.status for r in results] == ["ok", "ok", "ok"]
    assert len(large.calls) == 3


def test_duplicate_ids_in_a_batch_are_rejected():
    g = StepGraph(inputs=["question"])
    g.add_tool("a", lambda s: 1)
    g.add_sequence(START, "a", END)
    with pytest.raises(ValueError, match="duplicate run id '1'"):
        asyncio.run(runtime().map(g, [("1", "a"), ("1", "b")]))


def test_think_node_streams_step_events_before_the_result():
    small = ScriptedModel(outputs=["First step.\n\n", "Second step.\n\n", "So \\boxed{7}"])
    large = ScriptedModel(outputs=["unused"], logprobs=[{"8": -0.05}])
    from thinkahead.workflows import cot

    async def collect():
        return [item async for item in runtime(small, large, policy="specreason").stream(cot(), "What is 3+4?")]

    items = asyncio.run(collect())
    assert isinstance(items[-1], RunResult) and items[-1].answer == "7"
    steps = [e for e in items[:-1] if isinstance(e, TraceEvent) and e.kind == "step"]
    assert [s.data["text"] for s in steps] == ["First step.\n\n", "Second step.\n\n", "So \\boxed{7}"]
    assert all(s.data["author"] == "small" and s.data["verdict"] == "accepted" and s.data["score"] == 8 for s in steps)
    kinds = [e.kind for e in items[:-1]]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    assert items[-1].cost["judge_calls"] == 3 and items[-1].cost["tokens"]["small"] == 6


def test_inputs_are_checked():
    from thinkahead.workflows import cot

    with pytest.raises(ValueError, match=r"needs inputs \['question'\]"):
        asyncio.run(runtime().run(cot(), {"prompt": "x"}))
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        runtime(concurrency=0)
