"""Python faces of the C++ paged attention kernels (paged_attention.cpp: decode rows,
paged_prefill.cpp: prefill chunks).

Both read a cache of q's dtype or an FP8 one (``kv_code`` 1: E4M3, 2: E5M2, held as uint8 bytes
of K / k_scale and V / v_scale): the caller passes ``scale * k_scale`` as the softmax scale and
``v_scale``, which multiplies the output.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pagellm.kernels.cpu_build import build_library
from pagellm.kernels.packed import BoundCall

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_KV_CODES = (0, 1, 2)
"""0: the cache holds q's dtype; 1: FP8 E4M3 bytes; 2: FP8 E5M2 bytes."""


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, kv_code: int) -> None:
    assert k_cache.dtype == (q.dtype if kv_code == 0 else torch.uint8), (q.dtype, k_cache.dtype)


class PagedDecodeKernel:
    """out[b] = softmax(q[b] . K[b]^T * scale) V[b], K/V read through ``block_tables``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        fn = lib.paged_decode_attention
        fn.restype = ctypes.c_int
        fn.argtypes = (
            [ctypes.c_int] * 2
            + [ctypes.c_void_p] * 6
            + [ctypes.c_int] * 7
            + [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        )
        self._fn = fn

    @staticmethod
    def supports(dtype: torch.dtype, kv_code: int = 0) -> bool:
        return dtype in _DTYPE_CODES and kv_code in _KV_CODES

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        kv_code: int = 0,
        v_scale: float = 1.0,
        fixed_split: bool = False,
    ) -> None:
        """q/out [B, Hq, D]; caches [Hkv, blocks, block_size, D]; int32 tables [B, max_blocks].
        ``fixed_split``: a long context is split over threads by its length alone, never by
        the batch (batch-invariant mode)."""
        args = _decode_args(q, k_cache, v_cache, block_tables, context_lens, out, scale, kv_code,
                            v_scale, fixed_split)  # fmt: skip
        rc = self._fn(*args)
        if rc != 0:
            raise RuntimeError(f"paged_decode_attention failed with code {rc}")

    def bind(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        fixed_split: bool = False,
    ) -> Callable[[], int]:
        """A call attending with these very buffers (captured decode steps; a cache of q's
        dtype); it returns the kernel's status (0: done)."""
        args = _decode_args(
            q, k_cache, v_cache, block_tables, context_lens, out, scale, 0, 1.0, fixed_split
        )
        return BoundCall(self._lib, self._fn, args)


def _decode_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    kv_code: int,
    v_scale: float,
    fixed_split: bool = False,
) -> tuple:
    """The decode kernel's C arguments for these tensors, checked."""
    assert q.is_contiguous() and out.is_contiguous() and block_tables.is_contiguous()
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    _check_cache(q, k_cache, kv_code)
    b, hq, d = q.shape
    hkv, nb, bs, _ = k_cache.shape
    return (_DTYPE_CODES[q.dtype], kv_code, q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), context_lens.data_ptr(), out.data_ptr(), b, hq, hkv, d, nb,
            bs, block_tables.shape[1], scale, v_scale, torch.get_num_threads(),
            int(fixed_split))  # fmt: skip


def load_paged_decode_kernel(extra_flags: tuple[str, ...] = ()) -> PagedDecodeKernel | None:
    """The decode kernel built for this CPU; ``extra_flags`` build a variant (tests:
    ``-mno-avx512f`` takes the AVX2 path on an AVX-512 machine)."""
    lib = build_library("paged_attention.cpp", ("-fopenmp", *extra_flags))  # torch's libgomp
    return PagedDecodeKernel(lib) if lib is not None else None


_TILE_PRODUCTS = {0: None, 1: "AVX-512 BF16", 2: "AMX"}


