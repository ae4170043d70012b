"""A transformers model whose linears run on a GGUF file's own blocks (dtype "gguf").

`build_model(gguf_path, config)` reads the file's tensor index (gguf_check.read_index: the header only,
checked; the vocabulary arrays are skipped, not parsed), builds the transformers model on the meta device, fuses
Qwen2's q/k/v and gate/up (fused_qwen2.py), and puts in `GGUFLinear`s and a `GGUFEmbedding` over
views of the file's bytes (thinkahead/models/engine/kernels/kquant.py), read once into the process's memory (huge
pages where the kernel offers them: huge_pages.py), plus the few float tensors (norms, biases). Nothing
is dequantized or converted; the linears' blocks are rewritten in place into the kernel's layout (the
same bytes, codes permuted: kquant.kernel_layout). A start costs the config and the tokenizer, which
the weight cache keeps (cache.py stores entries of dtype "gguf" without weights), one read of
the file and its rewrite.

Architectures: qwen2 (the packaged Qwen2.5 models). Others are refused by name: llama-family GGUFs
store q/k rows permuted for their rope layout, which this loader does not undo.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from thinkahead.models.engine.weights import huge_pages
from thinkahead.models.engine.weights.gguf_check import EMBEDDING as _EMBEDDING
from thinkahead.models.engine.weights.gguf_check import F32 as _F32
from thinkahead.models.engine.weights.gguf_check import GGUFIndex, TensorInfo, read_index, scan_values
from thinkahead.models.engine.kernels.kquant import BLOCK_GEOMETRY, GGUFEmbedding, GGUFLinear, QuantTensor, blocks_view, kernel_layout

logger = logging.getLogger(__name__)

ARCHITECTURES = ("qwen2",)


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


def _check_architecture(path: Path, *names: str | None) -> None:
    for name in names:
        if name is not None and name not in ARCHITECTURES:
            raise ValueError(f"dtype 'gguf' runs {', '.join(ARCHITECTURES)} GGUF files; {path.name} is '{name}' "
                             "(use dtype 'int8')")


def build_model(gguf_path: str | Path, config: Any) -> Any:
    """The transformers model of `config` over the GGUF file's blocks (eval mode, float32 activations,
    batch-invariant attention); raises ValueError for an architecture or a tensor type it cannot run,
    `ModelFileError` for a damaged file (its header: `read_index`)."""
    index = read_index(gguf_path)
    _check_architecture(index.path, index.architecture, config.model_type)
    return _build(_Tensors(index), config)


def _build(tensors: _Tensors, config: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from thinkahead.models.engine.qwen2.exact_attention import use_exact_attention
    from thinkahead.models.engine.qwen2.fused_qwen2 import use_native_layers
    from thinkahead.models.engine.qwen2.fused_qwen2 import FusedQwen2Attention, FusedQwen2MLP, fuse_qwen2

    index = tensors.index
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
    weight cache keeps them). The file is checked first, before any conversion work: its header
    (`read_index`), then its scales and float values (`scan_values`, on the bytes the model runs on,
    before their rewrite)."""
    from transformers import AutoConfig, AutoTokenizer

    index = read_index(gguf_path)
    _check_architecture(index.path, index.architecture)
    tensors = _Tensors(index)
    scan_values(index, tensors.data)
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _check_architecture(gguf_path, config.model_type)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return _named(_build(tensors, config), str(gguf_path.parent)), tokenizer


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
