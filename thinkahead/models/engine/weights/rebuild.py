"""Taking a converted model apart into named tensors, and putting it back together without converting.

`collect` turns a model (after GGUF dequantisation and, for int8, `quantize_int8`) into the tensors
the weight cache stores (thinkahead/models/engine/weights/cache.py); `rebuild` builds the same model from
its saved config on the meta device (no memory, no random init), fuses q/k/v and gate/up where the
stored model had them fused (thinkahead/models/engine/qwen2/fused_qwen2.py, on the meta skeleton), puts int8
linears where they were, and assigns every stored tensor in place, memory-mapped, so nothing is
converted again. An int8 linear is stored as its int8 weights and scales, whichever kernel packed
it (`quantize.unpack_int8`), and packed again for the kernel of this process (`quantize.pack_int8`).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from thinkahead.models.engine.weights.cache import (
    _META_KEY,
    HASH_NAME,
    CacheInvalid,
    Uncacheable,
)

_QWEIGHT, _SCALES = "qweight", "scales"
_INT8_ATTRIBUTES = frozenset({"in_features", "out_features", "_packed"})
_INT8_BUFFERS = frozenset({"bias"})
_FUSED_MODULE = "thinkahead.models.engine.qwen2.fused_qwen2"


def _type_name(module: Any) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def _check_int8_layout() -> None:
    """The rebuild below knows `RowwiseInt8Linear`'s state; refuse if quantize.py changed it."""
    import torch

    from thinkahead.models.engine.kernels.quantize import RowwiseInt8Linear

    probe = RowwiseInt8Linear(torch.nn.Linear(2, 2))
    attributes = set(vars(probe)) - set(vars(torch.nn.Module()))
    if attributes != _INT8_ATTRIBUTES or set(probe._buffers) != _INT8_BUFFERS:
        raise Uncacheable(
            f"RowwiseInt8Linear now holds {sorted(attributes)} and buffers {sorted(probe._buffers)}; "
            "teach thinkahead/models/engine/weights/rebuild.py its new layout and bump FORMAT_VERSION"
        )


def skeleton(config: Any) -> Any:
    """The model class of `config` on the meta device: shapes, modules and buffers, no data."""
    import torch
    from transformers import AutoModelForCausalLM

    quantization = config.__dict__.pop("quantization_config", None)  # GGUF's: nothing to load here
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        if quantization is not None:
            config.quantization_config = quantization
    if quantization is not None:
        model.config.quantization_config = quantization
    return model


def _is_fused(model: Any) -> bool:
    """Whether `model` holds q/k/v or gate/up linears fused by `fuse_qwen2` (without importing it)."""
    return any(type(m).__module__ == _FUSED_MODULE for m in model.modules())


def _skeleton(config: Any, fused: bool) -> Any:
    model = skeleton(config)
    if fused:
        from thinkahead.models.engine.qwen2.fused_qwen2 import fuse_qwen2

        fuse_qwen2(model)
    return model


def _expected_types(model: Any, int8: list[str], fused: bool) -> dict[str, str]:
    from thinkahead.models.engine.kernels.quantize import RowwiseInt8Linear

    types = {name: _type_name(module) for name, module in _skeleton(model.config, fused).named_modules()}
    for name in int8:
        types[name] = f"{RowwiseInt8Linear.__module__}.{RowwiseInt8Linear.__qualname__}"
    return types


