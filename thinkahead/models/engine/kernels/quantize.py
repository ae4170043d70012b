"""Int8 linear layers for CPU inference that keep speculative verification exact.

Why: on x86 CPUs without AVX512-BF16/AMX, a bfloat16 matmul over several rows (a verification pass
of k draft tokens) falls back to slow converted kernels, so checking 8 tokens costs about 4x one
decode step and speculation barely pays. PyTorch's fbgemm int8 kernels (AVX512-VNNI) read a quarter
of the fp32 bytes and stay nearly flat in k.

Why not `torch.ao.quantization.quantize_dynamic`: it quantizes activations with one scale per
tensor, so a token's logits depend on the other tokens of the same forward; a verification pass
would not compute what one-token decoding computes, and speculative greedy output would drift from
plain greedy. `RowwiseInt8Linear` gives every row its own scale: each row is divided by its absolute
maximum and quantized with fixed parameters for the range [-1, 1] (those fbgemm's dynamic
quantization would pick for it; the fp32-output kernel takes them as arguments), so the
quantization parameters never depend on the batch. Integer accumulation is exact, so a row's
output is bit-identical whether it is computed alone or among k others.

Attention is the other shape-dependent piece: `quantize_int8` also switches the model to float64
attention (thinkahead/models/engine/qwen2/exact_attention.py), whose rows round to the same float32 values however
many tokens share the forward.

Numerics: weights are rounded to int8 per output channel (on top of the 4-bit GGUF quantization the
packaged models already carry); activations get 7 bits per token (fbgemm's reduce_range).

Kernels: fbgemm's, or where built and supported our AVX2 kernel (thinkahead/models/engine/kernels/int8_kernel.py,
`$THINKAHEAD_INT8_KERNEL`), which computes the same float32 outputs bit for bit from weights that
need no prepacking. A module keeps the kernel chosen when it was built (`_packed` holds fbgemm's
packed weights or the native `Int8Weights`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from thinkahead.models.engine.kernels import int8_kernel

# fbgemm's int8 linear over float32 input quantized with given per-tensor parameters, float32 output
# (None in a build without it; `quantize_int8` then refuses)
_LINEAR_FP32_OUT = getattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32", None)

# The activation quantization parameters fbgemm's dynamic quantization picks for the range [-1, 1]
# (7-bit, `reduce_range`): every row is scaled into that range, so these never depend on the batch.
X_SCALE, X_ZERO_POINT = 2 / 127, 64


class RowwiseInt8Linear(torch.nn.Module):
    """`y = x @ W.T + b` with int8 per-channel weights and per-row int8 activations (batch-invariant)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        scales = (weight.abs().amax(1) / 127).clamp_min(1e-12).double()
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensor creation is deprecated but the kernels are current
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
        self._packed = pack_int8(qweight.int_repr(), qweight.q_per_channel_scales())
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            rows = rows.float()
        if isinstance(self._packed, int8_kernel.Int8Weights):  # the same numbers, in one native call
            return int8_kernel.linear(rows, self._packed, self.bias, X_SCALE).reshape(*shape[:-1], self.out_features)
        row_max = rows.abs().amax(1, keepdim=True).clamp_min_(1e-30)  # every scaled row lies in [-1, 1]
        # fbgemm quantizes the scaled rows with the fixed (X_SCALE, X_ZERO_POINT), accumulates in
        # int32 and dequantizes to float32: the same numbers as `linear_dynamic` over the rows plus
        # an anchor row [1, -1, 0, ...] (which pinned its per-tensor range), without the extra row.
        out = _LINEAR_FP32_OUT(rows / row_max, X_SCALE, X_ZERO_POINT, self._packed)
        out.mul_(row_max)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_int8(qweight: torch.Tensor, scales: torch.Tensor) -> Any:
    """A `RowwiseInt8Linear._packed` for symmetric int8 weights [N, K] and their float64 scales [N]:
    the native kernel's `Int8Weights` where `int8_kernel.kernel_choice()` picks it, else fbgemm's."""
    if int8_kernel.kernel_choice() == int8_kernel.NATIVE:
        return int8_kernel.pack(qweight, scales, X_SCALE, X_ZERO_POINT)
    zero_points = torch.zeros(qweight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch._make_per_channel_quantized_tensor(qweight, scales, zero_points, 0)
        return torch.ops.quantized.linear_prepack(quantized, None)


def unpack_int8(packed: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weights [N, K], float64 scales [N]) of a `RowwiseInt8Linear._packed`, either kernel's."""
    if isinstance(packed, int8_kernel.Int8Weights):
        return int8_kernel.unpack(packed)
    qweight, _ = torch.ops.quantized.linear_unpack(packed)
    return qweight.int_repr(), qweight.q_per_channel_scales()


def quantize_int8(model: Any, fuse: bool = True) -> Any:
    """Cast `model` to float32, replace every `nn.Linear` with `RowwiseInt8Linear` and switch to
    batch-invariant attention, in place. With `fuse`, Qwen2 layers first get one linear for q/k/v and
    one for gate/up (thinkahead/models/engine/qwen2/fused_qwen2.py: bit-identical outputs, fewer kernel calls)."""
    from thinkahead.models.engine.qwen2.exact_attention import use_exact_attention
    from thinkahead.models.engine.qwen2.fused_qwen2 import use_native_layers

    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines:
        raise ValueError(f"int8 needs PyTorch's fbgemm quantized engine (x86); this build has {engines}")
    if _LINEAR_FP32_OUT is None:
        raise ValueError(f"int8 needs quantized::linear_with_input_q_dq_qweight_dq_output_fp32 (torch {torch.__version__})")
    torch.backends.quantized.engine = "fbgemm"
    torch.nn.Module.float(model)  # transformers blocks `.float()` on GGUF-loaded models; the cast is plain torch
    if fuse:
        from thinkahead.models.engine.qwen2.fused_qwen2 import fuse_qwen2

        fuse_qwen2(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, RowwiseInt8Linear(child))
    use_exact_attention(model)
    use_native_layers(model)
    model.eval()
    return model
