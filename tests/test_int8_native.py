"""The native AVX2 int8 linear (thinkahead/models/engine/kernels/int8_kernel.py): fbgemm's float32 outputs bit for bit.

`RowwiseInt8Linear` runs either kernel; these tests build both from the same float weights and
require equal bits on shapes the kernel's blocking does not divide (K not a multiple of 4 or 32,
N not a multiple of 32), rows computed alone equal to the same rows among up to 64 others, the same
bits with 1 and 2 threads and with either thread source, the fbgemm fallback, and speculative greedy
equal to plain greedy on a tiny int8 model running the native kernel.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from tests.test_speculative_decoding import repetitive_prompt
from thinkahead.models.engine.kernels import int8_kernel
from thinkahead.models.engine.kernels.native_extension import LazyExtension
from thinkahead.models.engine.kernels.quantize import (
    X_SCALE,
    X_ZERO_POINT,
    RowwiseInt8Linear,
    quantize_int8,
    unpack_int8,
)

pytestmark = pytest.mark.skipif(not int8_kernel.native_available(), reason="native int8 kernel not built here")


def _layers(linear: torch.nn.Linear, monkeypatch: pytest.MonkeyPatch) -> tuple[RowwiseInt8Linear, RowwiseInt8Linear]:
    monkeypatch.setenv(int8_kernel.ENV_KERNEL, "fbgemm")
    fbgemm = RowwiseInt8Linear(linear)
    monkeypatch.setenv(int8_kernel.ENV_KERNEL, "native")
    native = RowwiseInt8Linear(linear)
    assert not isinstance(fbgemm._packed, int8_kernel.Int8Weights)
    assert isinstance(native._packed, int8_kernel.Int8Weights)
    return fbgemm, native


def _inputs(rows: int, features: int) -> torch.Tensor:
    x = torch.randn(rows, features)
    x[0] *= 300.0  # an outlier row
    if rows > 3:
        x[1] = 0.0  # an all-zero row
        x[2, features // 2] = 40.0  # one outlier feature
        x[3] = x[3].abs()  # no negative value: the scaled row spans [0, 1]
    return x


@pytest.mark.parametrize(("in_features", "out_features", "bias"), [
    (96, 200, True), (37, 13, False), (1, 1, True), (130, 33, True), (256, 64, False), (1536, 96, True),
])
def test_native_outputs_equal_fbgemms_bit_for_bit(in_features, out_features, bias, monkeypatch) -> None:
    torch.manual_seed(in_features + out_features)
    fbgemm, native = _layers(torch.nn.Linear(in_features, out_features, bias=bias), monkeypatch)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 7, 9, 17):
            x = _inputs(rows, in_features)
            assert torch.equal(native(x), fbgemm(x)), rows
        x = torch.randn(2, 5, in_features)  # [batch, tokens, features] as models feed it
        assert native(x).shape == (2, 5, out_features)
        assert torch.equal(native(x), fbgemm(x))


def test_activations_on_rounding_ties_round_as_fbgemm(monkeypatch) -> None:
    """Scaled values near (2n + 1) / 127 round fma(x, 63.5, 64) onto halves: both must break ties alike."""
    torch.manual_seed(1)
    fbgemm, native = _layers(torch.nn.Linear(128, 40), monkeypatch)
    grid = torch.arange(-127, 128, dtype=torch.float32) / 127  # every tie and integer of the 7-bit grid
    x = torch.stack([grid[:128], grid[127:], grid[::2][:128]])
    x[:, 0] = 1.0  # row max exactly 1: the values above are the scaled values
    with torch.inference_mode():
        assert torch.equal(native(x), fbgemm(x))


def test_rows_alone_equal_rows_among_up_to_64(monkeypatch) -> None:
    torch.manual_seed(2)
    _, native = _layers(torch.nn.Linear(100, 70), monkeypatch)
    x = _inputs(64, 100)
    with torch.inference_mode():
        alone = torch.cat([native(x[i : i + 1]) for i in range(64)])
        for rows in range(1, 65):
            assert torch.equal(native(x[:rows]), alone[:rows]), rows


def test_same_bits_with_any_thread_count_and_thread_source(monkeypatch) -> None:
    torch.manual_seed(3)
    _, native = _layers(torch.nn.Linear(300, 2000), monkeypatch)  # enough output blocks for several chunks
    x = _inputs(11, 300)
    module = int8_kernel.EXTENSION.load()
    threads = torch.get_num_threads()
    outputs = []
    try:
        with torch.inference_mode():
            for mode in ("openmp", "pool"):
                module.set_threading(mode)
                for n in (1, 2, 3):
                    torch.set_num_threads(n)
                    outputs.append(native(x))
    finally:
        module.set_threading("openmp")
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outputs[0]) for out in outputs)


def test_pack_round_trips_and_refuses_what_it_cannot_compute() -> None:
    torch.manual_seed(4)
    qweight = torch.randint(-127, 128, (45, 67), dtype=torch.int8)
    scales = torch.rand(45, dtype=torch.float64) + 0.01
    weights = int8_kernel.pack(qweight, scales, X_SCALE, X_ZERO_POINT)
    assert weights.packed.shape == (2, 17, 32, 4)  # N 45 -> 64, K 67 -> 68
    back, back_scales = int8_kernel.unpack(weights)
    assert torch.equal(back, qweight) and torch.equal(back_scales, scales)
    assert torch.equal(weights.zp_colsum[:45], qweight.sum(1, dtype=torch.int32) * 64)
    with pytest.raises(ValueError, match="-127, 127"):
        int8_kernel.pack(torch.full((2, 3), -128, dtype=torch.int8), scales[:2], X_SCALE, X_ZERO_POINT)
    with pytest.raises(ValueError, match="int8"):
        int8_kernel.pack(qweight.float(), scales, X_SCALE, X_ZERO_POINT)
    with pytest.raises(ValueError, match="zero point"):
        int8_kernel.pack(qweight, scales, X_SCALE, 0)
    with pytest.raises(ValueError, match="rows must be float32"):
        int8_kernel.linear(torch.randn(2, 66), weights, None, X_SCALE)


def test_unpack_int8_gives_the_same_weights_from_either_kernel(monkeypatch) -> None:
    torch.manual_seed(5)
    fbgemm, native = _layers(torch.nn.Linear(70, 50), monkeypatch)
    (qf, sf), (qn, sn) = unpack_int8(fbgemm._packed), unpack_int8(native._packed)
    assert torch.equal(qf, qn) and torch.equal(sf, sn)


def test_fbgemm_is_chosen_by_the_environment_and_when_native_cannot_run(monkeypatch, caplog) -> None:
    linear = torch.nn.Linear(20, 10)
    monkeypatch.setenv(int8_kernel.ENV_KERNEL, "fbgemm")
    assert int8_kernel.kernel_choice() == int8_kernel.FBGEMM
    assert not isinstance(RowwiseInt8Linear(linear)._packed, int8_kernel.Int8Weights)
    monkeypatch.setenv(int8_kernel.ENV_KERNEL, "cuda")
    with pytest.raises(ValueError, match="THINKAHEAD_INT8_KERNEL"):
        int8_kernel.kernel_choice()
    # an unbuilt extension or a CPU without AVX2: native is asked for, fbgemm runs, one warning
    monkeypatch.setenv(int8_kernel.ENV_KERNEL, "native")
    monkeypatch.setattr(int8_kernel, "EXTENSION", LazyExtension.unavailable("_int8_native", "this CPU lacks AVX2/FMA"))
    monkeypatch.setattr(int8_kernel, "_warned", False)
    with caplog.at_level(logging.WARNING, logger=int8_kernel.__name__):
        assert int8_kernel.kernel_choice() == int8_kernel.FBGEMM
        layer = RowwiseInt8Linear(linear)
        assert int8_kernel.kernel_choice() == int8_kernel.FBGEMM
    assert not isinstance(layer._packed, int8_kernel.Int8Weights)
    assert [r.getMessage() for r in caplog.records] == [
        "the native int8 kernel cannot run (this CPU lacks AVX2/FMA): int8 linears use fbgemm"]
    monkeypatch.delenv(int8_kernel.ENV_KERNEL)  # the default falls back alike, without a second warning
    assert int8_kernel.kernel_choice() == int8_kernel.FBGEMM and len(caplog.records) == 1


def test_native_is_the_default_where_it_runs(monkeypatch) -> None:
    monkeypatch.delenv(int8_kernel.ENV_KERNEL, raising=False)
    assert int8_kernel.DEFAULT_KERNEL == int8_kernel.NATIVE
    assert isinstance(RowwiseInt8Linear(torch.nn.Linear(8, 4))._packed, int8_kernel.Int8Weights)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_speculative_greedy_equals_plain_greedy_on_the_native_kernel(arch, tiny_model_factory, monkeypatch) -> None:
    from thinkahead.models.engine.runner import HFEngine
    from thinkahead.token_spec.controller import FixedController
    from thinkahead.token_spec.decoder import SpeculativeDecoder, plain_greedy
    from thinkahead.token_spec.drafters import SuffixDrafter
    from thinkahead.token_spec.suffix_cache import SuffixCache

    monkeypatch.setenv(int8_kernel.ENV_KERNEL, "fbgemm")
    fbgemm_engine = HFEngine(quantize_int8(copy.deepcopy(tiny_model_factory(arch))))
    monkeypatch.setenv(int8_kernel.ENV_KERNEL, "native")
    model = quantize_int8(copy.deepcopy(tiny_model_factory(arch)))
    assert all(isinstance(m._packed, int8_kernel.Int8Weights) for m in model.modules()
               if isinstance(m, RowwiseInt8Linear))
    engine = HFEngine(model)
    decoder = SpeculativeDecoder(engine, SuffixDrafter(SuffixCache(max_depth=24)), FixedController(6))
    accepted = 0
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        reference = plain_greedy(engine, prompt, 40)
        assert plain_greedy(fbgemm_engine, prompt, 40) == reference  # the kernels agree token for token
        for _ in range(2):
            result = decoder.generate(prompt, max_new_tokens=40, stop_token_ids=[])
            assert result.token_ids == reference
            accepted += result.stats.spec_num_correct_drafts
    assert accepted > 0
