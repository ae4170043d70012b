"""Fused q/k/v and gate/up int8 linears (thinkahead/models/engine/qwen2/fused_qwen2.py): the same bits, fewer calls.

Per-channel weight scales and per-row activation scales make a fused layer's output columns the
separate layers' outputs exactly: logits of fused and unfused int8 Qwen2 models are bit-identical,
chain and tree; speculative greedy still equals plain greedy; the weight cache stores the fused
layers, so a warm start packs each fused layer once and converts nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from thinkahead.models.engine.kernels import quantize
from thinkahead.models.engine.weights import load as weights
from thinkahead.models.engine.qwen2.fused_qwen2 import (FusedQwen2Attention, FusedQwen2ForCausalLM, FusedQwen2MLP, fuse_qwen2,
                                            use_native_layers)
from thinkahead.models.engine.kernels.quantize import RowwiseInt8Linear, quantize_int8, unpack_int8
from thinkahead.models.engine.runner import HFEngine

from tests.test_speculative_decoding import assert_suffix_speculation_is_exact
from tests.tiny_models import VOCAB


def _qwen2(intermediate: int = 96, layers: int = 3, seed: int = 0) -> Qwen2ForCausalLM:
    """A tiny random Qwen2 (GQA 4:2, head_dim 16); an intermediate size that is no multiple of 16
    puts the activation's vector/scalar tail inside a row."""
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=intermediate, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_hidden_layers=layers, max_position_embeddings=512,
                         initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def _pair(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    return quantize_int8(copy.deepcopy(model), fuse=False), quantize_int8(copy.deepcopy(model), fuse=True)


def test_qwen2_layers_are_fused_and_their_int8_weights_are_the_separate_ones() -> None:
    unfused, fused = _pair(_qwen2())
    for plain, joined in zip(unfused.model.layers, fused.model.layers, strict=True):
        assert type(joined.self_attn) is FusedQwen2Attention and type(joined.mlp) is FusedQwen2MLP
        assert not hasattr(joined.self_attn, "q_proj") and not hasattr(joined.mlp, "gate_proj")
        for fused_linear, parts in ((joined.self_attn.qkv_proj, [plain.self_attn.q_proj, plain.self_attn.k_proj,
                                                                 plain.self_attn.v_proj]),
                                    (joined.mlp.gate_up_proj, [plain.mlp.gate_proj, plain.mlp.up_proj])):
            assert isinstance(fused_linear, RowwiseInt8Linear)
            weight, scales = unpack_int8(fused_linear._packed)
            separate = [unpack_int8(p._packed) for p in parts]
            assert torch.equal(weight, torch.cat([w for w, _ in separate]))
            assert torch.equal(scales, torch.cat([s for _, s in separate]))
            if parts[0].bias is not None:
                assert torch.equal(fused_linear.bias, torch.cat([p.bias for p in parts]))


@pytest.mark.parametrize("intermediate", [96, 100])
def test_fused_logits_are_bit_identical_chain_and_tree(intermediate) -> None:
    unfused, fused = _pair(_qwen2(intermediate))
    # fusion alone (the native layer ops change the norm's rounding: tests/test_layer_ops.py); the fused
    # model's own forward still runs, the same ops as transformers'
    assert type(fused) is FusedQwen2ForCausalLM and use_native_layers(fused, False) is False
    engines = [HFEngine(unfused), HFEngine(fused)]
    sessions = [engine.new_session() for engine in engines]
    prompt = [(7 * i + 3) % VOCAB for i in range(37)]
    steps: list[tuple[list[int], list[int] | None]] = [
        (prompt, None),  # prefill: many rows
        ([11], None), ([12], None),  # decode steps: one row
        ([5, 6, 7, 8, 9], [-1, 0, 0, 2, 1]),  # a tree of drafts
    ]
    # rows of 100: torch's SiLU gives a strided fused gate's row tails (scalar loop) other bits than the contiguous
    # gate's (vector loop), seen an ulp apart on an AMD EPYC, which can move a row's int8 scale: close, not equal
    def same(a: torch.Tensor, b: torch.Tensor, what) -> None:
        if intermediate % 32 == 0:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")

    for tokens, parents in steps:
        unfused_logits, fused_logits = (e.forward(s, tokens, parents) for e, s in zip(engines, sessions, strict=True))
        same(unfused_logits, fused_logits, (tokens, parents))
    engines[0].keep_path(sessions[0], 39, [0, 2, 3])
    engines[1].keep_path(sessions[1], 39, [0, 2, 3])
    after = [e.forward(s, [13, 14]) for e, s in zip(engines, sessions, strict=True)]
    same(after[0], after[1], "after keep_path")


@pytest.mark.parametrize("tree", [False, True])
def test_fused_speculative_greedy_equals_plain_greedy(tree) -> None:
    model = quantize_int8(copy.deepcopy(_qwen2(intermediate=128, layers=2)))
    assert any(isinstance(m, FusedQwen2MLP) for m in model.modules())
    engine = HFEngine(model)
    assert_suffix_speculation_is_exact(engine, tree)


def test_other_architectures_and_subclasses_are_not_fused(tiny_model_factory) -> None:
    llama = quantize_int8(copy.deepcopy(tiny_model_factory("llama")))
    assert hasattr(llama.model.layers[0].self_attn, "q_proj")
    assert fuse_qwen2(copy.deepcopy(tiny_model_factory("llama"))) == 0
    model = _qwen2(layers=1)
    attention = model.model.layers[0].self_attn
    attention.__class__ = type("Custom", (type(attention),), {})  # its own forward may use q_proj
    assert fuse_qwen2(model) == 1  # the MLP only
    assert hasattr(attention, "q_proj")


def test_fusion_works_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = Qwen2ForCausalLM(_qwen2(layers=2).config)
    assert fuse_qwen2(model) == 4
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.device.type == "meta" and tuple(qkv.weight.shape) == (64 + 32 + 32, 64)
    assert model.model.layers[1].self_attn.qkv_sizes == (64, 32, 32)


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    path = tmp_path_factory.mktemp("tiny-qwen2")
    _qwen2(intermediate=100).save_pretrained(path)
    fast.save_pretrained(path)
    return path


def test_weight_cache_stores_the_fused_layers(tiny_qwen2_dir, tmp_path, monkeypatch) -> None:
    spec = str(tiny_qwen2_dir)
    fresh, _ = weights.load_causal_lm(spec, "int8", cache_dir=tmp_path, weight_cache=False)
    weights.load_causal_lm(spec, "int8", cache_dir=tmp_path, weight_cache=True)  # converts and stores
    packs: list[tuple[int, int]] = []
    real_pack = quantize.pack_int8

    def counting_pack(qweight, scales):
        packs.append(tuple(qweight.shape))
        return real_pack(qweight, scales)

    monkeypatch.setattr(quantize, "pack_int8", counting_pack)
    monkeypatch.setattr(weights, "_convert", lambda *a, **k: pytest.fail("converted despite the cache"))
    cached, _ = weights.load_causal_lm(spec, "int8", cache_dir=tmp_path, weight_cache=True)
    assert [type(m) for m in cached.modules()] == [type(m) for m in fresh.modules()]
    assert type(cached.model.layers[0].self_attn) is FusedQwen2Attention
    linears = [tuple(unpack_int8(m._packed)[0].shape) for m in cached.modules() if isinstance(m, RowwiseInt8Linear)]
    packs.remove((2, 2))  # the rebuild's check of RowwiseInt8Linear's layout packs one 2x2 probe
    assert sorted(packs) == sorted(linears) and len(linears) == 3 * 4 + 1  # qkv, o, gate_up, down; lm_head
    ids = torch.tensor([[1, 5, 9, 20, 33, 7, 101, 3]])
    with torch.inference_mode():
        assert torch.equal(cached(ids).logits, fresh(ids).logits)
