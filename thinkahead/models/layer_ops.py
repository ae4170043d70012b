"""Qwen2 decoder layers with their row-wise glue in native code (thinkahead/models/native/layer_ops.cpp).

Why: after the linears, a CPU decode step of the 1.5B model spent ~12 ms of ~77 in about 1,400 small
torch ops (norms, the rotary embedding, views, casts) and transformers' module calls around them.
Here a layer is its linears, four native calls (the RMS norm twice, the rotary embedding with the q/k/v
split, attention) and a few torch ops (the KV cache append, SiLU, the residual adds): 1.5B gguf decode
step 77-80 -> 73.5-74.3 ms (docs/token_spec.md). A batch of several sequences runs the same calls.

Exactness: the native ops compute each row on its own in a fixed order (attention too: native/attention.inc,
float32 over float32 K/V, half the bytes of the float64 attention it replaced), the linears are row-wise
and the cache append copies: speculative greedy output equals plain greedy output, and a sequence in a
batch gets the logits it gets alone. The rotary embedding gives transformers' bits; the norm and attention
do not (the norm's mean accumulates in float64, attention rounds in its own order), so
`FusedQwen2ForCausalLM` (fused_qwen2.py) runs these layers for every engine forward, never mixing the two.

Where the extension is not built, `available()` is false and the model keeps the torch ops.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

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
    `[B, T, H]` float32: `mask` None (each sequence a chain after its cached prefix) or additive
    `[B or 1, 1, T, S]`; the cache (or None) receives each layer's float32 keys/values. Returns the normed
    hidden `[B, T, H]`."""
    native = EXTENSION.require("the native layer ops")
    if hidden.dim() != 3 or hidden.dtype != torch.float32:
        raise ValueError(f"native layers take float32 sequences [B, T, H], got {tuple(hidden.shape)} {hidden.dtype}")
    B, T, H = hidden.shape
    S = T + (cache.get_seq_length() if cache is not None else 0)  # keys each query row may see, new ones included
    mask = _checked_mask(mask, B, T, S)
    h = hidden.reshape(B * T, H).contiguous()
    cos, sin = (e.to(torch.float32).expand(B, T, -1).reshape(B * T, -1).contiguous() for e in position_embeddings)
    threads = torch.get_num_threads()
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        D = attn.head_dim
        hq, hkv = attn.qkv_sizes[0] // D, attn.qkv_sizes[1] // D
        qkv = attn.qkv_proj(_norm(native, layer.input_layernorm, h)).contiguous()
        if qkv.dtype != torch.float32 or tuple(qkv.shape) != (B * T, (hq + 2 * hkv) * D) or cos.shape[1] != D:
            raise ValueError(f"layer {i}: q/k/v {tuple(qkv.shape)} {qkv.dtype} and rotary {tuple(cos.shape)} do not fit "
                             f"{hq} + 2 x {hkv} heads of {D} over {B} x {T} tokens in float32")
        q = torch.empty(hq, B * T, D)  # sequence b's row t at b * T + t
        k = torch.empty(hkv, B * T, D)
        v = torch.empty(hkv, B * T, D)
        native.rope_split(qkv.data_ptr(), B * T, hq, hkv, D, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(),
                          v.data_ptr())
        k, v = (x.view(hkv, B, T, D).transpose(0, 1) for x in (k, v))
        keys, values = (k.contiguous(), v.contiguous()) if cache is None else cache.update(k, v, i)
        if keys.shape[-2] != S or keys.dtype != torch.float32:
            raise RuntimeError(f"cache layer {i} holds {keys.shape[-2]} {keys.dtype} tokens after the append, expected "
                               f"{S} float32")
        if keys.stride()[-2:] != (D, 1) or values.stride() != keys.stride():
            keys, values = keys.contiguous(), values.contiguous()
        out = torch.empty(B * T, hq * D)
        native.attention(q.data_ptr(), B, T, hq, hkv, D, keys.data_ptr(), values.data_ptr(), S, keys.stride(0),
                         keys.stride(1), 0 if mask is None else mask.data_ptr(),
                         0 if mask is None or mask.shape[0] == 1 else T * S, attn.scaling, out.data_ptr(), threads)
        h = h + attn.o_proj(out)
        mlp = layer.mlp
        gate, up = mlp.gate_up_proj(_norm(native, layer.post_attention_layernorm, h)).split(mlp.intermediate_size, dim=-1)
        h = h + mlp.down_proj(mlp.act_fn(gate).mul_(up))
    return _norm(native, inner.norm, h).reshape(B, T, H)


def _checked_mask(mask: torch.Tensor | None, B: int, T: int, S: int) -> torch.Tensor | None:
    """`mask` as contiguous float32 `[B or 1, T, S]` (a bool mask: True where a key may be seen)."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[0] not in (1, B) or tuple(mask.shape[1:]) != (1, T, S):
        batch = "1" if B == 1 else f"{B} or 1"
        raise ValueError(f"the attention mask is {tuple(mask.shape)}, expected ({batch}, 1, {T}, {S})")
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape).masked_fill_(~mask, -torch.inf)
    return mask.to(torch.float32).reshape(mask.shape[0], T, S).contiguous()
