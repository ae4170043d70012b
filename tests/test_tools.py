"""Tools never block the event loop: bounded calculator and BFCL math, tool calls off the loop with a time limit."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import pytest

from thinkahead.evals import data
from thinkahead.models import ScriptedModel
from thinkahead.orchestrator import END, START, Runtime, StepGraph
from thinkahead.step_spec.policies import make_policy
from thinkahead.workflows import build_workflow, react
from thinkahead.workflows.tools import calculator

NESTED_POWER = "(((10**64)**64)**64)**64"  # unbounded, 27 s of one big-int multiplication holding the GIL


def runtime(large: ScriptedModel) -> Runtime:
    return Runtime(ScriptedModel(outputs=["unused"]), large, make_policy("large"))


def timed_in_subprocess(code: str, timeout_s: float = 20.0) -> dict:
    """Run `code` (which prints one JSON line) in a fresh interpreter; a hang fails the test, not the suite.

    A runaway big-int operation holds the GIL, so no in-process guard could interrupt it.
    """
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the call did not finish within {timeout_s:g} s")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- calculator bounds


def test_the_nested_power_is_an_error_observation_in_well_under_a_second():
    out = timed_in_subprocess(
        "import json, time\n"
        "from thinkahead.workflows.tools import calculator\n"
        f"t0 = time.perf_counter(); text = calculator({NESTED_POWER!r})\n"
        "print(json.dumps({'text': text, 'elapsed': time.perf_counter() - t0}))\n"
    )
    assert out["text"].startswith("error:") and "digits" in out["text"]
    assert out["elapsed"] < 1.0


def test_commas_separate_arguments_and_group_thousands():
    assert calculator("max(3, 5)") == "5"
    assert calculator("min(3,5, 4)") == "3"
    assert calculator("round(2.345, 2)") == "2.35"
    assert calculator("1,234 + 1") == "1235"
    assert calculator("1,234,567 - 1") == "1234566"
    assert calculator("(1,234 + 1) * 2") == "2470"
    assert calculator("1,234.5 * 2") == "2469"
    # inside a call's parentheses a comma always separates arguments (documented choice)
    assert calculator("max(1,234)") == "234"
    assert calculator("1,2345").startswith("error:")  # not a thousands group, and no tuples


def test_huge_results_are_error_observations_not_exceptions():
    assert calculator("((10**64)**64)**2").startswith("error:")  # over Python's 4,300-digit str limit
    assert calculator("(10**2000) * (10**2000) * (10**2000)").startswith("error:")
    assert calculator("round(5, -1000000)").startswith("error:")  # 10**1000000 inside round
    assert calculator("1e308 * 10").startswith("error:")  # inf is not a result
    assert calculator("(-8) ** 0.5").startswith("error:")  # complex
    assert calculator("-" * 100_000 + "1").startswith("error:")  # too long to parse safely
    assert calculator("2**1000") == str(2**1000)  # big but bounded results still come back
    assert calculator("1**(10**100)") == "1"


# --------------------------------------------------------------------------- BFCL math bounds


def require_bfcl() -> None:
    dist, version = data.PACKAGES["bfcl_eval"]
    try:
        data.read_package_file("bfcl_eval", "bfcl_eval/__init__.py")
    except KeyError:
        pass
    except Exception as exc:  # no PyPI access and nothing installed or cached
        pytest.skip(f"{dist}=={version} unavailable ({exc}); "
                    f"`pip install --no-deps {dist}=={version}` enables this test")


def test_bfcl_power_square_root_and_logarithm_are_bounded():
    require_bfcl()
    out = timed_in_subprocess(
        "import json, time\n"
        "from thinkahead.evals.bfcl import BfclEnvironment\n"
        "ref = {'initial_config': {}, 'involved_classes': ['MathAPI'], 'ground_truth': []}\n"
        "env = BfclEnvironment(json.dumps(ref))\n"
        "calls = [('power', f'base={10**64}, exponent=1000000'), ('square_root', 'number=2, precision=100000000'),\n"
        "         ('logarithm', 'value=2, base=10, precision=10000000'),\n"
        "         ('round_number', 'number=5, decimal_places=-1000000000'),\n"
        "         ('power', 'base=2, exponent=10'), ('square_root', 'number=16, precision=5')]\n"
        "out = {}\n"
        "for name, args in calls:\n"
        "    t0 = time.perf_counter(); text = env.call(name, args)\n"
        "    out[f'{name}({args[:20]})'] = [text[:300], time.perf_counter() - t0]\n"
        "print(json.dumps(out))\n"
    )
    texts = [text for text, _ in out.values()]
    assert all(elapsed < 1.0 for _, elapsed in out.values()), out
    assert all(t.startswith("Error during execution:") for t in texts[:4]), texts
    assert "digits" in texts[0] and "precision" in texts[1] and "precision" in texts[2], texts
    assert "decimal_places" in texts[3], texts
    assert json.loads(texts[4]) == {"result": 1024}
    assert texts[5] == "{'result': Decimal('4')}"


# --------------------------------------------------------------------------- off the event loop


def test_a_slow_sync_tool_runs_while_the_event_loop_keeps_going():
    events: list[str] = []
    ticked = threading.Event()

    def slow(arg: str) -> str:
        """Waits until the event loop has ticked while it runs."""
        events.append("tool start")
        ticked.wait(3)  # only the ticker coroutine sets it: possible only while the loop is free
        events.append("tool end")
        return "slow result"

    large = ScriptedModel(outputs=[" go\nAction: slow[x]\n", " ok\nFinal Answer: done"])

    async def main():
        finished = asyncio.Event()

        async def ticker() -> None:
            while not finished.is_set():
                await asyncio.sleep(0.005)
                events.append("tick")
                if "tool start" in events and events.count("tick") >= 3:
                    ticked.set()

        tick_task = asyncio.create_task(ticker())
        try:
            return await runtime(large).run(react(tools={"slow": slow}), {"question": "q"})
        finally:
            finished.set()
            await tick_task

    result = asyncio.run(main())
    assert result.ok and result.answer == "done"
    assert "Observation: slow result" in large.generated_prompts()[1]
    start, end = events.index("tool start"), events.index("tool end")
    assert "tick" in events[start:end]  # the loop ran other coroutines during the tool call


def test_a_sync_tool_node_of_a_graph_runs_off_the_loop():
    events: list[str] = []
    ticked = threading.Event()

    def work(state: dict) -> str:
        events.append("node start")
        ticked.wait(3)
        events.append("node end")
        return state["question"].upper()

    g = StepGraph(inputs=["question"])
    g.add_tool("work", work)
    g.add_sequence(START, "work", END)

    async def main():
        run = asyncio.create_task(runtime(ScriptedModel()).run(g, "q"))
        while not run.done():
            await asyncio.sleep(0.005)
            events.append("tick")
            if "node start" in events:
                ticked.set()
        return await run

    result = asyncio.run(main())
    assert result.ok and result.answer == "Q"
    assert "tick" in events[events.index("node start"):events.index("node end")]


def test_a_tool_past_the_time_limit_is_an_error_observation_not_a_stall(caplog):
    events: list[str] = []
    release = threading.Event()

    def hang(arg: str) -> str:
        """Never finishes on its own."""
        events.append("tool start")
        release.wait(30)
        events.append("tool end")
        return "too late"

    large = ScriptedModel(outputs=[" go\nAction: hang[x]\n", " gave up\nFinal Answer: none"])
    try:
        result = asyncio.run(runtime(large).run(react(tools={"hang": hang}, tool_timeout_s=0.2), {"question": "q"}))
        assert events == ["tool start"]  # the run (and asyncio.run) ended while the tool still hangs
    finally:
        release.set()
    assert result.ok and result.answer == "none"
    observation = large.generated_prompts()[1].split("Observation: ")[-1].splitlines()[0]
    assert observation.startswith("error: tool 'hang' did not finish within 0.2 s"), observation
    assert any("tool 'hang' did not finish" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_an_async_tool_past_the_time_limit_is_an_error_observation():
    async def wait_forever(arg: str) -> str:
        """Never answers."""
        await asyncio.Event().wait()
        return "never"

    large = ScriptedModel(outputs=[" go\nAction: wait[x]\n", " gave up\nFinal Answer: none"])
    result = asyncio.run(runtime(large).run(react(tools={"wait": wait_forever}, tool_timeout_s=0.05), "q"))
    assert result.ok and result.answer == "none"
    observation = large.generated_prompts()[1].split("Observation: ")[-1].splitlines()[0]
    assert observation == "error: tool 'wait' did not finish within 0.05 s"


def test_the_tool_time_limit_is_an_option_with_one_default():
    from thinkahead.workflows.tools import TOOL_TIMEOUT_S

    assert TOOL_TIMEOUT_S > 0
    assert isinstance(build_workflow("react", tool_timeout_s=5), StepGraph)
    for bad in (0, -1, float("nan"), "5"):
        with pytest.raises(ValueError, match="tool_timeout_s"):
            react(tool_timeout_s=bad)


def test_the_calculator_through_react_rejects_a_huge_power():
    large = ScriptedModel(outputs=[" go\nAction: calculator[((10**64)**64)**64]\n", " ok\nFinal Answer: none"])
    result = asyncio.run(runtime(large).run(react(), {"question": "q"}))
    assert result.ok
    observation = large.generated_prompts()[1].split("Observation: ")[-1].splitlines()[0]
    assert observation.startswith("error:") and "digits" in observation and "ValueError" not in observation
