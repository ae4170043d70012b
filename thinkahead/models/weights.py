"""Loading a model spec's weights into transformers (GGUF dequantisation, optional int8), lazily importing torch."""

from __future__ import annotations

import os
from typing import Any

from thinkahead.models.registry import prepare
from thinkahead.models.specs import resolve_model_spec

DTYPES: tuple[str, ...] = ("bfloat16", "float32", "int8")


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of a model spec (registry name, `hf:ORG/NAME`, directory, .gguf), no weights."""
    source = resolve_model_spec(spec)
    if source.registry_name is not None:
        path = prepare(source.registry_name)
        location, gguf_file = str(path.parent), path.name
    else:
        location, gguf_file = source.location, source.gguf_file
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(location, **({"gguf_file": gguf_file} if gguf_file else {}))


def _apply_thread_setting() -> None:
    """Set torch's intra-op threads from THINKAHEAD_THREADS when it is set; else leave torch's default."""
    raw = os.environ.get("THINKAHEAD_THREADS")
    if raw is None or raw.strip() == "":
        return
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"THINKAHEAD_THREADS must be a positive integer, got {raw!r}")
    import torch

    torch.set_num_threads(threads)


def load_causal_lm(
    spec: str,
    dtype: str = "bfloat16",
    wheel_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[Any, Any]:
    """Resolve `spec`, prepare packaged weights if needed, and load (model, tokenizer).

    GGUF sources load with ``from_pretrained(DIR, gguf_file=NAME)`` (weights are unpacked to
    `dtype`); hub ids and local directories load without gguf_file. The model is in eval mode.
    `dtype="int8"` loads in bf16, then quantizes every linear layer (thinkahead/models/quantize.py).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    source = resolve_model_spec(spec)
    if source.registry_name is not None:
        path = prepare(source.registry_name, cache_dir=cache_dir, wheel_dir=wheel_dir)
        location, gguf_file = str(path.parent), path.name
    else:
        location, gguf_file = source.location, source.gguf_file

    _apply_thread_setting()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(location, dtype=torch_dtype, **extra)
    tokenizer = AutoTokenizer.from_pretrained(location, **extra)
    model.eval()
    if dtype == "int8":
        from thinkahead.models.quantize import quantize_int8

        model = quantize_int8(model)
    return model, tokenizer
