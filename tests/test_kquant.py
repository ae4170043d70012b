"""dtype "gguf": linears on a GGUF file's own blocks (thinkahead/models/engine/kernels/kquant.py, native/kquant_linear.cpp).

The kernel equals a float64 reference over the same quantized activations (gguf's own dequantizer
for the weights), for every block type it runs; each row's output is the same bits alone or among
others, on one thread or two, fused or in separate parts; a tiny Qwen2 written as a GGUF file gives
bit-identical logits decoded one token at a time or verified in one pass, and speculative greedy
equals plain greedy; the header reader agrees with gguf's and refuses truncated files.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from thinkahead.models.engine.kernels import kquant

pytestmark = pytest.mark.skipif(kquant.unavailable_reason() is not None, reason=str(kquant.unavailable_reason()))

TYPES = {"Q4_K": T.Q4_K, "Q6_K": T.Q6_K, "Q4_0": T.Q4_0, "Q5_0": T.Q5_0, "Q8_0": T.Q8_0}


def random_blocks(kind: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid blocks of `kind` for a [rows, cols] tensor: random values, block scales of a sane size."""
    rng = np.random.default_rng(seed)
    if kind in (T.Q4_0, T.Q5_0, T.Q8_0):
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, kind)
    values, nbytes = kquant.BLOCK_GEOMETRY[int(kind)]
    blocks = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    # block scales that keep weights below ~0.2, as in real files
    scales = (rng.random((rows, cols // values)) * 2e-4 + 5e-5).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    if kind == T.Q4_K:  # d, dmin first
        blocks[:, :, 0:2] = scales
        blocks[:, :, 2:4] = (rng.random((rows, cols // values)) * 1e-4).astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    else:  # Q6_K: d last
        blocks[:, :, 208:210] = scales
    return blocks.reshape(rows, -1)


@contextlib.contextmanager
def restored_kernel_settings(native):
    """The kernel's build and tile threshold as they were, whatever a test sets inside."""
    best, tile_from = native.isa(), native.tile_from()
    try:
        yield
    finally:
        native.set_isa(best)
        native.set_tile_from(tile_from)


def quant_tensor(name: str, kind: T, rows: int, cols: int, seed: int = 0) -> tuple[kquant.QuantTensor, np.ndarray]:
    blocks = random_blocks(kind, rows, cols, seed)
    return kquant.QuantTensor(name, int(kind), rows, cols, torch.from_numpy(blocks)), blocks


def quantized_rows(x: torch.Tensor, kind: T) -> torch.Tensor:
    """The activations as the kernel sees them (llama.cpp's Q8_K or Q8_0 rounding), in float64."""
    out = []
    for row in x.double():
        if kind in (T.Q4_K, T.Q6_K):
            blocks = row.reshape(-1, 256)
            peak = blocks.gather(1, blocks.abs().argmax(1, keepdim=True)).float()
            iscale = -127.0 / peak
            q = torch.clamp(torch.round(iscale * blocks.float()), max=127)
            out.append((q * (1 / iscale)).double().reshape(-1))
        else:
            blocks = row.float().reshape(-1, 32)
            d = blocks.abs().amax(1, keepdim=True) / 127
            q = torch.round(blocks * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
            out.append((q * d).double().reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("name", list(TYPES))
def test_the_kernel_equals_a_float64_reference_on_quantized_rows(name) -> None:
    kind = TYPES[name]
    cols = 512 if kind in (T.Q4_K, T.Q6_K) else 32 * 11  # Q5_0/Q8_0: a group of 8 blocks, then 3
    tensor, blocks = quant_tensor("w", kind, 70, cols)
    bias = torch.randn(70)
    layer = kquant.GGUFLinear([tensor], bias)
    x = torch.randn(5, cols)
    weight = torch.from_numpy(dequantize(blocks, kind)).double()
    reference = quantized_rows(x, kind) @ weight.T + bias.double()
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (5, 70)
    assert float((out.double() - reference).abs().max() / reference.abs().max()) < 1e-5


@pytest.mark.parametrize("name", list(TYPES))
def test_a_rows_output_never_depends_on_the_other_rows_or_the_threads(name) -> None:
    kind = TYPES[name]
    cols = 768 if kind in (T.Q4_K, T.Q6_K) else 32 * 13
    layer = kquant.GGUFLinear([quant_tensor("w", kind, 300, cols, seed=1)[0]])
    x = torch.randn(17, cols) * 3
    together = layer(x)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15):
                assert torch.equal(layer(x[:m]), together[:m]), (threads, m)
            for i in (0, 6, 16):
                assert torch.equal(layer(x[i:i + 1])[0], together[i]), (threads, i)
    finally:
        torch.set_num_threads(previous)


def test_fused_parts_give_each_parts_own_columns_and_bias() -> None:
    parts = [quant_tensor("q", T.Q4_K, 64, 256, 2)[0], quant_tensor("k", T.Q6_K, 32, 256, 3)[0],
             quant_tensor("v", T.Q4_K, 48, 256, 4)[0]]
    bias = torch.randn(144)
    fused = kquant.GGUFLinear(parts, bias)
    x = torch.randn(6, 256)
    separate = torch.cat([kquant.GGUFLinear([p], b)(x) for p, b in zip(parts, bias.split([64, 32, 48]), strict=True)], 1)
    assert torch.equal(fused(x), separate)
    assert "Q4_K+Q6_K+Q4_K" in repr(fused)


def test_a_nan_spoils_only_its_own_row() -> None:
    layer = kquant.GGUFLinear([quant_tensor("w", T.Q4_K, 40, 256)[0]])
    x = torch.randn(3, 256)
    clean = layer(x)
    x[1, 7] = float("nan")
    out = layer(x)
    assert torch.isnan(out[1]).all() and torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])


def test_bad_tensors_are_refused_by_name() -> None:
    blocks = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="blk.0.attn_q.weight: ggml type 3 is not one of"):
        kquant.QuantTensor("blk.0.attn_q.weight", 3, 4, 256, blocks)  # Q4_1
    with pytest.raises(ValueError, match="300 columns is not a multiple of its block size 256"):
        kquant.QuantTensor("w", int(T.Q4_K), 4, 300, blocks)
    with pytest.raises(ValueError, match="do not hold 4 x 512 values of Q4_K"):
        kquant.QuantTensor("w", int(T.Q4_K), 4, 512, blocks)
    with pytest.raises(ValueError, match="same number of columns"):
        kquant.GGUFLinear([kquant.QuantTensor("a", int(T.Q4_K), 4, 256, blocks),
                           kquant.QuantTensor("b", int(T.Q4_K), 2, 512, torch.zeros(2, 288, dtype=torch.uint8))])


def test_embedding_rows_are_dequantized_on_lookup() -> None:
    tensor, blocks = quant_tensor("token_embd.weight", T.Q4_K, 50, 256, 5)
    table = kquant.GGUFEmbedding(tensor)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    expected = torch.from_numpy(dequantize(blocks, T.Q4_K))[ids]
    assert torch.equal(table(ids), expected)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 50\)"):
        table(torch.tensor([[50]]))


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K])
def test_long_rows_in_spans_give_the_avx2_builds_bits(kind) -> None:
    """Rows of 21 super-blocks (past SPAN_FROM_BLOCKS): the 512-bit build meets 2-8 rows of x a span of 8 super-
    blocks at a time, in groups of 8 weight rows (20 rows: a partial group; 21 blocks: a partial span), and the rows
    left after a tile the same way; every output's bits are the AVX2 build's, row by row."""
    native = kquant.kernel()
    if "avx512vnni-zmm" not in native.isas():
        pytest.skip("spans run in the 512-bit build")
    layer = kquant.GGUFLinear([quant_tensor("w", kind, 20, 256 * 21, seed=11)[0]], torch.randn(20))
    x = torch.randn(21, 256 * 21) * 2
    outputs = {}
    with restored_kernel_settings(native):
        for isa in ("avx2", "avx512vnni-zmm"):
            native.set_isa(isa)
            native.set_tile_from(0)
            outputs[isa] = [layer(x[:m]) for m in range(1, 9)]
            native.set_tile_from(16)  # a tile of 16 rows, then 5 in a span (or row by row)
            outputs[isa].append(layer(x))
    for m, (a, b) in enumerate(zip(outputs["avx2"], outputs["avx512vnni-zmm"], strict=True)):
        assert torch.equal(a, b), m + 1
    assert torch.equal(outputs["avx2"][-1][:8], outputs["avx2"][7])  # rows are rows, whatever else is in the call


@pytest.mark.parametrize("name", list(TYPES))
def test_every_isa_build_gives_the_avx2_builds_bits(name) -> None:
    native = kquant.kernel()
    isas = native.isas()
    if len(isas) < 2:
        pytest.skip("this CPU runs the AVX2 build only")
    kind = TYPES[name]
    cols = 512 if kind in (T.Q4_K, T.Q6_K) else 32 * 11  # Q5_0/Q8_0: a group of 8 blocks, then 3
    layer = kquant.GGUFLinear([quant_tensor("w", kind, 200, cols, seed=7)[0]], torch.randn(200))
    x = torch.randn(28, cols) * 2
    outputs = {}
    with restored_kernel_settings(native):
        for isa in isas:
            native.set_isa(isa)
            native.set_tile_from(8)  # tiles from 8 rows: 9 (of 8 rows), 16, 21 and 28 (of 16 in 512-bit vectors;
            outputs[isa] = [layer(x[:m]) for m in (1, 2, 3, 4, 9, 16, 21, 28)]  # 28: a partial one)
            native.set_tile_from(0)  # row by row: passes of up to 4 or 8 rows, and the rest
            outputs[isa] += [layer(x[:m]) for m in (5, 6, 7, 8, 13, 21)]
    for isa in isas[1:]:
        for a, b in zip(outputs["avx2"], outputs[isa], strict=True):
            assert torch.equal(a, b), isa
    with pytest.raises(ValueError, match="avx2, avxvnni, avx512vnni, avx512vnni-zmm or avx512vnni-amx"):
        native.set_isa("sse")
    # the best build by default: AMX's tiles where the CPU has them, else the 512-bit products where they were
    # measured to pay
    vector_builds = [i for i in isas if i not in ("avx512vnni-zmm", "avx512vnni-amx")]
    expected = ("avx512vnni-amx" if "avx512vnni-amx" in isas
                else "avx512vnni-zmm" if native.zmm_pays() else vector_builds[-1])
    assert native.isa() == expected


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q6_K])
def test_amx_tiles_give_the_vector_tiles_bits(kind) -> None:
    """AMX multiplies Q4_K's tiles from 24 rows of x (Q6_K stays on the vector tiles): tiles in pairs and one alone
    (40 rows: three tiles), passes of fewer weight rows (a chunk's last: 40 rows in chunks of 16), long rows (the
    next pass's weights asked for while the first tile multiplies) and both threads' scratch give every output
    the bits of the 512-bit vector tiles."""
    native = kquant.kernel()
    if "avx512vnni-amx" not in native.isas():
        pytest.skip("this CPU (or its kernel) has no AMX")
    layer = kquant.GGUFLinear([quant_tensor("w", kind, 40, 256 * 9, seed=5)[0],
                               quant_tensor("v", kind, 24, 256 * 9, seed=6)[0]], torch.randn(64))
    x = torch.randn(56, 256 * 9) * 3
    sizes = (1, 16, 24, 33, 40, 56)
    outputs = {}
    with restored_kernel_settings(native):
        for isa in ("avx512vnni-zmm", "avx512vnni-amx"):
            native.set_isa(isa)
            native.set_tile_from(1)
            outputs[isa] = [layer(x[:m]) for m in sizes]
    for m, a, b in zip(sizes, outputs["avx512vnni-zmm"], outputs["avx512vnni-amx"], strict=True):
        assert torch.equal(a, b), m
    assert torch.equal(outputs["avx512vnni-amx"][-1][:24], outputs["avx512vnni-amx"][2])


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0"])
def test_rows_too_small_to_scale_count_as_zeros(name) -> None:
    kind = TYPES[name]
    cols = 256
    bias = torch.randn(16)
    layer = kquant.GGUFLinear([quant_tensor("w", kind, 16, cols)[0]], bias)
    x = torch.full((2, cols), 1e-38)
    x[1] = 0.0
    out = layer(x)
    assert torch.equal(out[0], bias) and torch.equal(out[1], bias)


