"""Qwen2 decoder layers with their row-wise glue in native code (thinkahead/models/native/layer_ops.cpp).

Why: after the linears, a CPU decode step of the 1.5B model spent ~12 ms of ~77 in about 1,400 small
torch ops (norms, the rotary embedding, views, casts) and transformers' module calls around them.
Here a layer is its linears, float64 attention (exact_attention.py), three native calls (the RMS norm
twice, the rotary embedding with the q/k/v split) and a few torch ops (the KV cache append, SiLU, the
residual adds): 1.5B gguf decode step 77-80 -> 73.5-74.3 ms (docs/token_spec.md).

Exactness: the native ops compute each row on its own in a fixed order, the linears are row-wise, the
cache append copies, and float64 attention rounds every row to the same float32 values however many
rows share it: speculative greedy output equals plain greedy output. The rotary embedding gives
transformers' bits; the norm does not (its mean accumulates in float64), so `FusedQwen2ForCausalLM`
(fused_qwen2.py) runs these layers for every engine forward, never mixing the two.

Where the extension is not built, `available()` is false and the model keeps the torch ops.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from thinkahead.models.exact_attention import fp64_sdpa_forward, keeps_float64_kv
from thinkahead.models.native_extension import LazyExtension

EXTENSION = LazyExtension("_layer_native", "nothing (plain C++)")


def available() -> bool:
    return EXTENSION.load() is not None


def _fits(weight: torch.Tensor, dim: int) -> bool:
    return (weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.shape == (dim,))


def _norm(native: ModuleType, norm: Any, rows: torch.Tensor) -> torch.Tensor:
    """The RMS norm of float32 rows `[n, H]` (contiguous, on the CPU) by `norm`'s weight and epsilon."""
    if (rows.dim() != 2 or rows.dtype != torch.float32 or rows.device.type != "cpu" or not rows.is_contiguous()
            or not _fits(norm.weight, rows.shape[1])):
        raise ValueError(f"the native RMS norm takes contiguous float32 CPU rows [n, H] and a float32 weight [H]; got "
                         f"{tuple(rows.shape)} {rows.dtype} {rows.device} and {tuple(norm.weight.shape)} {norm.weight.dtype}")
    out = torch.empty_like(rows)
    native.rms_norm(rows.data_ptr(), rows.shape[0], rows.shape[1], norm.weight.data_ptr(), norm.variance_epsilon,
                    out.data_ptr())
    return out


def rms_norm(norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The native RMS norm of `hidden` `[..., H]` (float32, CPU), every row on its own."""
    native = EXTENSION.require("the native layer ops")
    return _norm(native, norm, hidden.reshape(-1, hidden.shape[-1]).contiguous()).reshape(hidden.shape)


def supports(model: Any) -> bool:
    """Whether the layers of `model` (a fused Qwen2) can run here now: the extension, float32 norm weights
    of the hidden size, contiguous, on the CPU (checked at every forward: a model can be moved or cast)."""
    if not available():
        return False
    inner = model.model
    hidden = model.config.hidden_size
    return _fits(inner.norm.weight, hidden) and all(
        _fits(layer.input_layernorm.weight, hidden) and _fits(layer.post_attention_layernorm.weight, hidden)
        for layer in inner.layers)


def run(inner: Any, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None, cache: Any) -> torch.Tensor:
    """The decoder layers and final norm of `inner` (a Qwen2Model of fused layers) over `hidden`
    `[1, T, H]` float32: `mask` None (a chain after the cached prefix) or additive `[1, 1, T, S]`; the
    cache (or None) receives each layer's keys/values (float64 where `keeps_float64_kv`). Returns the
    normed hidden `[1, T, H]`."""
    native = EXTENSION.require("the native layer ops")
    if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.dtype != torch.float32:
        raise ValueError(f"native layers take one float32 sequence [1, T, H], got {tuple(hidden.shape)} {hidden.dtype}")
    T, H = hidden.shape[1], hidden.shape[2]
    S = T + (cache.get_seq_length() if cache is not None else 0)  # keys each query row may see, new ones included
    _check_mask(mask, T, S)
    wide = cache is None or keeps_float64_kv(cache)
    h = hidden.reshape(T, H).contiguous()
    cos, sin = (e.reshape(T, -1).to(torch.float32).contiguous() for e in position_embeddings)
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        D = attn.head_dim
        hq, hkv = attn.qkv_sizes[0] // D, attn.qkv_sizes[1] // D
        qkv = attn.qkv_proj(_norm(native, layer.input_layernorm, h)).contiguous()
        if qkv.dtype != torch.float32 or tuple(qkv.shape) != (T, (hq + 2 * hkv) * D) or tuple(cos.shape) != (T, D):
            raise ValueError(f"layer {i}: q/k/v {tuple(qkv.shape)} {qkv.dtype} and rotary {tuple(cos.shape)} do not fit "
                             f"{hq} + 2 x {hkv} heads of {D} over {T} tokens in float32")
        q = torch.empty(1, hq, T, D, dtype=torch.float64)
        k = torch.empty(1, hkv, T, D, dtype=torch.float64)
        v = torch.empty(1, hkv, T, D, dtype=torch.float64)
        native.rope_split(qkv.data_ptr(), T, hq, hkv, D, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(),
                          v.data_ptr())
        if not wide:
            k, v = k.float(), v.float()
        keys, values = (k, v) if cache is None else cache.update(k, v, i)
        if keys.shape[-2] != S:
            raise RuntimeError(f"cache layer {i} holds {keys.shape[-2]} tokens after the append, expected {S}")
        out = fp64_sdpa_forward(attn, q, keys, values, mask, scaling=attn.scaling)[0]  # [1, T, hq, D] float64
        out = out.to(torch.float32).reshape(T, hq * D)  # rounded once, as the float32 query would have it
        h = h + attn.o_proj(out)
        mlp = layer.mlp
        gate, up = mlp.gate_up_proj(_norm(native, layer.post_attention_layernorm, h)).split(mlp.intermediate_size, dim=-1)
        h = h + mlp.down_proj(mlp.act_fn(gate).mul_(up))
    return _norm(native, inner.norm, h).reshape(1, T, H)


def _check_mask(mask: torch.Tensor | None, T: int, S: int) -> None:
    if mask is not None and tuple(mask.shape) != (1, 1, T, S):
        raise ValueError(f"the attention mask is {tuple(mask.shape)}, expected (1, 1, {T}, {S})")
