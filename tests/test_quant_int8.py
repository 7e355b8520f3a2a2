"""W8A8 computed as integers (quant_int8.cpp): activations quantized per token exactly as the
reference (``quantize_activations_int8``) does, AMX-INT8 and AVX2 dot-product sums equal to
exact integer sums, the weight-only route close to them, and the format's constraints."""

from __future__ import annotations

import pytest
import torch

from pagellm.kernels.quant_int8 import DOT, load_quant_int8_kernel, row_scales
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


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 17, 32])
@pytest.mark.parametrize("n", [1, 6, 72, 97])
def test_dot_product_sums_are_the_exact_integer_sums(int8, rows, n):
    """The AVX2 path (a decode step's rows): every block size and remainder of rows and
    features, weight codes of -128 (the format allows them: |w| is 128 unsigned there)."""
    if int8.dot_max_rows == 0:
        pytest.skip("no AVX2 here")
    torch.manual_seed(rows * 100 + n)
    for k in (32, 576):
        w = quantize(torch.randn(n, k), W8A8)
        w.q.view(torch.int8)[:, :5] = -128
        w.q.view(torch.int8)[:, 5:9] = 127
        x = torch.randn(rows, k) * 4
        x[0, :3] = torch.tensor([-50.0, 50.0, -50.0])  # codes -127 / 127 against -128
        scales = row_scales(w)
        out = torch.empty(rows, n)
        assert int8.bind(x, w, scales, out, path=DOT)() == 0
        assert torch.equal(out, _exact(x, w))
        xb = x.bfloat16()
        outb = torch.empty(rows, n, dtype=torch.bfloat16)
        assert int8.bind(xb, w, scales, outb, path=DOT)() == 0
        assert torch.equal(outb, _exact(xb, w).bfloat16())


def test_dot_path_takes_decode_rows_only(int8):
    if int8.dot_max_rows == 0 or int8.has_amx:
        pytest.skip("no AVX2 here, or AMX takes every call")
    w = quantize(torch.randn(16, 64), W8A8)
    assert int8.path(torch.randn(int8.dot_max_rows, 64), w) == DOT
    assert int8.path(torch.randn(int8.dot_max_rows + 1, 64), w) is None
    assert int8.path(torch.randn(2, 48), quantize(torch.randn(16, 48), W8A8)) is None


@pytest.mark.parametrize("route", ["amx", "dot", "weight-only"])
def test_every_route_computes_the_scheme(route):
    """The linear kernel's W8A8 call: AMX where the CPU has it, AVX2 dot products for a few
    rows, otherwise the same codes through the weight-only paths (K not a multiple of 32 always
    so): within float rounding of the exact result."""
    kernel = load_quant_linear_kernel()
    if kernel is None or kernel.int8 is None:
        pytest.skip("no C++ compiler")
    int8 = kernel.int8
    if route == "amx" and not int8.has_amx:
        pytest.skip("no AMX-INT8 here")
    if route == "dot" and int8.dot_max_rows == 0:
        pytest.skip("no AVX2 here")
    saved = int8.has_amx, int8.dot_max_rows
    int8.has_amx = route == "amx"
    int8.dot_max_rows = saved[1] if route == "dot" else 0
    try:
        for k in (128, 96, 80):
            w = quantize(torch.randn(48, k), W8A8)
            for rows in (1, 8, 40):
                x = torch.randn(rows, k)
                got = kernel.w8a8(x, w, row_scales(w))
                torch.testing.assert_close(got, _exact(x, w), rtol=1e-5, atol=1e-5)
    finally:
        int8.has_amx, int8.dot_max_rows = saved


def test_int8_activations_need_per_row_int8_weights():
    for bad in (
        dict(bits=4, group_size=0, zero=8),
        dict(bits=8, group_size=32),
        dict(bits=8, group_size=0, kind="fp8_e4m3"),
        dict(bits=8, group_size=0, offsets=True),
    ):
        with pytest.raises(ValueError, match="int8 activations"):
            QuantFormat("bad", act_int8=True, **bad)
