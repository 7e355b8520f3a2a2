"""Attention over the paged KV cache: the CPU backend (C++ kernels for decode rows and for
prefill chunks), the PyTorch reference for GPU backends, and what runs on a CUDA device until a
Triton backend does (there, every path is torch's fused scaled-dot-product attention).

Cache layout per layer: K and V each ``[num_kv_heads, num_blocks, block_size, head_dim]``, so one
``index_select`` over ``[kv_heads * blocks, block_size * head_dim]`` rows gathers a batch's
context straight into ``[batch, kv_heads, context, head_dim]`` (contiguous, ready for matmul).

Two paths share each step. "Row-wise" tokens come first in the batch and are attended together,
one query row each with its own context length: decode tokens always, and with the C++ kernel
also prefill chunks whose attention work (tokens x context) is small, each of their tokens being
a row that sees the positions up to its own. The kernel reads K/V in place through the block
table; without it, decode rows gather their blocks into a buffer padded to the longest context.
The remaining prefill chunks go, all of them in one call, to the C++ prefill kernel: tiled over
keys with an online softmax, reading the prefix through the block table (nothing is gathered and
no score matrix is formed). Without that kernel they are attended one sequence at a time with
GEMMs over a gathered prefix, causal within the chunk. Metadata is built on the host and moved
to the device once per step.

On a CPU with the C++ kernels an eager step's rotary and K/V write are one call of the fused
decode op (``rotate_and_write``, the same bits as the eager rotary): the layer hands over its
q/k/v projection and gets q back rotated, k and v already in the cache (a 2048-token chunk of
SmolLM2: 0.4 ms a layer where the eager rotary took 1.6 and the write 0.35).

With an FP8 cache (``--kv-cache-dtype fp8``) the step's K and V are quantized as they are written
and every path reads them back from the cache: the C++ kernels convert FP8 as they load, the
PyTorch paths dequantize what they gather, and a chunk that starts its sequence attends to its
own K and V rounded as the cache holds them, so a chunked or cached prefill sees the same values
as a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagellm.attention.backend import SeqLayout
from pagellm.attention.kv_cache import KVCacheFormat, LayerKV
from pagellm.kernels.decode_ops import DTYPE_CODES, DecodeOps
from pagellm.kernels.paged_attention import PagedDecodeKernel, PagedPrefillKernel


@dataclass(slots=True)
class PrefillChunk:
    token_start: int
    num_tokens: int
    start_pos: int
    gather_idx: torch.Tensor | None
    """Rows of this sequence's blocks (None when the chunk starts the sequence)."""


@dataclass(slots=True)
class KernelPrefills:
    """Every prefill chunk of the step, for one call of the prefill kernel."""

    token_start: int
    """The chunks' tokens are the step's tokens from here on."""
    block_tables: torch.Tensor
    """int32 [chunks, max_blocks]."""
    query_starts: torch.Tensor
    """int32 [chunks + 1]: each chunk's first token, counted from ``token_start``."""
    start_pos: torch.Tensor
    """int32 [chunks]: tokens cached before each chunk."""
    max_chunk_tokens: int


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_rows: int
    """The first ``num_rows`` tokens are attended row-wise (see the module docstring)."""
    prefills: list[PrefillChunk]
    kernel_prefills: KernelPrefills | None = None
    """Set instead of ``prefills`` when the prefill kernel attends the chunks."""
    row_block_tables: torch.Tensor | None = None
    """int32 [rows, max_blocks] for the kernel: each row's sequence's block table."""
    row_context_lens: torch.Tensor | None = None
    """int32 [rows]: how many positions each row attends to (its own position + 1)."""
    decode_gather_idx: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    """Additive mask [rows, 1, 1, padded_context]: 0 where a key exists, -inf past the end."""
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None


