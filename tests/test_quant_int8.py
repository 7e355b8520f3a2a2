"""W8A8 computed as integers (quant_int8.cpp): activations quantized per token exactly as the
reference (``quantize_activations_int8``) does, AMX-INT8 sums equal to exact integer sums, the
other CPUs' route close to them, and the format's constraints."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels.quant_int8 import load_quant_int8_kernel, row_scales
from pagellm.kernels.quant_linear import load_quant_linear_kernel
from pagellm.quant.formats import QuantFormat, quantize_activations_int8
from pagellm.quant.online import quantize

W8A8 = QuantFormat("w8a8", bits=8, group_size=0, act_int8=True)


@pytest.fixture(scope="module")
def int8():
    kernel = load_quant_int8_kernel()
    if kernel is None:
        pytest.skip("no C++ compiler")
    return kernel


def _exact(x: torch.Tensor, w) -> torch.Tensor:
    """The scheme's result computed exactly: integer sums (in float64), then sx, then sw."""
    codes, scales = quantize_activations_int8(x)
    sums = (codes.double() @ w.q.view(torch.int8).double().t()).float()
    return (sums * scales) * row_scales(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [64, 72, 200])
def test_activations_are_quantized_as_the_reference(int8, dtype, k):
    torch.manual_seed(k)
    x = (torch.randn(9, k) * torch.logspace(-3, 3, 9).unsqueeze(1)).to(dtype)
    x[3] = 0  # an all-zero row: scale 1, codes 0
    x[5, 7] = 1e4  # one outlier sets the row's scale
    codes, scales = int8.quantize(x)
    ref_codes, ref_scales = quantize_activations_int8(x)
    assert torch.equal(codes.float(), ref_codes) and torch.equal(scales, ref_scales)
    assert codes.abs().max() <= 127 and scales[3].item() == 1.0


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 33, 300])
@pytest.mark.parametrize("n", [16, 72, 96])
def test_amx_sums_are_the_exact_integer_sums(int8, rows, n):
    if not int8.has_amx:
        pytest.skip("no AMX-INT8 here")
    torch.manual_seed(rows * n)
    w = quantize(torch.randn(n, 192), W8A8)
    x = torch.randn(rows, 192) * 4
    assert torch.equal(int8(x, w, row_scales(w)), _exact(x, w))
    xb = x.bfloat16()
    got = int8(xb, w, row_scales(w))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _exact(xb, w).bfloat16())


@pytest.mark.parametrize("has_amx", [True, False])
def test_every_route_computes_the_scheme(has_amx):
    """The linear kernel's W8A8 call: AMX where the CPU has it, otherwise the same codes through
    the weight-only paths, and K not a multiple of 64 always so: within float rounding of the
    exact result."""
    kernel = load_quant_linear_kernel()
    if kernel is None or kernel.int8 is None:
        pytest.skip("no C++ compiler")
    if has_amx and not kernel.int8.has_amx:
        pytest.skip("no AMX-INT8 here")
    saved = kernel.int8.has_amx
    kernel.int8.has_amx = has_amx
    try:
        for k in (128, 96):
            w = quantize(torch.randn(48, k), W8A8)
            for rows in (1, 8, 40):
                x = torch.randn(rows, k)
                got = kernel.w8a8(x, w, row_scales(w))
                torch.testing.assert_close(got, _exact(x, w), rtol=1e-5, atol=1e-5)
    finally:
        kernel.int8.has_amx = saved


def test_int8_activations_need_per_row_int8_weights():
    for bad in (
        dict(bits=4, group_size=0, zero=8),
        dict(bits=8, group_size=32),
        dict(bits=8, group_size=0, kind="fp8_e4m3"),
        dict(bits=8, group_size=0, offsets=True),
    ):
        with pytest.raises(ValueError, match="int8 activations"):
            QuantFormat("bad", act_int8=True, **bad)
