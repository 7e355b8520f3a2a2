"""Batch-invariant mode's CUDA kernels under TRITON_INTERPRET=1 on the CPU (on a GPU when there
is one): the Triton linear layer and RMSNorm give each row the same bits for any number of rows
and any place among them, and the Triton prefill kernel gives a token the same attention as one
chunk of a prompt, as a chunk of its own and as a decode (how the GPU path attends every token
in this mode)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

triton = pytest.importorskip("triton", reason="Triton is installed by `make test`")

from pagellm.attention.triton_prefill import TritonPrefillKernel  # noqa: E402
from pagellm.kernels.triton_invariant import (  # noqa: E402
    TritonInvariantLinear,
    triton_rms_norm,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.float32]
"""The interpreter computes in numpy, which has no bf16: on the CPU the kernels run in fp32."""


@pytest.fixture(autouse=True)
def row_invariant_interpreter_dot(monkeypatch):
    """Under the interpreter ``tl.dot`` is numpy's matmul, and OpenBLAS's sgemm gives a row other
    bits at another place in the tile on some CPUs (20 of 32 rows on an AVX2 Zen 3), which a GPU's
    MMA does not. What these tests check is our tiling (fixed tiles, K walked in order), so on the
    CPU the dot is an outer-product sum over K whose every element depends only on its row and
    column."""
    if torch.cuda.is_available():
        return
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc_type = d.data.dtype
        lhs, rhs = a.data.astype(acc_type), b.data.astype(acc_type)
        total = np.zeros(d.data.shape, acc_type)
        for kk in range(lhs.shape[-1]):
            total += lhs[..., :, kk : kk + 1] * rhs[..., kk : kk + 1, :]
        return TensorHandle(total + d.data, d.dtype.scalar)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_equal_alone_for_every_count_and_place(dtype):
    gen = torch.Generator().manual_seed(0)
    n, k = 80, 100  # neither a multiple of the tiles
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(40, k, generator=gen).to(dtype).to(DEVICE)
    kernel = TritonInvariantLinear()
    packed = kernel.pack(w, b)
    alone = [kernel(x[i : i + 1], packed) for i in range(40)]
    for rows, start in ((2, 0), (33, 7), (40, 0), (5, 35)):
        out = kernel(x[start : start + rows], packed)
        for i in range(rows):
            assert torch.equal(out[i : i + 1], alone[start + i]), (rows, start, i)
    expected = (x.double() @ w.double().T + b.double()).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(kernel(x, packed).float(), expected, rtol=tol, atol=tol * k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_equal_alone_and_the_reference(dtype):
    from pagellm.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 96, generator=gen).to(dtype).to(DEVICE)
    norm = RMSNorm(96, 1e-5).to(DEVICE)
    norm.weight.data = torch.randn(96, generator=gen).to(DEVICE)
    together = triton_rms_norm(x, norm.weight, 1e-5)
    for i in range(9):
        assert torch.equal(triton_rms_norm(x[i : i + 1], norm.weight, 1e-5), together[i : i + 1])
    with torch.no_grad():
        torch.testing.assert_close(together, norm.to(dtype)(x), rtol=1e-5, atol=1e-5)


def test_prefill_kernel_gives_a_token_the_same_bits_as_a_chunk_alone_or_a_decode():
    gen = torch.Generator().manual_seed(2)
    hkv, group, d, bs, blocks = 2, 2, 32, 16, 12
    k_cache = torch.randn(hkv, blocks, bs, d, generator=gen).to(DEVICE)
    v_cache = torch.randn(hkv, blocks, bs, d, generator=gen).to(DEVICE)
    table = torch.randperm(blocks, generator=gen)[:8].to(torch.int32).view(1, -1).to(DEVICE)
    length = 70
    q = torch.randn(length, hkv * group, d, generator=gen).to(DEVICE)
    kernel = TritonPrefillKernel()

    def attend(first: int, count: int) -> torch.Tensor:
        """Tokens [first, first + count) as one chunk after ``first`` cached ones."""
        out = torch.empty(count, hkv * group, d, device=DEVICE)
        starts = torch.tensor([0, count], dtype=torch.int32, device=DEVICE)
        pos = torch.tensor([first], dtype=torch.int32, device=DEVICE)
        kernel(q[first : first + count].contiguous(), k_cache, v_cache, table, starts, pos,
               out, d**-0.5)  # fmt: skip
        return out

    whole = attend(0, length)
    for first, count in ((0, 33), (33, 37), (50, 1), (69, 1), (5, 17)):
        part = attend(first, count)
        assert torch.equal(part, whole[first : first + count]), (first, count)
