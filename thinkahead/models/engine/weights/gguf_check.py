"""A GGUF file's header read into a checked index, and its scales and float values scanned.

`read_index(path)` parses the header (the vocabulary and other arrays are skipped, their lengths
kept) and refuses, with a `ModelFileError` of one line naming the file and the tensor, a file that
any loader would misread: a bad magic or version; key or tensor counts that cannot fit in the file;
a value type, string or array that runs past the end; a bad `general.alignment`; a tensor of an
unknown ggml type, of 0 or more than 4 dimensions, whose rows are not whole blocks, that starts off
the alignment, lies past the end of the file, overlaps another or appears twice. For the
architectures whose layout is known here (`LAYOUTS`: qwen2, llama) it also checks what the
architecture needs: the metadata that sizes the model (integers >= 1, heads that divide), every
tensor the model needs present with the shape that metadata gives (the vocabulary's length for the
embedding's rows), norms and biases in F32, and no tensor the model does not have. It costs a read of
the header, and it is done once per state of the file (path, size, mtime, ctime, inode): a start
asks for the index several times (is the model cached, which dtype, the build).

`scan_values(index, data)` looks at every quantized block's scales (the fp16 `d` and `dmin` of the
K-quants and the 32-value blocks) and every value of a float tensor for NaN or infinity, over the
file's bytes in memory or mapped; the loaders call it once, at conversion (thinkahead/models/engine/weights/load.py,
gguf_native.convert), whose result the weight cache keeps under the file's sha256: a warm start
scans nothing.

Limits: GGUF has no checksum. A flipped byte in a quantized code, or one that leaves a scale or a
float value finite, cannot be told from a real weight: such damage loads and gives wrong output.
Only a comparison of the file's sha256 with a known one finds it (the registry does for packaged
models, thinkahead/models/registry.py).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from thinkahead.models.errors import ModelFileError

T = GGMLQuantizationType
F32 = int(T.F32)
EMBEDDING = "token_embd.weight"  # the token embedding table (also the lm_head where the file has no output.weight)
TOKENS_KEY = "tokenizer.ggml.tokens"
# (values, bytes) per block of every ggml type gguf knows
TYPE_SIZES: dict[int, tuple[int, int]] = {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}
TYPE_NAMES: dict[int, str] = {int(kind): kind.name for kind in GGML_QUANT_SIZES}
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
_MAX_ALIGNMENT = 1 << 16
_MAX_STRING = 1 << 24
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, dimensions, one dimension, type, offset
_STRING, _ARRAY, _MAX_NESTING = 8, 9, 4
# GGUF metadata value types: struct formats by type id (8 = string, 9 = array)
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

# Where each block type keeps its scales: (encoding, byte offsets in the block), as ggml lays the blocks out
_HALF, _SINGLE, _E8M0 = "f16", "f32", "e8m0"
_SCALES: dict[int, tuple[str, tuple[int, ...]]] = {
    **{int(t): (_HALF, (0,)) for t in (T.Q4_0, T.Q5_0, T.Q8_0, T.IQ2_XXS, T.IQ2_XS, T.IQ3_XXS, T.IQ1_S, T.IQ4_NL,
                                        T.IQ3_S, T.IQ2_S, T.IQ4_XS)},
    **{int(t): (_HALF, (0, 2)) for t in (T.Q4_1, T.Q5_1, T.Q4_K, T.Q5_K)},  # d, then m / dmin
    int(T.Q2_K): (_HALF, (80, 82)), int(T.Q3_K): (_HALF, (108,)), int(T.Q6_K): (_HALF, (208,)),
    int(T.TQ1_0): (_HALF, (52,)), int(T.TQ2_0): (_HALF, (64,)),
    int(T.Q8_K): (_SINGLE, (0,)), int(T.MXFP4): (_E8M0, (0,)),
}
_FLOATS: dict[int, Any] = {int(T.F32): np.float32, int(T.F16): np.float16, int(T.F64): np.float64, int(T.BF16): None}
_SCAN_CHUNK = 1 << 20  # blocks (or values) looked at per step: bounded temporaries whatever the tensor's size


@dataclass(frozen=True, slots=True)
class TensorInfo:
    type: int
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    offset: int  # from the start of the file

    @property
    def nbytes(self) -> int:
        values, nbytes = TYPE_SIZES[self.type]
        return math.prod(self.shape) // values * nbytes  # whole blocks: checked when the index is read


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    path: Path
    architecture: str
    tensors: Mapping[str, TensorInfo]  # read-only: one index is shared by every reader of the file


def damaged(path: Path, what: str, tensor: str | None = None) -> ModelFileError:
    """The error for a damaged file: one line naming the file (and the tensor)."""
    where = f"tensor {_shown(tensor)}: " if tensor is not None else ""
    return ModelFileError(f"{path}: {where}{what}")


def _shown(text: str) -> str:
    """A name read from the file, printable on one line."""
    return text if text.isprintable() else ascii(text)


class _Reader:
    def __init__(self, fh: BinaryIO, path: Path, size: int):
        self.fh, self.path, self.size = fh, path, size

    def left(self) -> int:
        return self.size - self.fh.tell()

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = self.fh.read(size)
        if len(data) != size:
            raise damaged(self.path, "the GGUF header ends early (truncated file?)")
        return struct.unpack(fmt, data)[0]

    def string(self, what: str) -> str:
        n = self.take("<Q")
        if n > min(_MAX_STRING, self.left()):
            raise damaged(self.path, f"{what} of {n} bytes at byte {self.fh.tell() - 8} (damaged header?)")
        try:
            return self.fh.read(n).decode("utf-8")
        except UnicodeDecodeError:
            raise damaged(self.path, f"{what} at byte {self.fh.tell() - n} is not UTF-8 (damaged header?)") from None

    def skip(self, size: int) -> None:
        """Move `size` bytes forward, never past the end of the file."""
        if size > self.left():
            raise damaged(self.path, "the GGUF header ends early (truncated file?)")
        self.fh.seek(size, 1)

    def value(self, kind: int, key: str) -> tuple[Any, int | None]:
        """(value, None) of a scalar or string; (None, length) of an array, skipped."""
        if kind in _SCALAR_FORMATS:
            return self.take(_SCALAR_FORMATS[kind]), None
        if kind == _STRING:
            return self.string(f"the value of {_shown(key)}"), None
        if kind != _ARRAY:
            raise damaged(self.path, f"key {_shown(key)} has unknown value type {kind} (damaged header?)")
        item, count = self.take("<I"), self.take("<Q")
        self._skip_items(item, count, key, 1)
        return None, count

    def _skip_items(self, item: int, count: int, key: str, depth: int) -> None:
        if item in _SCALAR_FORMATS:  # in one seek
            self.skip(struct.calcsize(_SCALAR_FORMATS[item]) * count)
        elif item == _STRING:  # the vocabulary: lengths only
            if count * 8 > self.left():
                raise damaged(self.path, f"array {_shown(key)} of {count} strings cannot fit in the file")
            for _ in range(count):
                self.skip(self.take("<Q"))
        elif item == _ARRAY and depth < _MAX_NESTING:
            if count * 12 > self.left():
                raise damaged(self.path, f"array {_shown(key)} of {count} arrays cannot fit in the file")
            for _ in range(count):
                inner, n = self.take("<I"), self.take("<Q")
                self._skip_items(inner, n, key, depth + 1)
        else:
            raise damaged(self.path, f"array {_shown(key)} has items of value type {item} (damaged header?)")


def read_index(path: str | Path) -> GGUFIndex:
    """The architecture and tensor table of a GGUF file, checked (the module docstring says what);
    raises `ModelFileError` naming the file (and the tensor) for a damaged one."""
    path = Path(path).resolve()
    st = path.stat()
    return _read_index(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@functools.lru_cache(maxsize=8)
def _read_index(path: Path, size: int, *identity: int) -> GGUFIndex:
    with open(path, "rb") as fh:
        reader = _Reader(fh, path, size)
        if fh.read(4) != b"GGUF":
            raise ModelFileError(f"{path} is not a GGUF file (bad magic)")
        version = reader.take("<I")
        if version not in (2, 3):
            raise damaged(path, f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = reader.take("<Q"), reader.take("<Q")
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > reader.left():
            raise damaged(path, f"{n_kv} keys and {n_tensors} tensors cannot fit in a file of {size} bytes "
                                "(damaged header or truncated file?)")
        meta: dict[str, Any] = {}
        arrays: dict[str, int] = {}
        for _ in range(n_kv):
            key = reader.string("a key")
            if key in meta or key in arrays:
                raise damaged(path, f"key {_shown(key)} appears twice")
            value, length = reader.value(reader.take("<I"), key)
            if length is None:
                meta[key] = value
            else:
                arrays[key] = length
        infos = [_tensor_info(reader) for _ in range(n_tensors)]
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not _is_int(alignment) or not 1 <= alignment <= _MAX_ALIGNMENT or alignment & (alignment - 1):
            raise damaged(path, f"general.alignment {alignment!r} is not a power of two in [1, {_MAX_ALIGNMENT}]")
        start = -(-fh.tell() // alignment) * alignment
    tensors = _check_tensors(path, size, infos, start, alignment)
    architecture = meta.get("general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise damaged(path, "general.architecture is missing (damaged header?)")
    if architecture in LAYOUTS:
        _check_layout(path, architecture, meta, arrays, tensors)
    return GGUFIndex(path, architecture, MappingProxyType(tensors))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tensor_info(reader: _Reader) -> tuple[str, int, tuple[int, ...], int]:
    name = reader.string("a tensor name")
    n_dims = reader.take("<I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise damaged(reader.path, f"{n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})", name)
    dims = tuple(reader.take("<Q") for _ in range(n_dims))
    return name, reader.take("<I"), dims, reader.take("<Q")


def _check_tensors(path: Path, size: int, infos: list[tuple[str, int, tuple[int, ...], int]], start: int,
                   alignment: int) -> dict[str, TensorInfo]:
    """Each tensor's type, shape, alignment and bounds (in the header's order), then overlaps."""
    tensors: dict[str, TensorInfo] = {}
    for name, kind, dims, offset in infos:
        if name in tensors:
            raise damaged(path, "appears twice in the tensor table", name)
        if kind not in TYPE_SIZES:
            raise damaged(path, f"unknown ggml type {kind} (damaged header?)", name)
        values = TYPE_SIZES[kind][0]
        if 0 in dims:
            raise damaged(path, f"shape {dims} has an empty dimension", name)
        if dims[0] % values:
            raise damaged(path, f"shape {dims} is not whole {TYPE_NAMES[kind]} blocks of {values} values", name)
        if offset % alignment:
            raise damaged(path, f"data offset {offset} is not a multiple of the alignment {alignment} (misaligned)",
                          name)
        info = TensorInfo(kind, dims, start + offset)
        if info.offset + info.nbytes > size:
            raise damaged(path, f"lies past the end of the file (truncated?): it ends at byte "
                                f"{info.offset + info.nbytes} of {size}", name)
        tensors[name] = info
    ordered = sorted(tensors.items(), key=lambda item: item[1].offset)
    for (before, a), (name, b) in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset:
            raise damaged(path, f"its bytes {b.offset}.. overlap tensor {_shown(before)} (bytes {a.offset}.."
                                f"{a.offset + a.nbytes}); a tensor's type or shape is damaged", name)
    return tensors


# --------------------------------------------------------------------------- what an architecture needs


@dataclass(frozen=True, slots=True)
class Layout:
    """The tensors of a llama-style decoder: blocks of separate q/k/v/output projections, a gated MLP and
    two norms, between a token embedding and a final norm (and an lm_head, or the embedding tied)."""

    qkv_bias: bool  # q/k/v biases required (qwen2); else they, and an output bias, are optional
    optional: tuple[str, ...] = ()  # other tensors a file may have (shapes not checked)


LAYOUTS: dict[str, Layout] = {"qwen2": Layout(qkv_bias=True),
                              "llama": Layout(qkv_bias=False, optional=("rope_freqs.weight",))}
_MAX_SIZE = 1 << 32
_SIZES = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")


def _check_layout(path: Path, arch: str, meta: Mapping[str, Any], arrays: Mapping[str, int],
                  tensors: Mapping[str, TensorInfo]) -> None:
    """Every tensor an `arch` model needs, with the shape its metadata gives; nothing it does not have."""
    if meta.get(f"{arch}.expert_count"):
        return  # a mixture of experts: another tensor layout, not checked here
    size = {key: _size(path, meta, f"{arch}.{key}") for key in _SIZES}
    heads = size["attention.head_count"]
    kv_heads = _size(path, meta, f"{arch}.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise damaged(path, f"{arch}.attention.head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    hidden = size["embedding_length"]
    key_dim = _size(path, meta, f"{arch}.attention.key_length", hidden // heads)
    value_dim = _size(path, meta, f"{arch}.attention.value_length", key_dim)
    if f"{arch}.attention.key_length" not in meta and hidden % heads:
        raise damaged(path, f"{arch}.embedding_length {hidden} is not a multiple of head_count {heads}")
    rows = tensors[EMBEDDING].shape[-1] if EMBEDDING in tensors else 0
    vocab = arrays.get(TOKENS_KEY) or _size(path, meta, f"{arch}.vocab_size", rows)  # llama.cpp's order
    needed = dict(_needed(LAYOUTS[arch], size["block_count"], hidden, size["feed_forward_length"], heads * key_dim,
                          kv_heads * key_dim, heads * value_dim, kv_heads * value_dim, vocab))
    for name, (shape, required) in needed.items():
        info = tensors.get(name)
        if info is None:
            if required:
                raise damaged(path, f"is missing (a {arch} model of {size['block_count']} blocks needs it)", name)
            continue
        if info.shape != shape:
            raise damaged(path, f"shape {info.shape}, where the file's metadata ({arch}: {hidden} wide, vocabulary "
                                f"{vocab}) gives {shape}", name)
        if len(shape) == 1 and info.type != F32:
            raise damaged(path, f"is {TYPE_NAMES[info.type]}; a {arch} file's norms and biases are F32", name)
    optional = set(LAYOUTS[arch].optional)
    for name in tensors:
        if name not in needed and name not in optional:
            raise damaged(path, f"is not a tensor of a {arch} model of {size['block_count']} blocks", name)


def _size(path: Path, meta: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """Metadata `key`, an integer >= 1 (`default` where the file has none; None: it must have it)."""
    if key not in meta:
        if default is None:
            raise damaged(path, f"{key} is missing")
        return default
    value = meta[key]
    if not _is_int(value) or not 1 <= value <= _MAX_SIZE:
        raise damaged(path, f"{key} is {value!r}, not an integer in [1, {_MAX_SIZE}]")
    return value


def _needed(layout: Layout, blocks: int, hidden: int, ffn: int, q: int, k: int, o: int, v: int,
            vocab: int) -> Iterator[tuple[str, tuple[tuple[int, ...], bool]]]:
    """(name, (GGUF shape, required)) of every tensor of the layout."""
    yield EMBEDDING, ((hidden, vocab), True)
    yield "output_norm.weight", ((hidden,), True)
    yield "output.weight", ((hidden, vocab), False)  # absent: the embedding is the lm_head
    for i in range(blocks):
        for short, shape in (("attn_norm.weight", (hidden,)), ("ffn_norm.weight", (hidden,)),
                             ("attn_q.weight", (hidden, q)), ("attn_k.weight", (hidden, k)),
                             ("attn_v.weight", (hidden, v)), ("attn_output.weight", (o, hidden)),
                             ("ffn_gate.weight", (hidden, ffn)), ("ffn_up.weight", (hidden, ffn)),
                             ("ffn_down.weight", (ffn, hidden))):
            yield f"blk.{i}.{short}", (shape, True)
        for short, shape in (("attn_q.bias", (q,)), ("attn_k.bias", (k,)), ("attn_v.bias", (v,))):
            yield f"blk.{i}.{short}", (shape, layout.qkv_bias)
        if not layout.qkv_bias:
            yield f"blk.{i}.attn_output.bias", ((hidden,), False)


# --------------------------------------------------------------------------- values


def scan_values(index: GGUFIndex, data: np.ndarray) -> None:
    """Raise `ModelFileError` naming the tensor (and block) where a block's scale or a float value is
    NaN or infinite. `data`: the whole file as uint8 (read or mapped); it is only read. Block types
    whose scales are not listed in `_SCALES` (integer tensors, IQ1_M's packed scales) are not scanned."""
    for name, info in index.tensors.items():
        raw = data[info.offset:info.offset + info.nbytes]
        if info.type in _FLOATS:
            bad, what = _bad_float(info, raw), "value {} is NaN or infinite"
        elif info.type in _SCALES:
            bad, what = _bad_scale(info, raw), f"{TYPE_NAMES[info.type]} block {{}} has a NaN or infinite scale"
        else:
            continue
        if bad is not None:
            raise damaged(index.path, what.format(bad) + " (damaged data)", name)


def scan_file(index: GGUFIndex) -> None:
    """`scan_values` over a read-only memory map of the file (for loaders that read it themselves)."""
    data = np.memmap(index.path, dtype=np.uint8, mode="r")
    try:
        scan_values(index, data)
    finally:
        del data


def _bad_scale(info: TensorInfo, raw: np.ndarray) -> int | None:
    """The first block of `raw` whose scale is NaN or infinite (from the exponent bits alone)."""
    encoding, offsets = _SCALES[info.type]
    blocks = raw.reshape(-1, TYPE_SIZES[info.type][1])
    for first in range(0, len(blocks), _SCAN_CHUNK):
        chunk = blocks[first:first + _SCAN_CHUNK]
        bad = np.zeros(len(chunk), dtype=bool)
        for at in offsets:
            if encoding == _HALF:  # exponent bits 14..10, all in the high byte
                bad |= (chunk[:, at + 1] & 0x7C) == 0x7C
            elif encoding == _SINGLE:  # exponent bits 30..23
                bad |= ((chunk[:, at + 3] & 0x7F) == 0x7F) & (chunk[:, at + 2] >= 0x80)
            else:  # E8M0: 0xFF is NaN
                bad |= chunk[:, at] == 0xFF
        if bad.any():
            return first + int(np.argmax(bad))
    return None


def _bad_float(info: TensorInfo, raw: np.ndarray) -> int | None:
    """The first value of a float tensor that is NaN or infinite."""
    dtype = _FLOATS[info.type]
    values = raw.view(np.uint16) if dtype is None else raw.view(dtype)
    for first in range(0, len(values), _SCAN_CHUNK):
        chunk = values[first:first + _SCAN_CHUNK]
        bad = (chunk & 0x7F80) == 0x7F80 if dtype is None else ~np.isfinite(chunk)  # BF16: exponent bits 14..7
        if bad.any():
            return first + int(np.argmax(bad))
    return None
