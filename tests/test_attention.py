"""The native float32 attention (thinkahead/models/engine/kernels/native/attention.inc) called directly: close to float64
attention, every row's bits independent of the call's shape and of where its keys sit between the ones it
sees, masks per sequence, a row that sees nothing, and bad shapes refused."""

from __future__ import annotations

import math

import pytest
import torch

native = pytest.importorskip("thinkahead.models.engine.kernels._layer_native")

HQ, HKV = 6, 2


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           threads: int = 2) -> torch.Tensor:
    """q [B, hq, T, D], k/v [B, hkv, S, D] (views with any head/batch stride), mask additive [B or 1, T, S]
    -> [B, T, hq, D]."""
    B, hq, T, D = q.shape
    hkv, S = k.shape[1], k.shape[2]
    rows = q.permute(1, 0, 2, 3).reshape(hq, B * T, D).contiguous()
    out = torch.empty(B * T, hq * D)
    if mask is not None:
        mask = mask.contiguous()
    native.attention(rows.data_ptr(), B, T, hq, hkv, D, k.data_ptr(), v.data_ptr(), S, k.stride(0), k.stride(1),
                     0 if mask is None else mask.data_ptr(), 0 if mask is None or mask.shape[0] == 1 else T * S,
                     1 / math.sqrt(D), out.data_ptr(), threads)
    return out.reshape(B, T, hq, D)


def reference(q, k, v, allowed):
    """float64 softmax attention; allowed [B or 1, T, S] bool."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = (x.double().repeat_interleave(groups, dim=1) for x in (k, v))
    scores = q.double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], -torch.inf)
    return (scores.softmax(-1) @ vv).transpose(1, 2)


def causal(T: int, S: int) -> torch.Tensor:
    return torch.ones(T, S, dtype=torch.bool).tril(S - T)[None]


@pytest.mark.parametrize("D", [64, 128, 40])  # 40: not a multiple of 16, the plain C++ path
def test_close_to_float64_attention_and_rows_alone_are_rows_together(D) -> None:
    torch.manual_seed(D)
    T, S = 7, 50
    q, k, v = torch.randn(1, HQ, T, D), torch.randn(1, HKV, S, D), torch.randn(1, HKV, S, D)
    together = attend(q, k, v)
    assert torch.allclose(together.double(), reference(q, k, v, causal(T, S)), atol=1e-5)
    for t in range(T):  # row t alone: the cache's first S - T + t + 1 keys
        seen = S - T + t + 1
        alone = attend(q[:, :, t:t + 1], k[:, :, :seen], v[:, :, :seen], threads=1)
        assert torch.equal(alone[0, 0], together[0, t])


def test_a_tree_row_gets_the_bits_of_the_same_chain_at_other_slots() -> None:
    """Keys a row does not see, between the ones it sees, change nothing: a tree node's ancestors sit at
    other cache slots than the same tokens decoded as a chain."""
    torch.manual_seed(3)
    D, prefix = 64, 30
    chain_k, chain_v = torch.randn(1, HKV, prefix + 3, D), torch.randn(1, HKV, prefix + 3, D)
    q = torch.randn(1, HQ, 1, D)
    chain = attend(q, chain_k, chain_v)  # the row sees all 33 keys
    # a tree of 6 nodes after the prefix; our row is node 5 with ancestors 1, 3: slots 31, 33, 35
    slots = [prefix + 1, prefix + 3, prefix + 5]
    tree_k, tree_v = torch.randn(1, HKV, prefix + 6, D), torch.randn(1, HKV, prefix + 6, D)
    tree_k[:, :, :prefix], tree_v[:, :, :prefix] = chain_k[:, :, :prefix], chain_v[:, :, :prefix]
    for i, s in enumerate(slots):
        tree_k[:, :, s], tree_v[:, :, s] = chain_k[:, :, prefix + i], chain_v[:, :, prefix + i]
    mask = torch.full((1, 1, prefix + 6), torch.finfo(torch.float32).min)
    mask[..., :prefix] = 0
    mask[..., slots] = 0
    assert torch.equal(attend(q, tree_k, tree_v, mask), chain)


def test_sequences_of_a_batch_with_their_own_masks_and_strided_caches() -> None:
    torch.manual_seed(4)
    B, T, S, D = 2, 3, 20, 64
    room = torch.randn(B, HKV, 32, D)  # a cache buffer with spare room: head stride 32 * D
    k, v = room[:, :, :S], torch.randn(B, HKV, 32, D)[:, :, :S]
    q = torch.randn(B, HQ, T, D)
    allowed = torch.rand(B, T, S) > 0.3
    allowed[..., 0] = True
    mask = torch.zeros(B, T, S).masked_fill_(~allowed, -torch.inf)
    both = attend(q, k, v, mask)
    assert torch.allclose(both.double(), reference(q, k, v, allowed), atol=1e-5)
    for b in range(B):
        assert torch.equal(attend(q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1]), both[b:b + 1])


def test_a_row_that_sees_no_key_is_zeros_not_nan() -> None:
    q, k, v = torch.randn(1, HQ, 2, 16), torch.randn(1, HKV, 4, 16), torch.randn(1, HKV, 4, 16)
    mask = torch.zeros(1, 2, 4)
    mask[0, 1] = -torch.inf
    out = attend(q, k, v, mask)
    assert torch.equal(out[0, 1], torch.zeros(HQ, 16)) and torch.isfinite(out).all()


def test_bad_shapes_are_refused_before_any_memory_is_read() -> None:
    with pytest.raises(ValueError, match="bad shape"):
        native.attention(0, 1, 5, 6, 2, 64, 0, 0, 4, 0, 4 * 64, 0, 0, 0.1, 0, 1)  # 5 rows, 4 keys
    with pytest.raises(ValueError, match="bad shape"):
        native.attention(0, 1, 1, 6, 4, 64, 0, 0, 4, 0, 4 * 64, 0, 0, 0.1, 0, 1)  # 6 heads over 4
    with pytest.raises(ValueError, match="bad shape"):
        native.attention(0, 1, 1, 6, 2, 64, 0, 0, 10, 0, 4 * 64, 0, 0, 0.1, 0, 1)  # head stride < 10 keys


@pytest.mark.parametrize("D", [64, 40])  # the AVX2 path and the plain one
def test_a_nan_key_spoils_only_the_rows_that_see_it(D) -> None:
    torch.manual_seed(5)
    T = S = 8
    q, k, v = torch.randn(1, HQ, T, D), torch.randn(1, HKV, S, D), torch.randn(1, HKV, S, D)
    k[0, 0, 5, 3] = float("nan")  # key 5 of the first key/value head
    out = attend(q, k, v)  # [1, T, HQ, D]; query heads 0-2 read key/value head 0
    group = HQ // HKV
    assert out[0, 5:, :group].isnan().all()
    assert torch.isfinite(out[0, :5]).all() and torch.isfinite(out[0, :, group:]).all()


def test_two_sessions_forwarding_at_once_on_one_model_get_their_own_rows() -> None:
    """Two threads through one model's native layers (attention's per-thread scratch, the kernels' thread
    team): each session's logits are what it gets alone."""
    import copy

    from thinkahead.models.engine.kernels.quantize import quantize_int8
    from thinkahead.models.engine.runner import HFEngine

    from tests.concurrency import run_at_once
    from tests.test_int8_fusion import _qwen2
    from tests.tiny_models import VOCAB

    engine = HFEngine(quantize_int8(copy.deepcopy(_qwen2(intermediate=96, layers=2))))
    assert engine.model._native_layers
    prompts = [[(3 * i + s) % VOCAB for i in range(90)] for s in (1, 2)]

    def script(prompt):
        session = engine.new_session()
        out = [engine.forward(session, prompt)]
        out += [engine.forward(session, [t]) for t in (5, 6, 7, 8)]
        out.append(engine.forward(session, [9, 10, 11, 12], [-1, 0, 0, 2]))
        return torch.cat(out)

    alone = [script(p) for p in prompts]
    together: list = [None, None]

    def run(i):
        for _ in range(5):
            got = script(prompts[i])
            if together[i] is None:
                together[i] = got
            assert torch.equal(got, alone[i])

    run_at_once(lambda: run(0), lambda: run(1))
    assert torch.equal(together[0], alone[0]) and torch.equal(together[1], alone[1])


