"""Loading a model spec's weights into transformers (GGUF dequantisation, optional int8, or the GGUF's own
blocks), lazily importing torch."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from thinkahead.models.engine import heap
from thinkahead.models.engine.dtypes import AUTO, DTYPES, GGUF, INT8
from thinkahead.models.engine.weights.progress import ConversionProgress
from thinkahead.models.registry import get_entry, prepare, prepared_path
from thinkahead.models.specs import ModelSource, resolve_model_spec
from thinkahead.models.templates import repair_chat_template
from thinkahead.models.engine.weights.cache import (
    CacheKey,
    cache_enabled,
    cache_root,
    directory_digest,
    entry_path,
    file_digest,
    is_complete,
    load_entry,
    make_key,
    store_entry,
)

logger = logging.getLogger(__name__)

PathArg = str | os.PathLike[str] | None
STAGE_READ, STAGE_INT8, STAGE_STORE = "reading the weights", "converting to int8", "writing the weight cache"


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of a model spec (registry name, `hf:ORG/NAME`, directory, .gguf), no weights."""
    location, gguf_file = _locate(resolve_model_spec(spec), None, None)
    _check_header(location, gguf_file)
    from transformers import AutoTokenizer

    return repair_chat_template(AutoTokenizer.from_pretrained(location, **({"gguf_file": gguf_file} if gguf_file else {})))


def _check_header(location: str, gguf_file: str | None) -> None:
    """A damaged GGUF file is refused here (`ModelFileError`, naming the file and the tensor), before any
    work on it; its header is read once per state of the file (thinkahead/models/engine/weights/gguf_check.py)."""
    if gguf_file is not None:
        from thinkahead.models.engine.weights.gguf_check import read_index

        read_index(Path(location, gguf_file))


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


def _locate(source: ModelSource, cache_dir: PathArg, wheel_dir: PathArg) -> tuple[str, str | None]:
    """(location, gguf file name or None) of a resolved spec; packaged models are prepared first."""
    if source.registry_name is None:
        return str(source.location), source.gguf_file
    path = prepare(source.registry_name, cache_dir=cache_dir, wheel_dir=wheel_dir)
    return str(path.parent), path.name


def _locate_prepared(source: ModelSource, cache_dir: PathArg) -> tuple[str, str | None] | None:
    """As `_locate`, without preparing: None for a packaged model that is not prepared yet."""
    if source.registry_name is None:
        return str(source.location), source.gguf_file
    path = prepared_path(source.registry_name, cache_dir=cache_dir)
    return None if path is None else (str(path.parent), path.name)


def _cache_key(source: ModelSource, location: str, gguf_file: str | None, dtype: str, root: Path,
               compute: bool = True) -> CacheKey | None:
    """The weight-cache key of a located model, or None when it has no local identity (a hub id) or,
    with `compute=False`, when finding it would mean hashing files."""
    if source.registry_name is not None:
        label, digest = source.registry_name, get_entry(source.registry_name).sha256
    elif gguf_file is not None:
        path = Path(location) / gguf_file
        label, digest = path.stem, file_digest(path, root, compute)
    elif source.kind == "dir":
        label, digest = Path(location).name, directory_digest(Path(location), root, compute)
    else:
        logger.debug("%s is a hub id: its converted weights are not cached", location)
        return None
    return None if digest is None else make_key(label, digest, dtype)


def resolve_dtype(dtype: str, location: str, gguf_file: str | None) -> str:
    """`dtype`, with "auto" made concrete for a located model: "gguf" where the model is a GGUF file the
    native kernel runs (thinkahead/models/engine/weights/gguf_native.py reads only its header), else "int8". Raises
    `ModelFileError` for a damaged GGUF file."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype != AUTO:
        return dtype
    if gguf_file is None:
        return INT8
    from thinkahead.models.engine.weights.gguf_native import unsupported_reason
    from thinkahead.models.engine.kernels.kquant import unavailable_reason

    # a damaged file raises (ModelFileError, from its header): it is an error whatever the dtype, not a
    # reason to fall back to int8, whose loader would fail on it later and worse
    why = unavailable_reason() or unsupported_reason(Path(location, gguf_file))
    if why is not None:
        logger.info("dtype auto: int8 for %s (gguf cannot run it: %s)", gguf_file, why)
        return INT8
    return GGUF


def weight_cache_entry(spec: str, dtype: str, cache_dir: PathArg = None) -> Path | None:
    """The weight-cache folder `load_causal_lm(spec, dtype)` reads and writes, whether it exists or not;
    None when it cannot be named without preparing or hashing (a packaged model not prepared yet, a
    file not hashed yet) or the model is not cached at all (a hub id)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    source = resolve_model_spec(spec)
    located = _locate_prepared(source, cache_dir)
    if located is None:
        return None
    root = cache_root(cache_dir)
    dtype = resolve_dtype(dtype, *located)
    key = _cache_key(source, located[0], located[1], dtype, root, compute=False)
    return None if key is None else entry_path(root, key)


