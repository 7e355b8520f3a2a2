"""Python face of the W8A8 kernel (quant_int8.cpp): activations quantized per token to int8 and
multiplied with int8 weights as integers, on AMX-INT8 tiles for any number of rows, with AVX2
integer dot products for a decode step's few rows; elsewhere the same quantization of x in C,
then the weight-only kernels."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pagellm.kernels.cpu_build import build_library
from pagellm.kernels.packed import BoundCall
from pagellm.quant.formats import QuantizedWeight

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
DOT, AMX = 1, 2
"""The C kernel's paths: AVX2 dot products (few rows), AMX-INT8 tiles."""


class QuantInt8Kernel:
    """``quantize(x)`` per token, and ``x @ W^T`` of a W8A8 weight (``fmt.act_int8``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i = ctypes.c_void_p, ctypes.c_int
        self._quantize = lib.quant_int8_quantize
        self._quantize.restype = i
        self._quantize.argtypes = [i, ptr, i, i, ptr, ptr, i]
        self._lib = lib
        self._linear = lib.quant_int8_linear
        self._linear.restype = i
        self._linear.argtypes = [i, i, ptr, ptr, ptr, ptr, i, i, i, i]
        self.has_amx = bool(lib.quant_int8_has_amx())
        self.dot_max_rows = int(lib.quant_int8_dot_max_rows())
        """Rows of x the AVX2 dot path takes (0: none in this build)."""

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 codes [m, k] and float32 scales [m, 1], as ``quantize_activations_int8``."""
        x = x.contiguous()
        m, k = x.shape
        q = torch.empty(m, k, dtype=torch.int8)
        s = torch.empty(m, 1, dtype=torch.float32)
        args = (x.data_ptr(), m, k, q.data_ptr(), s.data_ptr(), torch.get_num_threads())
        rc = self._quantize(_DTYPE_CODES[x.dtype], *args)
        if rc != 0:
            raise RuntimeError(f"quant_int8_quantize failed with code {rc}")
        return q, s

    def path(self, x: torch.Tensor, w: QuantizedWeight) -> int | None:
        """The path that takes this call (``AMX``: K a multiple of 64; ``DOT``: K a multiple of
        32 and at most ``dot_max_rows`` rows), None where neither does (fp32 or bf16 x only)."""
        if x.dim() != 2 or x.dtype not in _DTYPE_CODES or x.device.type != "cpu":
            return None
        k = w.shape[1]
        if self.has_amx and k % 64 == 0:
            return AMX
        if x.shape[0] <= self.dot_max_rows and k % 32 == 0:
            return DOT
        return None

    def applies(self, x: torch.Tensor, w: QuantizedWeight) -> bool:
        """Whether a path of this kernel takes the call."""
        return self.path(x, w) is not None

    def __call__(
        self,
        x: torch.Tensor,
        w: QuantizedWeight,
        row_scales: torch.Tensor,
        path: int | None = None,
    ) -> torch.Tensor:
        """``row_scales``: the weight's scales as float32 [n] (``row_scales(w)``, kept by the
        caller); ``path`` as ``self.path`` gave it (found here when None)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
        rc = self.bind(x, w, row_scales, out, path)()
        if rc != 0:
            raise RuntimeError(f"quant_int8_linear failed with code {rc} ({w.fmt.name})")
        return out

    def bind(
        self,
        x: torch.Tensor,
        w: QuantizedWeight,
        row_scales: torch.Tensor,
        out: torch.Tensor,
        path: int | None = None,
    ) -> Callable[[], int]:
        """A call computing ``out`` = the W8A8 product of x and W with these very buffers
        (captured steps convert the arguments once) on ``path`` (default: ``self.path``); it
        returns the kernel's status (0: done)."""
        path = self.path(x, w) if path is None else path
        m, k = x.shape
        n = w.shape[0]
        assert path in (DOT, AMX), "no path of the int8 kernel takes this call"
        assert x.is_contiguous() and out.is_contiguous() and out.shape == (m, n)
        assert out.dtype == x.dtype and row_scales.dtype == torch.float32
        args = (path, _DTYPE_CODES[x.dtype], x.data_ptr(), w.q.data_ptr(),
                row_scales.data_ptr(), out.data_ptr(), m, n, k, torch.get_num_threads())  # fmt: skip
        return BoundCall(self._lib, self._linear, args)


def row_scales(w: QuantizedWeight) -> torch.Tensor:
    """A per-row weight's scales as contiguous float32 [n]."""
    return w.scales.float().reshape(-1).contiguous()


def load_quant_int8_kernel() -> QuantInt8Kernel | None:
    """The W8A8 kernel built for this CPU, or None without a compiler."""
    # the documented order of the float products: no reassociation
    lib = build_library(
        "quant_int8.cpp", ("-fopenmp", "-ffp-contract=off", "-fno-associative-math")
    )
    return QuantInt8Kernel(lib) if lib is not None else None
