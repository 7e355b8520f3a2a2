"""Captured decode steps: the CPU counterpart of vLLM's CUDA graphs.

Eager PyTorch dispatches a few hundred ops per decode step (norms, rotary, splits, residual
adds, each layer's glue around its projections), and at a handful of sequences that dispatch
costs more than the arithmetic. A captured step is a fixed list of bare kernel calls over
static buffers, recorded once per batch size: per layer a fused residual-add + RMSNorm, the
Q/K/V projection, rotary + K/V cache write, paged decode attention, the output projection, a
second add + norm, gate/up, SiLU-and-multiply and down (``pagellm.kernels.decode_ops`` for the
glue, the quantized / few-rows linear kernels and the decode attention kernel for the rest).
Every argument (pointers into the weights, the KV cache and the static buffers, shapes, thread
count) is converted once when the plan is built; a step copies its token ids, positions, slots,
context lengths and block tables into the static inputs and runs the list, each run of
consecutive kernel calls from C in one call (``pagellm.kernels.packed``: one ctypes call apiece
cost about a microsecond of Python, ~0.3 ms of a one-stream step).

Which steps: those whose every sequence decodes, or advances a small prefill chunk beside
sequences that decode, with at most ``max_size`` rows: one token per sequence, its last token
and the proposals after it under speculative decoding, or a chunk of a few tokens (at most
``ROW_WORK_LIMIT`` tokens x context: the cut chunks of a long prompt while others decode, a short
prompt joining them). Each row
attends with the decode kernel up to its own position, after the whole step's K/V are written
(so a proposal, or a chunk's token, sees the ones before it), except a chunk with enough rows
(tokens x query heads of a group) to fill half a work item of the prefill kernel: chunks go last
in the step and through one prefill kernel call per layer, which reads a chunk's prefix once
for all its tokens (a long prompt's cut chunk deep in its prompt: the decode kernel read the
prefix once per token). A CPU gains nothing from padding a batch up to a bucket (a padded row
costs the same arithmetic as a real one), so each number of rows gets its own plan, built on first
use (about a millisecond). A long prompt's chunk the scheduler spreads over several steps
(``layer_parts``, layered prefill) goes through a share of the layers per step, the other rows
through all of them (``LayeredChunk``). Under eager-only settings (``--enforce-eager``), with tensor or
pipeline parallelism, an FP8 KV cache, q/k norms or a GPU, steps stay eager.

A linear layer that is not one bare kernel call (several quantized parts, a bias after a
quantized projection, more rows than a kernel's few-rows path, a bf16 dense weight on a CPU
without AMX) runs as its module into the static buffer: still correct, only less fused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagellm.engine.outputs import ScheduledRequest
from pagellm.kernels.decode_ops import DTYPE_CODES, DecodeOps
from pagellm.kernels.packed import run_from_c
from pagellm.kernels.paged_attention import PagedPrefillKernel
from pagellm.layers.linear import Linear
from pagellm.layers.quant_linear import QuantLinear, QuantPart

Call = Callable[[], Any]
ChunkKey = tuple[str, int, tuple[int, ...], tuple[int, ...]]


def unsupported_reason(model: nn.Module, backend: Any, device: torch.device) -> str | None:
    """Why this model cannot run captured decode steps, or None when it can."""
    if device.type != "cpu":
        return "captured steps are built for the CPU (a GPU runs eager)"
    if model.comm.tp is not None or model.comm.layout.pp_size > 1:
        return "tensor/pipeline parallelism runs eager"
    if backend.decode_kernel is None:
        return "no decode attention kernel (no C++ compiler?)"
    if backend.kv_format.fp8 is not None:
        return "an FP8 KV cache runs eager"
    if not DecodeOps.supports(backend.dtype):
        return f"dtype {backend.dtype} runs eager"
    if model.norm is None or model.embed_tokens is None:
        return "a model without its embedding or final norm"
    attn = model.layers[0].self_attn
    if attn.q_norm is not None:
        return "q/k norms run eager"
    if attn.rotary.cos.shape[-1] * 2 != attn.head_dim:
        return "partial rotary runs eager"
    return None


class StepInputs:
    """The static input tensors of every plan: rows [0, batch) are a step's sequences, those
    the decode kernel attends first, then the prefill kernel's chunks."""

    def __init__(self, rows: int, table_width: int) -> None:
        self.ids = torch.zeros(rows, dtype=torch.long)
        self.positions = torch.zeros(rows, dtype=torch.long)
        self.slots = torch.zeros(rows, dtype=torch.long)
        self.context_lens = torch.ones(rows, dtype=torch.int32)
        self.block_tables = torch.zeros(rows, table_width, dtype=torch.int32)
        self.table_rows: list[list[int] | None] = [None] * rows
        """The block table each row holds: a row is rewritten only when it changes. Compared
        by value: after speculative proposals are trimmed or a preempted request returns, a
        request holds as many blocks as before but not the same ones."""
        self.chunk_tables = torch.zeros(rows, table_width, dtype=torch.int32)
        self.chunk_table_rows: list[list[int] | None] = [None] * rows
        """The same for the prefill kernel's chunks: one table per chunk."""
        self.query_starts = torch.zeros(rows + 1, dtype=torch.int32)
        """Offsets of the chunks' first tokens, from the first chunk row."""
        self.start_pos = torch.zeros(rows, dtype=torch.int32)

    def fill(
        self, scheduled: list[ScheduledRequest], block_size: int, num_chunks: int = 0
    ) -> tuple[int, int]:
        """Copy the step's rows in (a sequence's tokens are consecutive rows), the last
        ``num_chunks`` sequences as the prefill kernel's chunks; returns how many rows there
        are and how many of them the decode kernel attends."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in scheduled:
            ids += s.token_ids
            for p in range(s.start_pos, s.start_pos + s.num_tokens):
                positions.append(p)
                slots.append(s.block_ids[p // block_size] * block_size + p % block_size)
        b = len(ids)
        self.ids[:b] = torch.tensor(ids, dtype=torch.long)
        self.positions[:b] = torch.tensor(positions, dtype=torch.long)
        self.slots[:b] = torch.tensor(slots, dtype=torch.long)
        self.context_lens[:b] = torch.tensor(positions, dtype=torch.int32) + 1
        rowwise = scheduled[: len(scheduled) - num_chunks]
        row = 0
        for s in rowwise:
            for _ in range(s.num_tokens):
                _set_table(self.block_tables, self.table_rows, row, s.block_ids)
                row += 1
        chunks = scheduled[len(scheduled) - num_chunks :]
        starts = [0]
        for i, s in enumerate(chunks):
            _set_table(self.chunk_tables, self.chunk_table_rows, i, s.block_ids)
            starts.append(starts[-1] + s.num_tokens)
        if chunks:
            self.query_starts[: len(starts)] = torch.tensor(starts, dtype=torch.int32)
            self.start_pos[: len(chunks)] = torch.tensor(
                [s.start_pos for s in chunks], dtype=torch.int32
            )
        return b, row


def _set_table(
    tables: torch.Tensor, held: list[list[int] | None], row: int, block_ids: list[int]
) -> None:
    """Row ``row`` of ``tables`` holds ``block_ids`` (written only when they changed)."""
    if held[row] != block_ids:
        tables[row, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        held[row] = list(block_ids)


class Activations:
    """Static activation buffers for up to ``rows`` sequences; a plan uses views of their first
    rows, so every plan shares them (steps never overlap)."""

    def __init__(self, rows: int, model: nn.Module, dtype: torch.dtype) -> None:
        a = model.layers[0]
        attn, mlp = a.self_attn, a.mlp
        hidden = model.arch.hidden_size

        def buf(width: int) -> torch.Tensor:
            return torch.zeros(rows, width, dtype=dtype)

        self.residual = buf(hidden)
        self.normed = buf(hidden)
        self.qkv = buf(attn.q_size + 2 * attn.kv_size)
        self.q = buf(attn.q_size)
        self.attn = buf(attn.q_size)
        self.proj = buf(hidden)
        self.gate_up = buf(2 * mlp.intermediate)
        self.act = buf(mlp.intermediate)


class LayeredChunk:
    """Layered prefill: a long prompt's deep chunk beside decoding streams goes through the
    model's layers over ``layer_parts`` steps, so that no step pays its whole cost (deep in an
    8000-token prompt one work item of the prefill kernel, 10 tokens, read ~7000 keys per head
    and layer: the step took ~2.7x a decode step). Between parts the chunk's rows of the residual
    stream and its pending addend wait here; its K/V of the layers done are in its blocks, which
    the scheduler keeps (it schedules the same chunk again until the chunk is whole)."""

    def __init__(self, rows: int, model: nn.Module, dtype: torch.dtype) -> None:
        hidden = model.arch.hidden_size
        self.residual = torch.zeros(rows, hidden, dtype=dtype)
        self.addend = torch.zeros(rows, hidden, dtype=dtype)
        self.key: ChunkKey | None = None
        """The parked chunk: request, first position, tokens and blocks."""
        self.next_layer = 0
        self._step_key: ChunkKey | None = None
        """The key of the chunk the running step layers (None: it layers none)."""
        self.num_parts = 0
        """Steps that ran a share of a chunk's layers so far (tests read it)."""

    def layers(
        self, scheduled: list[ScheduledRequest], num_chunks: int, num_layers: int
    ) -> tuple[int, int]:
        """The layers this step's chunks go through: all but for one chunk spread over steps,
        whose next share of (about) ``num_layers / layer_parts`` layers it is."""
        chunk = scheduled[-1]
        self._step_key = None
        if num_chunks != 1 or chunk.layer_parts <= 1:
            self.forget((chunk.request_id,))  # a parked chunk run whole is done with
            return 0, num_layers
        self._step_key = key = (
            chunk.request_id, chunk.start_pos, tuple(chunk.token_ids), tuple(chunk.block_ids)
        )  # fmt: skip
        first = self.next_layer if self.key == key else 0
        parts = min(chunk.layer_parts, num_layers)
        ends = [round(p * num_layers / parts) for p in range(1, parts + 1)]
        return first, next(e for e in ends if e > first)

    def ran(self, end: int, num_layers: int) -> str | None:
        """Record that the step's layered chunk went through its layers up to ``end``; returns
        its request while layers are left."""
        key, self._step_key = self._step_key, None
        if key is None:
            return None
        self.num_parts += 1
        if end == num_layers:
            self.key = None
            return None
        self.key, self.next_layer = key, end
        return key[0]

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the parked chunk if it belongs to one of ``request_ids`` (read only then)."""
        if self.key is not None and any(r == self.key[0] for r in request_ids):
            self.key = None

    def park_call(self, acts: Activations, rowwise: int, b: int) -> Call:
        """After the chunk's last layer of a step: its rows of the stream wait here."""
        rows = b - rowwise

        def park() -> int:
            self.residual[:rows].copy_(acts.residual[rowwise:b])
            self.addend[:rows].copy_(acts.proj[rowwise:b])
            return 0

        return park

    def restore_call(self, acts: Activations, rowwise: int, b: int) -> Call:
        """Before the chunk's first layer of a later step: its rows come back as they left."""
        rows = b - rowwise

        def restore() -> int:
            acts.residual[rowwise:b].copy_(self.residual[:rows])
            acts.proj[rowwise:b].copy_(self.addend[:rows])
            return 0

        return restore


