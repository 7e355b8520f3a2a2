"""Runs one engine step: SchedulerOutput -> one model forward over the flattened batch -> tokens.

Sequences the attention backend attends row-wise (decodes, small prefill chunks) are placed first
in the batch, then the other prefill chunks. Logits are computed only at the positions that sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagellm.attention.backend import SeqLayout, cache_bytes_per_block
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.config import GIB, CacheConfig
from pagellm.engine.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from pagellm.kernels.paged_attention import load_paged_decode_kernel
from pagellm.models.arch import ModelArch
from pagellm.runner.loader import ModelFiles, load_model
from pagellm.runner.malloc import keep_heap_memory
from pagellm.sampling.sampler import Sampler


@dataclass(frozen=True, slots=True)
class StepInputs:
    order: list[ScheduledRequest]
    input_ids: torch.Tensor
    positions: torch.Tensor
    layouts: list[SeqLayout]
    sample_rows: list[int]
    sample_reqs: list[ScheduledRequest]


def num_blocks_for(arch: ModelArch, cache: CacheConfig, dtype: torch.dtype) -> int:
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    return int(cache.kv_cache_memory * GIB) // _bytes_per_block(arch, cache, dtype)


def num_host_blocks_for(arch: ModelArch, cache: CacheConfig, dtype: torch.dtype) -> int:
    if cache.num_host_blocks_override is not None:
        return cache.num_host_blocks_override
    return int(cache.swap_space * GIB) // _bytes_per_block(arch, cache, dtype)


def _bytes_per_block(arch: ModelArch, cache: CacheConfig, dtype: torch.dtype) -> int:
    return cache_bytes_per_block(
        arch.num_layers, arch.num_kv_heads, arch.head_dim, cache.block_size, dtype
    )


class ModelRunner:
    def __init__(
        self, files: ModelFiles, dtype: torch.dtype, cache: CacheConfig, swap: bool = False
    ) -> None:
        arch = files.arch
        keep_heap_memory()
        self.arch = arch
        self.dtype = dtype
        self.block_size = cache.block_size
        self.backend = TorchAttentionBackend(
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            cache.block_size,
            dtype,
            decode_kernel=load_paged_decode_kernel(),
        )
        self.model = load_model(files, dtype, self.backend)
        self.num_blocks = num_blocks_for(arch, cache, dtype)
        self.kv_caches = self.backend.allocate_cache(arch.num_layers, self.num_blocks)
        self.num_host_blocks = num_host_blocks_for(arch, cache, dtype) if swap else 0
        self.host_caches = self.backend.allocate_cache(arch.num_layers, self.num_host_blocks)
        """Separate host tensors for swapped-out KV (pinned host memory once on a GPU)."""
        self.sampler = Sampler()

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.sampler.forget(sched.finished_request_ids)
        # swap-outs read device blocks the forward (or a swap-in) may overwrite: copy them first
        copy_blocks(self.kv_caches, self.host_caches, sched.swap_out)
        copy_blocks(self.host_caches, self.kv_caches, sched.swap_in)
        if sched.is_empty:
            return RunnerOutput({})
        inputs = prepare_inputs(sched.scheduled, self.backend.is_row_wise)
        with torch.inference_mode():
            meta = self.backend.build_metadata(inputs.layouts, self.num_blocks)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)
            if not inputs.sample_rows:
                return RunnerOutput({})
            rows = torch.tensor(inputs.sample_rows, dtype=torch.long)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            result = self.sampler.sample(logits, inputs.sample_reqs)
        sampled = {
            r.request_id: t for r, t in zip(inputs.sample_reqs, result.token_ids, strict=True)
        }
        logprobs = {
            r.request_id: lp
            for r, lp in zip(inputs.sample_reqs, result.logprobs, strict=True)
            if lp is not None
        }
        return RunnerOutput(sampled, logprobs)


def copy_blocks(
    src: list[tuple[torch.Tensor, ...]],
    dst: list[tuple[torch.Tensor, ...]],
    pairs: list[tuple[int, int]],
) -> None:
    """Copy KV blocks ``src_block -> dst_block`` in every layer (K and V)."""
    if not pairs:
        return
    src_ids = torch.tensor([a for a, _ in pairs], dtype=torch.long)
    dst_ids = torch.tensor([b for _, b in pairs], dtype=torch.long)
    for src_layer, dst_layer in zip(src, dst, strict=True):
        for s, d in zip(src_layer, dst_layer, strict=True):  # [kv_heads, blocks, block, dim]
            d.index_copy_(1, dst_ids, s.index_select(1, src_ids))


def prepare_inputs(
    scheduled: list[ScheduledRequest], row_wise: Callable[[int, int], bool]
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
            sample_rows.append(len(ids) - 1)
            sample_reqs.append(s)
    return StepInputs(
        order,
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(positions, dtype=torch.long),
        layouts,
        sample_rows,
        sample_reqs,
    )
