"""Python face of the batch-invariant linear kernel (invariant_linear.cpp): weights packed once,
``out = x @ W.T + bias`` with each output element reduced over K in the same order for any
number of rows (``--batch-invariant``)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.kernels.cpu_build import build_library

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
PATH_NAMES = {0: "float32 FMA", 1: "AVX-512 BF16", 2: "AMX"}
BLOCK_COLS = 16
BF16_K_STEP = 32


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """A [n, k] weight in the kernel's layout (see invariant_linear.cpp) and its bias in fp32."""

    data: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int
    kp: int
    """K as packed: bf16 rounds it up to 32 (zeros), fp32 keeps it."""
    dtype: torch.dtype

    def nbytes(self) -> int:
        extra = self.bias.numel() * 4 if self.bias is not None else 0
        return self.data.numel() * self.data.element_size() + extra


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
    """``weight`` [n, k] (bf16 or fp32) packed 16 output columns to a block."""
    n, k = weight.shape
    dtype = weight.dtype
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"the batch-invariant linear takes float32 or bfloat16, not {dtype}")
    np_ = -(-n // BLOCK_COLS) * BLOCK_COLS
    w = weight.detach()
    if dtype == torch.bfloat16:
        kp = -(-k // BF16_K_STEP) * BF16_K_STEP
        w = F.pad(w, (0, kp - k, 0, np_ - n))
        data = w.view(np_ // BLOCK_COLS, BLOCK_COLS, kp // 2, 2).permute(0, 2, 1, 3)
    else:
        kp = k
        w = F.pad(w, (0, 0, 0, np_ - n))
        data = w.view(np_ // BLOCK_COLS, BLOCK_COLS, k).permute(0, 2, 1)
    b = bias.detach().float().contiguous() if bias is not None else None
    return PackedWeight(data.contiguous(), b, n, k, kp, dtype)


class InvariantLinearKernel:
    """``out = x @ W.T + bias`` for any number of rows, each row as if it were alone."""

    def __init__(self, lib: ctypes.CDLL, path: int | None = None) -> None:
        fn = lib.invariant_linear
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
        self._fn = fn
        best = int(lib.invariant_linear_best_path())
        if path is not None and not 0 <= path <= best:
            raise ValueError(f"path {path} is not available here (best: {best})")
        self.path = best if path is None else path
        """The bf16 path (2 AMX, 1 AVX-512 BF16, 0 float32 FMA); float32 always takes 0."""

    @staticmethod
    def pack(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        return pack_weight(weight, bias)

    @property
    def path_name(self) -> str:
        return PATH_NAMES[self.path]

    def __call__(self, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, w.k)
        if x.dtype != w.dtype:
            raise ValueError(f"x is {x.dtype}, the weight {w.dtype}")
        if w.kp != w.k:
            x = F.pad(x, (0, w.kp - w.k))
        x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, w.n, dtype=x.dtype)
        path = self.path if x.dtype == torch.bfloat16 else 0
        rc = self._fn(
            path,
            _DTYPE_CODES[x.dtype],
            x.data_ptr(),
            w.data.data_ptr(),
            w.bias.data_ptr() if w.bias is not None else None,
            out.data_ptr(),
            m,
            w.n,
            w.k,
            w.kp,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"invariant_linear failed with code {rc}")
        return out.view(*lead, w.n)


def load_invariant_linear_kernel(path: int | None = None) -> InvariantLinearKernel | None:
    """The kernel built for this CPU (``path`` forces a slower bf16 path: tests), or None
    without a compiler."""
    # the source's order is the reduction order: no contraction or reassociation by the compiler
    flags = ("-fopenmp", "-ffp-contract=off", "-fno-associative-math")
    lib = build_library("invariant_linear.cpp", flags)
    return InvariantLinearKernel(lib, path) if lib is not None else None
