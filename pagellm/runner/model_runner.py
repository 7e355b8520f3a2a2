"""Runs one engine step: SchedulerOutput -> one model forward over the flattened batch -> tokens.

Sequences the attention backend attends row-wise (decodes, small prefill chunks) are placed first
in the batch, then the other prefill chunks. Logits are computed only at the positions that sample.

Under tensor/pipeline parallelism every rank runs this same step on its part of the model (the
step's SchedulerOutput is broadcast to all): a stage after the first receives the previous
stage's activations, a stage before the last sends its own on, and only rank 0 samples (the last
stage sends it the logits). Every rank's KV cache holds its own heads of its own layers.

On a GPU (``device``), the step's index tensors are built on the host and copied over once;
weights, KV cache and activations stay on the card, and only the sampled rows' logits (or,
for a greedy batch, the chosen ids) come back to the host.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pagellm.attention.backend import SeqLayout, cache_bytes_per_block
from pagellm.attention.kv_cache import kv_cache_format
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.config import GIB, CacheConfig, StepLimits
from pagellm.engine.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from pagellm.kernels.bf16_tiles import load_bf16_tiles_kernel
from pagellm.kernels.cpu_build import cpu_has_native_bf16
from pagellm.kernels.decode_ops import DecodeOps, load_decode_ops
from pagellm.kernels.paged_attention import (
    PagedPrefillKernel,
    load_paged_decode_kernel,
    load_paged_prefill_kernel,
)
from pagellm.kernels.quant_linear import load_quant_linear_kernel
from pagellm.kernels.skinny_linear import load_skinny_linear_kernel
from pagellm.layers.linear import use_skinny_linears, use_tile_linears
from pagellm.layers.quant_linear import quant_tensors, use_quant_kernel
from pagellm.layers.row_ops import CpuRowOps, use_row_ops
from pagellm.models.arch import ModelArch
from pagellm.parallel.comm import Collectives
from pagellm.runner.batch_invariant import make_batch_invariant
from pagellm.runner.captured import CapturedDecoder, unsupported_reason
from pagellm.runner.device import gpu_kv_budget
from pagellm.runner.draft import DraftModel, Proposals
from pagellm.runner.loader import ModelFiles, load_model
from pagellm.runner.malloc import keep_heap_memory
from pagellm.sampling.sampler import Sampler

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepInputs:
    order: list[ScheduledRequest]
    input_ids: torch.Tensor
    positions: torch.Tensor
    layouts: list[SeqLayout]
    sample_rows: list[int]
    """Rows whose logits are needed: a sampling request's last one, or (proposed tokens) its
    last ``1 + len(spec_token_ids)``."""
    sample_reqs: list[ScheduledRequest]


def num_blocks_for(
    arch: ModelArch,
    cache: CacheConfig,
    dtype: torch.dtype,
    comm: Collectives | None = None,
    budget_bytes: int | None = None,
    draft: ModelArch | None = None,
) -> int:
    """KV blocks that fit this rank's budget: ``budget_bytes`` when given (a GPU's), else
    ``kv_cache_memory`` GiB (per rank); with a ``draft`` model, each block also holds its KV."""
    gib = cache.kv_cache_memory if budget_bytes is None else budget_bytes / GIB
    return _blocks_in(gib, cache.num_gpu_blocks_override, arch, cache, dtype, comm, draft)


def num_host_blocks_for(
    arch: ModelArch,
    cache: CacheConfig,
    dtype: torch.dtype,
    comm: Collectives | None = None,
    draft: ModelArch | None = None,
) -> int:
    """Host blocks for swapped-out KV in this rank's ``swap_space``."""
    return _blocks_in(
        cache.swap_space, cache.num_host_blocks_override, arch, cache, dtype, comm, draft
    )


def _blocks_in(
    gib: float,
    override: int | None,
    arch: ModelArch,
    cache: CacheConfig,
    dtype: torch.dtype,
    comm: Collectives | None,
    draft: ModelArch | None = None,
) -> int:
    if override is not None:
        return override
    per_block = _bytes_per_block(arch, cache, dtype, comm)
    if draft is not None:
        per_block += _bytes_per_block(draft, cache, dtype, None)
    return int(gib * GIB) // per_block


