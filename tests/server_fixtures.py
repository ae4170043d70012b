"""Shared helpers of the server tests: uvicorn on free loopback ports, scripted model pairs, SSE reading."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn

from thinkahead.models import ScriptedModel

JUDGE_YES = [{"9": -0.05}]
TINY_QUESTION = [{"role": "user", "content": "w5 w6 w7 w8"}]  # words the tiny random model's vocabulary holds
STEPS = ["Multiply.\n\n", "So \\boxed{391}."]


def scripted_pair(delay_s: float = 0.0):
    small = ScriptedModel(outputs=list(STEPS), name="small-scripted", delay_s=delay_s)
    large = ScriptedModel(outputs=["\\boxed{391}"], logprobs=JUDGE_YES, name="large-scripted", delay_s=delay_s)
    return small, large


def _serving():
    """A `start(app) -> base URL` that runs apps with uvicorn on free ports, and stops them when closed."""
    running = []

    def start(app) -> str:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        running.append((server, thread))
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def serve():
    """Starts apps with uvicorn on free ports; returns their base URLs; stops them afterwards."""
    yield from _serving()


@pytest.fixture(scope="module")
def serve_module():
    """`serve` for a whole module (a real model loaded once serves all its tests)."""
    yield from _serving()


def chat(model: str, question: str = "What is 17 * 23?", **extra):
    return {"model": model, "messages": [{"role": "user", "content": question}], **extra}


def sse_payloads(response: httpx.Response):
    """The `data:` payloads of an event stream as they arrive, JSON-decoded except the final [DONE]."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)
        else:
            assert line == "", f"unexpected line in the event stream: {line!r}"


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    """The tiny random model (tests/conftest.py) as a float32 `LocalModel` named "tiny"."""
    from thinkahead.models.local import LocalModel

    return LocalModel(str(tiny_model_dir), dtype="float32", name="tiny")


@pytest.fixture
def tiny_url(serve, tiny):
    """A server on a loopback port whose small and large model are both `tiny`."""
    from thinkahead.serving.openai_server import create_app

    return serve(create_app(small=tiny, large=tiny))


def openai_client(url: str):
    """The real `openai` client for a server started by `serve`, without retries."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
