"""A transformers model whose linears run on a GGUF file's own blocks (dtype "gguf").

`build_model(gguf_path, config)` reads the file's tensor index (`read_index`: the header only; the
vocabulary arrays are skipped, not parsed), builds the transformers model on the meta device, fuses
Qwen2's q/k/v and gate/up (fused_qwen2.py), and puts in `GGUFLinear`s and a `GGUFEmbedding` over
views of the file's bytes (thinkahead/models/kquant.py), read once into the process's memory (huge
pages where the kernel offers them: huge_pages.py), plus the few float tensors (norms, biases). Nothing
is dequantized or converted; the linears' blocks are rewritten in place into the kernel's layout (the
same bytes, codes permuted: kquant.kernel_layout). A start costs the config and the tokenizer, which
the weight cache keeps (weight_cache.py stores entries of dtype "gguf" without weights), one read of
the file and its rewrite.

Architectures: qwen2 (the packaged Qwen2.5 models). Others are refused by name: llama-family GGUFs
store q/k rows permuted for their rope layout, which this loader does not undo.
"""

from __future__ import annotations

import functools
import logging
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES

from thinkahead.models import huge_pages
from thinkahead.models.kquant import BLOCK_GEOMETRY, GGUFEmbedding, GGUFLinear, QuantTensor, blocks_view, kernel_layout

logger = logging.getLogger(__name__)

ARCHITECTURES = ("qwen2",)
_F32 = 0
_EMBEDDING = "token_embd.weight"  # the token embedding table (also the lm_head where the file has no output.weight)
_TYPE_SIZES = {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}  # (values, bytes) per block
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: fixed sizes (bytes) by type id; 8 = string, 9 = array
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    type: int
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    offset: int  # from the start of the file


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    path: Path
    architecture: str
    tensors: Mapping[str, TensorInfo]  # read-only: one index is shared by every reader of the file


class _Reader:
    def __init__(self, fh: BinaryIO, path: Path, size: int):
        self.fh, self.path, self.size = fh, path, size

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = self.fh.read(size)
        if len(data) != size:
            raise ValueError(f"{self.path}: the GGUF header ends early (truncated file?)")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.take("<Q")
        if n > 1 << 24:
            raise ValueError(f"{self.path}: a GGUF string of {n} bytes (corrupt header?)")
        return self.fh.read(n).decode("utf-8", errors="replace")

    def skip(self, size: int) -> None:
        """Move `size` bytes forward, never past the end of the file."""
        target = self.fh.tell() + size
        if target > self.size:
            raise ValueError(f"{self.path}: the GGUF header ends early (truncated file?)")
        self.fh.seek(target)

    def value(self, kind: int) -> Any:
        if kind in _SCALAR_FORMATS:
            return self.take(_SCALAR_FORMATS[kind])
        if kind == 8:
            return self.string()
        if kind != 9:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        item, count = self.take("<I"), self.take("<Q")
        if item in _SCALAR_SIZES:  # skipped in one seek
            self.skip(_SCALAR_SIZES[item] * count)
        elif item == 8:  # strings (the vocabulary): lengths only
            for _ in range(count):
                self.skip(self.take("<Q"))
        else:  # arrays of arrays: GGUF writers never make them (and a loop of them would recurse)
            raise ValueError(f"{self.path}: a GGUF array of value type {item} is not supported")
        return None


