"""The native row-wise layer ops (thinkahead/models/engine/kernels/layer_ops.py, native/layer_ops.cpp) and the fused
Qwen2 forward that runs them: transformers' numbers (the rotary embedding to the bit, the norm to
float rounding), rows that never depend on the batch, exact speculation, and the fallbacks."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2 import modeling_qwen2 as qwen2

from thinkahead.models.engine.kernels import layer_ops
from thinkahead.models.engine.qwen2.exact_attention import use_exact_attention
from thinkahead.models.engine.qwen2.fused_qwen2 import CACHE_NAME, FusedQwen2ForCausalLM, fuse_qwen2, use_native_layers
from thinkahead.models.engine.kernels.native_extension import LazyExtension
from thinkahead.models.engine.kernels.quantize import quantize_int8
from thinkahead.models.engine.runner import HFEngine

from tests.test_int8_fusion import _qwen2
from tests.test_speculative_decoding import assert_suffix_speculation_is_exact
from tests.tiny_models import VOCAB

native = pytest.importorskip("thinkahead.models.engine.kernels._layer_native")


def _native_float_qwen2(intermediate: int = 100, layers: int = 3) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers' float Qwen2, the same weights fused with native layer ops)."""
    reference = _qwen2(intermediate, layers)
    model = copy.deepcopy(reference)
    fuse_qwen2(model)
    use_exact_attention(model)
    assert type(model) is FusedQwen2ForCausalLM and use_native_layers(model)
    return reference, model


def test_rope_split_is_transformers_rotary_embedding_bit_for_bit() -> None:
    T, hq, hkv, D = 5, 4, 2, 16
    torch.manual_seed(1)
    qkv = torch.randn(T, (hq + 2 * hkv) * D) * 4
    config = Qwen2Config(hidden_size=hq * D, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=D)
    cos, sin = qwen2.Qwen2RotaryEmbedding(config)(qkv, torch.arange(30, 30 + T)[None])
    q = qkv[:, : hq * D].view(1, T, hq, D).transpose(1, 2)
    k = qkv[:, hq * D : (hq + hkv) * D].view(1, T, hkv, D).transpose(1, 2)
    v = qkv[:, (hq + hkv) * D :].view(1, T, hkv, D).transpose(1, 2)
    q_ref, k_ref = qwen2.apply_rotary_pos_emb(q, k, cos, sin)
    out = [torch.empty(1, h, T, D) for h in (hq, hkv, hkv)]
    native.rope_split(qkv.data_ptr(), T, hq, hkv, D, cos[0].contiguous().data_ptr(), sin[0].contiguous().data_ptr(),
                      *(o.data_ptr() for o in out))
    for got, want in zip(out, (q_ref, k_ref, v), strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="bad shape"):
        native.rope_split(qkv.data_ptr(), T, 3, hkv, D, 0, 0, 0, 0, 0)  # 3 query heads for 2 kv heads


def test_rms_norm_matches_transformers_and_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(2)
    dim = 100  # not a multiple of the 8 partial sums: the tail is summed too
    norm = qwen2.Qwen2RMSNorm(dim, eps=1e-6)
    norm.weight.data = torch.randn(dim)
    x = torch.randn(9, dim) * 3
    x[4] = 0.0  # eps keeps it finite
    together = layer_ops._norm(native, norm, x)
    alone = torch.cat([layer_ops._norm(native, norm, x[i : i + 1]) for i in range(9)])
    assert torch.equal(together, alone)
    with torch.no_grad():
        assert torch.allclose(together, norm(x), rtol=1e-6, atol=1e-6)
    assert torch.equal(together[4], torch.zeros(dim))


def test_native_layers_follow_transformers_and_every_row_is_the_same_alone_or_batched() -> None:
    reference, model = _native_float_qwen2()
    prompt = [(7 * i + 3) % VOCAB for i in range(30)]
    engines = HFEngine(reference), HFEngine(model)
    sessions = [e.new_session() for e in engines]
    for tokens, parents in ((prompt, None), ([11], None), ([5, 6, 7, 8], [-1, 0, 0, 2]), ([9, 10], None)):
        if parents is None and tokens == [9, 10]:
            for e, s in zip(engines, sessions, strict=True):
                e.keep_path(s, 31, [0, 2, 3])
        want, got = (e.forward(s, tokens, parents) for e, s in zip(engines, sessions, strict=True))
        assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (tokens, float((got - want).abs().max()))
    # exact rows need row-wise linears too (float GEMMs round by shape): the int8 model
    int8 = quantize_int8(copy.deepcopy(reference))
    assert int8._native_layers
    engine = HFEngine(int8)
    with torch.inference_mode():
        whole = engine.logits_for_prefix(prompt)
        pieces = engine.new_session()
        parts = [engine.forward(pieces, prompt[:7]), engine.forward(pieces, prompt[7:8]), engine.forward(pieces, prompt[8:])]
    assert torch.equal(torch.cat(parts), whole)


@pytest.mark.parametrize("tree", [False, True])
def test_speculative_greedy_equals_plain_greedy_on_native_layers(tree) -> None:
    model = quantize_int8(copy.deepcopy(_qwen2(intermediate=128, layers=2)))
    assert model._native_layers
    assert_suffix_speculation_is_exact(HFEngine(model), tree)


