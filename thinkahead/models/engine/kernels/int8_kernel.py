"""The native AVX2 int8 linear (thinkahead/models/engine/kernels/native/int8_linear.cpp) behind `RowwiseInt8Linear`.

Why: fbgemm's int8 kernels need their weights prepacked at every model load (the packed form cannot
be cached) and read a single row's weights at about half the memory bandwidth. The native kernel
takes int8 weights in a layout of our own (`Int8Weights`: plain tensors, which a weight cache can
store and memory-map) and streams them once per call for all rows. Its output is bit-identical to
the fbgemm path (`tests/test_int8_native.py`), so the choice never changes a token.

Choice: `$THINKAHEAD_INT8_KERNEL` = ``native`` or ``fbgemm``; unset, `DEFAULT_KERNEL` (native).
Where native cannot run (extension not built, CPU without AVX2/FMA) int8 linears use fbgemm, with one
warning. The weight cache stores int8 weights and scales (`quantize.unpack_int8`) and packs them for
the kernel of the loading process (`quantize.pack_int8`), so either kernel reads any entry.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from thinkahead.models.engine.kernels.native_extension import LazyExtension

logger = logging.getLogger(__name__)

ENV_KERNEL = "THINKAHEAD_INT8_KERNEL"
NATIVE, FBGEMM = "native", "fbgemm"
KERNELS = (NATIVE, FBGEMM)
DEFAULT_KERNEL = NATIVE

EXTENSION = LazyExtension("_int8_native", "AVX2/FMA")
_warned = False


def native_available() -> bool:
    """Whether the native kernel can run here (extension built, CPU with AVX2 and FMA)."""
    return EXTENSION.load() is not None


def kernel_choice() -> str:
    """The int8 kernel new `RowwiseInt8Linear`s use: `$THINKAHEAD_INT8_KERNEL`, else `DEFAULT_KERNEL`;
    fbgemm where the native kernel cannot run."""
    global _warned
    wanted = os.environ.get(ENV_KERNEL, "").strip().lower() or DEFAULT_KERNEL
    if wanted not in KERNELS:
        raise ValueError(f"${ENV_KERNEL} must be one of {', '.join(KERNELS)}, not {wanted!r}")
    if wanted == FBGEMM or native_available():
        return wanted
    if not _warned:
        _warned = True
        logger.warning("the native int8 kernel cannot run (%s): int8 linears use fbgemm", EXTENSION.error)
    return FBGEMM


@dataclass(slots=True)
class Int8Weights:
    """One int8 linear in the native kernel's layout: what a weight cache would store and memory-map.

    `packed`: int8 [Np // 32, Kp // 4, 32, 4] with Np = N rounded up to 32 and Kp = K rounded up to 4
    (zero padding): element [b, g, c, i] = W[32 b + c, 4 g + i]. `zp_colsum`: int32 [Np], 64 * the sum
    of each output channel's weights (the activations' zero point times the column sums). `scale`:
    float32 [Np], float32(x_scale) * float32(w_scale[n]) (fbgemm's product). `w_scales`: the per-channel
    scales as quantized (float64 [N]), so that `unpack` gives the weights back exactly.
    """

    packed: torch.Tensor
    zp_colsum: torch.Tensor
    scale: torch.Tensor
    w_scales: torch.Tensor
    out_features: int
    in_features: int


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _module() -> ModuleType:
    return EXTENSION.require("the native int8 kernel")


def pack(qweight: torch.Tensor, w_scales: torch.Tensor, x_scale: float, x_zero_point: int) -> Int8Weights:
    """`Int8Weights` from symmetric int8 weights [N, K] (values in [-127, 127]) and their scales [N]."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or 0 in qweight.shape:
        raise ValueError(f"qweight must be a non-empty 2-D int8 tensor, not {qweight.dtype} {tuple(qweight.shape)}")
    n, k = (int(v) for v in qweight.shape)
    if w_scales.shape != (n,):
        raise ValueError(f"scales {tuple(w_scales.shape)} do not match {n} output channels")
    if int(qweight.min()) < -127:
        raise ValueError("int8 weights must lie in [-127, 127] (symmetric quantization)")
    mod = _module()
    if x_zero_point != mod.ZERO_POINT:
        raise ValueError(f"the native kernel's activation zero point is {mod.ZERO_POINT}, not {x_zero_point}")
    block, group = int(mod.BLOCK_N), int(mod.GROUP_K)
    np_, kp = _round_up(n, block), _round_up(k, group)
    qweight = qweight.contiguous()
    packed = torch.empty(np_ // block, kp // group, block, group, dtype=torch.int8)
    zp_colsum = torch.empty(np_, dtype=torch.int32)
    mod.pack_weights(qweight.data_ptr(), n, k, packed.data_ptr(), zp_colsum.data_ptr())
    scale = torch.zeros(np_, dtype=torch.float32)
    scale[:n] = torch.tensor(x_scale, dtype=torch.float32) * w_scales.float()
    return Int8Weights(packed, zp_colsum, scale, w_scales.double().contiguous(), n, k)


def unpack(weights: Int8Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights [N, K], float64 scales [N]) as given to `pack`."""
    qweight = torch.empty(weights.out_features, weights.in_features, dtype=torch.int8)
    _module().unpack_weights(weights.packed.data_ptr(), weights.out_features, weights.in_features, qweight.data_ptr())
    return qweight, weights.w_scales


def linear(rows: torch.Tensor, weights: Int8Weights, bias: torch.Tensor | None, x_scale: float) -> torch.Tensor:
    """float32 [M, N] = the int8 linear of float32 rows [M, K], plus `bias` (float32 [N]) if given."""
    mod = EXTENSION.module
    if mod is None:
        raise ValueError("the native int8 kernel is not loaded (pack weights first)")
    if rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] != weights.in_features:
        raise ValueError(f"rows must be float32 [M, {weights.in_features}], not {rows.dtype} {tuple(rows.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (weights.out_features,)):
        raise ValueError(f"bias must be float32 [{weights.out_features}]")
    rows = rows.contiguous()
    if bias is not None:
        bias = bias.contiguous()  # kept alive here: the kernel reads it through a raw pointer
    out = torch.empty(rows.shape[0], weights.out_features, dtype=torch.float32)
    mod.linear(rows.data_ptr(), rows.shape[0], weights.in_features, weights.packed.data_ptr(),
               weights.zp_colsum.data_ptr(), weights.scale.data_ptr(),
               0 if bias is None else bias.data_ptr(), out.data_ptr(), weights.out_features, x_scale,
               torch.get_num_threads())
    return out