def _bytes_per_block(
    arch: ModelArch, cache: CacheConfig, dtype: torch.dtype, comm: Collectives | None
) -> int:
    layout = (comm or Collectives.single()).layout
    return cache_bytes_per_block(
        layout.layers(arch.num_layers).count,
        layout.kv_heads(arch.num_kv_heads).count,
        arch.head_dim,
        cache.block_size,
        dtype,
    )


def _allocate(make: Callable[[], list[Any]], setting: str) -> list[Any]:
    """The caches ``make`` allocates; a refused allocation names the setting that asked."""
    try:
        return make()
    except (RuntimeError, MemoryError) as exc:
        if "alloc" not in str(exc).lower() and not isinstance(exc, MemoryError):
            raise
        raise ValueError(f"{setting} cannot be allocated on this machine: lower it") from exc


def _backend(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache: CacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    batch_invariant: bool = False,
) -> TorchAttentionBackend:
    return TorchAttentionBackend(
        num_heads,
        num_kv_heads,
        head_dim,
        cache.block_size,
        dtype,
        decode_kernel=load_paged_decode_kernel() if device.type == "cpu" else None,
        device=device,
        prefill_kernel=_prefill_kernel(device),
        kv_format=kv_cache_format(cache.kv_cache_dtype),
        calculate_kv_scales=cache.calculate_kv_scales,
        batch_invariant=batch_invariant,
    )


def _load(
    files: ModelFiles,
    dtype: torch.dtype,
    backend,
    comm,
    device: torch.device,
    batch_invariant: bool = False,
):
    model = load_model(files, dtype, backend, comm, device)
    if batch_invariant:
        make_batch_invariant(model, device)
    elif device.type == "cpu":
        ops = load_decode_ops()
        if ops is not None and DecodeOps.supports(dtype):
            use_row_ops(model, CpuRowOps(ops))
        tiles = load_bf16_tiles_kernel()
        use_skinny_linears(
            model, load_skinny_linear_kernel(), cpu_has_native_bf16(), bf16_dot=tiles is None
        )
        use_tile_linears(model, tiles)
        use_quant_kernel(model, load_quant_linear_kernel())
    elif device.type == "cuda":
        from pagellm.kernels.triton_quant import load_triton_quant_kernel

        use_quant_kernel(model, load_triton_quant_kernel(device))
    return model


def _prefill_kernel(device: torch.device):
    """The C++ prefill kernel on a CPU, the Triton one on a GPU where Triton is installed."""
    if device.type == "cpu":
        return load_paged_prefill_kernel()
    from pagellm.attention.triton_prefill import TritonPrefillKernel, triton_available

    return TritonPrefillKernel() if triton_available() else None


