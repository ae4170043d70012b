"""Int8 linear layers for CPU inference that keep speculative verification exact.

Why: on x86 CPUs without AVX512-BF16/AMX, a bfloat16 matmul over several rows (a verification pass
of k draft tokens) falls back to slow converted kernels, so checking 8 tokens costs about 4x one
decode step and speculation barely pays. PyTorch's fbgemm int8 kernels (AVX512-VNNI) read a quarter
of the fp32 bytes and stay nearly flat in k.

Why not `torch.ao.quantization.quantize_dynamic`: it quantizes activations with one scale per
tensor, so a token's logits depend on the other tokens of the same forward; a verification pass
would not compute what one-token decoding computes, and speculative greedy output would drift from
plain greedy. `RowwiseInt8Linear` gives every row its own scale: each row is divided by its absolute
maximum, and one fixed anchor row `[1, -1, 0, ...]` pins fbgemm's per-tensor range to [-1, 1], so
the quantization parameters never depend on the batch. Integer accumulation is exact, so a row's
output is bit-identical whether it is computed alone or among k others.

Attention is the other shape-dependent piece: `quantize_int8` also switches the model to float64
attention (thinkahead/models/exact_attention.py), whose rows round to the same float32 values however
many tokens share the forward.

Numerics: weights are rounded to int8 per output channel (on top of the 4-bit GGUF quantization the
packaged models already carry); activations get 7 bits per token (fbgemm's reduce_range).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


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
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        anchor = torch.zeros(1, self.in_features)
        anchor[0, 0], anchor[0, 1 % self.in_features] = 1.0, -1.0
        self.register_buffer("_anchor", anchor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        row_max = rows.abs().amax(1, keepdim=True).clamp_min(1e-30)
        scaled = torch.cat([rows / row_max, self._anchor])
        out = torch.ops.quantized.linear_dynamic(scaled, self._packed, True)[:-1] * row_max
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(model: Any) -> Any:
    """Cast `model` to float32, replace every `nn.Linear` with `RowwiseInt8Linear` and switch to
    batch-invariant attention, in place."""
    from thinkahead.models.exact_attention import use_exact_attention

    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines:
        raise ValueError(f"int8 needs PyTorch's fbgemm quantized engine (x86); this build has {engines}")
    torch.backends.quantized.engine = "fbgemm"
    torch.nn.Module.float(model)  # transformers blocks `.float()` on GGUF-loaded models; the cast is plain torch
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, RowwiseInt8Linear(child))
    use_exact_attention(model)
    model.eval()
    return model
