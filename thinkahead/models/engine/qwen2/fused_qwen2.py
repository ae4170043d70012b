"""One linear for q/k/v and one for gate/up in Qwen2 decoder layers, with a leaner forward for them.

Why: a plain decode step of the int8 1.5B model runs seven int8 linears per layer, each one a
kernel call plus its activation scaling over the same input row. q, k and v read the same input,
and so do gate and up: fused, they are two calls (1536 -> 2048 and 1536 -> 17920 on the 1.5B)
instead of five, and the input row is scaled and quantized twice instead of five times.

Exactness: `RowwiseInt8Linear` quantizes weights per output channel and activations per row, so an
output channel's value depends only on its own weight row, its scale, its bias and the input row:
the fused layer's output is, column for column, bit-identical to the separate layers' outputs
(tests/test_int8_fusion.py: a tiny Qwen2's logits, chain and tree, fused == unfused).

`fuse_qwen2(model)` fuses float `nn.Linear`s before `quantize_int8` replaces them (the per-row
scale of the concatenated weight is the scale of each row on its own, so the int8 weights are the
same), on real tensors or on the meta device (the weight cache's rebuild uses it on a skeleton).
Only the exact transformers classes `Qwen2Attention` / `Qwen2MLP` are fused; any other
architecture, or a subclass, keeps its own modules and forward.

A model whose every layer is fused becomes `FusedQwen2ForCausalLM`: the engine's forwards (token ids,
no mask or a 4D tree mask, a KV cache, batch-invariant attention) run the layers directly, the same tensor
ops in the same order as transformers' forward (bit-identical logits, tests/test_int8_fusion.py)
without its per-module wrappers, hooks and mask building: 28 layers x 7 modules per decode step.
Any other call (inputs_embeds, output options, training, another attention) takes transformers' path.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen2 import modeling_qwen2 as qwen2

from thinkahead.models.engine.kernels import layer_ops
from thinkahead.models.engine.qwen2.exact_attention import IMPLEMENTATION as EXACT_ATTENTION
from thinkahead.models.engine.qwen2.exact_attention import keeps_float64_kv

QKV, GATE_UP = "qkv_proj", "gate_up_proj"
_QKV_PARTS, _GATE_UP_PARTS = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
# transformers >= 5.24 names the KV cache `cache` (argument and output field), earlier versions `past_key_values`
CACHE_NAME = "cache" if "cache" in inspect.signature(qwen2.Qwen2ForCausalLM.forward).parameters else "past_key_values"


class FusedQwen2Attention(qwen2.Qwen2Attention):
    """`Qwen2Attention` with `qkv_proj` (one linear, outputs q | k | v) instead of q/k/v_proj."""

    qkv_sizes: tuple[int, int, int]

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        layer_ops.structure_changed()  # a native layer loop built on the old linear must not run it

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Any = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # transformers >= 5.24 passes the KV cache as `cache`, earlier versions as `past_key_values`
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query, key, value = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
        query = query.view(hidden_shape).transpose(1, 2)
        key = key.view(hidden_shape).transpose(1, 2)
        value = value.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = qwen2.apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            if self.config._attn_implementation == EXACT_ATTENTION and keeps_float64_kv(cache):
                key, value = key.double(), value.double()
            key, value = cache.update(key, value, self.layer_idx)
        attention = qwen2.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, qwen2.eager_attention_forward
        )
        out, weights = attention(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, sliding_window=self.sliding_window, **kwargs,
        )
        return self.o_proj(out.reshape(*input_shape, -1)), weights


class FusedQwen2MLP(qwen2.Qwen2MLP):
    """`Qwen2MLP` with `gate_up_proj` (one linear, outputs gate | up) instead of gate/up_proj."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        layer_ops.structure_changed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act_fn(gate).mul_(up))


def _rms_norm(norm: qwen2.Qwen2RMSNorm, hidden: torch.Tensor) -> torch.Tensor:
    """`Qwen2RMSNorm.forward`, op for op."""
    x = hidden.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(hidden.dtype)