def is_weight_cached(spec: str, dtype: str, cache_dir: PathArg = None, weight_cache: bool | None = None) -> bool:
    """Whether `load_causal_lm(spec, dtype)` would load from the weight cache (cheap: no hashing)."""
    if not cache_enabled(weight_cache):
        return False
    entry = weight_cache_entry(spec, dtype, cache_dir)
    return entry is not None and is_complete(entry)


def load_causal_lm(
    spec: str,
    dtype: str = "bfloat16",
    wheel_dir: PathArg = None,
    cache_dir: PathArg = None,
    weight_cache: bool | None = None,
    progress: bool | None = None,
) -> tuple[Any, Any]:
    """Resolve `spec`, prepare packaged weights if needed, and load (model, tokenizer).

    GGUF sources load with ``from_pretrained(DIR, gguf_file=NAME)`` (weights are unpacked to
    `dtype`); hub ids and local directories load without gguf_file. The model is in eval mode.
    `dtype="int8"` loads in bf16, then quantizes every linear layer (thinkahead/models/engine/kernels/quantize.py).
    `dtype="gguf"` (GGUF sources only) computes on the file's own blocks (thinkahead/models/engine/weights/gguf_native.py);
    `dtype="auto"` is gguf where that runs, else int8 (`resolve_dtype`).

    The converted model is cached (thinkahead/models/engine/weights/cache.py) under `cache_dir`'s
    ``weight-cache`` folder and memory-mapped by later loads, bit-identical; `weight_cache=False`
    (or ``THINKAHEAD_WEIGHT_CACHE=0``) converts every time. `progress`: a bar on stderr while a
    model converts (None: only when stderr is a terminal).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    source = resolve_model_spec(spec)
    if dtype == GGUF:
        from thinkahead.models.engine.kernels.kquant import unavailable_reason

        if (why := unavailable_reason()) is not None:
            raise ValueError(f"dtype 'gguf' cannot run here: {why}; use dtype 'int8'")
    location, gguf_file = _locate(source, cache_dir, wheel_dir)
    _check_header(location, gguf_file)
    dtype = resolve_dtype(dtype, location, gguf_file)
    if dtype == GGUF and gguf_file is None:
        raise ValueError(f"dtype 'gguf' computes on a GGUF file's blocks; {spec!r} is not a GGUF model (use dtype 'int8')")
    _apply_thread_setting()
    with heap.loading():  # the objects it makes live as long as the process: see heap.py
        root = cache_root(cache_dir)
        key = _cache_key(source, location, gguf_file, dtype, root) if cache_enabled(weight_cache) else None
        if key is not None:
            loaded = load_entry(root, key, location, source_file=Path(location, gguf_file) if gguf_file else None)
            if loaded is not None:
                return _with_rotary_tables(*loaded)
        label = source.registry_name or Path(location, gguf_file or "").name
        stages = (STAGE_READ, *((STAGE_INT8,) if dtype == INT8 else ()), *((STAGE_STORE,) if key is not None else ()))
        with ConversionProgress(f"{label} ({dtype})", stages, cached=key is not None, enabled=progress) as bar:
            started = time.perf_counter()
            model, tokenizer = _convert(location, gguf_file, dtype, bar)
            if key is not None:
                bar.stage(STAGE_STORE)
                store_entry(root, key, model, tokenizer, convert_s=time.perf_counter() - started)
        return _with_rotary_tables(model, tokenizer)


def _with_rotary_tables(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    """Every model loaded here reads its rotary cos/sin from a table (exact_rotary.py), whatever its dtype:
    torch's threaded cos/sin gave part of a first forward's positions errors up to 1.5e-4 in some processes."""
    from thinkahead.models.engine.qwen2.exact_rotary import use_exact_rotary

    use_exact_rotary(model)
    return model, repair_chat_template(tokenizer)


def _convert(location: str, gguf_file: str | None, dtype: str, bar: ConversionProgress) -> tuple[Any, Any]:
    """Load with transformers (dequantising a GGUF) and, for int8, quantize: the slow path. For gguf,
    only the config and the tokenizer are converted (from the GGUF's metadata)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bar.stage(STAGE_READ)
    if dtype == GGUF and gguf_file is not None:
        from thinkahead.models.engine.weights.gguf_native import convert

        return convert(Path(location, gguf_file))
    if gguf_file is not None:  # NaN or infinite scales: refused before transformers dequantizes them
        from thinkahead.models.engine.weights.gguf_check import read_index, scan_file

        scan_file(read_index(Path(location, gguf_file)))
    extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, INT8: torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(location, dtype=torch_dtype, **extra)
    tokenizer = AutoTokenizer.from_pretrained(location, **extra)
    model.eval()
    if dtype == INT8:
        from thinkahead.models.engine.kernels.quantize import quantize_int8

        bar.stage(STAGE_INT8)
        model = quantize_int8(model)
    return model, tokenizer
