"""Batch-invariant kernels in Triton, for the CUDA path of ``--batch-invariant``: a linear layer
and an RMSNorm whose every output row is computed by the same tile sequence whatever the number
of rows (fixed tile sizes, never tuned by shape; K walked from 0 upwards with no split; one
program per row for the norm). cuBLAS picks its algorithm (and a split of K) from the shape, so
``F.linear`` gives a row other bits in another batch; these do not.

Run on a GPU, and on the CPU under ``TRITON_INTERPRET=1`` (how the tests check them without one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is optional (CUDA installs bring it)
    triton = None
    tl = None

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _linear(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            a = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                mask=(offs_m[:, None] < M) & (kk[None, :] < K),
                other=0.0,
            )
            b = tl.load(
                w_ptr + offs_n[None, :] * stride_wn + kk[:, None],
                mask=(offs_n[None, :] < N) & (kk[:, None] < K),
                other=0.0,
            )
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
        )

    @triton.jit
    def _rms_norm(x_ptr, w_ptr, out_ptr, N, eps, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        ok = offs < N
        x = tl.load(x_ptr + row * stride + offs, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / N + eps)
        normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded, as the HF norm
        w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True, slots=True)
class TritonWeight:
    """The weight as it is ([n, k], contiguous) and its bias."""

    data: torch.Tensor
    bias: torch.Tensor | None


class TritonInvariantLinear:
    """``out = x @ W.T + bias`` in fixed tiles (the CUDA counterpart of
    ``InvariantLinearKernel``, same calls)."""

    path_name = "Triton"

    def __init__(self) -> None:
        if triton is None:
            raise RuntimeError("Triton is not installed")

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> TritonWeight:
        return TritonWeight(weight.detach().contiguous(), bias)

    def __call__(self, x: torch.Tensor, w: TritonWeight) -> torch.Tensor:
        n, k = w.data.shape
        lead = x.shape[:-1]
        x = x.reshape(-1, k).contiguous()
        m = x.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0:
            return out.view(*lead, n)
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        bias = w.bias if w.bias is not None else x
        _linear[grid](
            x, w.data, bias, out, m, n, k, x.stride(0), w.data.stride(0), out.stride(0),
            HAS_BIAS=w.bias is not None,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )  # fmt: skip
        return out.view(*lead, n)


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of ``x`` (float32 statistics, the normalized row rounded to x's
    dtype before the weight), one program per row."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden).contiguous()
    out = torch.empty_like(rows)
    if rows.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm[(rows.shape[0],)](rows, weight.to(x.dtype), out, hidden, eps, rows.stride(0),
                                    BLOCK=block)  # fmt: skip
    return out.view(x.shape)
