"""The int8 linear's kernel path: fixed activation quantization parameters instead of an anchor row.

`RowwiseInt8Linear` calls fbgemm's fp32-output kernel with fixed (X_SCALE, X_ZERO_POINT) on rows
scaled into [-1, 1]. These tests pin that it computes exactly what `linear_dynamic` computed over the
same rows plus the anchor row `[1, -1, 0, ...]` (the previous forward), and that a row is
bit-identical alone or among k others.
"""

from __future__ import annotations

import pytest
import torch

from thinkahead.models.engine.kernels.quantize import X_SCALE, X_ZERO_POINT, RowwiseInt8Linear


@pytest.fixture(autouse=True)
def _fbgemm_kernel(monkeypatch):
    """These tests pin fbgemm's path (tests/test_int8_native.py pins the native kernel to it)."""
    monkeypatch.setenv("THINKAHEAD_INT8_KERNEL", "fbgemm")


def _anchor_row_forward(layer: RowwiseInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """The previous forward: per-row scaling, an anchor row pinning linear_dynamic's range to [-1, 1]."""
    rows = x.reshape(-1, layer.in_features).float()
    anchor = torch.zeros(1, layer.in_features)
    anchor[0, 0], anchor[0, 1] = 1.0, -1.0
    row_max = rows.abs().amax(1, keepdim=True).clamp_min(1e-30)
    out = torch.ops.quantized.linear_dynamic(torch.cat([rows / row_max, anchor]), layer._packed, True)[:-1]
    out = out * row_max
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], layer.out_features)


def _inputs(rows: int, features: int) -> torch.Tensor:
    x = torch.randn(rows, features)
    x[0] *= 300.0  # an outlier row
    x[1] = 0.0  # an all-zero row
    x[2, 5] = 40.0  # one outlier feature
    x[3] = x[3].abs()  # a row with no negative value: its scaled range is [0, 1]
    return x


def test_fixed_quantization_parameters_are_fbgemms_for_the_unit_range() -> None:
    """If fbgemm ever picks other parameters for [-1, 1], the kernel path would silently change."""
    torch.backends.quantized.engine = "fbgemm"
    unit = torch.tensor([[1.0, -1.0, 0.25]])
    scale, zero_point = torch._choose_qparams_per_tensor(unit, True)  # reduce_range, as linear_dynamic
    assert (scale, zero_point) == (X_SCALE, X_ZERO_POINT)


@pytest.mark.parametrize(("in_features", "out_features", "bias"), [(96, 200, True), (37, 13, False), (256, 64, True)])
def test_kernel_path_equals_the_anchor_row_forward(in_features, out_features, bias) -> None:
    torch.manual_seed(in_features)
    layer = RowwiseInt8Linear(torch.nn.Linear(in_features, out_features, bias=bias))
    x = _inputs(9, in_features)
    with torch.inference_mode():
        assert torch.equal(layer(x), _anchor_row_forward(layer, x))
        assert torch.equal(layer(x[None]), _anchor_row_forward(layer, x[None]))  # [1, T, F] as models feed it


@pytest.mark.parametrize("k", [2, 3, 8, 16])
def test_a_row_alone_equals_that_row_among_k(k) -> None:
    torch.manual_seed(k)
    layer = RowwiseInt8Linear(torch.nn.Linear(160, 72))
    x = _inputs(max(k, 4), 160)[:k] if k >= 4 else torch.randn(k, 160) * 7
    with torch.inference_mode():
        together = layer(x[None])[0]
        for i in range(k):
            assert torch.equal(layer(x[i : i + 1])[0], together[i]), i
