"""Int8 linears: batch-invariant rows, close to float32, and speculative greedy stays exact."""

from __future__ import annotations

import copy

import pytest
import torch

from thinkahead.models.engine.kernels.quantize import RowwiseInt8Linear, quantize_int8
from thinkahead.models.engine.runner import HFEngine

from tests.test_speculative_decoding import assert_suffix_speculation_is_exact


def test_rows_are_batch_invariant_and_close_to_float32() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200)
    layer = RowwiseInt8Linear(linear)
    x = torch.randn(3, 7, 96)
    x[0, 2] *= 80.0  # an outlier token must not change its neighbours' results
    together = layer(x)
    alone = torch.stack([torch.stack([layer(x[b, t][None])[0] for t in range(7)]) for b in range(3)])
    assert together.shape == (3, 7, 200)
    assert torch.equal(together, alone)
    reference = linear(x)
    assert ((together - reference).norm() / reference.norm()).item() < 0.03


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("tree", [False, True])
def test_speculative_greedy_is_token_identical_in_int8(arch, tree, tiny_model_factory) -> None:
    model = quantize_int8(copy.deepcopy(tiny_model_factory(arch)))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert_suffix_speculation_is_exact(HFEngine(model), tree, seeds=3)


class _Attention(torch.nn.Module):
    is_causal = True


def test_fp64_attention_rows_do_not_depend_on_the_batch() -> None:
    """A query row is bit-identical whether it is verified among 16 rows or decoded alone."""
    from thinkahead.models.engine.qwen2.exact_attention import fp64_sdpa_forward

    torch.manual_seed(0)
    heads, kv_heads, dim, prefix, n = 12, 2, 64, 1500, 16
    query = torch.randn(1, heads, n, dim)
    key, value = torch.randn(1, kv_heads, prefix + n, dim) * 2, torch.randn(1, kv_heads, prefix + n, dim)
    module = _Attention()
    together, _ = fp64_sdpa_forward(module, query, key, value, None, scaling=dim**-0.5)
    assert together.shape == (1, n, heads, dim)
    for i in range(n):
        alone, _ = fp64_sdpa_forward(
            module, query[:, :, i : i + 1], key[:, :, : prefix + i + 1], value[:, :, : prefix + i + 1], None,
            scaling=dim**-0.5,
        )
        assert torch.equal(together[:, i], alone[:, 0]), i
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(6, 1), value.repeat_interleave(6, 1),
        attn_mask=torch.ones(n, prefix + n, dtype=torch.bool).tril(prefix), scale=dim**-0.5,
    ).transpose(1, 2)
    assert torch.allclose(together, reference, atol=1e-5)


def test_fp64_attention_refuses_what_it_cannot_compute() -> None:
    from thinkahead.models.engine.qwen2.exact_attention import fp64_sdpa_forward

    q, kv = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="softcap"):
        fp64_sdpa_forward(_Attention(), q, kv, kv, None, softcap=30.0)
    with pytest.raises(ValueError, match="dropout"):
        fp64_sdpa_forward(_Attention(), q, kv, kv, None, dropout=0.1)
