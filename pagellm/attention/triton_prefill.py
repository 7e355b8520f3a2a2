"""Paged prefill/extend attention in Triton: the CUDA counterpart of the C++ prefill kernel,
with the same contract (``PagedPrefillKernel.__call__``).

One program per (chunk, query head, block of BLOCK_M query tokens): it walks the chunk's keys
through the block table in tiles of BLOCK_N with an online softmax, full over the cached prefix
and causal inside the chunk; nothing is gathered and no score matrix is formed. Inputs in the
cache's dtype, accumulation in fp32. Runs on a GPU, and on the CPU under ``TRITON_INTERPRET=1``
(how the tests check it without one).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is optional (CUDA installs bring it)
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _paged_prefill(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, pos_ptr, scale,
        stride_qt, stride_qh, stride_kh, stride_kb, stride_ks, stride_tb,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        chunk = tl.program_id(0)
        head = tl.program_id(1)
        tile = tl.program_id(2)
        first = tl.load(starts_ptr + chunk)
        num_tokens = tl.load(starts_ptr + chunk + 1) - first
        if tile * BLOCK_M < num_tokens:
            start = tl.load(pos_ptr + chunk)
            kv_head = head // GROUP
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            row_ok = offs_m < num_tokens
            d_ok = offs_d < HEAD_DIM
            q = tl.load(
                q_ptr + (first + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            positions = start + offs_m
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            kv_end = start + tl.minimum((tile + 1) * BLOCK_M, num_tokens)
            table = tables_ptr + chunk * stride_tb
            for n0 in range(0, kv_end, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                key_ok = offs_n < kv_end
                blocks = tl.load(table + offs_n // BLOCK_SIZE, mask=key_ok, other=0)
                rows = kv_head * stride_kh + blocks * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks
                kv_mask = key_ok[:, None] & d_ok[None, :]
                k = tl.load(k_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
                s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
                visible = (offs_n[None, :] <= positions[:, None]) & key_ok[None, :]
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
                m_i = m_new
            result = acc / l_i[:, None]
            tl.store(
                out_ptr
                + (first + offs_m)[:, None] * stride_qt
                + head * stride_qh
                + offs_d[None, :],
                result.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & d_ok[None, :],
            )


class TritonPrefillKernel:
    """Same call as ``PagedPrefillKernel``; ``block_m``/``block_n`` are the tile sizes."""

    def __init__(self, block_m: int = 32, block_n: int = 32) -> None:
        if triton is None:
            raise RuntimeError("Triton is not installed")
        self.block_m = block_m
        self.block_n = block_n

    @staticmethod
    def supports(dtype: torch.dtype, kv_code: int = 0) -> bool:
        """``kv_code`` 0: the cache holds ``dtype`` (an FP8 cache is not read here)."""
        return dtype in (torch.float32, torch.bfloat16, torch.float16) and kv_code == 0

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        start_pos: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        max_chunk_tokens: int | None = None,
    ) -> None:
        """q/out [T, Hq, D]; caches [Hkv, blocks, block_size, D]; int32 ``block_tables``
        [chunks, max_blocks], ``query_starts`` [chunks + 1], ``start_pos`` [chunks]."""
        assert q.stride(-1) == 1 and out.stride() == q.stride() and k_cache.is_contiguous()
        _, hq, d = q.shape
        hkv, _, bs, _ = k_cache.shape
        if max_chunk_tokens is None:
            max_chunk_tokens = int((query_starts[1:] - query_starts[:-1]).max())
        grid = (start_pos.shape[0], hq, triton.cdiv(max_chunk_tokens, self.block_m))
        _paged_prefill[grid](
            q, k_cache, v_cache, out, block_tables, query_starts, start_pos, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0),
            GROUP=hq // hkv, BLOCK_SIZE=bs, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
            BLOCK_M=self.block_m, BLOCK_N=self.block_n,
        )  # fmt: skip
