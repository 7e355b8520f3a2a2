"""Where a rank computes: choosing its device, and how much of a GPU its KV cache may take.

On CPU the KV cache gets ``--kv-cache-memory`` GiB. On a GPU it gets what ``--gpu-memory-
utilization`` of the card leaves after everything else this rank holds at its peak (weights, the
activations of a profiled step of ``max_num_batched_tokens`` tokens, CUDA context and
communicators), as vLLM sizes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagellm.config import DEVICES


def resolve_device(name: str, index: int = 0) -> torch.device:
    """``auto``: the GPU when torch sees one, else the CPU. ``index`` picks among the visible
    GPUs (a worker rank's own card); it is made the current CUDA device."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {name!r}")
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device cuda was asked for, but torch {torch.__version__} sees no CUDA GPU "
            f"(built with CUDA {torch.version.cuda}); use --device cpu"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"rank needs GPU {index} but only {count} are visible (CUDA_VISIBLE_DEVICES); "
            "a replica needs one GPU per rank"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpu_kv_budget(device: torch.device, utilization: float, profile: Callable[[], None]) -> int:
    """Bytes this rank's KV cache may take on ``device``: ``utilization`` of the card, less the
    peak this process reaches while ``profile`` runs (weights + a largest step) and less the
    memory outside torch's allocator (CUDA context, NCCL, other processes)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {utilization}")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    budget = int(total * utilization) - peak - max(outside_torch, 0)
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.2f} of {total / 2**30:.1f} GiB "
            f"is less than the weights and a step's activations ({peak / 2**30:.2f} GiB) plus "
            f"{max(outside_torch, 0) / 2**30:.2f} GiB outside torch; raise "
            "--gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return budget
