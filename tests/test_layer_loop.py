"""The native layer loop (thinkahead/models/engine/kernels/native/layer_loop.inc): a GGUF model's decoder layers in one native
call give the bits layer_ops.py's Python loop gives, for prefill, decode, chains and trees, batches, and two
threads at once; the cache is left as it was when a run fails; SiLU close to torch's; bad plans refused."""

from __future__ import annotations

import pytest
import torch

native = pytest.importorskip("thinkahead.models.engine.kernels._layer_native")
pytest.importorskip("thinkahead.models.engine.kernels._kquant_native")

from thinkahead.models.engine.weights import gguf_native
from thinkahead.models.engine.kernels import layer_ops
from thinkahead.models.engine.runner import HFEngine
from thinkahead.models.engine.kv_cache import GrowingCache

from tests.concurrency import run_at_once
from tests.test_gguf_native import tiny_config, write_tiny_gguf
from tests.tiny_models import VOCAB


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("loop-gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def engine(tiny_path):
    engine = HFEngine(gguf_native.build_model(tiny_path, tiny_config()))
    assert engine.model._native_layers
    return engine


def script(engine: HFEngine, prompt: list[int]) -> torch.Tensor:
    """Prefill, three decode steps, a verified chain and a tree: every row's logits."""
    session = engine.new_session()
    out = [engine.forward(session, prompt)]
    out += [engine.forward(session, [t]) for t in (5, 6, 7)]
    out.append(engine.forward(session, [8, 9, 10]))
    out.append(engine.forward(session, [11, 12, 4, 13], [-1, 0, 0, 1]))
    return torch.cat(out)


def python_loop(monkeypatch) -> None:
    monkeypatch.setattr(layer_ops, "_plan", lambda native, inner: None)


def test_the_native_loop_runs_and_gives_the_python_loops_bits(engine, monkeypatch) -> None:
    calls = []
    real = layer_ops._run_native
    monkeypatch.setattr(layer_ops, "_run_native", lambda *a: calls.append(1) or real(*a))
    prompt = [(7 * i + 3) % VOCAB for i in range(41)]
    ours = script(engine, prompt)
    assert len(calls) == 6  # every forward of the script took the native loop
    python_loop(monkeypatch)
    assert torch.equal(ours, script(engine, prompt))
    assert len(calls) == 6


def test_a_sequence_in_a_batch_gets_what_it_gets_alone(engine, monkeypatch) -> None:
    model = engine.model
    ids = torch.tensor([[(5 * i + s) % VOCAB for i in range(19)] for s in (1, 2)])
    with torch.no_grad():
        together = model(ids, cache=GrowingCache(), use_cache=True).logits
        alone = [model(ids[b:b + 1], cache=GrowingCache(), use_cache=True).logits for b in (0, 1)]
        python_loop(monkeypatch)
        slow = model(ids, cache=GrowingCache(), use_cache=True).logits
    assert torch.equal(together, torch.cat(alone)) and torch.equal(together, slow)


def test_two_threads_at_once_get_what_each_gets_alone(engine) -> None:
    prompts = [[(3 * i + s) % VOCAB for i in range(70)] for s in (1, 2)]
    alone = [script(engine, p) for p in prompts]

    def run(i: int) -> None:
        for _ in range(4):
            assert torch.equal(script(engine, prompts[i]), alone[i])

    run_at_once(lambda: run(0), lambda: run(1))


def test_a_failed_run_leaves_the_cache_as_it_was(engine, monkeypatch) -> None:
    session = engine.new_session()
    prompt = [(7 * i + 3) % VOCAB for i in range(20)]
    engine.forward(session, prompt)
    plan = layer_ops._plan(native, engine.model.model)

    class Failing:
        def run(self, *args):
            raise RuntimeError("boom")

    monkeypatch.setattr(layer_ops, "_plan", lambda native, inner: Failing())
    with pytest.raises(RuntimeError, match="boom"):
        engine.forward(session, [5, 6])
    monkeypatch.setattr(layer_ops, "_plan", lambda native, inner: plan)
    cache = session.cache
    assert cache.get_seq_length() == 20 and all(layer.keys.shape[-2] == 20 for layer in cache.layers)
    fresh = engine.new_session()
    engine.forward(fresh, prompt)
    assert torch.equal(engine.forward(session, [5, 6]), engine.forward(fresh, [5, 6]))


def test_a_cache_without_room_takes_the_python_loop_with_the_same_bits(engine) -> None:
    from transformers import DynamicCache

    model = engine.model
    ids = torch.tensor([[(5 * i + 1) % VOCAB for i in range(17)]])
    with torch.no_grad():
        theirs = model(ids, cache=DynamicCache(), use_cache=True).logits
        ours = model(ids, cache=GrowingCache(), use_cache=True).logits
    assert torch.equal(theirs, ours)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, width = gate_up.shape
    out = torch.empty(rows, width // 2)
    native.silu_mul(gate_up.contiguous().data_ptr(), rows, width // 2, out.data_ptr())
    return out


def test_silu_mul_is_close_to_torch_and_the_same_in_every_lane() -> None:
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(3, 37, generator=gen) * 6, torch.randn(3, 37, generator=gen)
    ours = silu_mul(torch.cat([gate, up], dim=1))
    torch.testing.assert_close(ours, torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-7)
    # one value at every position, the tail past the last full vector too: the same bits everywhere
    same = silu_mul(torch.cat([torch.full((1, 13), 1.7), torch.full((1, 13), -0.3)], dim=1))
    assert torch.equal(same, same[:, :1].expand(1, 13))
    gate = torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0, 90.0, -90.0]])
    odd = silu_mul(torch.cat([gate, torch.ones(1, 6)], dim=1))[0]
    assert torch.isnan(odd[0]) and odd[1] == float("inf") and torch.isnan(odd[2])  # torch: -inf / inf is NaN too
    assert odd[3] == 0.0 and odd[4] == 90.0 and -1e-30 < float(odd[5]) <= 0.0


