"""Reads vLLM's ``--enforce-eager`` and ``--compilation-config`` into the largest decode batch
that runs captured (``pagellm.runner.captured``); 0 means every step runs eager.

``--compilation-config`` is a JSON object (or the mapping itself from a YAML file or
``LLM(...)``). Its ``cudagraph_capture_sizes`` list (or ``max_cudagraph_capture_size``, older
``max_capture_size``) sets the largest size; ``cudagraph_mode: "NONE"`` or ``use_cudagraph:
false`` turn capture off, as they do in vLLM. The other keys vLLM has (compilation levels,
inductor's settings) are accepted and have no effect here: pagellm's capture is not inductor. Without a size, vLLM's default applies: min(2 x max_num_seqs, 512). Bad values raise
ValueError naming the key. This module imports no torch.
"""

from __future__ import annotations

from typing import Any

from pagellm.config import CompilationConfig, json_object_flag

DEFAULT_MAX_CAPTURE_SIZE = 512

_SIZE_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size", "max_capture_size")
_SWITCH_KEYS = ("cudagraph_mode", "use_cudagraph")
_VLLM_KEYS = (
    "level", "mode", "backend", "custom_ops", "splitting_ops", "use_inductor", "compile_sizes",
    "inductor_compile_config", "inductor_passes", "pass_config", "debug_dump_path",
    "cache_dir", "full_cuda_graph", "cudagraph_num_of_warmups", "cudagraph_copy_inputs",
    "use_inductor_graph_partition",
)  # fmt: skip
"""vLLM keys accepted without effect."""


def max_capture_size(config: CompilationConfig, max_num_seqs: int) -> int:
    """The most sequences a captured decode step takes (0: none are captured)."""
    raw = _raw_mapping(config.compilation_config)
    if config.enforce_eager or _turned_off(raw):
        return 0
    sizes = raw.get("cudagraph_capture_sizes")
    if sizes is not None:
        if not isinstance(sizes, list) or not all(_positive_int(s) for s in sizes):
            raise ValueError(
                "--compilation-config: cudagraph_capture_sizes must be a list of positive "
                f"integers, not {sizes!r}"
            )
        return max(sizes, default=0)
    for key in ("max_cudagraph_capture_size", "max_capture_size"):
        value = raw.get(key)
        if value is not None:
            if not (_positive_int(value) or value == 0):
                raise ValueError(f"--compilation-config: {key} must be an integer >= 0")
            return int(value)
    return min(2 * max_num_seqs, DEFAULT_MAX_CAPTURE_SIZE)


def _turned_off(raw: dict[str, Any]) -> bool:
    mode = raw.get("cudagraph_mode")
    if mode is not None and not isinstance(mode, str):
        raise ValueError("--compilation-config: cudagraph_mode must be a string")
    use = raw.get("use_cudagraph")
    if use is not None and not isinstance(use, bool):
        raise ValueError("--compilation-config: use_cudagraph must be true or false")
    return (mode or "").upper() == "NONE" or use is False


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _raw_mapping(value: str | dict | None) -> dict[str, Any]:
    return json_object_flag(
        value, "--compilation-config", (*_SIZE_KEYS, *_SWITCH_KEYS, *_VLLM_KEYS)
    )
