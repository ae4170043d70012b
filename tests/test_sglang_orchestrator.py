"""The orchestrator end to end against two fake SGLang servers (small and large).

A SpecReason chain of thought with the large model as judge over SGLang's logprobs, a large
server that dies mid-batch and comes back (refused connections are retried), and one that stays
down (finished runs are kept in the result store and the batch resumes once it is back).

SGLang itself does not install here (CUDA builds only), so everything runs against
`tests/fake_sglang.py`, real sockets and real subprocesses; nothing here has run on a GPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fake_sglang import FakeSGLangServer
from tests.llm_judge import LLM_SPECREASON
from tests.sglang_fixtures import generate_bodies
from thinkahead.models.sglang import SGLangModel

# -- the orchestrator against two fake servers -----------------------------------------------------


def small_responder(prompt: str, body: dict[str, Any]) -> str:
    """The small model: a sound first step, then a wrong final answer."""
    if "Multiply" not in prompt.split("user: ", 1)[-1].split("assistant: ", 1)[-1]:
        return "Multiply 17 by 23: 17 * 20 = 340 and 17 * 3 = 51.\n\nmore"
    return "So 340 + 51 = \\boxed{392}."


def large_responder(prompt: str, body: dict[str, Any]) -> str:
    return "So 340 + 51 = \\boxed{391}."


def judge_scores(prompt: str) -> dict[str, float]:
    """The large model as judge: the wrong sum scores 1, anything else 9."""
    return {"1": -0.1, "9": -2.4} if "392" in prompt else {"9": -0.05, "1": -3.2}


@pytest.fixture
def pair() -> Iterator[tuple[FakeSGLangServer, FakeSGLangServer]]:
    small = FakeSGLangServer(small_responder, speculative_algorithm="NGRAM", model_path="fake/small")
    large = FakeSGLangServer(large_responder, judge_scores, speculative_algorithm="SUFFIX", model_path="fake/large")
    small.start()
    large.start()
    try:
        yield small, large
    finally:
        small.stop()
        large.stop()


def in_one_loop(orch: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Run `orch.<method>(...)` and close its models in the same event loop (pooled clients belong to it)."""
    async def main() -> Any:
        try:
            return await getattr(orch, method)(*args, **kwargs)
        finally:
            await orch.aclose()

    return asyncio.run(main())


def orchestrator(small: FakeSGLangServer, large: FakeSGLangServer, **settings: Any):
    from thinkahead import Orchestrator

    opts: dict[str, Any] = {"timeout_s": 5.0, "max_retries": 6, "backoff_s": 0.05}
    opts.update(settings.pop("client", {}))
    return Orchestrator(small=SGLangModel(small.url, "small", **opts), large=SGLangModel(large.url, "large", **opts),
                        policy=LLM_SPECREASON, **settings)


def test_cot_specreason_end_to_end(pair: tuple[FakeSGLangServer, FakeSGLangServer]) -> None:
    small, large = pair
    result = in_one_loop(orchestrator(small, large), "run", "cot", "What is 17 * 23?")
    assert result.ok, result.error
    assert result.answer == "391"
    steps = [e["data"] for e in result.trace if e["kind"] == "step"]
    assert [(s["author"], s["verdict"], s["score"]) for s in steps] == [("small", "accepted", 9.0),
                                                                         ("large", "rejected", 1.0)]
    assert steps[0]["spec"]["spec_verify_ct"] > 0  # SGLang's speculative stats reach the trace
    judge_calls = [b for b in generate_bodies(large) if b.get("return_logprob")]
    assert len(judge_calls) == 2
    assert all(b["logprob_start_len"] == len(b["input_ids"]) - 1 for b in judge_calls)
    # each judge call reused the prefix the small model's step already shared with it
    judged = [g for g in large.generations if g["return_logprob"]]
    assert all(g["cached_tokens"] > 0 for g in judged[1:])


def test_server_dies_mid_batch_and_comes_back(tmp_path: Path, pair: tuple[FakeSGLangServer, FakeSGLangServer]) -> None:
    """The large server dies between two of its requests and is back 0.3 s later: its refused
    connections are retried until it is back. (A request it held when it died is not resent:
    see test_a_generation_the_server_may_have_run_is_not_resent.)"""
    small, large = pair
    calls = 0

    def responder(prompt: str, body: dict[str, Any]) -> str:
        nonlocal calls
        calls += 1
        if calls == 3:  # one run at a time: the large server holds no request now
            large.die(0.3)
        return small_responder(prompt, body)

    small.responder = responder
    from thinkahead.orchestrator.store import ResultStore

    store = tmp_path / "runs.jsonl"
    results = in_one_loop(orchestrator(small, large, concurrency=1), "map",
                          [f"What is 17 * 23? (#{i})" for i in range(6)], store=store)
    assert large.deaths == 1
    assert sorted(r.id for r in results) == [str(i) for i in range(6)]
    assert all(r.ok and r.answer == "391" for r in results), [r.error for r in results]
    assert len(list(ResultStore(store))) == 6


def test_server_down_keeps_finished_runs_and_the_batch_finishes_when_it_is_back(
    tmp_path: Path, pair: tuple[FakeSGLangServer, FakeSGLangServer]
) -> None:
    """The large server dies and stays down: finished runs are in the store, the others fail;
    once it is back the same batch resumes and runs only what had not finished."""
    from thinkahead.orchestrator.store import ResultStore

    small, large = pair
    large.faults.extend([""] * 9 + ["die"])  # 3 runs (2 judge calls + 1 rewrite each) finish first
    store = tmp_path / "runs.jsonl"
    questions = [f"What is 17 * 23? (#{i})" for i in range(6)]
    first = orchestrator(small, large, concurrency=1, retry={"attempts": 2, "backoff_s": 0.01},
                         client={"max_retries": 1, "backoff_s": 0.01, "timeout_s": 1.0})
    results = in_one_loop(first, "map", questions, store=store)
    done = {r.id for r in results if r.ok}
    assert done == {"0", "1", "2"}
    assert {r.status for r in results if not r.ok} == {"error"}
    assert "connection error" in next(r.error for r in results if not r.ok)
    assert ResultStore(store).done_ids() == done  # every finished run was written before the failure

    large.revive()
    before = len(generate_bodies(small))
    second = orchestrator(small, large, concurrency=2)
    resumed = in_one_loop(second, "map", questions, store=store)
    assert sorted(r.id for r in resumed) == ["3", "4", "5"]  # finished runs are not run again
    assert all(r.ok and r.answer == "391" for r in resumed)
    assert len(generate_bodies(small)) - before == 3 * 2  # two small steps per resumed run, none for the others
    latest = ResultStore(store).latest()
    assert sorted(latest) == [str(i) for i in range(6)] and all(r.status == "ok" for r in latest.values())