class TorchAttentionBackend:
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        decode_kernel: PagedDecodeKernel | None = None,
        device: torch.device | str = "cpu",
        prefill_kernel: PagedPrefillKernel | None = None,
        kv_format: KVCacheFormat | None = None,
        calculate_kv_scales: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        self.device = torch.device(device)
        on_cpu = self.device.type == "cpu"
        self.kv_format = kv_format or KVCacheFormat("auto")
        self.calculate_kv_scales = calculate_kv_scales and self.kv_format.fp8 is not None
        code = self.kv_format.kernel_code
        self.decode_kernel = (
            decode_kernel
            if on_cpu and decode_kernel and decode_kernel.supports(dtype, code)
            else None
        )
        self.prefill_kernel = (
            prefill_kernel if prefill_kernel and prefill_kernel.supports(dtype, code) else None
        )
        """The C++ kernel on a CPU, the Triton one on a GPU (same contract)."""
        self.rope_ops: DecodeOps | None = None
        """The C++ decode ops where ``rotate_and_write`` applies (``use_rope_ops``)."""
        self.fused_sdpa = not on_cpu
        """On a GPU, reduced precision also goes through SDPA (flash / memory-efficient)."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.scale = head_dim**-0.5
        self.batch_invariant = batch_invariant
        """Every token goes through one kernel that reads its keys in an order set by its
        position alone (on a CPU each token a row of the decode kernel, on a GPU a query of
        the Triton prefill kernel): a prefill token's attention equals the same token's decoded
        one, whatever the chunking and the batch (``pagellm.runner.batch_invariant``)."""
        if (
            batch_invariant
            and (self.prefill_kernel if self.fused_sdpa else self.decode_kernel) is None
        ):
            raise ValueError(
                "--batch-invariant needs the C++ decode attention kernel on a CPU (a C++ "
                "compiler) or the Triton prefill kernel on a GPU, for this dtype and KV cache"
            )

    # Above this many (query tokens x context positions) a prefill chunk is cheaper as GEMMs.
    ROW_WISE_WORK_LIMIT = 256 * 1024

    def is_row_wise(self, num_tokens: int, start_pos: int) -> bool:
        """Whether a sequence's chunk goes to the row-wise path (the runner puts those first)."""
        if self.batch_invariant:
            return not self.fused_sdpa  # a CPU's decode kernel; a GPU's prefill kernel
        if num_tokens == 1:
            return True
        if self.decode_kernel is None or self.prefill_kernel is not None:
            return False
        return num_tokens * (start_pos + num_tokens) <= self.ROW_WISE_WORK_LIMIT

    def prefill_item_rows(self) -> int:
        """Query rows of the C++ prefill kernel's smallest work item for this backend's calls
        (0 without that kernel)."""
        kernel = self.prefill_kernel
        if not isinstance(kernel, PagedPrefillKernel):
            return 0
        return kernel.smallest_item_rows(
            self.dtype, self.kv_format.kernel_code, self.head_dim, self.block_size
        )

    @property
    def cache_dtype(self) -> torch.dtype:
        """The element type of the cache tensors (uint8 for FP8)."""
        return self.kv_format.storage_dtype(self.dtype)

    def allocate_cache(self, num_layers: int, num_blocks: int, host: bool = False) -> list[LayerKV]:
        shape = (self.num_kv_heads, num_blocks, self.block_size, self.head_dim)
        device = "cpu" if host else self.device
        pin = host and self.device.type == "cuda"

        def tensor() -> torch.Tensor:
            return torch.zeros(shape, dtype=self.cache_dtype, device=device, pin_memory=pin)

        pending = self.calculate_kv_scales and not host
        return [LayerKV(tensor(), tensor(), scales_pending=pending) for _ in range(num_layers)]

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
        num_row_seqs = 0
        while num_row_seqs < len(seqs) and self.is_row_wise(
            seqs[num_row_seqs].num_tokens, seqs[num_row_seqs].start_pos
        ):
            num_row_seqs += 1
        rows, rest = seqs[:num_row_seqs], seqs[num_row_seqs:]
        assert not any(self.is_row_wise(s.num_tokens, s.start_pos) for s in rest), (
            "row-wise sequences must come first"
        )
        num_rows = sum(s.num_tokens for s in rows)
        meta = TorchAttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_rows=num_rows,
            prefills=[]
            if self.prefill_kernel
            else self._prefill_chunks(rest, num_rows, num_blocks),
        )
        if self.prefill_kernel and rest:
            meta.kernel_prefills = _kernel_prefills(rest, num_rows)
        if rows:
            self._row_metadata(meta, rows, num_blocks)
        if self.device.type != "cpu":
            _move_to(meta, self.device)
        return meta

    def _row_metadata(
        self, meta: TorchAttentionMetadata, rows: list[SeqLayout], num_blocks: int
    ) -> None:
        max_blocks = max(len(s.block_ids) for s in rows)
        table = torch.zeros(len(rows), max_blocks, dtype=torch.long)
        for i, seq in enumerate(rows):
            table[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.long)
        if self.decode_kernel is not None:
            counts = torch.tensor([s.num_tokens for s in rows])
            meta.row_block_tables = table.to(torch.int32).repeat_interleave(counts, dim=0)
            lens = [p + 1 for s in rows for p in range(s.start_pos, s.start_pos + s.num_tokens)]
            meta.row_context_lens = torch.tensor(lens, dtype=torch.int32)
            return
        self._decode_gather_metadata(meta, rows, table, num_blocks)

    def _decode_gather_metadata(
        self,
        meta: TorchAttentionMetadata,
        decodes: list[SeqLayout],
        table: torch.Tensor,
        num_blocks: int,
    ) -> None:
        head_offsets = torch.arange(self.num_kv_heads, dtype=torch.long) * num_blocks
        meta.decode_gather_idx = (head_offsets.view(1, -1, 1) + table.unsqueeze(1)).reshape(-1)
        context = table.shape[1] * self.block_size
        lens = torch.tensor([s.start_pos + 1 for s in decodes], dtype=torch.long)
        valid = torch.arange(context).unsqueeze(0) < lens.unsqueeze(1)
        mask = torch.zeros(len(decodes), 1, 1, context, dtype=self.dtype)
        meta.decode_mask = mask.masked_fill_(
            ~valid.view(len(decodes), 1, 1, context), float("-inf")
        )
        shape = (len(decodes), self.num_kv_heads, context, self.head_dim)
        meta.k_buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        meta.v_buf = torch.empty(shape, dtype=self.dtype, device=self.device)

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

    def use_rope_ops(self, ops: DecodeOps) -> None:
        """Let ``rotate_and_write`` rotate q and k and write k and v in one call of ``ops``
        (the runner, on a CPU): only where every step's K/V are read back from the cache by
        the C++ kernels (a prefill kernel takes every chunk) and stored as q's dtype (no FP8)."""
        applies = (
            self.prefill_kernel is not None
            and self.kv_format.fp8 is None
            and self.dtype in DTYPE_CODES
            and self.device.type == "cpu"
        )
        self.rope_ops = ops if applies else None

    def rotate_and_write(
        self,
        cache: LayerKV,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: torch.nn.Module,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor | None:
        """q [tokens, heads, head_dim] rotated from the fused projection ``qkv`` [tokens, (heads
        + 2 kv heads) x head_dim], with k rotated and v written into the cache at the step's
        slots, by the C++ op; None where it does not apply (see ``use_rope_ops``): then the
        caller rotates and ``forward`` writes."""
        ops = self.rope_ops
        if ops is None or not qkv.is_contiguous():
            return None
        tokens = qkv.shape[0]
        hkv, nb, bs, d = cache.k.shape
        q = torch.empty(tokens, self.num_heads, d, dtype=qkv.dtype)
        positions = positions.contiguous()  # held here: the call reads its memory
        rc = ops.rope_kv_write(
            DTYPE_CODES[qkv.dtype], qkv.data_ptr(), positions.data_ptr(),
            rotary.cos.data_ptr(), rotary.sin.data_ptr(), q.data_ptr(), cache.k.data_ptr(),
            cache.v.data_ptr(), meta.slot_mapping.data_ptr(), tokens, self.num_heads, hkv, d,
            nb * bs, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode_rope_kv_write failed with code {rc}")
        return q

    def forward(
        self,
        cache: LayerKV,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        """Attention of the step's queries; k and v None: already in the cache
        (``rotate_and_write``)."""
        if k is not None:
            self._write(cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        nr = meta.num_rows
        if nr:
            out[:nr] = self._row_wise(cache, q[:nr], meta)
        if meta.prefills and self.kv_format.fp8 is not None:
            k, v = self._as_cached(k, cache.k_scale), self._as_cached(v, cache.v_scale)
        for chunk in meta.prefills:
            sl = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[sl] = self._prefill(cache, q[sl], k[sl], v[sl], chunk)
        batch = meta.kernel_prefills
        if batch is not None:
            start = batch.token_start
            self.prefill_kernel(
                q[start:].contiguous(),
                cache.k,
                cache.v,
                batch.block_tables,
                batch.query_starts,
                batch.start_pos,
                out[start:],
                self.scale * cache.k_scale,
                batch.max_chunk_tokens,
                **self._kernel_kv_args(cache),
            )
        return out.view(q.shape[0], -1)

    def _kernel_kv_args(self, cache: LayerKV) -> dict:
        """An FP8 cache's code and v_scale for the C++ kernels (nothing for a plain cache, so
        that a kernel without FP8, as the Triton one, keeps its signature)."""
        if self.kv_format.fp8 is None:
            return {}
        return {"kv_code": self.kv_format.kernel_code, "v_scale": cache.v_scale}

    def _write(self, cache: LayerKV, k, v, slot_mapping) -> None:
        if self.kv_format.fp8 is not None:
            if cache.scales_pending:
                cache.take_scales_from(k, v)
            k = self.kv_format.quantize(k, cache.k_scale)
            v = self.kv_format.quantize(v, cache.v_scale)
        hkv, nb, bs, d = cache.k.shape
        cache.k.view(hkv, nb * bs, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
        cache.v.view(hkv, nb * bs, d).index_copy_(1, slot_mapping, v.transpose(0, 1))

    def _as_cached(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """x as an FP8 cache holds it (quantized and back)."""
        return self.kv_format.dequantize(self.kv_format.quantize(x, scale), scale, x.dtype)

    def _gather(self, cache: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None):
        hkv, nb, bs, d = cache.shape
        rows = cache.view(hkv * nb, bs * d)
        if out is None:
            return rows.index_select(0, idx)
        return torch.index_select(rows, 0, idx, out=out.view(-1, bs * d))

    def _gather_values(
        self, cache: torch.Tensor, scale: float, idx: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The rows ``idx`` of a cache as values in the compute dtype (into ``out`` if given)."""
        if self.kv_format.fp8 is None:
            return self._gather(cache, idx, out)
        rows = self.kv_format.dequantize(self._gather(cache, idx, None), scale, self.dtype)
        return rows if out is None else out.view(rows.shape).copy_(rows)

    def _row_wise(self, cache: LayerKV, q: torch.Tensor, meta: TorchAttentionMetadata):
        b = q.shape[0]
        if meta.row_block_tables is not None:
            out = torch.empty_like(q)
            self.decode_kernel(
                q.contiguous(),
                cache.k,
                cache.v,
                meta.row_block_tables,
                meta.row_context_lens,
                out,
                self.scale * cache.k_scale,
                fixed_split=self.batch_invariant,
                **self._kernel_kv_args(cache),
            )
            return out
        self._gather_values(cache.k, cache.k_scale, meta.decode_gather_idx, meta.k_buf)
        self._gather_values(cache.v, cache.v_scale, meta.decode_gather_idx, meta.v_buf)
        keys, values = meta.k_buf, meta.v_buf  # [B, Hkv, L, D]
        if q.dtype == torch.float32 or self.fused_sdpa:
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

    def _prefill(self, cache: LayerKV, q, k, v, chunk: PrefillChunk) -> torch.Tensor:
        n, ctx = chunk.num_tokens, chunk.start_pos + chunk.num_tokens
        if chunk.gather_idx is None:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, n, D]
        else:
            shape = (self.num_kv_heads, -1, self.head_dim)
            idx = chunk.gather_idx
            keys = self._gather_values(cache.k, cache.k_scale, idx, None).view(shape)[:, :ctx]
            values = self._gather_values(cache.v, cache.v_scale, idx, None).view(shape)[:, :ctx]
        if q.dtype == torch.float32 or self.fused_sdpa:
            mask = None
            if chunk.gather_idx is not None:
                mask = _causal_mask(chunk.start_pos, n, torch.bool, q.device)
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
        mask = _causal_mask(chunk.start_pos, n, torch.float32, q.device).repeat(self.group, 1)
        out = self._grouped_attention(qg, keys, values, mask)  # [Hkv, G * n, D]
        out = out.view(self.num_kv_heads, self.group, n, self.head_dim)
        return out.permute(2, 0, 1, 3).reshape(n, self.num_heads, self.head_dim)


def _kernel_prefills(seqs: list[SeqLayout], token_start: int) -> KernelPrefills:
    max_blocks = max(len(s.block_ids) for s in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    starts = [0]
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
        starts.append(starts[-1] + seq.num_tokens)
    return KernelPrefills(
        token_start,
        tables,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([s.start_pos for s in seqs], dtype=torch.int32),
        max(s.num_tokens for s in seqs),
    )


def _causal_mask(start: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[n, start + n]: query i (at position start + i) sees keys at positions <= start + i."""
    keys = torch.arange(start + n, device=device).unsqueeze(0)
    allowed = keys <= torch.arange(start, start + n, device=device).unsqueeze(1)
    if dtype == torch.bool:
        return allowed
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return zeros.masked_fill_(~allowed, float("-inf"))


def _move_to(meta: TorchAttentionMetadata, device: torch.device) -> None:
    """The host-built index tensors onto the device (the buffers were made there)."""
    for name in (
        "slot_mapping",
        "row_block_tables",
        "row_context_lens",
        "decode_gather_idx",
        "decode_mask",
    ):
        value = getattr(meta, name)
        if value is not None:
            setattr(meta, name, value.to(device, non_blocking=True))
    for chunk in meta.prefills:
        if chunk.gather_idx is not None:
            chunk.gather_idx = chunk.gather_idx.to(device, non_blocking=True)
    batch = meta.kernel_prefills
    if batch is not None:
        for name in ("block_tables", "query_starts", "start_pos"):
            setattr(batch, name, getattr(batch, name).to(device, non_blocking=True))
