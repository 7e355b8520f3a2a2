"""The few-rows linear kernel against float64 ``F.linear``, and its use by ``Linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fakes import RowSpy

from pagellm.kernels.skinny_linear import load_skinny_linear_kernel
from pagellm.layers.linear import Linear, use_skinny_linears


@pytest.fixture(scope="module", params=[8, 16], ids=["8-lanes", "16-lanes"])
def kernel(request):
    built = load_skinny_linear_kernel(vector_width=request.param)
    assert built is not None, "the C++ kernel must build on this machine (g++ is required)"
    return built


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 32])
@pytest.mark.parametrize(("n", "k"), [(1536, 576), (577, 99), (7, 1031)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_linear(kernel, rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = kernel(x, w, b)
    expected = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 13, 32])
@pytest.mark.parametrize(("n", "k"), [(1536, 576), (577, 99), (7, 1031)])
def test_bf16_is_the_fp32_product_rounded_once(kernel, rows, n, k):
    """bf16 x and W (AVX-512 BF16 dot products where the 16-lane build has them: one row of W
    a pass up to their rows, four above; fp32 arithmetic elsewhere), a bias, weight rows past a
    multiple of 16 and inputs past a multiple of 32: within one bf16 rounding of the fp32 sum."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    out = kernel(x, w, b)
    exact = F.linear(x.double(), w.double(), b.double())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-4 * k)


def test_bf16_rounds_once_like_torch(kernel):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 576, generator=gen).bfloat16()
    w = torch.randn(200, 576, generator=gen).bfloat16()
    out = kernel(x, w, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-2, atol=0.0)


def test_linear_takes_the_kernel_for_decode_steps_only():
    kernel = load_skinny_linear_kernel()
    layer = Linear(64, 48, bias=True)
    assert use_skinny_linears(layer, kernel) == 1
    layer.skinny = spy = RowSpy(kernel)
    for rows in (1, 8, 32, 33, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert spy.rows == [1, 8, 32]


def test_rows_beyond_the_kernel_are_refused_not_miscomputed():
    kernel = load_skinny_linear_kernel()
    w = torch.randn(16, 32)
    assert not kernel.applies(torch.randn(33, 32), w)
    assert not kernel.applies(torch.randn(2, 32).bfloat16(), w)
    assert kernel.applies(torch.randn(2, 32), w)


def test_bf16_dot_products_take_the_fewest_rows_and_onednn_the_rest():
    """With AVX-512 BF16 and no AMX tiles (``bf16_dot``), bf16 layers keep their oneDNN packing
    and give the kernel's dot products the steps of at most ``bf16_dot_rows`` rows."""
    kernel = load_skinny_linear_kernel()
    layer = Linear(576, 300, bias=True).to(torch.bfloat16)
    layer.pack()
    packed = layer.packed
    taken = use_skinny_linears(layer, kernel, native_bf16=True, bf16_dot=True)
    assert taken == (1 if kernel.bf16_dot_rows else 0)
    assert layer.packed is packed and not layer.fp32_panels
    assert use_skinny_linears(layer, kernel, native_bf16=True) == 0  # AMX tiles: not these
    if not taken:
        pytest.skip("no AVX-512 BF16 dot products in this build")
    layer.skinny = spy = RowSpy(kernel)
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 2, 3, 4, 8, 40):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        exact = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        torch.testing.assert_close(layer(x).float(), exact, rtol=2**-7, atol=2e-2)
    assert spy.rows == [r for r in (1, 2, 3, 4, 8, 40) if r <= kernel.bf16_dot_rows]


@pytest.mark.parametrize("native_bf16", [True, False])
def test_bf16_without_bf16_products_skips_onednn(native_bf16):
    """A CPU without bf16 products: bf16 layers unpacked, the few-rows kernel for decode steps
    and fp32 GEMMs over widened panels above (every output within one bf16 rounding of the
    fp32 product of the same bf16 values); with bf16 products they keep oneDNN's packing."""
    kernel = load_skinny_linear_kernel()
    gen = torch.Generator().manual_seed(3)
    layer = Linear(576, 5000, bias=True).to(torch.bfloat16)
    layer.pack()
    packed = layer.packed is not None
    assert use_skinny_linears(layer, kernel, native_bf16=native_bf16) == (0 if native_bf16 else 1)
    assert layer.fp32_panels == (not native_bf16)
    assert (layer.packed is not None) == (packed and native_bf16)
    for rows in (1, 32, 33, 300):
        x = torch.randn(rows, 576, generator=gen).bfloat16()
        exact = F.linear(x.float(), layer.weight.float(), layer.bias.float())
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 5000)
        if not native_bf16:  # fp32 sums rounded once to bf16
            torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-3)
    x3 = torch.randn(2, 40, 576, generator=gen).bfloat16()  # leading dimensions kept
    assert layer(x3).shape == (2, 40, 5000)
