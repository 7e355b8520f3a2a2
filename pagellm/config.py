"""Engine configuration: one frozen dataclass per area and a composite.

Every field is documented once here; CLI flags (``--max-num-seqs``) are derived from field names,
so the names follow vLLM's where vLLM has the setting. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATION_METHODS = (
    "auto", "none", "gguf", "awq", "gptq", "compressed-tensors", "int8", "int4", "fp8"
)  # fmt: skip
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


class _Checked:
    """A settings area whose every field is checked when it is made (flags, YAML files,
    ``LLM(...)``, cluster ``engine_args`` alike): of the type its field declares and in its
    range, else ValueError naming it. A YAML ``"false"`` is not taken for true, nor ``1.7``
    sequences for 1, and a zero step budget or block size is refused at start-up instead of
    hanging requests or dividing by 0."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            _check_field(f.name, str(f.type), getattr(self, f.name))


@dataclass(frozen=True, slots=True)
class ModelConfig(_Checked):
    """What to load and how."""

    model: str | None = None
    """HF directory (config.json + *.safetensors) or a .gguf file; None = the embedded default."""
    dtype: str = "auto"
    """Compute dtype: auto (bfloat16 on a GPU or a CPU with native bf16, else float32),
    float32, bfloat16, float16."""
    device: str = "auto"
    """Where the model runs: auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda.
    Under tensor/pipeline parallelism each rank takes its own GPU."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None = the model's own context length."""
    seed: int = 0
    """Seed for requests that give none (each request still gets its own generator)."""
    tokenizer: str | None = None
    """Tokenizer directory when it differs from the model's."""
    quantization: str | None = None
    """How weights are kept (vLLM's names): auto/None (as the checkpoint is: a GGUF's Q8_0,
    Q4_0, Q4_1, Q4_K and Q6_K tensors stay quantized, an AWQ / GPTQ / compressed-tensors
    checkpoint is read as its quantization_config says; its W8A8 / FP8 schemes are served
    weight-only, activations in --dtype), none (a GGUF dequantized to --dtype at load), gguf,
    awq, gptq, compressed-tensors (the checkpoint must be so), int8 (per-channel W8A16), int4
    (grouped W4A16) or fp8 (per-channel FP8 E4M3 weights, W8A16) quantizing a float checkpoint
    at load (decoder linear layers; embeddings and LM head stay in --dtype)."""
    batch_invariant: bool = False
    """Batch-invariant mode (vLLM's VLLM_BATCH_INVARIANT=1 as a flag): a request's tokens and
    logprobs are bit-identical whatever else shares its steps (batch size, its place in the
    batch, chunked prefill, prefix-cache hits, preemption, the TP all-reduce). Computes with
    dense weights: with quantization auto a GGUF is dequantized to --dtype; a checkpoint kept
    quantized is refused. CPU only. Holds on one machine and build, not across CPU kinds."""


@dataclass(frozen=True, slots=True)
class CacheConfig(_Checked):
    """The paged KV cache."""

    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: float = 2.0
    """KV-cache budget in GiB on CPU (per rank); the number of blocks is derived from it."""
    gpu_memory_utilization: float = 0.9
    """On a GPU: the fraction of the card a rank may use; its KV cache gets what is left of it
    after the weights and the activations of a profiled largest step."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks, overriding the memory budget (tests, experiments)."""
    swap_space: float = 4.0
    """Host memory in GiB for KV blocks swapped out by --preemption-mode swap."""
    num_host_blocks_override: int | None = None
    """Exact number of host KV blocks for swapping (tests, experiments)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose tokens (and all before them) were computed before."""
    kv_cache_dtype: str = "auto"
    """How K and V are stored: auto (the compute dtype), fp8 or fp8_e4m3 (FP8 E4M3: 3 mantissa
    bits, up to 448), fp8_e5m2 (2 mantissa bits, up to 57344). FP8 takes one byte per value, half
    of bf16 (a quarter of fp32): about twice the blocks in the same --kv-cache-memory. Each layer
    stores K / k_scale and V / v_scale (--calculate-kv-scales, else the checkpoint's k_scale /
    v_scale, else 1.0), rounded to nearest and saturated at the format's largest
    value."""
    calculate_kv_scales: bool = False
    """With an FP8 KV cache: each layer's k_scale and v_scale from the first step that writes
    its cache (max |K| / 200 and max |V| / 100, vLLM's rule) instead of the checkpoint's or
    1.0."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig(_Checked):
    """Continuous batching limits."""

    max_num_seqs: int = 256
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decode tokens)."""
    enable_chunked_prefill: bool = True
    """Split long prompts into chunks that share steps with decodes."""
    long_prefill_token_threshold: int | None = None
    """A prompt longer than this many tokens is long (None: max_num_batched_tokens, a prompt
    that needs more than one step; 0: no prompt is long). In a step that also decodes other
    requests, a long prompt's chunk is cut to --long-prefill-decode-budget; alone, it takes the
    whole budget."""
    max_num_partial_prefills: int = 1
    """Most requests whose prefill goes on past the step (partial prefills) in one step."""
    max_long_partial_prefills: int = 1
    """Most long prompts among those partial prefills."""
    long_prefill_decode_budget: int = 20
    """A long prompt's work per step while others decode, in tokens at the start of a
    sequence: a chunk deeper in the prompt gets fewer tokens, as its attention reads more
    context, and past the attention crossover whole prefill-kernel items (the streams decoding
    then keep their inter-token latency; 0: no cut). 20 on a Zen 4 EPYC with layered prefill
    (8 streams, an 8000-token prompt, bf16): streams' ITL p99 1.56-1.80x in 5 runs, the
    prompt's TTFT 47-51 s; 24: 1.59-2.11x, 40-46 s; 16: 1.70-1.72x, 60-62 s. (An AVX2 EPYC
    before layered prefill, fp32, one run each: 24 2.2x, 20 2.6x, 16 2.3x.)"""
    long_prefill_layer_parts: int = 4
    """Layered prefill: while others decode, a long prompt's chunk that costs more than
    --long-prefill-decode-budget even at one work item (deep in the prompt) goes through the
    model's layers over up to this many steps, a share of the layers a step (captured CPU steps;
    1: never)."""
    scheduling_policy: str = "fcfs"
    """fcfs (arrival order), priority (a request's priority, then arrival; more important
    arrivals may preempt), or fair (per-tenant virtual token counting)."""
    preemption_mode: str = "recompute"
    """recompute (free the blocks, compute them again on resume) or swap (copy them to host
    memory and back; falls back to recompute when the host pool is full)."""
    preemption_protect_after: int = 2
    """Thrash guard: a request preempted this many times is preempted again only as a last resort."""


