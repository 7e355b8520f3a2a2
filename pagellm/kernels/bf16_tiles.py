"""Python face of the AMX bf16 linear kernel for few-row steps (see bf16_tiles.cpp)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pagellm.kernels.cpu_build import build_library
from pagellm.kernels.packed import BoundCall

MAX_ROWS = 32
"""Rows of x up to which the kernel beats oneDNN's packed bf16 GEMM (measured on a Xeon with
AMX, 30 layers of SmolLM2's shapes: 1.23-1.28x at 1-32 rows, 0.96-0.99x at 48-64); larger steps keep oneDNN."""


class Bf16TilesKernel:
    """``out = x @ weight.T + bias`` for bf16 x and weight, ``weight`` as stored."""

    def __init__(self, lib: ctypes.CDLL, max_rows: int = MAX_ROWS) -> None:
        self._lib = lib
        fn = lib.bf16_tiles_linear
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        self._fn = fn
        self.max_rows = max_rows

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and 0 < x.shape[0] <= self.max_rows
            and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and weight.dim() == 2
            and weight.shape[1] % 32 == 0
            and weight.is_contiguous()
        )

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """For x that ``applies`` (the caller checked)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
        bias32 = _fp32(bias)
        rc = self._fn(*self._args(x, weight, bias32, out))
        if rc != 0:
            raise RuntimeError(f"bf16_tiles_linear failed with code {rc}")
        return out

    def bind(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
    ) -> Callable[[], int]:
        """A call computing ``out = x @ weight.T + bias`` with these very buffers (captured
        decode steps); it returns the kernel's status (0: done, else an error code)."""
        assert self.applies(x, weight) and x.is_contiguous() and out.is_contiguous()
        bias32 = _fp32(bias)
        call = BoundCall(self._lib, self._fn, self._args(x, weight, bias32, out))
        call.keepalive = bias32  # the fp32 bias lives with the call
        return call

    @staticmethod
    def _args(
        x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None, out: torch.Tensor
    ) -> tuple:
        m, k = x.shape
        bias_ptr = bias32.data_ptr() if bias32 is not None else None
        return (x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(), m, weight.shape[0],
                k, torch.get_num_threads())  # fmt: skip


def _fp32(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as the kernel adds it (fp32, before the one rounding to bf16)."""
    return bias.detach().float().contiguous() if bias is not None else None


def load_bf16_tiles_kernel() -> Bf16TilesKernel | None:
    """The kernel where this CPU has AMX (and a compiler), else None."""
    lib = build_library("bf16_tiles.cpp", ("-fopenmp",))
    if lib is None or not lib.bf16_tiles_available():
        return None
    return Bf16TilesKernel(lib)