def _nbytes(kind: int, dims: tuple[int, ...]) -> int:
    """Bytes of a tensor of a ggml type gguf knows (0 for others: only its start is checked)."""
    values, nbytes = _TYPE_SIZES.get(kind, (1, 0))
    return -(-math.prod(dims) // values) * nbytes  # Python ints: no overflow


def read_index(path: str | Path) -> GGUFIndex:
    """The architecture and tensor table of a GGUF file, from its header (arrays skipped). A start reads
    it up to three times (is the model cached, which dtype, the build): it is parsed once per state of
    the file (path, size, mtime, ctime, inode)."""
    path = Path(path).resolve()
    st = path.stat()
    return _read_index(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@functools.lru_cache(maxsize=8)
def _read_index(path: Path, size: int, *identity: int) -> GGUFIndex:
    with open(path, "rb") as fh:
        reader = _Reader(fh, path, size)
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        version = reader.take("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = reader.take("<Q"), reader.take("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = reader.string()
            meta[key] = reader.value(reader.take("<I"))
        infos: list[tuple[str, int, tuple[int, ...], int]] = []
        for _ in range(n_tensors):
            name = reader.string()
            dims = tuple(reader.take("<Q") for _ in range(reader.take("<I")))
            infos.append((name, reader.take("<I"), dims, reader.take("<Q")))
        alignment = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or not 1 <= alignment <= 1 << 16:
            raise ValueError(f"{path}: general.alignment {alignment!r} is not an integer in [1, 65536]")
        start = -(-fh.tell() // alignment) * alignment
    tensors = {}
    for name, kind, dims, offset in infos:
        tensors[name] = TensorInfo(kind, dims, start + offset)
        if start + offset + _nbytes(kind, dims) > size:
            raise ValueError(f"{path}: tensor {name} lies past the end of the file (truncated?)")
    return GGUFIndex(path, str(meta.get("general.architecture", "")), MappingProxyType(tensors))


def unsupported_reason(path: str | Path) -> str | None:
    """Why `build_model` would refuse this GGUF file (architecture, a linear's block type), from its
    header alone; None when it runs."""
    index = read_index(path)
    if index.architecture not in ARCHITECTURES:
        return f"architecture '{index.architecture}'"
    for name, info in index.tensors.items():
        if len(info.shape) == 2 and info.type not in BLOCK_GEOMETRY:
            return f"tensor {name} has ggml type {info.type}"
    return None


class _Tensors:
    """Views of a GGUF file's tensors: its bytes read into the process's own memory, in huge pages where
    the kernel offers them (huge_pages.py: the kernels stream them ~14% faster). The linears' tensors
    are rewritten there into the kernel's layout, each once (`linear`)."""

    def __init__(self, index: GGUFIndex):
        self.index = index
        self.data = huge_pages.read(index.path, huge=huge_pages.available())
        self._rewritten: dict[str, QuantTensor] = {}

    def linear(self, name: str) -> QuantTensor:
        """Tensor `name` in the kernel's layout (rewritten in place, once; a copy for the embedding table,
        which the embedding reads in the file's layout)."""
        if name not in self._rewritten:
            self._rewritten[name] = kernel_layout(self.quant(name), in_place=name != _EMBEDDING)
        return self._rewritten[name]

    def has(self, name: str) -> bool:
        return name in self.index.tensors

    def _info(self, name: str) -> TensorInfo:
        if name not in self.index.tensors:
            raise ValueError(f"{self.index.path}: tensor {name} is missing")
        return self.index.tensors[name]

    def quant(self, name: str) -> QuantTensor:
        info = self._info(name)
        if info.type not in BLOCK_GEOMETRY or len(info.shape) != 2:
            raise ValueError(f"{self.index.path}: tensor {name} has ggml type {info.type} and shape {info.shape}; "
                             "dtype 'gguf' runs 2-D Q4_K, Q6_K, Q4_0, Q5_0 and Q8_0 tensors (use dtype 'int8')")
        cols, rows = info.shape
        values, nbytes = BLOCK_GEOMETRY[info.type]
        row_bytes = cols // values * nbytes  # read_index checked that the tensor ends inside the file
        blocks = self.data[info.offset:info.offset + rows * row_bytes].reshape(rows, row_bytes)
        return QuantTensor(name, info.type, rows, cols, blocks_view(blocks))

    def float32(self, name: str) -> torch.Tensor:
        info = self._info(name)
        if info.type != _F32:
            raise ValueError(f"{self.index.path}: tensor {name} has ggml type {info.type}, expected F32")
        values = self.data[info.offset:info.offset + 4 * math.prod(info.shape)].view(np.float32)
        return torch.from_numpy(values.copy()).reshape(tuple(reversed(info.shape)))


def _linear(tensors: _Tensors, names: list[str]) -> GGUFLinear:
    parts = [tensors.linear(f"{name}.weight") for name in names]
    biases = [f"{name}.bias" for name in names]
    present = [tensors.has(b) for b in biases]
    if any(present) and not all(present):
        raise ValueError(f"{tensors.index.path}: only some of {names} have a bias")
    bias = torch.cat([tensors.float32(b) for b in biases]) if all(present) else None
    return GGUFLinear(parts, bias)


def _set_param(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"{name}: the GGUF tensor has shape {tuple(value.shape)}, the model expects {tuple(old.shape)}")
    setattr(module, name, torch.nn.Parameter(value, requires_grad=False))


def _check_architecture(path: Path, config: Any, architecture: str | None = None) -> None:
    for name in (architecture, config.model_type):
        if name is not None and name not in ARCHITECTURES:
            raise ValueError(f"dtype 'gguf' runs {', '.join(ARCHITECTURES)} GGUF files; {path.name} is '{name}' "
                             "(use dtype 'int8')")


def build_model(gguf_path: str | Path, config: Any) -> Any:
    """The transformers model of `config` over the GGUF file's blocks (eval mode, float32 activations,
    batch-invariant attention); raises ValueError for an architecture or a tensor type it cannot run."""
    from transformers import AutoModelForCausalLM

    from thinkahead.models.exact_attention import use_exact_attention
    from thinkahead.models.fused_qwen2 import use_native_layers
    from thinkahead.models.fused_qwen2 import FusedQwen2Attention, FusedQwen2MLP, fuse_qwen2

    index = read_index(gguf_path)
    _check_architecture(index.path, config, index.architecture)
    tensors = _Tensors(index)
    config.tie_word_embeddings = False  # the lm_head gets its own module below
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fuse_qwen2(model)
    inner = model.model
    inner.embed_tokens = GGUFEmbedding(tensors.quant(_EMBEDDING))
    output = "output.weight" if tensors.has("output.weight") else _EMBEDDING
    model.lm_head = GGUFLinear([tensors.linear(output)])
    for i, layer in enumerate(inner.layers):
        blk = f"blk.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, FusedQwen2Attention) or not isinstance(mlp, FusedQwen2MLP):
            raise ValueError(f"layer {i}: expected Qwen2 attention and MLP modules, got {type(attn).__name__}")
        attn.qkv_proj = _linear(tensors, [f"{blk}.attn_q", f"{blk}.attn_k", f"{blk}.attn_v"])
        attn.o_proj = _linear(tensors, [f"{blk}.attn_output"])
        mlp.gate_up_proj = _linear(tensors, [f"{blk}.ffn_gate", f"{blk}.ffn_up"])
        mlp.down_proj = _linear(tensors, [f"{blk}.ffn_down"])
        _set_param(layer.input_layernorm, "weight", tensors.float32(f"{blk}.attn_norm.weight"))
        _set_param(layer.post_attention_layernorm, "weight", tensors.float32(f"{blk}.ffn_norm.weight"))
    _set_param(inner.norm, "weight", tensors.float32("output_norm.weight"))
    inner.rotary_emb = type(inner.rotary_emb)(config=config)  # its inverse frequencies were made on meta
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"{index.path.name}: no GGUF tensor for {', '.join(left[:5])}")
    use_exact_attention(model)
    use_native_layers(model)
    model.eval()
    logger.debug("built %s over %s (%d tensors)", config.model_type, index.path, len(index.tensors))
    return model


def convert(gguf_path: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of a GGUF file, config and tokenizer converted from its metadata (slow: the
    weight cache keeps them)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _check_architecture(gguf_path, config)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return _named(build_model(gguf_path, config), str(gguf_path.parent)), tokenizer


def rebuild_entry(entry: Path, gguf_path: Path, name_or_path: str) -> tuple[Any, Any]:
    """(model, tokenizer) from a weight-cache entry of dtype "gguf" (config and tokenizer files) over
    the GGUF file's blocks."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    model = build_model(gguf_path, AutoConfig.from_pretrained(entry))
    if (entry / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(entry)
    return _named(model, name_or_path), AutoTokenizer.from_pretrained(entry)


def _named(model: Any, name_or_path: str) -> Any:
    model.config._name_or_path = name_or_path
    return model
