"""Python face of the fused decode-step glue (decode_ops.cpp): residual add + RMSNorm, rotary +
K/V cache write, SiLU-and-multiply. The ctypes functions are exposed as they are, so that a
captured step (``pagellm.runner.captured``) binds their arguments once and calls them bare."""

from __future__ import annotations

import ctypes

import torch

from pagellm.kernels.cpu_build import build_library

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class DecodeOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i, f, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
        self.add_rms_norm = lib.decode_add_rms_norm
        self.add_rms_norm.restype = i
        self.add_rms_norm.argtypes = [i, ptr, ptr, ptr, ptr, i, i, f, i]
        self.rope_kv_write = lib.decode_rope_kv_write
        self.rope_kv_write.restype = i
        self.rope_kv_write.argtypes = [i, *[ptr] * 8, i, i, i, i, i64, i]
        self.silu_mul = lib.decode_silu_mul
        self.silu_mul.restype = i
        self.silu_mul.argtypes = [i, ptr, ptr, i, i, i]

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in DTYPE_CODES


def load_decode_ops() -> DecodeOps | None:
    """The ops built for this CPU, or None without a compiler."""
    lib = build_library("decode_ops.cpp", ("-fopenmp", "-ffp-contract=off"))
    return DecodeOps(lib) if lib is not None else None
