"""SDK habits: sync calls inside a running event loop (Jupyter), the orchestrator as a context manager,
one base class for the library's exceptions, `raise_on_error`, logging instead of printing, py.typed."""

from __future__ import annotations

import ast
import asyncio
import logging
from pathlib import Path

import pytest

import thinkahead
from thinkahead import Orchestrator
from thinkahead.errors import RunFailed, ThinkaheadError
from thinkahead.models import ScriptedModel

from tests.llm_judge import LLM_SPECREASON

JUDGE_YES = [{"9": -0.05}]


class Closing(ScriptedModel):
    closed = 0

    async def aclose(self) -> None:
        type(self).closed += 1


def pair():
    small = ScriptedModel(outputs=["So \\boxed{4}."], name="small")
    large = ScriptedModel(outputs=["\\boxed{4}"], logprobs=JUDGE_YES, name="large")
    return small, large


def test_run_sync_and_map_sync_work_inside_a_running_event_loop():
    orch = Orchestrator(*pair(), policy=LLM_SPECREASON)

    async def notebook_cell():  # Jupyter runs cells inside its own event loop
        one = orch.run_sync("cot", "What is 2 + 2?")
        many = orch.map_sync(["What is 2 + 2?", "What is 1 + 3?"], "cot")
        return one, many

    one, many = asyncio.run(notebook_cell())
    assert one.answer == "4" and [r.answer for r in many] == ["4", "4"]
    assert orch.run_sync("cot", "What is 2 + 2?").answer == "4"  # and outside one, as before


def test_the_orchestrator_is_a_context_manager_that_closes_its_models():
    Closing.closed = 0
    with Orchestrator(Closing(outputs=["So \\boxed{4}."]), Closing(logprobs=JUDGE_YES), policy="small") as orch:
        assert orch.run_sync("cot", "q").answer == "4"
    assert Closing.closed == 2

    async def use():
        async with Orchestrator(Closing(outputs=["So \\boxed{4}."]), Closing(), policy="small") as orch:
            return (await orch.run("cot", "q")).answer

    assert asyncio.run(use()) == "4" and Closing.closed == 4


def test_raise_on_error_raises_a_thinkahead_error_and_logs(caplog):
    def broken(prompt, request):
        raise ValueError("the small model is broken")

    orch = Orchestrator(ScriptedModel(outputs=broken), ScriptedModel(logprobs=JUDGE_YES), policy="small")
    assert orch.run_sync("cot", "q").status == "error"  # default: the failed run is returned
    with caplog.at_level(logging.WARNING, logger="thinkahead.sdk"), pytest.raises(RunFailed) as err:
        orch.run_sync("cot", "q", raise_on_error=True)
    assert isinstance(err.value, ThinkaheadError) and err.value.result.status == "error"
    assert "the small model is broken" in str(err.value)
    assert any("failed" in r.getMessage() for r in caplog.records)


def test_library_exceptions_share_one_base_and_keep_their_old_ones():
    from thinkahead.evals.data import DataUnavailableError
    from thinkahead.models.http import ModelServerError
    from thinkahead.models.registry import ChecksumError, ModelDownloadError
    from thinkahead.orchestrator.graph import GraphError
    from thinkahead.orchestrator.jsonl import LogError
    from thinkahead.serving.asgi import RequestError
    from thinkahead.orchestrator.budget import BudgetExceeded
    from thinkahead.orchestrator.runtime import NodeError, ToolTimeoutError
    from thinkahead.serving.sglang_launcher import LaunchError

    for cls, old in [(BudgetExceeded, Exception), (NodeError, RuntimeError), (ToolTimeoutError, RuntimeError),
                     (GraphError, ValueError), (LogError, ValueError), (ModelServerError, RuntimeError),
                     (ChecksumError, ValueError), (ModelDownloadError, RuntimeError),
                     (DataUnavailableError, RuntimeError), (LaunchError, RuntimeError), (RequestError, Exception)]:
        assert issubclass(cls, ThinkaheadError) and issubclass(cls, old), cls


def test_the_package_is_typed_and_never_prints():
    root = Path(thinkahead.__file__).parent
    assert (root / "py.typed").is_file()
    library = [p for folder in (root, root.parent / "orchestrator", root.parent / "workflows")
               for p in folder.rglob("*.py") if "cli" not in p.relative_to(root.parent).parts]
    offenders = [f"{p}:{node.lineno}" for p in library for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]
    assert offenders == []  # the command line prints; the library logs