def wide_tiles_supported() -> bool:
    before = native.attention_tile_rows()
    try:
        native.attention_tile_rows(12)
    except ValueError:
        return False
    native.attention_tile_rows(before)
    return True


@pytest.mark.skipif(not wide_tiles_supported(), reason="tiles of 12 rows need AVX-512VL")
@pytest.mark.parametrize("T", [1, 2, 3, 5, 16])
def test_tiles_of_12_rows_give_the_bits_of_tiles_of_6(T) -> None:
    """With AVX-512VL a tile holds 12 query rows (a sequence's 2 rows of 6 heads read its keys once); each row is
    still the same chain of operations, so the bits are those of 6-row tiles, masked or causal, in a batch."""
    torch.manual_seed(T)
    B, S, D = 3, 40, 128
    q, k, v = torch.randn(B, HQ, T, D), torch.randn(B, HKV, S, D), torch.randn(B, HKV, S, D)
    mask = torch.where(torch.rand(B, T, S) < 0.2, torch.tensor(-torch.inf), torch.randn(B, T, S))
    before = native.attention_tile_rows()
    try:
        runs = {}
        for rows in (6, 12):
            assert native.attention_tile_rows(rows) in (6, 12)
            runs[rows] = attend(q, k, v), attend(q, k, v, mask), attend(q, k, v, threads=1)
    finally:
        native.attention_tile_rows(before)
    for narrow, wide in zip(runs[6], runs[12], strict=True):
        assert torch.equal(narrow, wide)
    assert torch.allclose(runs[12][0].double(), reference(q, k, v, causal(T, S)), atol=1e-5)


def test_a_tile_size_other_than_6_or_12_is_refused() -> None:
    for rows in (-1, 7, 16):
        with pytest.raises(ValueError, match="attention_tile_rows"):
            native.attention_tile_rows(rows)
