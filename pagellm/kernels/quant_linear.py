"""Python face of the quantized linear kernel (see quant_linear.cpp): integer and FP8 E4M3
codes in the stored form of ``pagellm.quant.formats``."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from pagellm.kernels.cpu_build import build_library
from pagellm.quant.formats import QuantizedWeight

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
PANEL_BYTES = 8 << 20
"""The large-batch path decodes this much of a weight (fp32) at a time: a panel that stays in
cache while torch's GEMM reads it."""


class QuantLinearKernel:
    """``x @ W^T`` with W kept quantized: decoded in registers for at most ``max_rows`` rows of
    x, decoded a cache-sized panel at a time into fp32 for torch's GEMM above that."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i = ctypes.c_void_p, ctypes.c_int
        self._linear = lib.quant_linear
        self._linear.restype = i
        self._linear.argtypes = [i, ptr, ptr, ptr, ptr, ptr, i, i, i, i, i, ptr, ptr, i, i, i, i]
        self._dequant = lib.quant_dequantize
        self._dequant.restype = i
        self._dequant.argtypes = [ptr, ptr, ptr, ptr, i, i, i, i, i, i, i, i, ptr, i]
        self.max_rows = int(lib.quant_linear_max_rows())
        self._panel = torch.empty(0)

    @staticmethod
    def supports(group: int) -> bool:
        """Whether a group of this many inputs is whole vectors at every width it builds for
        (8 or 16 lanes); other layers keep the reference path."""
        return group % 16 == 0

    def applies(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype in _DTYPE_CODES and x.device.type == "cpu"

    def __call__(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        x = x.contiguous()
        if x.shape[0] <= self.max_rows:
            return self._skinny(x, w)
        return self._panels(x, w)

    def _skinny(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        out = torch.empty(m, n, dtype=x.dtype)
        fmt = w.fmt
        rc = self._linear(
            _DTYPE_CODES[x.dtype],
            x.data_ptr(),
            *_layout(w),
            fmt.group(k),
            None,
            out.data_ptr(),
            m,
            n,
            k,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"quant_linear failed with code {rc} ({fmt.name}, {n}x{k})")
        return out

    def bind(self, x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor) -> Callable[[], int]:
        """A call computing ``out = x @ W^T`` in the few-rows path with these very buffers
        (captured decode steps: the arguments are converted once); it returns the kernel's
        status (0: done)."""
        m, k = x.shape
        assert x.is_contiguous() and out.is_contiguous() and m <= self.max_rows
        assert out.shape == (m, w.shape[0]) and out.dtype == x.dtype
        args = (_DTYPE_CODES[x.dtype], x.data_ptr(), *_layout(w), w.fmt.group(k), None,
                out.data_ptr(), m, w.shape[0], k, torch.get_num_threads())  # fmt: skip
        return functools.partial(self._linear, *args)

    def _panels(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        n, k = w.shape
        # fp32 GEMM whatever x is: a bf16 GEMM over the bf16-rounded panel was ~2x faster on a CPU
        # with native bf16, but flipped the default model's bf16 answer at a near-tie where
        # transformers' bf16 keeps it (tests/test_smollm2.py), so it is not used
        gemm = torch.float32
        xg = x.to(gemm)
        rows = max(1, min(n, PANEL_BYTES // (4 * k)))
        if rows == n:
            return torch.nn.functional.linear(xg, self.dequantize(w, 0, n).to(gemm)).to(x.dtype)
        out = torch.empty(x.shape[0], n, dtype=x.dtype)
        for row0 in range(0, n, rows):
            count = min(rows, n - row0)
            out[:, row0 : row0 + count] = xg @ self.dequantize(w, row0, count).to(gemm).t()
        return out

    def dequantize(self, w: QuantizedWeight, row0: int, rows: int) -> torch.Tensor:
        """Rows [row0, row0 + rows) of ``w`` in fp32, in the shared panel buffer (valid until
        the next call)."""
        k = w.shape[1]
        if self._panel.numel() < rows * k:
            self._panel = torch.empty(rows * k, dtype=torch.float32)
        out = self._panel[: rows * k].view(rows, k)
        fmt = w.fmt
        rc = self._dequant(
            *_layout(w),
            fmt.group(k),
            row0,
            rows,
            k,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"quant_dequantize failed with code {rc} ({fmt.name})")
        return out


def _layout(w: QuantizedWeight) -> tuple:
    """q, scales, offsets, zeros, scale_half, zero_const, bits, fp8: the C layout's arguments."""
    for t in (w.q, w.scales, w.zeros, w.offsets):
        if t is not None and not t.is_contiguous():
            raise ValueError("quantized weights must be contiguous")
    return (
        w.q.data_ptr(),
        w.scales.data_ptr(),
        w.offsets.data_ptr() if w.offsets is not None else None,
        w.zeros.data_ptr() if w.zeros is not None else None,
        int(w.scales.dtype == torch.float16),
        w.fmt.zero or 0,
        w.fmt.bits,
        int(w.fmt.fp8),
    )


def load_quant_linear_kernel(
    vector_width: int | None = None, extra_flags: tuple[str, ...] = ()
) -> QuantLinearKernel | None:
    """The kernel built for this CPU (``vector_width`` 8 or 16 forces the lanes, ``extra_flags``
    e.g. ``-mno-avx2`` the portable decoder: tests)."""
    flags: tuple[str, ...] = ("-fopenmp", *extra_flags)
    if vector_width is not None:
        flags += (f"-DPAGELLM_VEC_WIDTH={vector_width}", "-Wno-psabi")
    lib = build_library("quant_linear.cpp", flags)
    return QuantLinearKernel(lib) if lib is not None else None
