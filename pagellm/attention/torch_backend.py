"""CPU attention over the paged KV cache in plain PyTorch (also the reference for GPU backends).

Cache layout per layer: K and V each ``[num_kv_heads, num_blocks, block_size, head_dim]``, so one
``index_select`` over ``[kv_heads * blocks, block_size * head_dim]`` rows gathers a batch's
context straight into ``[batch, kv_heads, context, head_dim]`` (contiguous, ready for matmul).
Decode tokens (one query per sequence) are attended together, padded to the longest context;
prefill chunks are attended one sequence at a time, causal within the chunk and over the prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.attention.backend import SeqLayout
from pagellm.kernels.paged_attention import PagedDecodeKernel


@dataclass(slots=True)
class PrefillChunk:
    token_start: int
    num_tokens: int
    start_pos: int
    gather_idx: torch.Tensor | None
    """Rows of this sequence's blocks (None when the chunk starts the sequence)."""


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_gather_idx: torch.Tensor | None
    decode_mask: torch.Tensor | None
    """Additive mask [decodes, 1, 1, padded_context]: 0 where a key exists, -inf past the end."""
    decode_context: int
    prefills: list[PrefillChunk]
    k_buf: torch.Tensor | None
    v_buf: torch.Tensor | None
    decode_block_tables: torch.Tensor | None = None
    """int32 [decodes, max_blocks], for the C++ kernel (which reads the cache in place)."""
    decode_context_lens: torch.Tensor | None = None