@dataclass(frozen=True, slots=True)
class ParallelConfig(_Checked):
    """Splitting one replica's model over several worker processes."""

    tensor_parallel_size: int = 1
    """Ranks that split each layer (heads, MLP columns, vocabulary), joined by all-reduces."""
    pipeline_parallel_size: int = 1
    """Stages that split the layers; activations pass from stage to stage."""
    pipeline_microbatches: int = 0
    """Micro-batches a step is split into under pipeline parallelism, so stages overlap
    (0: as many as stages; 1: none)."""
    distributed_timeout: float = 60.0
    """Seconds any collective may take before the replica fails its requests (a dead or hung
    rank never makes it wait forever)."""
    worker_cls: str = "auto"
    """module:Class of the runner the other ranks build (auto: pagellm's ModelRunner)."""
    distributed_executor_backend: str = "mp"
    """mp (worker ranks spawned on this machine) or ray (Ray actors on the bundles of the
    current placement group, possibly on other nodes; what `pagellm cluster` uses)."""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True, slots=True)
class SpeculativeConfig(_Checked):
    """Speculative decoding (vLLM's flags; ``pagellm/spec/settings.py`` reads them)."""

    speculative_config: str | None = None
    """JSON object as vLLM's --speculative-config: {"method": "ngram", "num_speculative_tokens":
    4, "prompt_lookup_min": 2, "prompt_lookup_max": 5, "disable_by_batch_size": 8,
    "max_model_len": ...}. A YAML file or LLM(...) may give the mapping itself."""
    speculative_model: str | None = None
    """Older vLLM flag: "[ngram]" (or "ngram") selects prompt-lookup speculation."""
    num_speculative_tokens: int | None = None
    """Older vLLM flag: tokens proposed per step (the JSON's num_speculative_tokens)."""
    speculative_max_model_len: int | None = None
    """Older vLLM flag: no proposals for a sequence whose length would pass this."""
    speculative_disable_by_batch_size: int | None = None
    """Older vLLM flag: no proposals in a step with more running sequences than this."""


@dataclass(frozen=True, slots=True)
class CompilationConfig(_Checked):
    """Captured decode steps (vLLM's flags; ``pagellm/runner/capture_settings.py`` reads them)."""

    enforce_eager: bool = False
    """Run every step eager (no captured decode steps), as vLLM's --enforce-eager."""
    compilation_config: str | None = None
    """JSON object as vLLM's --compilation-config: {"cudagraph_capture_sizes": [1, 2, 4, 8]}
    or {"max_cudagraph_capture_size": 64} (also "max_capture_size"). Decode steps of up to the
    largest size run captured; by default that is min(2 x max_num_seqs, 512), as in vLLM. A YAML
    file or LLM(...) may give the mapping itself."""


@dataclass(frozen=True, slots=True)
class StructuredOutputsConfig(_Checked):
    """Structured outputs (vLLM's flag; ``structured_settings`` reads it)."""

    structured_outputs_config: str | None = None
    """JSON object as vLLM's --structured-outputs-config: {"backend": "xgrammar",
    "disable_any_whitespace": false}. backend: auto or xgrammar (the one pagellm has);
    disable_any_whitespace: JSON outputs without free whitespace. A YAML file or LLM(...) may
    give the mapping itself."""