def collect(model: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """(tensors by name, safetensors metadata) of a converted model; Uncacheable if `rebuild` could
    not give it back exactly."""
    import torch

    from thinkahead.models.engine.kernels.quantize import RowwiseInt8Linear, unpack_int8

    tensors: dict[str, Any] = {}
    int8: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, RowwiseInt8Linear):
            if not int8:
                _check_int8_layout()
            qweight, scales = unpack_int8(module._packed)  # symmetric per channel: no zero points
            if qweight.dtype != torch.int8 or scales.dtype != torch.float64 or scales.shape != (qweight.shape[0],):
                raise Uncacheable(f"{name}: int8 weights are not symmetric per-channel")
            tensors[f"{name}.{_QWEIGHT}"] = qweight
            tensors[f"{name}.{_SCALES}"] = scales
            int8.append(name)
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    params: list[str] = []
    frozen: list[str] = []
    named = [(True, model.named_parameters(remove_duplicate=False)), (False, model.named_buffers(remove_duplicate=False))]
    for is_param, items in named:
        for name, tensor in items:
            if id(tensor) in seen:
                aliases[name] = seen[id(tensor)]
                continue
            if name in tensors:
                raise Uncacheable(f"tensor name {name} is used twice")
            if tensor.device.type != "cpu":
                raise Uncacheable(f"{name} is on {tensor.device}, not the CPU")
            seen[id(tensor)] = name
            tensors[name] = tensor.detach()
            if is_param:
                params.append(name)
                if not tensor.requires_grad:
                    frozen.append(name)
    types = {name: _type_name(module) for name, module in model.named_modules()}
    fused = _is_fused(model)
    if types != _expected_types(model, int8, fused):
        raise Uncacheable("its modules differ from those its config builds")
    meta = {"int8": int8, "fused": fused, "params": params, "frozen": frozen, "aliases": aliases, "types": types}
    return tensors, {_META_KEY: json.dumps(meta, separators=(",", ":"))}


def _dtype_name(tensor: Any) -> str:
    import torch

    names = {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    try:
        return names[tensor.dtype]
    except KeyError:
        raise Uncacheable(f"tensors of dtype {tensor.dtype} are not supported") from None


def write_safetensors(path: Path, tensors: dict[str, Any], metadata: dict[str, str]) -> str:
    """Write `tensors` as one safetensors file, streaming (no second copy in memory), fsynced.

    Largest itemsize first, so every tensor starts at an offset aligned to its element size.
    Returns the file's sha256, computed while writing."""
    import torch

    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        tensor = tensors[name]
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _dtype_name(tensor), "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.new(HASH_NAME)
    with open(path, "wb") as fh:
        for chunk in (len(raw).to_bytes(8, "little"), raw):
            fh.write(chunk)
            digest.update(chunk)
        for name in order:
            flat = tensors[name].detach().contiguous().reshape(-1)
            data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
            fh.write(data)
            digest.update(data)
        fh.flush()
        os.fsync(fh.fileno())
    return digest.hexdigest()


def _int8_module(qweight: Any, scales: Any) -> Any:
    """An empty `RowwiseInt8Linear` of `qweight`'s shape; `_prepack` fills `_packed`, `_place` its bias."""
    import torch

    from thinkahead.models.engine.kernels.quantize import RowwiseInt8Linear

    if qweight.dtype != torch.int8 or qweight.dim() != 2 or scales.dtype != torch.float64:
        raise CacheInvalid("an int8 linear's stored weights have the wrong type")
    if scales.shape != (qweight.shape[0],):
        raise CacheInvalid("an int8 linear's scales do not match its weights")
    module = RowwiseInt8Linear.__new__(RowwiseInt8Linear)
    torch.nn.Module.__init__(module)
    module.out_features, module.in_features = (int(n) for n in qweight.shape)
    module._packed = None
    for name in _INT8_BUFFERS:
        module.register_buffer(name, None)
    return module


def _prepack(qweight: Any, scales: Any) -> Any:
    """The int8 kernel's packed form of stored int8 weights (a copy in its own layout); for fbgemm the
    costly part of a cached load (about 70 MB/s of weights per core on AVX2), and it releases the GIL."""
    from thinkahead.models.engine.kernels.quantize import pack_int8

    return pack_int8(qweight, scales)


def _place(model: Any, name: str, value: Any, is_param: bool, requires_grad: bool) -> None:
    import torch

    path, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise CacheInvalid(f"the model has no module {path!r} for {name}") from None
    if is_param:
        if leaf not in module._parameters:
            raise CacheInvalid(f"{name} is not a parameter of the rebuilt model")
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=requires_grad)
    else:
        if leaf not in module._buffers:
            raise CacheInvalid(f"{name} is not a buffer of the rebuilt model")
        module._buffers[leaf] = value