class TorchAttentionBackend:
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        decode_kernel: PagedDecodeKernel | None = None,
    ) -> None:
        self.decode_kernel = (
            decode_kernel if decode_kernel and decode_kernel.supports(dtype) else None
        )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.scale = head_dim**-0.5

    def allocate_cache(self, num_layers: int, num_blocks: int) -> list[tuple[torch.Tensor, ...]]:
        shape = (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)
        return [
            (torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype))
            for _ in range(num_layers)
        ]

    # ----- per step ---------------------------------------------------------------------

    def build_metadata(self, seqs: list[SeqLayout], num_blocks: int) -> TorchAttentionMetadata:
        bs = self.block_size
        slots: list[int] = []
        for seq in seqs:
            table = seq.block_ids
            slots.extend(
                table[p // bs] * bs + p % bs
                for p in range(seq.start_pos, seq.start_pos + seq.num_tokens)
            )
        decodes = [s for s in seqs if s.num_tokens == 1]
        num_decodes = len(decodes)
        assert all(s.num_tokens == 1 for s in seqs[:num_decodes]), "decodes must come first"
        meta = TorchAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decodes=num_decodes,
            decode_gather_idx=None,
            decode_mask=None,
            decode_context=0,
            prefills=self._prefill_chunks(seqs[num_decodes:], num_decodes, num_blocks),
            k_buf=None,
            v_buf=None,
        )
        if num_decodes:
            self._decode_metadata(meta, decodes, num_blocks)
        return meta

    def _decode_metadata(
        self, meta: TorchAttentionMetadata, decodes: list[SeqLayout], num_blocks: int
    ) -> None:
        bs = self.block_size
        max_blocks = max(len(s.block_ids) for s in decodes)
        table = torch.zeros(len(decodes), max_blocks, dtype=torch.long)
        for i, seq in enumerate(decodes):
            table[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.long)
        if self.decode_kernel is not None:
            meta.decode_block_tables = table.to(torch.int32)
            lens = [s.start_pos + 1 for s in decodes]
            meta.decode_context_lens = torch.tensor(lens, dtype=torch.int32)
            return
        head_offsets = torch.arange(self.num_kv_heads, dtype=torch.long) * num_blocks
        meta.decode_gather_idx = (head_offsets.view(1, -1, 1) + table.unsqueeze(1)).reshape(-1)
        context = max_blocks * bs
        lens = torch.tensor([s.start_pos + 1 for s in decodes], dtype=torch.long)
        valid = torch.arange(context).unsqueeze(0) < lens.unsqueeze(1)
        mask = torch.zeros(len(decodes), 1, 1, context, dtype=self.dtype)
        meta.decode_mask = mask.masked_fill_(
            ~valid.view(len(decodes), 1, 1, context), float("-inf")
        )
        meta.decode_context = context
        shape = (len(decodes), self.num_kv_heads, context, self.head_dim)
        meta.k_buf = torch.empty(shape, dtype=self.dtype)
        meta.v_buf = torch.empty(shape, dtype=self.dtype)

    def _prefill_chunks(
        self, seqs: list[SeqLayout], token_start: int, num_blocks: int
    ) -> list[PrefillChunk]:
        chunks = []
        for seq in seqs:
            idx = None
            if seq.start_pos > 0:
                nb = -(-(seq.start_pos + seq.num_tokens) // self.block_size)
                blocks = torch.tensor(seq.block_ids[:nb], dtype=torch.long)
                heads = torch.arange(self.num_kv_heads, dtype=torch.long) * num_blocks
                idx = (heads.view(-1, 1) + blocks.view(1, -1)).reshape(-1)
            chunks.append(PrefillChunk(token_start, seq.num_tokens, seq.start_pos, idx))
            token_start += seq.num_tokens
        return chunks

    # ----- per layer --------------------------------------------------------------------

    def forward(
        self,
        cache: tuple[torch.Tensor, torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = cache
        self._write(k_cache, v_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(k_cache, v_cache, q[:nd], meta)
        for chunk in meta.prefills:
            sl = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[sl] = self._prefill(k_cache, v_cache, q[sl], k[sl], v[sl], chunk)
        return out.view(q.shape[0], -1)

    def _write(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        hkv, nb, bs, d = k_cache.shape
        k_cache.view(hkv, nb * bs, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_cache.view(hkv, nb * bs, d).index_copy_(1, slot_mapping, v.transpose(0, 1))

    def _gather(self, cache: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None):
        hkv, nb, bs, d = cache.shape
        rows = cache.view(hkv * nb, bs * d)
        if out is None:
            return rows.index_select(0, idx)
        return torch.index_select(rows, 0, idx, out=out.view(-1, bs * d))

    def _decode(self, k_cache, v_cache, q: torch.Tensor, meta: TorchAttentionMetadata):
        b = q.shape[0]
        if meta.decode_block_tables is not None:
            out = torch.empty_like(q)
            self.decode_kernel(
                q.contiguous(),
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                out,
                self.scale,
            )
            return out
        self._gather(k_cache, meta.decode_gather_idx, meta.k_buf)
        self._gather(v_cache, meta.decode_gather_idx, meta.v_buf)
        keys, values = meta.k_buf, meta.v_buf  # [B, Hkv, L, D]
        if q.dtype == torch.float32:
            qh = q.view(b, self.num_heads, 1, self.head_dim)
            out = F.scaled_dot_product_attention(
                qh, keys, values, attn_mask=meta.decode_mask, enable_gqa=True
            )
            return out.view(b, self.num_heads, self.head_dim)
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim)
        out = self._grouped_attention(qg, keys, values, meta.decode_mask)
        return out.view(b, self.num_heads, self.head_dim)

    def _grouped_attention(self, q, keys, values, mask_add) -> torch.Tensor:
        """Reduced precision: batched matmuls beat the CPU SDPA kernel; softmax in float32.

        q [..., Hkv, M, D] (M = the query heads of a KV head x query tokens) against keys and
        values [..., Hkv, ctx, D]; ``mask_add`` broadcasts onto the scores [..., Hkv, M, ctx].
        Folding the group into M keeps each product one plain batched GEMM (no broadcast copy).
        """
        scores = torch.matmul(q, keys.transpose(-1, -2)).float()
        scores.mul_(self.scale).add_(mask_add)
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, values)

    def _prefill(self, k_cache, v_cache, q, k, v, chunk: PrefillChunk) -> torch.Tensor:
        n, ctx = chunk.num_tokens, chunk.start_pos + chunk.num_tokens
        if chunk.gather_idx is None:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, n, D]
        else:
            shape = (self.num_kv_heads, -1, self.head_dim)
            keys = self._gather(k_cache, chunk.gather_idx, None).view(shape)[:, :ctx]
            values = self._gather(v_cache, chunk.gather_idx, None).view(shape)[:, :ctx]
        if q.dtype == torch.float32:
            mask = None
            if chunk.gather_idx is not None:
                mask = _causal_mask(chunk.start_pos, n, torch.bool)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                enable_gqa=True,
            )
            return out.squeeze(0).transpose(0, 1)
        qg = q.view(n, self.num_kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(self.num_kv_heads, self.group * n, self.head_dim)
        mask = _causal_mask(chunk.start_pos, n, torch.float32).repeat(self.group, 1)
        out = self._grouped_attention(qg, keys, values, mask)  # [Hkv, G * n, D]
        out = out.view(self.num_kv_heads, self.group, n, self.head_dim)
        return out.permute(2, 0, 1, 3).reshape(n, self.num_heads, self.head_dim)


def _causal_mask(start: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, start + n]: query i (at position start + i) sees keys at positions <= start + i."""
    allowed = torch.arange(start + n).unsqueeze(0) <= torch.arange(start, start + n).unsqueeze(1)
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