@dataclass(frozen=True, slots=True)
class StructuredSettings:
    backend: str = "xgrammar"
    disable_any_whitespace: bool = False


STRUCTURED_BACKENDS = ("auto", "xgrammar")


def structured_settings(config: StructuredOutputsConfig) -> StructuredSettings:
    """The parsed --structured-outputs-config; raises ValueError naming a bad key or value."""
    flag = "--structured-outputs-config"
    raw = json_object_flag(
        config.structured_outputs_config, flag, ("backend", "disable_any_whitespace")
    )
    backend = raw.get("backend", "auto")
    if backend not in STRUCTURED_BACKENDS:
        raise ValueError(
            f"{flag}: backend {backend!r} is not available (one of {', '.join(STRUCTURED_BACKENDS)})"
        )
    no_ws = raw.get("disable_any_whitespace", False)
    if not isinstance(no_ws, bool):
        raise ValueError(f"{flag}: disable_any_whitespace must be true or false")
    return StructuredSettings("xgrammar", no_ws)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The largest step the scheduler may hand a runner: what a GPU rank profiles its
    activation memory with before sizing its KV cache."""

    max_tokens: int = 2048
    """max_num_batched_tokens."""
    max_seqs: int = 256
    """max_num_seqs."""
    max_model_len: int = 2048
    """The longest context a sequence may reach."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs, composed from the per-area configs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    def step_limits(self, max_model_len: int) -> StepLimits:
        s = self.scheduler
        return StepLimits(s.max_num_batched_tokens, s.max_num_seqs, max_model_len)

    @classmethod
    def from_flat(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (CLI flags, YAML keys, ``LLM(**kwargs)``)."""
        parts: dict[str, dict[str, Any]] = {area: {} for area in _AREAS}
        owners = {f.name: area for area, sub in _AREAS.items() for f in dataclasses.fields(sub)}
        for key, value in kwargs.items():
            if key not in owners:
                raise TypeError(f"unknown engine setting {key!r}")
            parts[owners[key]][key] = value
        return cls(**{area: _AREAS[area](**vals) for area, vals in parts.items()})


_AT_LEAST: dict[str, int] = {
    "block_size": 1,
    "max_num_seqs": 1,
    "max_num_batched_tokens": 1,
    "max_model_len": 1,
    "num_gpu_blocks_override": 1,
    "num_host_blocks_override": 0,
    "swap_space": 0,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "pipeline_microbatches": 0,
    "preemption_protect_after": 0,
    "long_prefill_token_threshold": 0,
    "max_num_partial_prefills": 1,
    "max_long_partial_prefills": 1,
    "long_prefill_decode_budget": 0,
    "long_prefill_layer_parts": 1,
}
_ABOVE_ZERO = ("kv_cache_memory", "gpu_memory_utilization", "distributed_timeout")


def _check_field(name: str, annotation: str, value: Any) -> None:
    _check_type(name, annotation, value)
    if value is None:
        return
    if name in _AT_LEAST and value < _AT_LEAST[name]:
        raise ValueError(f"{name} must be at least {_AT_LEAST[name]}, got {value}")
    if name in _ABOVE_ZERO and not value > 0:
        raise ValueError(f"{name} must be above 0, got {value}")
    if name == "gpu_memory_utilization" and value > 1:
        raise ValueError(
            f"gpu_memory_utilization is a fraction of the GPU's memory (at most 1), got {value}"
        )


def _check_type(name: str, annotation: str, value: Any) -> None:
    kinds = [k.strip() for k in annotation.split("|")]
    if value is None:
        if "None" in kinds:
            return
        raise ValueError(f"{name} must be set, got None")
    kind = kinds[0]
    if kind == "bool":
        ok = isinstance(value, bool)
        wanted = "true or false"
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
        wanted = "an integer"
    elif kind == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        wanted = "a number"
    elif kind == "str":
        # JSON-object settings also take the mapping itself (a YAML file, LLM(...)), paths a
        # path object
        ok = isinstance(value, str | os.PathLike) or (
            isinstance(value, dict) and name.endswith("_config")
        )
        wanted = "a string"
    else:
        return
    if not ok:
        raise ValueError(f"{name} must be {wanted}, got {value!r}")


_AREAS: dict[str, type] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeConfig,
    "compilation": CompilationConfig,
    "structured": StructuredOutputsConfig,
}


def flat_fields() -> list[tuple[str, dataclasses.Field]]:
    """All settings as (name, field) pairs, for CLI/YAML derivation."""
    return [(f.name, f) for sub in _AREAS.values() for f in dataclasses.fields(sub)]


def json_object_flag(value: str | dict | None, flag: str, known: tuple[str, ...]) -> dict[str, Any]:
    """A JSON-object flag (``--speculative-config``, ``--compilation-config``) as a dict: the JSON
    text, or the mapping itself (a YAML file, ``LLM(...)``); empty when unset. Bad JSON, a
    non-object or a key outside ``known`` raise ValueError naming the flag."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(
            f"{flag}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}"
        )
    return dict(value)