class PagedPrefillKernel:
    """Prefill/extend attention over the paged cache (see paged_prefill.cpp): each chunk's tokens
    attend to the chunk's cached prefix in full and to the chunk itself causally."""

    def __init__(self, lib: ctypes.CDLL, allow_amx: bool = True) -> None:
        self._lib = lib
        fn = lib.paged_prefill_attention
        fn.restype = ctypes.c_int
        fn.argtypes = (
            [ctypes.c_int] * 2
            + [ctypes.c_void_p] * 7
            + [ctypes.c_int] * 7
            + [ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        )
        self._fn = fn
        self.vector_width = int(lib.paged_prefill_vector_width())
        self.item_rows = int(lib.paged_prefill_item_rows())
        """Query rows (token x query head of a group) per work item of the vector path: fewer
        rows cost as much as this many."""
        self._smallest_rows = lib.paged_prefill_smallest_item_rows
        self._smallest_rows.restype = ctypes.c_int
        self._smallest_rows.argtypes = [ctypes.c_int] * 5
        self.tile_products = _TILE_PRODUCTS[int(lib.paged_prefill_tile_products())]
        """How bf16 calls' products run where the tile path applies (bf16 q and cache, head_dim
        a multiple of 32): "AMX" tiles, "AVX-512 BF16" dot products in the tiles' layout (Zen
        4 / Zen 5), or None (float32 FMAs)."""
        self.allow_amx = allow_amx
        """False keeps bf16 calls on the float32 vector path (no tile products of either kind)."""

    @staticmethod
    def supports(dtype: torch.dtype, kv_code: int = 0) -> bool:
        return dtype in _DTYPE_CODES and kv_code in _KV_CODES

    def smallest_item_rows(
        self, dtype: torch.dtype, kv_code: int, head_dim: int, block_size: int
    ) -> int:
        """Query rows of the smallest work item of calls with these shapes (the kernel's own
        rule: half an item where its products run on AMX tiles): fewer rows cost as much as
        this many."""
        code = _DTYPE_CODES.get(dtype, -1)
        return int(self._smallest_rows(code, kv_code, head_dim, block_size, int(self.allow_amx)))

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
        kv_code: int = 0,
        v_scale: float = 1.0,
    ) -> None:
        """q/out [T, Hq, D]; caches [Hkv, blocks, block_size, D]; int32 ``block_tables``
        [chunks, max_blocks], ``query_starts`` [chunks + 1] (token offsets into q) and
        ``start_pos`` [chunks] (tokens cached before each chunk). ``max_chunk_tokens`` is
        for the Triton kernel's grid (unused here)."""
        args = self._args(q, k_cache, v_cache, block_tables, query_starts, start_pos, out,
                          scale, kv_code, v_scale)  # fmt: skip
        rc = self._fn(*args)
        if rc != 0:
            raise RuntimeError(f"paged_prefill_attention failed with code {rc}")

    def bind(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        start_pos: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> Callable[[], int]:
        """A call attending with these very buffers (the prefill chunks of a captured step; a
        cache of q's dtype); it returns the kernel's status (0: done). The number of chunks is
        ``start_pos``'s length, fixed when bound."""
        args = self._args(q, k_cache, v_cache, block_tables, query_starts, start_pos, out,
                          scale, 0, 1.0)  # fmt: skip
        return BoundCall(self._lib, self._fn, args)

    def _args(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        start_pos: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        kv_code: int,
        v_scale: float,
    ) -> tuple:
        """The kernel's C arguments for these tensors, checked."""
        for t in (q, out, block_tables, query_starts, start_pos):
            assert t.is_contiguous()
        for t in (block_tables, query_starts, start_pos):
            assert t.dtype == torch.int32
        assert q.dtype == out.dtype and k_cache.dtype == v_cache.dtype
        _check_cache(q, k_cache, kv_code)
        _, hq, d = q.shape
        hkv, nb, bs, _ = k_cache.shape
        return (_DTYPE_CODES[q.dtype], kv_code, q.data_ptr(), k_cache.data_ptr(),
                v_cache.data_ptr(), block_tables.data_ptr(), query_starts.data_ptr(),
                start_pos.data_ptr(), out.data_ptr(), start_pos.shape[0], hq, hkv, d, nb, bs,
                block_tables.shape[1], scale, v_scale, torch.get_num_threads(),
                int(self.allow_amx))  # fmt: skip


def load_paged_prefill_kernel(
    vector_width: int | None = None, allow_amx: bool = True
) -> PagedPrefillKernel | None:
    """The prefill kernel built for this CPU; ``vector_width`` forces 8 or 16 lanes and
    ``allow_amx=False`` keeps bf16 calls off AMX (tests, benchmarks)."""
    flags: tuple[str, ...] = ("-fopenmp",)  # torch's libgomp: see paged_prefill.cpp
    if vector_width is not None:
        flags += (f"-DPAGELLM_VEC_WIDTH={vector_width}", "-Wno-psabi")
    lib = build_library("paged_prefill.cpp", flags)
    return PagedPrefillKernel(lib, allow_amx) if lib is not None else None
