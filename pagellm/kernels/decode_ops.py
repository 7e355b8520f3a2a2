"""Python face of the fused decode-step glue (decode_ops.cpp): residual add + RMSNorm, rotary +
K/V cache write, SiLU-and-multiply; the greedy argmax over logits rows and a grammar's token
bitmask applied to a logits row. The ctypes functions are exposed as they are, so that a
captured step (``pagellm.runner.captured``) binds their arguments once (``bound``) and runs its
list of kernel calls from C (``run_calls``, see ``pagellm.kernels.packed``)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from pagellm.kernels.cpu_build import build_library
from pagellm.kernels.packed import BoundCall

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class DecodeOps:
    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i, f, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_int64
        self.lib = lib
        self.add_rms_norm = lib.decode_add_rms_norm
        self.add_rms_norm.restype = i
        self.add_rms_norm.argtypes = [i, ptr, ptr, ptr, ptr, i, i, f, i]
        self.rope_kv_write = lib.decode_rope_kv_write
        self.rope_kv_write.restype = i
        self.rope_kv_write.argtypes = [i, *[ptr] * 8, i, i, i, i, i64, i]
        self.silu_mul = lib.decode_silu_mul
        self.silu_mul.restype = i
        self.silu_mul.argtypes = [i, ptr, ptr, i, i, i]
        self._argmax = lib.decode_argmax_rows
        self._argmax.restype = i
        self._argmax.argtypes = [i, ptr, i, i, i64, ptr, i]
        self._apply_bitmask = lib.decode_apply_bitmask
        self._apply_bitmask.restype = i
        self._apply_bitmask.argtypes = [ptr, i, ptr, i]
        self.run_calls = lib.decode_run_calls
        """Bound calls in order from C: (n, entries, their packed arguments)."""
        self.run_calls.restype = i
        self.run_calls.argtypes = [i, ctypes.POINTER(ptr), ctypes.POINTER(ctypes.POINTER(i64))]

    def bound(self, fn: Any, *args: Any) -> BoundCall:
        """``fn`` (one of this library's functions above) with its arguments bound."""
        return BoundCall(self.lib, fn, args)

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """``logits.argmax(dim=-1).tolist()`` of CPU rows [rows, vocab] (float32 or bf16, last
        dimension contiguous), the first index among equal maxima, NaN above all (as torch)."""
        rows, n = logits.shape
        if logits.stride(1) != 1 or logits.dtype not in DTYPE_CODES or not logits.is_cpu:
            return logits.argmax(dim=-1).tolist()
        out = torch.empty(rows, dtype=torch.int64)
        rc = self._argmax(DTYPE_CODES[logits.dtype], logits.data_ptr(), rows, n,
                          logits.stride(0), out.data_ptr(), torch.get_num_threads())  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode_argmax_rows failed with code {rc}")
        return out.tolist()

    def apply_bitmask(self, row: torch.Tensor, bitmask: torch.Tensor) -> None:
        """``pagellm.sampling.sampler.apply_token_bitmask`` on a float32 CPU row, in C++."""
        if row.dtype != torch.float32 or not row.is_contiguous() or not row.is_cpu:
            from pagellm.sampling.sampler import apply_token_bitmask

            apply_token_bitmask(row, bitmask)
            return
        mask = bitmask.contiguous()
        rc = self._apply_bitmask(row.data_ptr(), row.shape[0], mask.data_ptr(), mask.shape[0])
        if rc != 0:
            raise RuntimeError(f"decode_apply_bitmask failed with code {rc}")

    @staticmethod
    def supports(dtype: torch.dtype) -> bool:
        return dtype in DTYPE_CODES


def load_decode_ops() -> DecodeOps | None:
    """The ops built for this CPU, or None without a compiler."""
    # in the source's order: a product eager code rounds, and the exp's split ln2, stay exact
    flags = ("-fopenmp", "-ffp-contract=off", "-fno-associative-math")
    lib = build_library("decode_ops.cpp", flags)
    return DecodeOps(lib) if lib is not None else None
