"""The server over a batching local model, as a hostile crowd uses it: many concurrent completions through the
real `openai` client, some streams abandoned after two chunks; every finished reply equals its solo reply, the
abandoned ones leave the batch, and the server stays healthy."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("thinkahead.models.engine.kernels._layer_native")
pytest.importorskip("thinkahead.models.engine.kernels._kquant_native")

from thinkahead.models.engine.weights import gguf_native
from thinkahead.models.local import LocalModel
from thinkahead.serving.openai_server import create_app

from tests.server_fixtures import openai_client, serve  # noqa: F401 (fixture)
from tests.test_gguf_native import tiny_config, write_tiny_gguf
from tests.tiny_models import byte_tokenizer

PROMPTS = [f"Item {i}: the value of {i} plus {i} is" for i in range(24)]


def test_a_crowd_of_completions_and_abandoned_streams_gets_exact_replies_and_leaves_the_batch_empty(tmp_path,
                                                                                                    serve):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    model = LocalModel(model=gguf_native.build_model(path, tiny_config()), tokenizer=byte_tokenizer(), name="tiny")
    assert model.engine.batches_rows
    url = serve(create_app({"concurrency": 8}, small=model, large=model))
    client = openai_client(url)

    def complete(prompt: str) -> str:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    alone = {p: complete(p) for p in PROMPTS[::3]}
    model.scheduler.peak_batch = 0
    steps = model.scheduler.steps

    def abandon(prompt: str) -> int:
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=400, temperature=0, stream=True)
        got = 0
        for _ in stream:
            got += 1
            if got == 2:
                break
        stream.close()
        return got

    with ThreadPoolExecutor(max_workers=24) as pool:
        finished = {p: pool.submit(complete, p) for p in PROMPTS[::3]}
        dropped = [pool.submit(abandon, p) for i, p in enumerate(PROMPTS) if i % 3]
        assert {p: f.result(timeout=120) for p, f in finished.items()} == alone
        assert all(f.result(timeout=120) == 2 for f in dropped)
    deadline = time.monotonic() + 10
    while model.scheduler.live and time.monotonic() < deadline:
        time.sleep(0.02)
    assert model.scheduler.live == 0
    assert model.scheduler.steps - steps < 200  # the abandoned streams left the batch long before their 400 tokens
    assert model.scheduler.peak_batch >= 4
    assert httpx.get(f"{url}/health").status_code == 200
    assert complete(PROMPTS[0]) == alone[PROMPTS[0]]
