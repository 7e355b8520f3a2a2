"""The KV cache's element format (``--kv-cache-dtype``) and one layer's cache storage.

``auto`` keeps K and V in the compute dtype. ``fp8`` / ``fp8_e4m3`` and ``fp8_e5m2`` keep one
byte per value: the bits of ``float8_e4m3fn`` / ``float8_e5m2`` in uint8 tensors (torch's CPU
ops copy and index uint8, not float8), holding K / k_scale and V / v_scale. Writing rounds to
nearest even and saturates at the format's largest finite value, so the cache never holds an
infinity or a NaN. Each layer has its own pair of scales: from the checkpoint, from its first
write (``--calculate-kv-scales``), or 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.config import KV_CACHE_DTYPES

K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0
"""--calculate-kv-scales: k_scale = max |K| / 200, v_scale = max |V| / 100 over the first write,
leaving room for larger values later (vLLM's constants)."""


@dataclass(frozen=True, slots=True)
class KVCacheFormat:
    """How K and V are stored."""

    name: str
    fp8: torch.dtype | None = None
    """torch's float8 dtype whose bits the cache holds; None: the compute dtype."""

    @property
    def kernel_code(self) -> int:
        """The C++ kernels' code: 0 the compute dtype, 1 E4M3, 2 E5M2."""
        return {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}[self.fp8]

    @property
    def max_value(self) -> float:
        return torch.finfo(self.fp8).max if self.fp8 is not None else float("inf")

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.uint8 if self.fp8 is not None else dtype

    def quantize(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x / scale in the stored form (uint8 bits of the FP8 value)."""
        limit = self.max_value
        scaled = (x.float() / scale).clamp_(-limit, limit)
        return scaled.to(self.fp8).view(torch.uint8)

    def dequantize(self, stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """The values a stored FP8 tensor stands for, in ``dtype``."""
        return (stored.view(self.fp8).float() * scale).to(dtype)


def kv_cache_format(kv_cache_dtype: str) -> KVCacheFormat:
    """The format ``--kv-cache-dtype`` names; ValueError (naming the setting) otherwise."""
    if kv_cache_dtype == "auto":
        return KVCacheFormat("auto")
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return KVCacheFormat(kv_cache_dtype, torch.float8_e4m3fn)
    if kv_cache_dtype == "fp8_e5m2":
        return KVCacheFormat(kv_cache_dtype, torch.float8_e5m2)
    raise ValueError(
        f"--kv-cache-dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
    )


@dataclass(eq=False, slots=True)
class LayerKV:
    """One layer's K and V cache, ``[kv_heads, blocks, block_size, head_dim]`` each, with the
    layer's FP8 scales. Iterates (and indexes) as the pair (k, v), so code that copies blocks
    or counts bytes treats it as two tensors."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0
    scales_pending: bool = False
    """--calculate-kv-scales: the scales come from the next write (then this turns False)."""

    def __iter__(self):
        yield self.k
        yield self.v

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.k, self.v)[index]

    def take_scales_from(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """--calculate-kv-scales: this write's K and V set the layer's scales (a write of only
        zeros, as a warm-up may make, leaves them pending)."""
        k_max, v_max = float(k.abs().max()), float(v.abs().max())
        if k_max > 0 and v_max > 0:
            self.k_scale, self.v_scale = k_max / K_SCALE_RANGE, v_max / V_SCALE_RANGE
            self.scales_pending = False