def rebuild(entry: Path, model_file: Path, dtype: str, name_or_path: str) -> tuple[Any, Any]:
    """(model, tokenizer) from a weight-cache entry: config and tokenizer files plus `model_file`.

    The int8 weights are packed for the int8 kernel in `torch.get_num_threads()` threads, largest first,
    while this thread places the other tensors and reads the tokenizer."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(entry)
    threads = max(1, torch.get_num_threads())
    with safe_open(model_file, framework="pt", device="cpu") as fh, ThreadPoolExecutor(threads) as pool:
        meta = json.loads((fh.metadata() or {})[_META_KEY])
        model = _skeleton(config, bool(meta.get("fused", False)))
        int8: list[str] = meta["int8"]
        if int8:
            _check_int8_layout()
            torch.backends.quantized.engine = "fbgemm"  # as quantize_int8: prepack for the fbgemm kernels
        stored = {name: (fh.get_tensor(f"{name}.{_QWEIGHT}"), fh.get_tensor(f"{name}.{_SCALES}")) for name in int8}
        packing: dict[str, tuple[Any, Future[Any]]] = {}
        for name in sorted(int8, key=lambda n: -stored[n][0].numel()):
            path, _, leaf = name.rpartition(".")
            parent = model.get_submodule(path)
            if not isinstance(getattr(parent, leaf, None), torch.nn.Linear):
                raise CacheInvalid(f"{name} is not a linear layer of the rebuilt model")
            module = _int8_module(*stored[name])
            setattr(parent, leaf, module)
            packing[name] = (module, pool.submit(_prepack, *stored[name]))
        skip = {f"{name}.{part}" for name in int8 for part in (_QWEIGHT, _SCALES)}
        params, frozen = set(meta["params"]), set(meta["frozen"])
        for name in fh.keys():  # noqa: SIM118 - safe_open is not iterable
            if name not in skip:
                _place(model, name, fh.get_tensor(name), name in params, name not in frozen)
        _tie(model, meta["aliases"], params)
        tokenizer = AutoTokenizer.from_pretrained(entry)  # Python work, while the threads pack
        for module, job in packing.values():
            module._packed = job.result()
    _check_complete(model, meta["types"])
    model.config._name_or_path = name_or_path
    if (entry / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(entry)
    model.eval()
    if int8:
        from thinkahead.models.engine.qwen2.exact_attention import use_exact_attention
        from thinkahead.models.engine.qwen2.fused_qwen2 import use_native_layers

        use_exact_attention(model)
        use_native_layers(model)
    return model, tokenizer


def _tie(model: Any, aliases: dict[str, str], params: set[str]) -> None:
    """Tied tensors: the very same object under both names, as in the converted model."""
    for alias, name in aliases.items():
        try:
            value = model.get_parameter(name) if name in params else model.get_buffer(name)
        except AttributeError:
            raise CacheInvalid(f"{alias} is tied to {name}, which was not stored") from None
        path, _, leaf = alias.rpartition(".")
        slots = model.get_submodule(path)._parameters if name in params else model.get_submodule(path)._buffers
        if leaf not in slots:
            raise CacheInvalid(f"{alias} is not a tensor of the rebuilt model")
        slots[leaf] = value


def _check_complete(model: Any, types: dict[str, str]) -> None:
    """Every module where it was, every tensor filled, every int8 linear whole."""
    from thinkahead.models.engine.kernels.quantize import RowwiseInt8Linear

    if {name: _type_name(module) for name, module in model.named_modules()} != types:
        raise CacheInvalid("the rebuilt modules differ from the stored model's")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type == "meta":
            raise CacheInvalid(f"{name} was not stored")
    for name, module in model.named_modules():
        if isinstance(module, RowwiseInt8Linear) and module._packed is None:
            raise CacheInvalid(f"{name} is incomplete")
