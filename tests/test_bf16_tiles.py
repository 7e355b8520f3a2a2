"""The AMX few-rows bf16 linear kernel against the fp32 product of the same bf16 values, and its
use by ``Linear`` (skipped on CPUs without AMX)."""

from __future__ import annotations

import pytest
import torch
from fakes import RowSpy

from pagellm.kernels.bf16_tiles import load_bf16_tiles_kernel
from pagellm.layers.linear import Linear, use_tile_linears

KERNEL = load_bf16_tiles_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="this CPU has no AMX (or no compiler)")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (48, 1536), (100, 32), (7, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_fp32_product_rounded_once(rows, n, k, bias):
    """Every output is the exact product of the bf16 inputs summed in fp32 (order aside) and
    rounded to bf16 once: within one bf16 rounding of the float64 result. Shapes cover an odd
    number of feature blocks (48: three), a last block of fewer than 16 features (100, 7) and
    a second tile of rows (17-32)."""
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    out = KERNEL(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    expected = reference(x, w, b)
    # one bf16 rounding (2^-8 relative) plus fp32 summation-order noise
    tol = expected.abs() * 2**-8 + 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert ((out.double() - expected).abs() <= tol).all()


def test_refuses_what_it_does_not_compute():
    w = torch.randn(64, 576).bfloat16()
    assert KERNEL.applies(torch.randn(32, 576).bfloat16(), w)
    assert not KERNEL.applies(torch.randn(33, 576).bfloat16(), w)  # oneDNN is faster there
    assert not KERNEL.applies(torch.randn(2, 576), w.float())  # fp32
    assert not KERNEL.applies(torch.randn(2, 100).bfloat16(), torch.randn(64, 100).bfloat16())
    assert not KERNEL.applies(torch.randn(2, 576).bfloat16(), w.t().contiguous().t())


def test_linear_takes_the_kernel_for_few_rows_only():
    layer = Linear(576, 200, bias=True).to(torch.bfloat16)
    layer.pack()
    assert use_tile_linears(layer, KERNEL) == 1
    layer.tiles = spy = RowSpy(KERNEL)
    for rows in (1, 8, 32, 33, 64):
        x = torch.randn(rows, 576).bfloat16()
        expected = reference(x, layer.weight.detach(), layer.bias.detach())
        got = layer(x).double()
        assert ((got - expected).abs() <= expected.abs() * 2**-7 + 1e-2).all()
    assert spy.rows == [1, 8, 32]


def test_fp32_layers_are_left_alone():
    layer = Linear(64, 32)
    assert use_tile_linears(layer, KERNEL) == 0 and layer.tiles is None
