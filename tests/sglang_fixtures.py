"""Shared helpers of the SGLang tests: a fake SGLang 0.5.23 server per test and `SGLangModel`s on it.

`running_server()` is the body of the `server` fixture each test module defines: a started fake
with NGRAM statistics whose "slow" fault takes `SLOW_S`, stopped afterwards. `make_model` builds
a client with short timeouts and fast retries, `run_model` runs a coroutine on it and closes its
connections in the same event loop, and `generate_bodies` lists the `/generate` bodies the fake
received. `FAKE_SCRIPT` is the fake run as a script, standing in for `sglang.launch_server`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.fake_sglang import FakeSGLangServer
from thinkahead.models.sglang import SGLangModel

ROOT = Path(__file__).resolve().parents[1]
FAKE_SCRIPT = str(ROOT / "tests" / "fake_sglang.py")
TIMEOUT_S = 0.3  # client timeout in the fault tests; "slow" replies take SLOW_S
SLOW_S = 1.0


def running_server() -> Iterator[FakeSGLangServer]:
    srv = FakeSGLangServer(speculative_algorithm="NGRAM")
    srv.slow_s = SLOW_S
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def make_model(server: FakeSGLangServer, **kwargs: Any) -> SGLangModel:
    opts: dict[str, Any] = {"timeout_s": TIMEOUT_S, "max_retries": 2, "backoff_s": 0.01, "api_key": ""}
    opts.update(kwargs)
    return SGLangModel(server.url, "fake", **opts)


def run_model(model: Any, fn: Callable[[Any], Any]) -> Any:
    """Run `fn(model)` and close the model's connections in the same event loop."""
    async def main() -> Any:
        try:
            return await fn(model)
        finally:
            await model.aclose()

    return asyncio.run(main())


def generate_bodies(server: FakeSGLangServer) -> list[dict[str, Any]]:
    return [body for path, body in server.requests if path == "/generate"]