def test_engine_forwards_skip_transformers_modules(monkeypatch) -> None:
    _, model = _native_float_qwen2(layers=2)

    def fail(*args, **kwargs):
        raise AssertionError("the engine forward went through transformers' modules")

    monkeypatch.setattr(qwen2.Qwen2Model, "forward", fail)
    monkeypatch.setattr(qwen2.Qwen2DecoderLayer, "forward", fail)
    monkeypatch.setattr(qwen2.Qwen2RMSNorm, "forward", fail)
    engine = HFEngine(model)
    session = engine.new_session()
    assert engine.forward(session, [3, 4, 5]).shape == (3, VOCAB)
    assert engine.forward(session, [6, 7], parents=[-1, -1]).shape == (2, VOCAB)


def test_other_calls_take_transformers_forward() -> None:
    reference, model = _native_float_qwen2(layers=2)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    with torch.inference_mode():
        batch = model(ids).logits  # two sequences: the fused layers' torch ops
        hidden = model(ids[:1], output_hidden_states=True)  # an output option: transformers' own forward
        want = reference(ids).logits
    assert hidden.hidden_states is not None and len(hidden.hidden_states) == 3
    assert torch.allclose(batch, want, atol=2e-4, rtol=1e-4)


def test_a_mask_of_the_wrong_shape_is_refused_by_name() -> None:
    _, model = _native_float_qwen2(layers=1)
    with pytest.raises(ValueError, match=r"attention mask is \(1, 1, 2, 5\), expected \(1, 1, 2, 2\)"):
        model(torch.tensor([[3, 4]]), attention_mask=torch.zeros(1, 1, 2, 5))


def test_without_the_extension_the_fused_model_keeps_transformers_numbers(monkeypatch) -> None:
    monkeypatch.setattr(layer_ops, "EXTENSION", LazyExtension.unavailable("_layer_native", "not built (test)"))
    assert not layer_ops.available()
    reference = _qwen2(layers=2)
    model = quantize_int8(copy.deepcopy(reference))
    assert type(model) is FusedQwen2ForCausalLM and not model._native_layers
    unfused = quantize_int8(copy.deepcopy(reference), fuse=False)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, unfused(ids).logits)
    with pytest.raises(ValueError, match=r"the native layer ops cannot run here: not built \(test\)"):
        layer_ops.rms_norm(model.model.norm, torch.randn(2, model.config.hidden_size))


def test_a_direct_call_makes_and_returns_a_cache_as_transformers_does() -> None:
    reference, model = _native_float_qwen2(layers=2)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.inference_mode():
        out = model(ids)  # use_cache from the config (True): a fresh cache comes back, filled
        cache = out[CACHE_NAME]
        step = model(torch.tensor([[7]]), past_key_values=cache, use_cache=True).logits
        want = reference(torch.tensor([[3, 4, 5, 6, 7]])).logits[:, -1:]
    assert cache.get_seq_length() == 5
    assert torch.allclose(step, want, atol=2e-4, rtol=1e-4)


def test_a_qkv_that_does_not_fit_the_heads_is_refused_before_native_code_reads_it() -> None:
    _, model = _native_float_qwen2(layers=1)
    attn = model.model.layers[0].self_attn
    attn.qkv_sizes = (attn.qkv_sizes[0] + attn.head_dim, *attn.qkv_sizes[1:])  # one query head more than it has
    with pytest.raises(ValueError, match=r"layer 0: q/k/v \(2, 128\) torch.float32 and rotary \(2, 16\) do not fit"):
        model(torch.tensor([[3, 4]]), use_cache=False)


def test_a_norm_weight_changed_after_enabling_falls_back_instead_of_misreading_it() -> None:
    """The native norm reads raw memory: a weight made non-contiguous (or cast, or moved) after
    `use_native_layers` must send the forward to torch's ops, not to a wrong read."""
    _, model = _native_float_qwen2(layers=2)
    weight = model.model.layers[1].post_attention_layernorm.weight
    spread = torch.zeros(2 * weight.numel())
    spread[::2] = weight.detach()
    model.model.layers[1].post_attention_layernorm.weight = torch.nn.Parameter(spread[::2], requires_grad=False)
    assert model._native_layers and not layer_ops.supports(model)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.inference_mode():
        got = model(ids, use_cache=False).logits
        want = qwen2.Qwen2ForCausalLM.forward(model, ids, use_cache=False).logits  # transformers' forward
    assert torch.equal(got, want)
    model.double()
    with torch.inference_mode():
        assert model(ids.clone(), use_cache=False).logits.dtype == torch.float64  # runs (was a ValueError)


def test_a_sequence_in_a_batch_gets_the_logits_it_gets_alone() -> None:
    model = quantize_int8(copy.deepcopy(_qwen2(layers=2)))
    assert model._native_layers
    ids = torch.tensor([[3, 4, 5, 6, 7], [9, 8, 7, 6, 5]])
    with torch.inference_mode():
        batch = model(ids, use_cache=False).logits
        alone = [model(ids[i : i + 1], use_cache=False).logits[0] for i in range(2)]
    assert torch.equal(batch[0], alone[0]) and torch.equal(batch[1], alone[1])


def test_output_options_in_the_config_take_transformers_forward() -> None:
    _, model = _native_float_qwen2(layers=2)
    model.config.output_hidden_states = True
    with torch.inference_mode():
        out = model(torch.tensor([[3, 4, 5]]))
    assert out.hidden_states is not None and len(out.hidden_states) == 3
