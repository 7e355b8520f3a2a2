"""Python face of the C++ paged decode-attention kernel (see paged_attention.cpp)."""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels.cpu_build import build_library

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class PagedDecodeKernel:
    """out[b] = softmax(q[b] . K[b]^T * scale) V[b], K/V read through ``block_tables``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.paged_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = (
            [ctypes.c_int]
            + [ctypes.c_void_p] * 6
            + [ctypes.c_int] * 7
            + [
                ctypes.c_float,
                ctypes.c_int,
            ]
        )
        self._fn = fn

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPE_CODES

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """q/out [B, Hq, D]; caches [Hkv, blocks, block_size, D]; int32 tables [B, max_blocks]."""
        assert q.is_contiguous() and out.is_contiguous() and block_tables.is_contiguous()
        assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
        b, hq, d = q.shape
        hkv, nb, bs, _ = k_cache.shape
        rc = self._fn(
            _DTYPE_CODES[q.dtype],
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            b,
            hq,
            hkv,
            d,
            nb,
            bs,
            block_tables.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"paged_decode_attention failed with code {rc}")


def load_paged_decode_kernel() -> PagedDecodeKernel | None:
    lib = build_library("paged_attention.cpp", ("-fopenmp",))  # torch's libgomp (AVX2 path)
    return PagedDecodeKernel(lib) if lib is not None else None


class PagedPrefillKernel:
    """Prefill/extend attention over the paged cache (see paged_prefill.cpp): each chunk's tokens
    attend to the chunk's cached prefix in full and to the chunk itself causally."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.paged_prefill_attention
        fn.restype = ctypes.c_int
        fn.argtypes = (
            [ctypes.c_int]
            + [ctypes.c_void_p] * 7
            + [ctypes.c_int] * 7
            + [ctypes.c_float, ctypes.c_int]
        )
        self._fn = fn
        self.vector_width = int(lib.paged_prefill_vector_width())

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in _DTYPE_CODES

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
        [chunks, max_blocks], ``query_starts`` [chunks + 1] (token offsets into q) and
        ``start_pos`` [chunks] (tokens cached before each chunk). ``max_chunk_tokens`` is
        for the Triton kernel's grid (unused here)."""
        for t in (q, out, block_tables, query_starts, start_pos):
            assert t.is_contiguous()
        for t in (block_tables, query_starts, start_pos):
            assert t.dtype == torch.int32
        assert q.dtype == k_cache.dtype == v_cache.dtype == out.dtype
        _, hq, d = q.shape
        hkv, nb, bs, _ = k_cache.shape
        rc = self._fn(
            _DTYPE_CODES[q.dtype],
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            query_starts.data_ptr(),
            start_pos.data_ptr(),
            out.data_ptr(),
            start_pos.shape[0],
            hq,
            hkv,
            d,
            nb,
            bs,
            block_tables.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"paged_prefill_attention failed with code {rc}")


def load_paged_prefill_kernel(vector_width: int | None = None) -> PagedPrefillKernel | None:
    """The prefill kernel built for this CPU; ``vector_width`` forces 8 or 16 lanes (tests)."""
    flags: tuple[str, ...] = ("-fopenmp",)  # torch's libgomp: see paged_prefill.cpp
    if vector_width is not None:
        flags += (f"-DPAGELLM_VEC_WIDTH={vector_width}", "-Wno-psabi")
    lib = build_library("paged_prefill.cpp", flags)
    return PagedPrefillKernel(lib) if lib is not None else None