def test_the_kernel_refuses_what_it_cannot_run_without_aborting() -> None:
    native = kquant.kernel()
    x, w, out = torch.randn(1, 64), torch.zeros(64, 40, dtype=torch.uint8), torch.empty(1, 64)
    with pytest.raises(ValueError, match="unsupported ggml type 7"):  # was a std::terminate in a worker thread
        native.linear(x.data_ptr(), 1, 64, [7], [w.data_ptr()], [64], [0], out.data_ptr(), 2)
    layer = kquant.GGUFLinear([quant_tensor("w", T.Q8_0, 8, 64)[0]])
    with pytest.raises(ValueError, match="runs on the CPU; the input is on meta"):
        layer(torch.empty(1, 64, device="meta"))


@pytest.mark.parametrize("name", list(TYPES))
def test_the_kernel_layout_is_a_rewrite_of_the_same_bytes_in_place_or_as_a_copy(name) -> None:
    kind = TYPES[name]
    tensor, blocks = quant_tensor("w", kind, 12, 512 if kind in (T.Q4_K, T.Q6_K) else 32 * 11, seed=3)
    original = blocks.copy()
    copy = kquant.kernel_layout(tensor)
    assert copy.layout == kquant.KERNEL_LAYOUT and kquant.kernel_layout(copy) is copy
    assert np.array_equal(tensor.blocks.numpy(), original)  # the file's blocks are left alone
    rewritten = kquant.kernel_layout(tensor, in_place=True)
    assert rewritten.blocks.data_ptr() == tensor.blocks.data_ptr() and torch.equal(rewritten.blocks, copy.blocks)
    if kind in (T.Q4_K, T.Q6_K):  # the codes move; the scales (d, dmin) stay where they were
        size, header = (144, slice(0, 4)) if kind == T.Q4_K else (210, slice(208, 210))
        assert not np.array_equal(copy.blocks.numpy(), original)
        assert np.array_equal(copy.blocks.numpy().reshape(-1, size)[:, header], original.reshape(-1, size)[:, header])
    else:  # each row's blocks in groups of 8 (here 8, then 3): the group's scales, high bits, codes
        size = {T.Q4_0: 18, T.Q5_0: 22}.get(kind, 34)
        rows = original.reshape(12, 11, size)
        expected = []
        for group in (rows[:, :8], rows[:, 8:]):
            parts = [group[:, :, :2], group[:, :, 2:6], group[:, :, 6:]] if kind == T.Q5_0 else [group[:, :, :2], group[:, :, 2:]]
            expected += [p.reshape(12, -1) for p in parts]
        assert np.array_equal(copy.blocks.numpy(), np.concatenate(expected, axis=1))
    with pytest.raises(ValueError, match="file's layout, not the kernel's"):
        kquant.GGUFEmbedding(copy)
    with pytest.raises(ValueError, match="layout must be"):
        kquant.QuantTensor("w", int(kind), tensor.rows, tensor.cols, tensor.blocks, "transposed")


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_tiles_of_eight_rows_give_the_row_by_row_bits(name) -> None:
    native = kquant.kernel()
    if native.isa() == "avx2":
        pytest.skip("tiles run where the CPU has AVX-VNNI or AVX-512 VNNI")
    kind = TYPES[name]
    layer = kquant.GGUFLinear([quant_tensor("a", kind, 37, 768, seed=1)[0], quant_tensor("b", T.Q4_K, 20, 768, seed=2)[0]],
                              torch.randn(57))
    x = torch.randn(29, 768) * 3
    x[5] = 0.0
    x[9, :256] = 1e-39  # a block too small to scale
    x[13, 300] = float("nan")
    default, threads_before = native.tile_from(), torch.get_num_threads()
    try:
        native.set_tile_from(0)
        rows = [layer(x[:m]) for m in range(1, 30)]
        native.set_tile_from(8)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            tiled = [layer(x[:m]) for m in range(1, 30)]
            for a, b in zip(rows, tiled, strict=True):
                assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        alone = torch.cat([layer(x[m:m + 1]) for m in range(29)])
        assert torch.equal(alone.nan_to_num(7.0), tiled[-1].nan_to_num(7.0))
        assert tiled[-1][13].isnan().all() and not tiled[-1][12].isnan().any()
        with pytest.raises(ValueError, match="rows >= 0"):
            native.set_tile_from(-2)
    finally:
        native.set_tile_from(default)
        torch.set_num_threads(threads_before)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_embedding_rows_are_gguf_pys_dequantized_bits(name, monkeypatch) -> None:
    """The native row lookup (kquant_rows.inc) gives gguf-py's dequantize bit for bit (block scales that are
    subnormal, infinite or NaN too), for any ids, and refuses ids outside the table by name."""
    import gguf.quants
    from gguf.quants import dequantize

    from thinkahead.models.engine.kernels.kquant import GGUFEmbedding, QuantTensor

    kind = TYPES[name]
    cols = 512
    blocks = random_blocks(kind, 40, cols, seed=3).reshape(40, cols // kquant.BLOCK_GEOMETRY[int(kind)][0], -1)
    at = blocks.shape[-1] - 2 if kind == T.Q6_K else 0  # where a block's fp16 scale d sits
    for row, value in ((0, 3e-7), (7, np.inf), (12, -np.inf), (39, np.nan)):
        blocks[row, 1, at:at + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    blocks = blocks.reshape(40, -1)
    table = torch.from_numpy(blocks.copy())
    embedding = GGUFEmbedding(QuantTensor("token_embd.weight", int(kind), 40, cols, table))
    ids = torch.tensor([[0, 39, 7, 7], [12, 3, 38, 1]])
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in the infinite-scale blocks: NaN, as intended
        expected = dequantize(blocks[ids.reshape(-1).numpy()], kind).reshape(2, 4, cols)
    monkeypatch.setattr(gguf.quants, "dequantize", None)  # the native path runs, never numpy's
    got = embedding(ids)
    assert got.shape == (2, 4, cols) and np.array_equal(got.numpy().view(np.uint32), expected.astype(np.float32).view(np.uint32))
    with pytest.raises(ValueError, match="token ids"):
        embedding(torch.tensor([40]))
    with pytest.raises(ValueError, match="integers on the CPU"):
        embedding(torch.tensor([1.7]))  # not truncated to row 1
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:  # float32 rows whatever the default dtype (float32 bits were read as float64 ones)
        again = embedding(ids)
        assert again.dtype == torch.float32 and torch.equal(again.view(torch.int32), got.view(torch.int32))
    finally:
        torch.set_default_dtype(previous)