def test_plans_and_calls_that_do_not_fit_are_refused_by_name(engine) -> None:
    model = engine.model
    H = model.config.hidden_size
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    norm, D = layer.input_layernorm.weight.data_ptr(), attn.head_dim
    linears = [x.kernel_args() for x in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]

    def spec(hkv=2, linears=linears):
        return (norm, 1e-6, norm, 1e-6, 4, hkv, D, 0.1, *linears)

    address = attn.qkv_proj.kernel_address()
    with pytest.raises(ValueError, match="address"):
        native.Layers(0, H, [spec()], norm, 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        native.Layers(address, H, [spec(hkv=1)], norm, 1e-6)  # 1 kv head: qkv is wider
    with pytest.raises(ValueError, match="lists of one length"):
        native.Layers(address, H, [spec(linears=[([], [], [], [], H), *linears[1:]])], norm, 1e-6)
    with pytest.raises(ValueError, match="reads 64 values, its input has"):
        native.Layers(address, H, [spec(linears=[linears[0], (*linears[1][:4], 64), *linears[2:]])], norm, 1e-6)
    plan = native.Layers(address, H, [spec()], norm, 1e-6)
    h, out = torch.zeros(4, H), torch.zeros(4, H)
    rope = torch.zeros(4, D)
    keys = torch.zeros(1, 2, 16, D)

    def run(hidden=H, rotary=D, capacity=16):
        plan.run(h.data_ptr(), 1, 4, hidden, rope.data_ptr(), rope.data_ptr(), rotary, 0, 0, 10, [keys.data_ptr()],
                 [keys.data_ptr()], [capacity], out.data_ptr(), 1)

    with pytest.raises(ValueError, match="rows of 32 values, the layers take"):
        run(hidden=32)
    with pytest.raises(ValueError, match="rotary rows of 32 values"):
        run(rotary=32)
    with pytest.raises(ValueError, match="room"):
        run(capacity=12)  # 10 held + 4 new


def test_a_replaced_linear_rebuilds_the_loop(tiny_path, monkeypatch) -> None:
    """The loop holds pointers into the linears it was built from: swapping one in makes it build anew, so the
    forward uses the new weights (and the Python loop's bits)."""
    model = gguf_native.build_model(tiny_path, tiny_config())
    mlp = model.model.layers[0].mlp
    prompt = [(7 * i + 3) % VOCAB for i in range(9)]
    engine = HFEngine(model)
    before = engine.forward(engine.new_session(), prompt)
    mlp.down_proj = model.model.layers[1].mlp.down_proj
    after = engine.forward(engine.new_session(), prompt)
    assert not torch.equal(before, after)
    python_loop(monkeypatch)
    assert torch.equal(after, engine.forward(engine.new_session(), prompt))


def test_a_cache_holding_float64_keys_continues_exactly(engine) -> None:
    """transformers' float64 attention leaves float64 K/V in the cache (float32 values, exactly): the next native
    forward copies them back to float32 instead of failing."""
    model = engine.model
    ids = torch.tensor([[(5 * i + 1) % VOCAB for i in range(10)]])
    with torch.no_grad():
        cache = GrowingCache()
        model(ids, cache=cache, use_cache=True)
        want = model(torch.tensor([[3, 4]]), cache=cache, use_cache=True).logits
        cache = GrowingCache()
        model(ids, cache=cache, use_cache=True)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys.double(), layer.values.double()
        got = model(torch.tensor([[3, 4]]), cache=cache, use_cache=True).logits
    assert torch.equal(got, want)


def test_a_cache_layer_that_cannot_make_room_changes_no_layer(engine) -> None:
    model = engine.model
    cache = GrowingCache()
    with torch.no_grad():
        model(torch.tensor([[(5 * i + 1) % VOCAB for i in range(6)]]), cache=cache, use_cache=True)
        cache.layers[1].keys = cache.layers[1].keys.half()  # a layer room cannot extend
        with pytest.raises(ValueError, match="float16"):
            model(torch.tensor([[3, 4]]), cache=cache, use_cache=True)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [6] * len(cache.layers)


def test_layers_of_different_lengths_are_refused_and_kept_as_they_were(engine) -> None:
    model = engine.model
    cache = GrowingCache()
    ids = torch.tensor([[(5 * i + 1) % VOCAB for i in range(12)]])
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        cache.layers[1].crop(-1)  # one layer a token short: the native loop would read a slot never written
        with pytest.raises(RuntimeError, match="expected 12"):
            model(torch.tensor([[3, 4]]), cache=cache, use_cache=True)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [12, 11] + [12] * (len(cache.layers) - 2)
