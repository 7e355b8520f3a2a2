"""Python face of the few-rows linear kernel (see skinny_linear.cpp)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pagellm.kernels.cpu_build import build_library
from pagellm.kernels.packed import BoundCall

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class SkinnyLinearKernel:
    """``out = x @ weight.T + bias`` for x of at most ``max_rows`` rows (decode and small mixed steps)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        fn = lib.skinny_linear
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        self._fn = fn
        self.max_rows = int(lib.skinny_linear_max_rows())
        self.bf16_dot_rows = int(lib.skinny_linear_bf16_dot_rows())
        """The most rows of bf16 x taken where bf16 goes to AVX-512 BF16 dot products (0: it
        is computed in fp32, up to ``max_rows``; skinny_linear.cpp says why so few)."""

    def rows_for(self, dtype: torch.dtype) -> int:
        """The most rows of x of this dtype the kernel takes."""
        if dtype == torch.bfloat16 and self.bf16_dot_rows:
            return self.bf16_dot_rows
        return self.max_rows

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and 0 < x.shape[0] <= self.rows_for(x.dtype)
            and x.dtype == weight.dtype
            and weight.dtype in _DTYPE_CODES
            and x.device.type == "cpu"
            and weight.is_contiguous()
        )

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        x = x.contiguous()
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty(m, n, dtype=x.dtype)
        if bias is not None:
            bias = bias.contiguous()
        rc = self._fn(
            _DTYPE_CODES[x.dtype],
            x.data_ptr(),
            weight.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            out.data_ptr(),
            m,
            n,
            k,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"skinny_linear failed with code {rc}")
        return out

    def bind(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
    ) -> Callable[[], int]:
        """A call computing ``out = x @ weight.T + bias`` with these very buffers (captured
        decode steps); it returns the kernel's status (0: done)."""
        assert self.applies(x, weight) and x.is_contiguous() and out.is_contiguous()
        assert bias is None or bias.is_contiguous()
        m, k = x.shape
        args = (_DTYPE_CODES[x.dtype], x.data_ptr(), weight.data_ptr(),
                bias.data_ptr() if bias is not None else None, out.data_ptr(), m,
                weight.shape[0], k, torch.get_num_threads())  # fmt: skip
        return BoundCall(self._lib, self._fn, args)


def load_skinny_linear_kernel(vector_width: int | None = None) -> SkinnyLinearKernel | None:
    """The kernel built for this CPU (``vector_width`` 8 or 16 forces the lanes: tests)."""
    flags: tuple[str, ...] = ("-fopenmp",)
    if vector_width is not None:
        flags += (f"-DPAGELLM_VEC_WIDTH={vector_width}", "-Wno-psabi")
    lib = build_library("skinny_linear.cpp", flags)
    return SkinnyLinearKernel(lib) if lib is not None else None
