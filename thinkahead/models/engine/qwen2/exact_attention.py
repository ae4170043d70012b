"""Attention whose rows do not depend on how many tokens share the forward pass.

Why: speculative verification checks k draft tokens in one forward, plain decoding feeds one token
at a time, and a prompt may be prefilled whole or in pieces (the KV prefix pool). float32 attention
kernels reduce in an order that depends on those shapes, so the same query row comes out a few ulp
apart (measured: up to 2e-6 at 1,500 keys). With int8 linears (thinkahead/models/engine/kernels/quantize.py) such a
difference can move an activation across an int8 rounding step; on Qwen2.5-1.5B that shifted a
logit by 0.28 and speculative greedy output left plain greedy output after 61 tokens.

The fix: compute attention in float64 and round the result to float32. Two evaluation orders then
differ by about 1e-16, far below float32's rounding step, so both round to the same float32 row
(measured: every row bit-identical, batched or alone; on the real model the outputs match).
The cost is small at short contexts and grows with the context (about 1.5x the attention itself).

Where it runs: transformers' forward of an int8 or gguf model (any architecture). The fused Qwen2 layers'
engine forwards (layer_ops.py) use native float32 attention instead (native/attention.inc: every row in one
fixed order, so batch-invariant by construction, over float32 K/V).
"""

from __future__ import annotations

from typing import Any

import torch

IMPLEMENTATION = "thinkahead_fp64_sdpa"
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")


def fp64_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: `[B, H, Q, D]` inputs, `[B, Q, H, D]` output."""
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"{IMPLEMENTATION} does not support `{name}`; load this model without dtype='int8'")
    if dropout:
        raise ValueError(f"{IMPLEMENTATION} is for inference and does not support dropout")
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    mask = attention_mask
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    if mask is None and q_len > 1 and getattr(module, "is_causal", True) is not False and is_causal is not False:
        # Queries are the last q_len positions of the cache: align the causal mask bottom-right.
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    q, k, v = query.double(), key.double(), value.double()
    if q_len == 1 and groups > 1:
        # One token: fold the query heads of each key/value head into rows (no repeated K/V).
        q = q.reshape(batch, kv_heads, groups, dim)
        if mask is not None and mask.dim() == 4 and mask.shape[1] != 1:
            raise ValueError(f"a per-head attention mask is not supported by {IMPLEMENTATION}")
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        out = out.reshape(batch, heads, 1, dim)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=groups > 1
        )
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def keeps_float64_kv(cache: Any) -> bool:
    """Whether float64 attention should store K/V in `cache` as float64: yes in a cache that appends in
    place (lossless, and a step then converts only its own tokens); no in one that concatenates
    (transformers' DynamicCache in `generate`: every step's copies would double)."""
    return bool(getattr(cache, "appends_in_place", False))


def use_exact_attention(model: Any) -> Any:
    """Switch `model` (a transformers model) to float64 attention and its rotary position encodings to a
    table (exact_rotary.py: torch's cos/sin can change with the thread split); returns the model."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from thinkahead.models.engine.qwen2.exact_rotary import use_exact_rotary

    AttentionInterface.register(IMPLEMENTATION, fp64_sdpa_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATION)
    use_exact_rotary(model)
    return model