class CapturedDecoder:
    """Plans of bare kernel calls for decode steps of up to ``max_size`` sequences."""

    def __init__(
        self,
        model: nn.Module,
        backend: Any,
        kv_caches: list[Any],
        ops: DecodeOps,
        max_size: int,
        block_size: int,
    ) -> None:
        self.model, self.backend, self.kv_caches, self.ops = model, backend, kv_caches, ops
        self.max_size = max_size
        self.block_size = block_size
        self.dtype = backend.dtype
        self.inputs = StepInputs(max_size, 64)
        self.acts = Activations(max_size, model, self.dtype)
        self.plans: dict[tuple[int, int, int, int, int], list[Call]] = {}
        """Plans by (rows, rows the decode kernel attends, prefill kernel chunks, the chunks'
        first layer and end layer)."""
        self.layered = LayeredChunk(max_size, model, self.dtype)
        self.unfinished: str | None = None
        """The request whose chunk went through only some layers in the last step."""
        self.num_steps = 0
        """Steps run captured so far (tests and the step profile read it)."""
        self.num_kernel_chunks = 0
        """Chunks attended by the prefill kernel so far (tests read it)."""
        prefill = backend.prefill_kernel
        self.prefill_kernel = (
            prefill
            if isinstance(prefill, PagedPrefillKernel) and not backend.batch_invariant
            else None
        )
        """The C++ prefill kernel, or None: every chunk is rows of the decode kernel (the
        batch-invariant mode reads every token's keys in the decode kernel's order)."""
        group = model.layers[0].self_attn.num_heads // model.layers[0].self_attn.num_kv_heads
        self.min_chunk_tokens = (
            -(-backend.prefill_item_rows() // (2 * group)) if self.prefill_kernel else 0
        )
        """A chunk of at least this many tokens fills half the prefill kernel's smallest work
        item: there one call reading the prefix once beats a decode-kernel row per token (in L3
        at a group of 3 on AVX2, 1-2 tokens as rows took 0.4-0.7x the kernel's time, 4-16
        tokens 1.1-1.8x; on the Xeon in bf16, where the smallest item is 16 rows and this is 3
        tokens, rows took 0.53-0.64x at 1 token, 0.87-1.07x at 2, 1.18-2.63x at 3-5, over
        300-7000 cached keys)."""

    ROW_WORK_LIMIT = 128 * 1024
    """A prefill chunk of at most this many (tokens x context positions) runs as rows of the
    step: the few tokens a long prompt advances while others decode, a short prompt joining."""

    def runs(self, scheduled: list[ScheduledRequest]) -> bool:
        """Whether this step runs captured: every sequence decodes (its last token, and the
        tokens proposed after it when it speculates) or, beside at least one that decodes, is
        a small prefill chunk; at most ``max_size`` rows in all. (A step of prefill chunks
        alone stays eager: the prefill kernel's tiles suit it, and a prompt alone computes as it
        always did.)"""
        rows = sum(s.num_tokens for s in scheduled)
        if not 0 < rows <= self.max_size:
            return False
        decodes = [s.num_tokens == 1 + len(s.spec_token_ids) for s in scheduled]
        return any(decodes) and all(
            d or self._small_chunk(s) or self._kernel_chunk(s)
            for s, d in zip(scheduled, decodes, strict=True)
        )

    def _small_chunk(self, s: ScheduledRequest) -> bool:
        end = s.start_pos + s.num_tokens
        return not s.spec_token_ids and s.num_tokens * end <= self.ROW_WORK_LIMIT

    def _kernel_chunk(self, s: ScheduledRequest) -> bool:
        """Whether this prefill chunk goes through the prefill kernel (see the module)."""
        return (
            self.prefill_kernel is not None
            and not s.spec_token_ids
            and s.num_tokens > 1
            and s.num_tokens >= self.min_chunk_tokens
        )

    def order(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """The step's sequences in row order: the prefill kernel's chunks last (stable)."""
        chunks = [s for s in scheduled if self._kernel_chunk(s)]
        if not chunks:
            return scheduled
        return [s for s in scheduled if not self._kernel_chunk(s)] + chunks

    def forward(self, scheduled: list[ScheduledRequest]) -> torch.Tensor:
        """The final hidden states [rows, hidden] of this step, one row per token in the order
        of ``scheduled`` (a view of a static buffer, valid until the next step); the K/V of its
        tokens are in the cache. The prefill kernel takes the chunks at the end of
        ``scheduled`` (``order`` puts them there); a chunk before a row stays rows."""
        widest = max(len(s.block_ids) for s in scheduled)
        if widest > self.inputs.block_tables.shape[1]:
            self._widen_tables(widest)
        num_chunks = 0
        while num_chunks < len(scheduled) and self._kernel_chunk(scheduled[-1 - num_chunks]):
            num_chunks += 1
        b, rowwise = self.inputs.fill(scheduled, self.block_size, num_chunks)
        first, end = self.layered.layers(scheduled, num_chunks, len(self.model.layers))
        key = (b, rowwise, num_chunks, first, end)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self._build(*key)
        try:
            for call in plan:
                rc = call()
                if rc:
                    raise RuntimeError(f"a captured decode step's kernel failed with code {rc}")
        except BaseException:
            # the parked rows may already hold this step's share: never resume from them
            self.layered.forget((scheduled[-1].request_id,))
            raise
        self.unfinished = self.layered.ran(end, len(self.model.layers))
        self.num_steps += 1
        self.num_kernel_chunks += num_chunks
        return self.acts.normed[:b]

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that ended or were preempted, or whose chunk an eager step ran whole: a
        chunk of theirs halfway through the layers is dropped (its KV blocks are freed or
        move)."""
        self.layered.forget(request_ids)

    def _widen_tables(self, blocks: int) -> None:
        """Block tables wider than any plan was built for: new tables, plans built again."""
        width = self.inputs.block_tables.shape[1]
        while width < blocks:
            width *= 2
        self.inputs = StepInputs(self.max_size, width)
        self.plans.clear()

    # ----- building a plan ------------------------------------------------------------

    def _build(self, b: int, rowwise: int, num_chunks: int, first: int, end: int) -> list[Call]:
        """The step's calls; the chunks (rows ``rowwise..b``) go through layers ``first..end``
        only (layered prefill: then there is one chunk), the other rows through all."""
        model, acts, ops, code = self.model, self.acts, self.ops, DTYPE_CODES[self.dtype]
        threads = torch.get_num_threads()
        num_layers = len(model.layers)
        embedded = b if first == 0 else rowwise
        residual, ids = acts.residual[:embedded], self.inputs.ids[:embedded]

        def embed() -> int:
            residual.copy_(model.embed_tokens(ids))
            return 0

        plan: list[Call] = [embed]
        x = None  # the residual stream's pending addend (none before the first layer)
        for i, (layer, cache) in enumerate(zip(model.layers, self.kv_caches, strict=True)):
            n = b if first <= i < end else rowwise
            if i == first and first > 0:
                plan.append(self.layered.restore_call(acts, rowwise, b))
            plan.append(self._norm(layer.input_layernorm, x, n, code, threads))
            chunks = num_chunks if n == b else 0
            plan += self._attention(layer.self_attn, cache, n, rowwise, chunks, code, threads)
            plan.append(self._norm(layer.post_attention_layernorm, acts.proj[:n], n, code, threads))
            plan.append(self._linear(layer.mlp.gate_up_proj, acts.normed[:n], acts.gate_up[:n]))
            plan.append(
                ops.bound(ops.silu_mul, code, acts.gate_up.data_ptr(), acts.act.data_ptr(), n,
                          layer.mlp.intermediate, threads)
            )  # fmt: skip
            plan.append(self._linear(layer.mlp.down_proj, acts.act[:n], acts.proj[:n]))
            x = acts.proj[:n]
            if i == end - 1 and end < num_layers:
                plan.append(self.layered.park_call(acts, rowwise, b))
        n = b if end == num_layers else rowwise
        plan.append(self._norm(model.norm, acts.proj[:n], n, code, threads))
        return run_from_c(plan, ops.run_calls)

    def _norm(self, norm: nn.Module, x: torch.Tensor | None, b: int, code: int, threads: int):
        """residual += x (when given); normed = norm(residual)."""
        acts = self.acts
        x_ptr = x.data_ptr() if x is not None else acts.residual.data_ptr()
        res_ptr = acts.residual.data_ptr() if x is not None else None
        return self.ops.bound(
            self.ops.add_rms_norm, code, x_ptr, res_ptr, norm.weight.data_ptr(),
            acts.normed.data_ptr(), b, norm.weight.shape[0], norm.eps, threads,
        )  # fmt: skip

    def _attention(
        self,
        attn: nn.Module,
        cache: Any,
        b: int,
        rowwise: int,
        num_chunks: int,
        code: int,
        threads: int,
    ) -> list[Call]:
        acts, inputs = self.acts, self.inputs
        hq, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        k, v = cache.k, cache.v
        cache_rows = k.shape[1] * k.shape[2]
        rope = self.ops.bound(
            self.ops.rope_kv_write, code, acts.qkv.data_ptr(), inputs.positions.data_ptr(),
            attn.rotary.cos.data_ptr(), attn.rotary.sin.data_ptr(), acts.q.data_ptr(),
            k.data_ptr(), v.data_ptr(), inputs.slots.data_ptr(), b, hq, hkv, d, cache_rows,
            threads,
        )  # fmt: skip
        scale = self.backend.scale * cache.k_scale
        attend: list[Call] = []
        if rowwise:
            attend.append(
                self.backend.decode_kernel.bind(
                    acts.q[:rowwise].view(rowwise, hq, d), k, v, inputs.block_tables[:rowwise],
                    inputs.context_lens[:rowwise], acts.attn[:rowwise].view(rowwise, hq, d),
                    scale, self.backend.batch_invariant,
                )
            )  # fmt: skip
        if num_chunks:
            n = b - rowwise
            attend.append(
                self.prefill_kernel.bind(
                    acts.q[rowwise:b].view(n, hq, d), k, v, inputs.chunk_tables[:num_chunks],
                    inputs.query_starts[: num_chunks + 1], inputs.start_pos[:num_chunks],
                    acts.attn[rowwise:b].view(n, hq, d), scale,
                )
            )  # fmt: skip
        return [
            self._linear(attn.qkv_proj, acts.normed[:b], acts.qkv[:b]),
            rope,
            *attend,
            self._linear(attn.o_proj, acts.attn[:b], acts.proj[:b]),
        ]

    def _linear(self, layer: nn.Module, x: torch.Tensor, out: torch.Tensor) -> Call:
        """One bare kernel call where the layer is one, else the module into ``out``."""
        if isinstance(layer, QuantLinear) and layer.bias is None and len(layer.parts) == 1:
            part = layer.parts[0]
            if isinstance(part, QuantPart):
                kernel = part.kernel
                if kernel is not None and part.perm is None and part.fmt.act_int8:
                    int8 = kernel.int8
                    if int8 is not None and int8.applies(x, part.stored()):
                        return int8.bind(x, part.stored(), part.row_scales(), out)
                elif (
                    kernel is not None
                    and part.perm is None
                    and kernel.applies(x)
                    and x.shape[0] <= kernel.max_rows
                ):
                    return kernel.bind(x, part.stored(), out)
            elif isinstance(part, Linear):
                layer = part
        if isinstance(layer, Linear):
            for kernel in (layer.skinny, layer.tiles):
                if kernel is not None and kernel.applies(x, layer.weight):
                    return kernel.bind(x, layer.weight, layer.bias, out)

        def run_module() -> int:
            out.copy_(layer(x))
            return 0

        return run_module