class ModelRunner:
    def __init__(
        self,
        files: ModelFiles,
        dtype: torch.dtype,
        cache: CacheConfig,
        swap: bool = False,
        comm: Collectives | None = None,
        microbatches: int = 1,
        device: torch.device | None = None,
        limits: StepLimits | None = None,
        draft_files: ModelFiles | None = None,
        capture_max_size: int = 0,
        batch_invariant: bool = False,
    ) -> None:
        """``draft_files``: the draft model of draft-model speculative decoding (one rank);
        ``capture_max_size``: decode steps of up to this many sequences run captured (0:
        none, see ``pagellm.runner.captured``); ``batch_invariant``: see
        ``pagellm.runner.batch_invariant``."""
        arch = files.arch
        self.device = device = device or torch.device("cpu")
        self.batch_invariant = batch_invariant
        if device.type == "cpu":
            keep_heap_memory()
        self.arch = arch
        self.dtype = dtype
        self.block_size = cache.block_size
        self.comm = comm = comm or Collectives.single()
        comm.fixed_order = batch_invariant  # the TP all-reduce sums in rank order
        layout = comm.layout
        self.backend = _backend(
            layout.split(arch.num_heads, "the number of attention heads").count,
            layout.kv_heads(arch.num_kv_heads).count,
            arch.head_dim,
            cache,
            dtype,
            device,
            batch_invariant,
        )
        self.model = _load(files, dtype, self.backend, comm, device, batch_invariant)
        draft_arch = draft_files.arch if draft_files is not None else None
        draft_backend = draft_model = None
        if draft_arch is not None:
            draft_backend = _backend(
                draft_arch.num_heads, draft_arch.num_kv_heads, draft_arch.head_dim, cache, dtype,
                device, batch_invariant,
            )  # fmt: skip
            draft_model = _load(draft_files, dtype, draft_backend, None, device, batch_invariant)
        layers = layout.layers(arch.num_layers).count
        budget = None
        if device.type == "cuda" and cache.num_gpu_blocks_override is None:
            limits = limits or StepLimits()
            # ranks load at their own pace; the profile's collectives must not time out on that
            comm.barrier("loaded")
            budget = gpu_kv_budget(
                device, cache.gpu_memory_utilization, lambda: self.profile_step(limits)
            )
        cache_dtype = self.backend.cache_dtype
        self.num_blocks = num_blocks_for(arch, cache, cache_dtype, comm, budget, draft_arch)
        if cache.num_gpu_blocks_override is not None:
            asked_by = f"--num-gpu-blocks-override {cache.num_gpu_blocks_override}"
        elif budget is not None:
            asked_by = f"--gpu-memory-utilization {cache.gpu_memory_utilization}"
        else:
            asked_by = f"--kv-cache-memory {cache.kv_cache_memory} GiB"
        self.kv_caches = _allocate(
            lambda: self.backend.allocate_cache(layers, self.num_blocks),
            f"{asked_by} ({self.num_blocks} blocks)",
        )
        self.num_host_blocks = (
            num_host_blocks_for(arch, cache, cache_dtype, comm, draft_arch) if swap else 0
        )
        host_asked_by = (
            f"--num-host-blocks-override {cache.num_host_blocks_override}"
            if cache.num_host_blocks_override is not None
            else f"--swap-space {cache.swap_space} GiB"
        )
        self.host_caches = _allocate(
            lambda: self.backend.allocate_cache(layers, self.num_host_blocks, host=True),
            f"{host_asked_by} ({self.num_host_blocks} blocks)",
        )
        """Separate host tensors for swapped-out KV (pinned under a GPU)."""
        self._set_checkpoint_kv_scales()
        self.draft = None
        self.draft_max_model_len = draft_arch.max_position_embeddings if draft_arch else None
        """Positions the draft model takes: no proposals past them."""
        if draft_model is not None:
            self.draft = DraftModel(
                draft_model, draft_backend, draft_arch.num_layers, self.num_blocks,
                self.num_host_blocks, device,
            )  # fmt: skip
        self.captured = self._captured_decoder(capture_max_size)
        ops = load_decode_ops() if device.type == "cpu" else None
        if ops is not None and hasattr(self.backend, "use_rope_ops"):
            self.backend.use_rope_ops(ops)  # eager steps: rotary + K/V write in one call
        self.sampler = Sampler(
            argmax=ops.argmax if ops is not None else None,
            apply_bitmask=ops.apply_bitmask if ops is not None else None,
        )
        self.microbatches = microbatches if layout.pp_size > 1 else 1
        """Micro-batches per step under pipeline parallelism (one stage per process works on
        one while the next stage works on the one before)."""

    def _captured_decoder(self, max_size: int) -> CapturedDecoder | None:
        if max_size <= 0:
            return None
        why = unsupported_reason(self.model, self.backend, self.device)
        ops = load_decode_ops() if why is None else None
        if why is None and ops is None:
            why = "the decode ops did not build (no C++ compiler?)"
        if why is not None:
            log.info("decode steps run eager: %s", why)
            return None
        log.info("decode steps of up to %d sequences run captured", max_size)
        return CapturedDecoder(
            self.model, self.backend, self.kv_caches, ops, max_size, self.block_size
        )

    @property
    def prefill_chunk_quantum(self) -> int:
        """Tokens whose query rows fill one work item of the C++ prefill kernel, which attends
        a long prompt's chunks beside decodes in eager and captured steps alike (5 at a group
        of 3 on AVX2); 1 without it or in the batch-invariant mode (rows of the decode kernel).
        A whole item even where a half one costs less (bf16 on AMX): a long prompt's deep
        chunks of half items made its deepest steps no faster (memory bound) and twice as many
        (an 8000-token prompt beside 8 streams, in process: 31.7 s against 20.4 s to its first
        token)."""
        kernel = getattr(self.backend, "prefill_kernel", None)
        if not isinstance(kernel, PagedPrefillKernel) or self.backend.batch_invariant:
            return 1
        return max(1, kernel.item_rows // self.backend.group)

    @property
    def layered_prefill_rows(self) -> int:
        """Most rows of a step whose long-prompt chunk can go through a share of the layers
        (layered prefill: captured steps with the prefill kernel); 0 where none can."""
        if self.captured is None or self.captured.prefill_kernel is None:
            return 0
        return self.captured.max_size

    def _set_checkpoint_kv_scales(self) -> None:
        """An FP8 cache takes the checkpoint's per-layer k_scale / v_scale where it has them
        (unless --calculate-kv-scales computes them from the first step)."""
        if self.backend.kv_format.fp8 is None or self.backend.calculate_kv_scales:
            return
        for layer, cache in zip(self.model.layers, self.kv_caches, strict=True):
            scales = layer.self_attn.kv_scales
            if scales is not None:
                cache.k_scale, cache.v_scale = scales

    def profile_step(self, limits: StepLimits) -> None:
        """This rank's part of the largest steps the scheduler may send, on a throwaway cache,
        so that their activation peak is measured: a fresh prefill of ``max_tokens``, the same
        chunk at the end of a ``max_model_len`` context, and ``max_seqs`` decodes that each see
        a whole ``max_model_len`` context (their attention buffers are padded to the longest),
        each with its logits. Ranks of one stage run them together (their all-reduces); stages
        do not talk (a later stage is handed zeros for its input)."""
        ctx = max(1, min(limits.max_model_len, self.arch.max_position_embeddings))
        n = max(1, min(limits.max_tokens, ctx))
        table = list(range(-(-ctx // self.block_size)))
        layers = self.comm.layout.layers(self.arch.num_layers).count
        caches = self.backend.allocate_cache(layers, len(table))
        decodes = min(limits.max_seqs, limits.max_tokens)
        for seqs in (
            [SeqLayout(n, 0, table)],
            [SeqLayout(n, ctx - n, table)],
            [SeqLayout(1, ctx - 1, table)] * decodes,
        ):
            self._profile_forward(seqs, caches, min(len(seqs), limits.max_seqs))

    def _profile_forward(self, seqs: list[SeqLayout], caches, sampled: int) -> None:
        layout = self.comm.layout
        meta = self.backend.build_metadata(seqs, len(seqs[0].block_ids))
        tokens = sum(s.num_tokens for s in seqs)
        positions = [p for s in seqs for p in range(s.start_pos, s.start_pos + s.num_tokens)]
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        received = None
        if not layout.is_first_stage:
            shape = (tokens, self.arch.hidden_size)
            received = torch.zeros(shape, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, pos, caches, meta, received)
            if layout.is_last_stage:
                self.model.compute_logits(hidden[:sampled]).float()  # + the sampler's copy

    def memory_bytes(self) -> dict[str, int]:
        """What this rank holds: its weights (quantized ones as stored) and its KV cache, in
        bytes."""
        weights = {p.data_ptr(): p.numel() * p.element_size() for p in quant_tensors(self.model)}
        weights.update(
            {p.data_ptr(): p.numel() * p.element_size() for p in self.model.parameters()}
        )
        packed = [
            m.invariant_weight for m in self.model.modules() if hasattr(m, "invariant_weight")
        ]
        weights.update({p.data_ptr(): p.numel() * p.element_size() for p in packed})
        kv = sum(t.numel() * t.element_size() for layer in self.kv_caches for t in layer)
        return {"weights": sum(weights.values()), "kv_cache": kv}

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.sampler.forget(sched.finished_request_ids)
        if self.captured is not None:
            self.captured.forget(sched.finished_request_ids)
            self.captured.forget(sched.preempted_request_ids)
        # swap-outs read device blocks the forward (or a swap-in) may overwrite: copy them first
        copy_blocks(self.kv_caches, self.host_caches, sched.swap_out)
        copy_blocks(self.host_caches, self.kv_caches, sched.swap_in)
        scheduled, proposals = sched.scheduled, None
        if self.draft is not None:
            # a preempted request's blocks are freed (recompute) or moved (swap): its draft KV
            # is computed again from its first position when it next speculates
            self.draft.forget(sched.finished_request_ids + sched.preempted_request_ids)
            copy_blocks(self.draft.kv_caches, self.draft.host_caches, sched.swap_out)
            copy_blocks(self.draft.host_caches, self.draft.kv_caches, sched.swap_in)
            scheduled, proposals = self._draft_proposals(scheduled)
        if not scheduled:
            return RunnerOutput({})
        unfinished: set[str] = set()
        with torch.inference_mode():
            if self.captured is not None and self.captured.runs(scheduled):
                sample_reqs, logits = self._captured_logits(scheduled)
                if self.captured.unfinished is not None:
                    unfinished.add(self.captured.unfinished)
            else:
                if self.captured is not None:  # a parked chunk run whole here is done with
                    self.captured.forget(s.request_id for s in scheduled)
                groups = split_batch(scheduled, self.microbatches)
                parts = [prepare_inputs(g, self.backend.is_row_wise, self.device) for g in groups]
                sample_reqs = [r for part in parts for r in part.sample_reqs]
                logits = self._logits(parts)
            if logits is None:
                return RunnerOutput({}, unfinished=unfinished)
            result = self.sampler.sample_step(
                logits, sample_reqs, proposals.probs if proposals else None
            )
        sampled = {r.request_id: t for r, t in zip(sample_reqs, result.token_ids, strict=True)}
        logprobs = {
            r.request_id: lp for r, lp in zip(sample_reqs, result.logprobs, strict=True) if lp
        }
        failed = {sample_reqs[i].request_id: why for i, why in result.failed.items()}
        for request_id in failed:
            sampled.pop(request_id)
        num_proposed = {}
        if proposals is not None:
            for req in sample_reqs:
                proposed = len(req.spec_token_ids)
                if req.num_draft_slots and req.request_id in sampled:
                    num_proposed[req.request_id] = proposed
                    accepted = len(sampled[req.request_id]) - 1
                    self.draft.verified(req, proposed, accepted)
        return RunnerOutput(sampled, logprobs, failed, num_proposed, unfinished)

    def _captured_logits(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[list[ScheduledRequest], torch.Tensor | None]:
        """A decode step run captured: the sampling requests and the logits of their rows
        (the last one, or the last ``1 + len(spec_token_ids)``)."""
        scheduled = self.captured.order(scheduled)
        hidden = self.captured.forward(scheduled)
        unfinished = self.captured.unfinished  # not through all layers: nothing to sample
        rows: list[int] = []
        end = 0
        for s in scheduled:
            end += s.num_tokens
            if s.sample and s.request_id != unfinished:
                rows.extend(range(end - 1 - len(s.spec_token_ids), end))
        if not rows:
            return [], None
        if len(rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(rows, dtype=torch.long))
        sample_reqs = [s for s in scheduled if s.sample and s.request_id != unfinished]
        return sample_reqs, self.model.compute_logits(hidden)

    def _draft_proposals(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[list[ScheduledRequest], Proposals | None]:
        """The step's requests with the draft model's proposals appended, and the proposals."""
        speculating = [s for s in scheduled if s.num_draft_slots]
        if not speculating:
            return scheduled, None
        with torch.inference_mode():
            proposals = self.draft.propose(speculating, self.sampler)
        out = []
        for s in scheduled:
            tokens = proposals.tokens.get(s.request_id)
            if s.num_draft_slots and tokens:
                s = dataclasses.replace(s, token_ids=s.token_ids + tokens, spec_token_ids=tokens)
            out.append(s)
        return out, proposals

    def _logits(self, parts: list[StepInputs]) -> torch.Tensor | None:
        """This rank's part of the forward over the step's micro-batches; the logits of the
        sampled rows (in micro-batch order) on rank 0, None on the other ranks and when nothing
        samples. Sends do not wait until the step's end, so while a later stage works on one
        micro-batch an earlier stage already computes the next."""
        layout, comm = self.comm.layout, self.comm
        last_stage_first_rank = layout.stage_ranks(layout.pp_size - 1)[0]
        sends, outputs, logits_out = [], [], []
        for inputs in parts:
            meta = self.backend.build_metadata(inputs.layouts, self.num_blocks)
            received = None
            if not layout.is_first_stage:
                shape = (len(inputs.input_ids), self.arch.hidden_size)
                received = comm.recv(shape, self.dtype, layout.peer_in_stage(layout.stage - 1))
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta, received)
            if not layout.is_last_stage:
                sends.append(comm.isend(hidden, layout.peer_in_stage(layout.stage + 1)))
            elif inputs.sample_rows:
                rows = torch.tensor(inputs.sample_rows, dtype=torch.long, device=self.device)
                logits = self.model.compute_logits(hidden.index_select(0, rows))  # TP gather
                if layout.rank == 0:
                    outputs.append(logits)
                elif layout.rank == last_stage_first_rank:
                    logits_out.append(logits)
        # Logits go back only after every micro-batch was received: rank 0 posts all its
        # activation sends before its first logits receive, and NCCL runs one pair's
        # point-to-point operations in order, so an earlier send back would deadlock.
        sends += [comm.isend(logits, 0) for logits in logits_out]
        if layout.rank == 0 and not layout.is_last_stage:
            shape = (self.arch.vocab_size,)
            outputs = [
                comm.recv((len(p.sample_rows), *shape), self.dtype, last_stage_first_rank)
                for p in parts
                if p.sample_rows
            ]
        comm.wait_sends(sends)
        if layout.rank != 0 or not outputs:
            return None
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def split_batch(scheduled: list[ScheduledRequest], parts: int) -> list[list[ScheduledRequest]]:
    """The step's sequences in up to ``parts`` contiguous micro-batches of near-equal token
    counts (every rank splits the same step the same way)."""
    if parts <= 1 or len(scheduled) <= 1:
        return [scheduled]
    total = sum(s.num_tokens for s in scheduled)
    groups: list[list[ScheduledRequest]] = [[]]
    done = 0
    for s in scheduled:
        boundary = total * len(groups) / parts
        if groups[-1] and done >= boundary and len(groups) < parts:
            groups.append([])
        groups[-1].append(s)
        done += s.num_tokens
    return groups


def copy_blocks(
    src: list[tuple[torch.Tensor, ...]],
    dst: list[tuple[torch.Tensor, ...]],
    pairs: list[tuple[int, int]],
) -> None:
    """Copy KV blocks ``src_block -> dst_block`` in every layer (K and V), also between a
    GPU cache and host memory."""
    if not pairs:
        return
    src_dev, dst_dev = src[0][0].device, dst[0][0].device
    src_ids = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=src_dev)
    dst_ids = torch.tensor([b for _, b in pairs], dtype=torch.long, device=dst_dev)
    for src_layer, dst_layer in zip(src, dst, strict=True):
        for s, d in zip(src_layer, dst_layer, strict=True):  # [kv_heads, blocks, block, dim]
            d.index_copy_(1, dst_ids, s.index_select(1, src_ids).to(dst_dev))


def prepare_inputs(
    scheduled: list[ScheduledRequest],
    row_wise: Callable[[int, int], bool],
    device: torch.device | None = None,
) -> StepInputs:
    """Flatten the step's tokens; sequences the backend attends row-wise come first."""
    first = [row_wise(s.num_tokens, s.start_pos) for s in scheduled]
    order = [s for s, f in zip(scheduled, first, strict=True) if f]
    order += [s for s, f in zip(scheduled, first, strict=True) if not f]
    ids: list[int] = []
    positions: list[int] = []
    layouts: list[SeqLayout] = []
    sample_rows: list[int] = []
    sample_reqs: list[ScheduledRequest] = []
    for s in order:
        ids.extend(s.token_ids)
        positions.extend(range(s.start_pos, s.start_pos + s.num_tokens))
        layouts.append(SeqLayout(s.num_tokens, s.start_pos, s.block_ids))
        if s.sample:
            sample_rows.extend(range(len(ids) - 1 - len(s.spec_token_ids), len(ids)))
            sample_reqs.append(s)
    return StepInputs(
        order,
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        layouts,
        sample_rows,
        sample_reqs,
    )
