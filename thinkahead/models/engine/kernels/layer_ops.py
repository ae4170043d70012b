"""Qwen2 decoder layers with their row-wise glue in native code (thinkahead/models/engine/kernels/native/layer_ops.cpp).

Why: after the linears, a CPU decode step of the 1.5B model spent ~12 ms of ~77 in about 1,400 small
torch ops (norms, the rotary embedding, views, casts) and transformers' module calls around them.
Here a layer is its linears, native calls (the RMS norm twice, the rotary embedding with the q/k/v split,
attention, SiLU times up) and a few torch ops (the KV cache append, the residual adds): 1.5B gguf decode
step 77-80 -> 73.5-74.3 ms (docs/token_spec.md). A batch of several sequences runs the same calls.

Where every linear is a GGUFLinear and the cache makes room in place (`GrowingCache.room`), the whole stack
runs in one native call instead (`Layers`, native/layer_loop.inc): the same ops in the same order, the same
bits, without ~20 Python calls per layer that each linear's streamed weights had evicted from the caches
(decode step 0.5B 30 -> 21.5 ms, 1.5B 72 -> 62 ms, measured in one process).

Exactness: the native ops compute each row on its own in a fixed order (attention too: native/attention.inc,
float32 over float32 K/V, half the bytes of the float64 attention it replaced), the linears are row-wise
and the cache append copies: speculative greedy output equals plain greedy output, and a sequence in a
batch gets the logits it gets alone. The rotary embedding gives transformers' bits; the norm, SiLU and
attention do not (the norm's mean accumulates in float64, SiLU's exponential is attention's, attention
rounds in its own order), so `FusedQwen2ForCausalLM` (fused_qwen2.py) runs these layers for every engine
forward, never mixing the two.

Where the extension is not built, `available()` is false and the model keeps the torch ops.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from thinkahead.models.engine.kernels.native_extension import LazyExtension

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


def _norm_key(inner: Any) -> tuple[int, ...]:
    """Where the norm weights of `inner` live: a model moved, cast or given new weights changes it."""
    return (inner.norm.weight.data_ptr(), *(w.data_ptr() for layer in inner.layers
                                            for w in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)))


def supports(model: Any) -> bool:
    """Whether the layers of `model` (a fused Qwen2) can run here now: the extension, float32 norm weights
    of the hidden size, contiguous, on the CPU (checked at every forward: a model can be moved or cast; the
    full check runs again whenever a norm weight's memory changed, its pass kept under `_norm_key`)."""
    if not available():
        return False
    inner = model.model
    key = _norm_key(inner)
    if inner.__dict__.get("_thinkahead_supported") == key:
        return True
    hidden = model.config.hidden_size
    ok = _fits(inner.norm.weight, hidden) and all(
        _fits(layer.input_layernorm.weight, hidden) and _fits(layer.post_attention_layernorm.weight, hidden)
        for layer in inner.layers)
    inner.__dict__["_thinkahead_supported"] = key if ok else None
    return ok


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
    plan = _plan(native, inner)
    if plan is not None and T > 0 and callable(getattr(cache, "room", None)):
        return _run_native(plan, inner, h.clone(), B, T, S, cos, sin, mask, cache, threads).reshape(B, T, H)
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        hq, hkv, D = _heads(attn)
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
        h = h + mlp.down_proj(_act(native, inner, mlp, mlp.gate_up_proj(_norm(native, layer.post_attention_layernorm, h))))
    return _norm(native, inner.norm, h).reshape(B, T, H)


def has_plan(inner: Any) -> bool:
    """Whether the native layer loop runs `inner`'s layers (every linear a GGUFLinear, SiLU)."""
    native = EXTENSION.load()
    return native is not None and _plan(native, inner) is not None


def run_ragged(inner: Any, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
               segments: list[tuple[int, torch.Tensor | None, Any]]) -> torch.Tensor:
    """The layers and final norm of `inner` over a ragged batch (`Layers.run_ragged`): `hidden` `[R, H]` float32
    holds every sequence's rows one after another, cos/sin `[R, D]`; `segments` per sequence (rows, additive
    mask `[1, 1, rows, held + rows]` or None, its cache). Each cache makes room for its rows (given back if the
    run fails). Needs the layer loop (`has_plan`)."""
    native = EXTENSION.require("the native layer ops")
    plan = _plan(native, inner)
    if plan is None or hidden.dim() != 2 or hidden.dtype != torch.float32:
        raise ValueError(f"a ragged batch needs the native layer loop and float32 rows [R, H], got "
                         f"{tuple(hidden.shape)} {hidden.dtype}")
    R, H = hidden.shape
    if sum(rows for rows, _, _ in segments) != R:
        raise ValueError(f"the sequences' rows do not add up to the batch's {R}")
    _, hkv, D = _heads(inner.layers[0].self_attn)
    n, shape = len(inner.layers), (1, hkv, D)
    cos, sin = (e.to(torch.float32).reshape(R, -1).contiguous() for e in position_embeddings)
    specs, masks, grown = [], [], []
    try:
        for rows, mask, cache in segments:
            if not callable(getattr(cache, "room", None)):
                raise ValueError("a ragged batch needs caches that make room in place (GrowingCache)")
            held = cache.get_seq_length()
            mask = _checked_mask(mask, 1, rows, held + rows)
            buffers = _make_room(cache, n, shape, rows, held)
            grown.append((cache, rows))
            masks.append(mask)  # alive until the run is over
            specs.append((rows, held, 0 if mask is None else mask.data_ptr(), *buffers))
        out = torch.empty(R, H)
        h = hidden.contiguous().clone()
        plan.run_ragged(h.data_ptr(), R, H, cos.data_ptr(), sin.data_ptr(), cos.shape[1], specs, out.data_ptr(),
                        torch.get_num_threads())
    except BaseException:
        for cache, rows in grown:
            _give_back(cache, n, rows)
        raise
    return out


def _heads(attn: Any) -> tuple[int, int, int]:
    """A fused attention's query heads, key/value heads and head dimension."""
    D = attn.head_dim
    return attn.qkv_sizes[0] // D, attn.qkv_sizes[1] // D, D


def _act(native: ModuleType, inner: Any, mlp: Any, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of `gate_up` `[n, 2 I]` (gate | up): native SiLU where the model's act is SiLU (the layer
    loop's bits), else the model's own."""
    size = mlp.intermediate_size
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * size:
        raise ValueError(f"gate/up output {tuple(gate_up.shape)} does not hold two halves of the intermediate size {size}")
    if getattr(inner.config, "hidden_act", None) == "silu" and gate_up.is_contiguous() and gate_up.dtype == torch.float32:
        out = torch.empty(gate_up.shape[0], size)
        native.silu_mul(gate_up.data_ptr(), gate_up.shape[0], size, out.data_ptr())
        return out
    gate, up = gate_up.split(size, dim=-1)
    return mlp.act_fn(gate).mul_(up)


def _linear_parts(linear: Any) -> tuple[list[int], list[int], list[int], list[int], int] | None:
    """A GGUFLinear's arguments to the kquant kernel, or None for any other linear."""
    from thinkahead.models.engine.kernels.kquant import GGUFLinear

    return linear.kernel_args() if isinstance(linear, GGUFLinear) else None


_structure = [0]  # bumped whenever a fused attention or MLP module has an attribute set (fused_qwen2.py)


def structure_changed() -> None:
    """Called by the fused modules on every attribute set: a cached layer loop is rebuilt before its next run."""
    _structure[0] += 1


def _plan_key(inner: Any) -> tuple:
    """What a layer loop was built from: the norm weights' addresses, the layers' attention and MLP modules
    (kept alive by the plan, so an id is never reused while it is cached) and the fused modules' version."""
    return (_structure[0], _norm_key(inner), tuple((id(layer.self_attn), id(layer.mlp)) for layer in inner.layers))


def _plan(native: ModuleType, inner: Any) -> Any | None:
    """The native layer loop (layer_loop.inc's `Layers`) of `inner`, built once per model and rebuilt when what it
    was built from changed (`_plan_key`); None where it cannot run the model: a linear that is not a GGUFLinear, an
    act other than SiLU."""
    key = _plan_key(inner)
    cached = inner.__dict__.get("_thinkahead_layers")
    if cached is not None and cached[0] == key:
        return cached[1]
    plan = None
    if getattr(inner.config, "hidden_act", None) == "silu":
        plan = _build_plan(native, inner)
    inner.__dict__["_thinkahead_layers"] = (key, plan)
    return plan


def _build_plan(native: ModuleType, inner: Any) -> Any | None:
    specs, modules = [], [inner.norm]
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [_linear_parts(x) for x in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(spec is None for spec in linears):
            return None
        specs.append((layer.input_layernorm.weight.data_ptr(), layer.input_layernorm.variance_epsilon,
                      layer.post_attention_layernorm.weight.data_ptr(), layer.post_attention_layernorm.variance_epsilon,
                      *_heads(attn), attn.scaling, *linears))
        modules.append(layer)
    if not specs:
        return None
    plan = native.Layers(inner.layers[0].self_attn.qkv_proj.kernel_address(), inner.config.hidden_size, specs,
                         inner.norm.weight.data_ptr(), inner.norm.variance_epsilon)
    plan.modules = modules  # the weights its pointers address live as long as it does
    return plan


def _fits_room(keys: torch.Tensor, values: torch.Tensor, shape: tuple[int, int, int]) -> bool:
    """Whether a layer's buffers are contiguous float32 CPU `[B, hkv, capacity, D]` alike."""
    return (keys.dtype == values.dtype == torch.float32 and keys.device.type == values.device.type == "cpu"
            and keys.is_contiguous() and values.is_contiguous() and keys.shape == values.shape and keys.dim() == 4
            and (keys.shape[0], keys.shape[1], keys.shape[3]) == shape)


def _run_native(plan: Any, inner: Any, h: torch.Tensor, B: int, T: int, S: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, cache: Any, threads: int) -> torch.Tensor:
    """`plan.run` over `h` `[B * T, H]` (a copy it updates), the new keys/values written into room the cache
    makes (given back if the run fails)."""
    _, hkv, D = _heads(inner.layers[0].self_attn)
    n, held = len(inner.layers), S - T
    keys, values, capacity = _make_room(cache, n, (B, hkv, D), T, held)
    out = torch.empty_like(h)
    try:
        plan.run(h.data_ptr(), B, T, h.shape[1], cos.data_ptr(), sin.data_ptr(), cos.shape[1],
                 0 if mask is None else mask.data_ptr(), 0 if mask is None or mask.shape[0] == 1 else T * S, held,
                 keys, values, capacity, out.data_ptr(), threads)
    except BaseException:
        _give_back(cache, n, T)
        raise
    return out


def _make_room(cache: Any, n: int, shape: tuple[int, int, int], new: int,
               held: int) -> tuple[list[int], list[int], list[int]]:
    """Room for `new` tokens in the first `n` layers of `cache` (`shape`: batch, kv heads, head dim) after the
    `held` it holds, as the native loop takes it: each layer's key and value buffer addresses and capacity.
    Buffers the loop cannot write (it reads raw memory) are given back and refused."""
    room = cache.room(n, *shape, new)  # checks every layer before it changes any
    if any(got != held or not _fits_room(k, v, shape) for k, v, got in room):
        _give_back(cache, n, new)
        raise RuntimeError(f"the cache's layers hold {sorted({got for _, _, got in room})} tokens (expected {held}) "
                           f"or buffers that are not contiguous float32 {list(shape)}")
    return [k.data_ptr() for k, _, _ in room], [v.data_ptr() for _, v, _ in room], [k.shape[-2] for k, _, _ in room]


def _give_back(cache: Any, n: int, new: int) -> None:
    """No layer keeps slots a run did not fill (a negative crop removes that many)."""
    for layer in cache.layers[:n]:
        layer.crop(-new)


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
