"""`GrowingCache` (thinkahead/models/engine/kv_cache.py): appends in place, the same logits as `DynamicCache`.

Prefill, decode steps, a tree forward, keep_path, truncation and appends after a crop give
bit-identical logits with either cache, for a float model, for the int8 model on the native layers
(float32 K/V) and on transformers' ops (whose float64 attention keeps float64 K/V); a buffer is reused
while it has room and never shared.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from thinkahead.models.engine.qwen2.fused_qwen2 import use_native_layers
from thinkahead.models.engine.kernels.quantize import quantize_int8
from thinkahead.models.engine.runner import EngineSession, HFEngine
from thinkahead.models.engine.kv_cache import MIN_CAPACITY, GrowingCache, GrowingLayer

from tests.test_int8_fusion import _qwen2
from tests.tiny_models import VOCAB


def _script(engine: HFEngine, session: EngineSession) -> list[torch.Tensor]:
    prompt = [(5 * i + 1) % VOCAB for i in range(70)]  # past MIN_CAPACITY: the buffer grows once
    out = [engine.forward(session, prompt)]
    out += [engine.forward(session, [t]) for t in (9, 10, 11)]
    out.append(engine.forward(session, [4, 5, 6, 7], [-1, 0, 0, 2]))
    engine.keep_path(session, 73, [0, 2, 3])
    out.append(engine.forward(session, [12, 13]))
    engine.truncate(session, 60)
    out += [engine.forward(session, [14, 15, 16]), engine.forward(session, [17])]
    return out


@pytest.mark.parametrize("kind", ["float32", "int8", "int8-transformers"])
def test_logits_are_bit_identical_to_dynamic_cache(kind) -> None:
    model = _qwen2(intermediate=96, layers=2)
    if kind.startswith("int8"):
        model = quantize_int8(copy.deepcopy(model))
        assert use_native_layers(model, kind == "int8") == (kind == "int8")
    engine = HFEngine(model)
    growing = engine.new_session()
    assert isinstance(growing.cache, GrowingCache)
    plain = EngineSession(cache=DynamicCache())
    for ours, theirs in zip(_script(engine, growing), _script(engine, plain), strict=True):
        assert torch.equal(ours, theirs)
    layer = growing.cache.layers[0]
    assert isinstance(layer, GrowingLayer) and layer.keys.shape[-2] == 64
    # transformers' float64 attention: the cache holds float64 K/V, converted once per token
    assert layer.keys.dtype == (torch.float64 if kind == "int8-transformers" else torch.float32)


def test_appends_reuse_the_buffer_and_a_crop_is_overwritten() -> None:
    layer = GrowingLayer()
    k = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(1, 2, 3, 4)
    keys, _ = layer.update(k, k + 100)
    buffer = layer._key_buffer
    assert buffer.shape[-2] == MIN_CAPACITY and torch.equal(keys, k)
    layer.crop(-1)
    step = torch.full((1, 2, 1, 4), -1.0)
    keys, values = layer.update(step, step)
    assert layer._key_buffer is buffer  # no copy of what was there
    assert torch.equal(keys, torch.cat([k[..., :2, :], step], -2)) and torch.equal(values[..., 2:, :], step)
    kept = torch.tensor([0, 2])  # someone replaced the tensors
    layer.keys, layer.values = layer.keys.index_select(-2, kept), layer.values.index_select(-2, kept)
    keys, _ = layer.update(step, step)
    assert layer._key_buffer is not buffer and torch.equal(keys[..., 1:, :], torch.cat([step, step], -2))
    many = torch.zeros(1, 2, MIN_CAPACITY * 2, 4)
    keys, _ = layer.update(many, many)
    assert keys.shape[-2] == 3 + 2 * MIN_CAPACITY <= layer._key_buffer.shape[-2]


def test_sessions_never_share_a_buffer() -> None:
    engine = HFEngine(_qwen2(layers=1))
    first, second = engine.new_session(), engine.new_session()
    engine.forward(first, [3, 4, 5])
    engine.forward(second, [3, 4, 5])
    assert first.cache.layers[0]._key_buffer.data_ptr() != second.cache.layers[0]._key_buffer.data_ptr()


def test_a_cache_filled_under_inference_mode_still_appends_outside_it() -> None:
    layer = GrowingLayer()
    k = torch.ones(1, 2, 3, 4)
    with torch.inference_mode():
        layer.update(k, k)
    with torch.no_grad():
        keys, _ = layer.update(2 * k, 2 * k)
    assert keys.shape[-2] == 6 and torch.equal(keys[..., 3:, :], 2 * k)


def test_float64_kv_only_in_a_cache_that_appends_in_place() -> None:
    """transformers' own DynamicCache (model.generate) keeps the model's float32 K/V: widening them there
    would double every step's concatenation copies."""
    model = quantize_int8(copy.deepcopy(_qwen2(intermediate=96, layers=1)))
    use_native_layers(model, False)  # the native layers keep float32 K/V in every cache
    ids = torch.tensor([[3, 4, 5, 6]])
    plain, growing = DynamicCache(), GrowingCache()
    with torch.inference_mode():
        a = model(ids, past_key_values=plain, use_cache=True).logits
        b = model(ids, past_key_values=growing, use_cache=True).logits
    assert plain.layers[0].keys.dtype == torch.float32 and growing.layers[0].keys.dtype == torch.float64
    assert torch.equal(a, b)


def test_a_long_sequence_cut_short_gives_its_room_back() -> None:
    layer = GrowingLayer()
    long = torch.randn(1, 2, 4000, 8, dtype=torch.float64)
    layer.update(long, long)
    assert layer._key_buffer.shape[-2] == 6000  # 1.5x, not 2x
    layer.crop(-3900)
    assert layer._key_buffer.shape[-2] == 150 and torch.equal(layer.keys, long[..., :100, :])
    step = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    keys, _ = layer.update(step, step)
    assert torch.equal(keys, torch.cat([long[..., :100, :], step], -2))