class FusedQwen2ForCausalLM(qwen2.Qwen2ForCausalLM):
    """`Qwen2ForCausalLM` over fused layers whose engine forwards run the layers directly (see the module
    docstring); every other call is transformers' own forward."""

    # Whether engine forwards run the layers' row-wise ops natively (layer_ops.py); set by
    # `use_native_layers` once the weights are final (an int8 model's norms become float32 after fusion).
    _native_layers = False

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        cache = kwargs.pop("cache", None)
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        if kwargs or not isinstance(logits_to_keep, int) or not self._lean(input_ids, attention_mask):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache, logits_to_keep=logits_to_keep, **{CACHE_NAME: cache}, **kwargs)
        if use_cache is None:  # as transformers reads it
            use_cache = bool(getattr(self.config, "use_cache", False))
        if use_cache and cache is None:  # the cache transformers would make (and return)
            cache = DynamicCache(config=self.config)
        hidden = self._layers(input_ids, attention_mask, position_ids, cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:, :]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), **{CACHE_NAME: cache if use_cache else None})

    def final_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None, cache: Any) -> torch.Tensor:
        """The last layer's normed hidden states `[batch, n, hidden]` (what `lm_head` reads) of an engine
        forward over `cache`: the same numbers `forward` feeds its output layer."""
        if self._lean(input_ids, attention_mask):
            return self._layers(input_ids, attention_mask, position_ids, cache)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, **{CACHE_NAME: cache}).last_hidden_state

    def ragged_ready(self) -> bool:
        """Whether `ragged_hidden` can run: the native layer loop over GGUF linears, and a GGUF output layer
        (rows that never depend on the batch, as the layers')."""
        from thinkahead.models.engine.kernels.kquant import GGUFLinear

        return (self._native_layers and layer_ops.supports(self) and isinstance(self.lm_head, GGUFLinear)
                and self.config._attn_implementation == EXACT_ATTENTION and layer_ops.has_plan(self.model))

    def ragged_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      segments: list[tuple[int, torch.Tensor | None, Any]]) -> torch.Tensor:
        """The normed last hidden states `[R, hidden]` of a ragged batch: `input_ids` / `position_ids` `[R]` hold
        every sequence's tokens one sequence after another, `segments` each sequence's (tokens, additive mask
        `[1, 1, n, held + n]` or None for a chain, cache). Each row gets the bits `final_hidden` gives it alone."""
        inner = self.model
        hidden = inner.embed_tokens(input_ids[None])
        cos, sin = inner.rotary_emb(hidden, position_ids[None])
        return layer_ops.run_ragged(inner, hidden[0], (cos[0], sin[0]), segments)

    def _lean(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> bool:
        """Whether a forward with these inputs runs the layers directly (`_layers`)."""
        config = self.config
        return (input_ids is not None and not self.training
                and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.is_floating_point()))
                and config._attn_implementation == EXACT_ATTENTION
                and not getattr(config, "output_hidden_states", False) and not getattr(config, "output_attentions", False))

    def _layers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, cache: Any) -> torch.Tensor:
        inner = self.model
        hidden = inner.embed_tokens(input_ids)
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = inner.rotary_emb(hidden, position_ids)
        # checked at every call: the model may have been moved or cast since `use_native_layers`
        if self._native_layers and layer_ops.supports(self) and hidden.dtype == torch.float32 and hidden.device.type == "cpu":
            return layer_ops.run(inner, hidden, position_embeddings, attention_mask, cache)
        # transformers' ops and attention, float64 attention aligning a missing mask bottom-right (the chain
        # after the cached prefix) as transformers' own causal mask does; a 4D mask (a tree) is used as given
        for layer in inner.layers:
            attn = layer.self_attn.forward(_rms_norm(layer.input_layernorm, hidden), position_embeddings,
                                           attention_mask, cache=cache)[0]
            hidden = hidden + attn
            hidden = hidden + layer.mlp.forward(_rms_norm(layer.post_attention_layernorm, hidden))
        hidden = _rms_norm(inner.norm, hidden)
        return hidden


def use_native_layers(model: Any, enable: bool = True) -> bool:
    """Run the engine forwards of `model` (a `FusedQwen2ForCausalLM`) on the native layer ops where they
    can run; returns whether they do. Other models are left alone (False)."""
    if not isinstance(model, FusedQwen2ForCausalLM):
        return False
    model._native_layers = bool(enable) and layer_ops.supports(model)
    return model._native_layers


def _leanable(model: Any) -> bool:
    """Whether `model` is exactly a transformers Qwen2ForCausalLM whose every layer is fused, full attention."""
    if type(model) is not qwen2.Qwen2ForCausalLM or "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
        return False
    inner = model.model
    norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    return (type(inner) is qwen2.Qwen2Model and all(type(n) is qwen2.Qwen2RMSNorm for n in norms)
            and all(type(layer) is qwen2.Qwen2DecoderLayer and type(layer.self_attn) is FusedQwen2Attention
                    and type(layer.mlp) is FusedQwen2MLP for layer in inner.layers))


def _fused_linear(parts: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One `nn.Linear` whose output is the concatenation of `parts`' outputs (no random init)."""
    first = parts[0]
    with_bias = [p.bias is not None for p in parts]
    if any(with_bias) and not all(with_bias):
        raise ValueError("cannot fuse linears of which only some have a bias")
    out_features = sum(p.out_features for p in parts)
    with torch.device("meta"):
        fused = torch.nn.Linear(first.in_features, out_features, bias=all(with_bias))
    grad = first.weight.requires_grad
    fused.weight = torch.nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=grad)
    if all(with_bias):
        fused.bias = torch.nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=grad)
    return fused


def _fusable(parts: list[Any]) -> bool:
    return all(type(p) is torch.nn.Linear for p in parts) and len({p.in_features for p in parts}) == 1 and len(
        {p.weight.dtype for p in parts}) == 1


def fuse_qwen2(model: Any) -> int:
    """Fuse q/k/v and gate/up of every `Qwen2Attention` / `Qwen2MLP` of `model`, in place (float
    `nn.Linear`s, real or meta); returns how many modules were fused (0 for other architectures)."""
    fused = 0
    for module in list(model.modules()):
        if type(module) is qwen2.Qwen2Attention:
            parts = [getattr(module, name) for name in _QKV_PARTS]
            if not _fusable(parts):
                continue
            module.qkv_proj = _fused_linear(parts)
            module.qkv_sizes = tuple(p.out_features for p in parts)
            for name in _QKV_PARTS:
                delattr(module, name)
            module.__class__ = FusedQwen2Attention
            fused += 1
        elif type(module) is qwen2.Qwen2MLP:
            parts = [getattr(module, name) for name in _GATE_UP_PARTS]
            if not _fusable(parts) or {p.out_features for p in parts} != {module.intermediate_size}:
                continue
            module.gate_up_proj = _fused_linear(parts)
            for name in _GATE_UP_PARTS:
                delattr(module, name)
            module.__class__ = FusedQwen2MLP
            fused += 1
    if _leanable(model):
        model.__class__ = FusedQwen2ForCausalLM
    return fused
