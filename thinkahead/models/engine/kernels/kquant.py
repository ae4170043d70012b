"""Linear and embedding layers computed on a GGUF file's own quantized blocks (dtype "gguf").

Why: a CPU decode step is bound by the bytes of weights it reads and the work of unpacking them. The
packaged models are Q4_K_M files (about 4.8 bits per weight); dtype "int8" dequantizes them and
stores 8 bits per weight again. Here the weights stay in the file's blocks (never converted; a
linear's Q4_K/Q6_K codes reordered, see Layout), and the native kernel
(thinkahead/models/engine/kernels/native/kquant_linear.cpp) multiplies them with each row of activations quantized
to 8 bits per block, as llama.cpp does.

Exactness: every row of the activations is quantized on its own and every output's block sums are
accumulated in one fixed order whatever the number of rows or the path (row by row, or tiles of 8
rows from 12 or 16 rows on, of 16 rows from 9 on in the 512-bit build), so verifying k drafted tokens
computes exactly what decoding them one by one computes (tests/test_kquant.py); with attention whose rows do not depend on the batch either (the native
layers' float32 attention, native/attention.inc, or float64 attention, exact_attention.py) speculative
greedy output equals plain greedy output.

Layout: a linear's blocks are rewritten once, at load, into the kernel's layout (native/kquant_layout.inc;
the same bytes per row): Q4_K/Q6_K codes permuted so that one multiply-add per 32 values leaves every
sub-block's sum in its own vector lane; Q4_0/Q5_0/Q8_0 blocks regrouped by 8 with their scales first, which
convert in one instruction. `kernel_layout` does it, in place where the caller owns the bytes. Embedding
tables keep the file's layout.

ISA: the dot products are compiled four times (native/kquant_dots.inc): AVX2, AVX-VNNI, AVX-512 VNNI
(256-bit vectors with EVEX's 32 registers: tiles of 8 weight rows instead of 4) and AVX-512 VNNI in 512-bit
vectors (`avx512vnni-zmm`: half the multiplies, tiles of 16 rows of x), whose multiply-adds give the same
integers in the same lanes: the same bits either way (`set_isa`, `isas` in tests). The best the CPU has
runs; the 512-bit build only where a one-off probe measures 512-bit multiplies paying (`zmm_pays`: AMD Zen 5
yes; CPUs that split or fuse them, as Zen 4 and many Intel cores, keep 256-bit vectors). Tiles need one of
the VNNI builds (AVX-512 VNNI alone, as on Ice Lake and Cascade Lake servers, is enough). Where the CPU has
AMX-INT8 and Linux grants its tile registers (Sapphire Rapids on), `avx512vnni-amx` is the 512-bit build with
its Q4_K tiles of 24 rows of x or more on AMX (native/kquant_amx.inc: 1.1-1.2x a prefill's forward, the same bits).

Block types: Q4_K and Q6_K (256 values per block; Q4_K_M files), Q5_0 and Q8_0 (32 values; the
0.5B's Q4_K_M file uses them where rows are not a multiple of 256), Q4_0 (32 values; Q4_0 files). Any other type is refused by
name (`SUPPORTED_TYPES`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from types import ModuleType

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from thinkahead.models.engine.kernels.native_extension import LazyExtension

_KERNEL_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                 GGMLQuantizationType.Q6_K)
# ggml type ids the kernel runs, by their GGUF names
SUPPORTED_TYPES: dict[str, int] = {t.name: int(t) for t in _KERNEL_TYPES}
_TYPE_NAMES = {v: k for k, v in SUPPORTED_TYPES.items()}
# (values, bytes) per block, as gguf defines them
BLOCK_GEOMETRY: dict[int, tuple[int, int]] = {int(t): GGML_QUANT_SIZES[t] for t in _KERNEL_TYPES}

EXTENSION = LazyExtension("_kquant_native", "AVX2, FMA or F16C")


def unavailable_reason() -> str | None:
    """Why dtype "gguf" cannot run here (None: it can)."""
    return None if EXTENSION.load() is not None else EXTENSION.error


def kernel() -> ModuleType:
    return EXTENSION.require("dtype 'gguf'", "; use dtype 'int8'")


FILE_LAYOUT, KERNEL_LAYOUT = "file", "kernel"  # QuantTensor.layout: the GGUF file's block layout, or the kernel's


@dataclass(frozen=True, slots=True)
class QuantTensor:
    """A 2-D GGUF tensor in its blocks: `blocks` uint8 [rows, row_bytes] for `rows` x `cols` values, in
    the file's layout or the kernel's (`kernel_layout`)."""

    name: str
    type: int
    rows: int
    cols: int
    blocks: torch.Tensor
    layout: str = FILE_LAYOUT

    def __post_init__(self) -> None:
        if self.type not in BLOCK_GEOMETRY:
            raise ValueError(f"tensor {self.name}: ggml type {self.type} is not one of {', '.join(SUPPORTED_TYPES)}")
        values, nbytes = BLOCK_GEOMETRY[self.type]
        if self.cols % values:
            raise ValueError(f"tensor {self.name}: {self.cols} columns is not a multiple of its block size {values}")
        if (tuple(self.blocks.shape) != (self.rows, self.cols // values * nbytes) or self.blocks.dtype != torch.uint8
                or not self.blocks.is_contiguous()):
            raise ValueError(f"tensor {self.name}: blocks {tuple(self.blocks.shape)} do not hold {self.rows} x "
                             f"{self.cols} values of {_TYPE_NAMES[self.type]} (contiguous uint8)")
        if self.layout not in (FILE_LAYOUT, KERNEL_LAYOUT):
            raise ValueError(f"tensor {self.name}: layout must be {FILE_LAYOUT!r} or {KERNEL_LAYOUT!r}, got {self.layout!r}")


def kernel_layout(tensor: QuantTensor, in_place: bool = False) -> QuantTensor:
    """`tensor` with its blocks in the kernel's layout. `in_place` rewrites the given bytes: the caller
    owns them, they are writable, and nothing reads them in the file's layout after; otherwise the
    rewritten blocks are a copy."""
    if tensor.layout == KERNEL_LAYOUT:
        return tensor
    blocks = tensor.blocks if in_place else torch.empty_like(tensor.blocks)
    kernel().repack(tensor.type, tensor.blocks.data_ptr(), blocks.data_ptr(), tensor.rows, tensor.cols)
    return replace(tensor, blocks=blocks, layout=KERNEL_LAYOUT)


def blocks_view(data: np.ndarray) -> torch.Tensor:
    """A torch view of uint8 blocks (a file's bytes, maybe read-only); the layers only ever read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable NumPy array": read-only by design
        return torch.from_numpy(data)


class GGUFLinear(torch.nn.Module):
    """`y = x @ W.T + b` where W is one GGUF tensor or several stacked along the outputs (fused q/k/v,
    gate/up), each in its own block type; float32 in, float32 out."""

    def __init__(self, parts: list[QuantTensor], bias: torch.Tensor | None = None):
        super().__init__()
        if not parts or len({p.cols for p in parts}) != 1:
            raise ValueError("a GGUFLinear needs one or more tensors with the same number of columns")
        parts = [kernel_layout(p) for p in parts]  # a copy where the loader has not rewritten them in place
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias {tuple(bias.shape)} does not match {self.out_features} outputs")
        self.names = tuple(p.name for p in parts)
        self._types = [p.type for p in parts]
        self._rows = [p.rows for p in parts]
        for i, part in enumerate(parts):
            self.register_buffer(f"blocks{i}", part.blocks, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous(), persistent=False)
        self._kernel = kernel()
        # The kernel's arguments, computed once (a decode step makes ~200 calls); `_keep` holds the
        # tensors behind the addresses alive whatever happens to the module's buffers.
        self._keep = [p.blocks for p in parts] + ([] if self.bias is None else [self.bias])
        self._weights = [p.blocks.data_ptr() for p in parts]
        offsets = [sum(self._rows[:i]) for i in range(len(parts))]
        self._biases = [0 if self.bias is None else self.bias.data_ptr() + 4 * o for o in offsets]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if x.device.type != "cpu":
            raise ValueError(f"GGUFLinear runs on the CPU; the input is on {x.device}")
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            rows = rows.float()
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        self._kernel.linear(rows.data_ptr(), rows.shape[0], self.in_features, self._types, self._weights, self._rows,
                            self._biases, out.data_ptr(), torch.get_num_threads())
        return out.reshape(*shape[:-1], self.out_features)

    def kernel_args(self) -> tuple[list[int], list[int], list[int], list[int], int]:
        """The kernel's description of this linear: its parts' types, block addresses, rows and bias addresses
        (0: none), and the values it reads, valid while the module lives (a native layer loop calls the kernel
        with them)."""
        return list(self._types), list(self._weights), list(self._rows), list(self._biases), self.in_features

    def kernel_address(self) -> int:
        """The address of the kernel's C entry (kquant_linear.cpp's thinkahead_kquant_linear)."""
        return int(self._kernel.linear_address())

    def output_rows(self, ids: torch.Tensor) -> GGUFLinear:
        """A linear whose output j is this one's output `ids[j]`, reading only those weight rows: a view
        of the blocks where ids run consecutively within one tensor, a copy of the rows otherwise."""
        ids = ids.reshape(-1).long()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.out_features:
            raise ValueError(f"output rows must be a non-empty list of ids in [0, {self.out_features})")
        starts = torch.tensor([sum(self._rows[:i]) for i in range(len(self._rows))])
        part_of = torch.searchsorted(starts, ids, right=True) - 1
        parts: list[QuantTensor] = []
        begin = 0
        for end in range(1, ids.numel() + 1):  # runs of ids that fall in the same tensor
            if end < ids.numel() and part_of[end] == part_of[begin]:
                continue
            i = int(part_of[begin])
            local = ids[begin:end] - starts[i]
            blocks = getattr(self, f"blocks{i}")
            first = int(local[0])
            if torch.equal(local, torch.arange(first, first + local.numel())):
                rows = blocks[first:first + local.numel()]
            else:
                rows = blocks.index_select(0, local)
            parts.append(QuantTensor(self.names[i], self._types[i], local.numel(), self.in_features, rows, KERNEL_LAYOUT))
            begin = end
        bias = None if self.bias is None else self.bias.index_select(0, ids)
        return GGUFLinear(parts, bias)

    def extra_repr(self) -> str:
        types = "+".join(_TYPE_NAMES[t] for t in self._types)
        return f"in_features={self.in_features}, out_features={self.out_features}, types={types}"


class GGUFEmbedding(torch.nn.Module):
    """Embedding rows dequantized from a GGUF tensor's blocks on lookup (only the rows asked for)."""

    def __init__(self, table: QuantTensor):
        super().__init__()
        if table.layout != FILE_LAYOUT:
            raise ValueError(f"embedding {table.name}: its blocks must be in the file's layout, not the kernel's")
        self.num_embeddings, self.embedding_dim = table.rows, table.cols
        self.name = table.name
        self._type = table.type
        self.register_buffer("blocks", table.blocks, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise ValueError(f"token ids must lie in [0, {self.num_embeddings}), got {int(flat.min())}..{int(flat.max())}")
        if flat.dtype.is_floating_point or flat.dtype.is_complex or flat.dtype == torch.bool or flat.device.type != "cpu":
            raise ValueError(f"token ids must be integers on the CPU, got {flat.dtype} on {flat.device}")
        native = EXTENSION.load() if self._type in BLOCK_GEOMETRY else None
        if native is not None and self.blocks.is_contiguous() and self.blocks.device.type == "cpu":
            # gguf-py's arithmetic in C++ (the same bits, tests/test_kquant.py): microseconds, not numpy's ~1 ms
            flat = flat.to(torch.int64).contiguous()
            out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.float32)
            native.dequantize_rows(self._type, self.blocks.data_ptr(), self.num_embeddings, self.embedding_dim,
                                   flat.data_ptr(), flat.numel(), out.data_ptr())
            return out.reshape(*ids.shape, self.embedding_dim)
        rows = self.blocks.index_select(0, flat).numpy()
        values = dequantize(rows, GGMLQuantizationType(self._type))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={_TYPE_NAMES[self._type]}"
