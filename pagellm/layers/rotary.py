"""Rotary position embedding (rotate-half layout) with Llama-3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, freq_factors: torch.Tensor | None
) -> torch.Tensor:
    # float32 arithmetic, as the Hugging Face reference computes it.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if freq_factors is not None:  # GGUF stores llama3 scaling as per-frequency divisors
        return inv_freq / freq_factors.float()
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling or {})
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    factor = float(cfg["factor"])
    low = float(cfg.get("low_freq_factor", 1.0))
    high = float(cfg.get("high_freq_factor", 4.0))
    old_len = float(cfg.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin per position; ``forward`` rotates q and k of shape [T, heads, dim]."""

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [T, heads, dim] (q and k heads together) at ``positions`` [T].

        cos/sin are cast to x's dtype first, as the Hugging Face reference does.
        """
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(x.dtype)
        sin = self.sin.index_select(0, positions).unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
