"""The attention backend contract: cache layout, per-step metadata, and the attention op.

A model calls ``backend.forward(layer_cache, q, k, v, metadata)`` in every layer; the runner calls
``build_metadata`` once per step. A GPU backend (Triton) implements the same three methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class SeqLayout:
    """One sequence's place in the flattened batch."""

    num_tokens: int
    start_pos: int
    """Tokens already in the cache before this step (the query's position offset)."""
    block_ids: list[int]


class AttentionBackend(Protocol):
    def allocate_cache(self, num_layers: int, num_blocks: int, host: bool = False) -> list[Any]:
        """Per-layer KV storage for ``num_blocks`` blocks, on the backend's device (or in host
        memory, pinned under a GPU, for swapped-out blocks)."""
        ...

    def is_row_wise(self, num_tokens: int, start_pos: int) -> bool:
        """Chunks for which this is True must come first in the batch (decodes always are)."""
        ...

    def build_metadata(self, seqs: list[SeqLayout], num_blocks: int) -> Any:
        """Everything the layers need for this step, ordered as ``is_row_wise`` asks."""
        ...

    def forward(
        self, cache: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any
    ) -> torch.Tensor:
        """Write k/v of this step into ``cache``, attend; q [T, Hq, D] -> [T, Hq * D]."""
        ...


def cache_bytes_per_block(
    num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * block_size * element
