"""Builds a ready LLMEngine from an EngineConfig: model, tokenizer, KV cache, and the executor
(one ModelRunner in this process, or a ParallelExecutor over tensor/pipeline-parallel ranks)."""

from __future__ import annotations

from pathlib import Path

from pagellm.config import EngineConfig, StructuredSettings, structured_settings
from pagellm.engine.llm_engine import LLMEngine
from pagellm.models.arch import ModelArch
from pagellm.runner.capture_settings import max_capture_size
from pagellm.runner.device import resolve_device
from pagellm.runner.loader import ModelFiles, open_model, resolve_dtype, resolve_source
from pagellm.runner.model_runner import ModelRunner
from pagellm.runner.tokenizer import Tokenizer
from pagellm.spec.settings import SpecSettings, spec_settings
from pagellm.structured.grammar import GrammarCompiler, StructuredOutputManager


def check_fits_model(config: EngineConfig, max_len: int, num_layers: int) -> None:
    """Settings that cannot work with this model's length or depth, refused at start-up."""
    sched = config.scheduler
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_len:
        raise ValueError(
            f"max_num_batched_tokens={sched.max_num_batched_tokens} is below "
            f"max_model_len={max_len}: without chunked prefill a longer prompt could never be "
            "scheduled; raise --max-num-batched-tokens, lower --max-model-len or enable "
            "chunked prefill"
        )
    if config.parallel.pipeline_parallel_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={config.parallel.pipeline_parallel_size} exceeds the "
            f"model's {num_layers} layers"
        )


def build_engine(config: EngineConfig) -> tuple[LLMEngine, Tokenizer]:
    check_kv_cache_settings(config)
    spec = spec_settings(config.speculative)  # a bad --speculative-config fails before loading
    structured = structured_settings(config.structured)  # and --structured-outputs-config
    max_capture_size(config.compilation, config.scheduler.max_num_seqs)  # and --compilation-config
    source = resolve_source(config.model.model)
    files = open_model(source, weight_quantization(config, source))
    arch = files.arch
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    tokenizer_source = source
    if config.model.tokenizer:
        try:
            tokenizer_source = resolve_source(config.model.tokenizer)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"--tokenizer: {exc}") from exc
    tokenizer = Tokenizer.load(tokenizer_source, arch.eos_token_id)
    max_len = config.model.max_model_len or arch.max_position_embeddings
    if max_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_len} exceeds the model's context length "
            f"({arch.max_position_embeddings})"
        )
    check_fits_model(config, max_len, arch.num_layers)
    swap = config.scheduler.preemption_mode == "swap"
    draft_files = open_draft(spec, arch, config) if spec is not None else None
    if config.parallel.world_size > 1:
        from pagellm.parallel.executor import ParallelExecutor

        executor = ParallelExecutor(
            files, config.model.dtype, dtype, config.cache, swap, config.parallel, device,
            config.step_limits(max_len), config.model.batch_invariant,
        )  # fmt: skip
    else:
        executor = ModelRunner(
            files, dtype, config.cache, swap=swap, device=device,
            limits=config.step_limits(max_len), draft_files=draft_files,
            capture_max_size=max_capture_size(config.compilation, config.scheduler.max_num_seqs),
            batch_invariant=config.model.batch_invariant,
        )  # fmt: skip
    engine = LLMEngine(
        config,
        executor,
        tokenizer,
        max_len,
        arch.vocab_size,
        attention_crossover=arch.attention_crossover(),
        structured=structured_output_manager(structured, tokenizer, arch.vocab_size, spec),
    )
    return engine, tokenizer


def weight_quantization(config: EngineConfig, source: Path) -> str | None:
    """--quantization as the loader takes it: batch-invariant mode computes with dense weights,
    so a GGUF file with quantization auto is dequantized to --dtype (what --quantization none
    does); anything else stays as given, and a model still quantized is refused after loading."""
    requested = config.model.quantization
    if config.model.batch_invariant and requested in (None, "auto") and source.suffix == ".gguf":
        return "none"
    return requested


def structured_output_manager(
    settings: StructuredSettings, tokenizer: Tokenizer, vocab_size: int, spec: SpecSettings | None
) -> StructuredOutputManager:
    """xgrammar over the model's tokenizer; its stop token is the model's end of sequence."""
    stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    compiler = GrammarCompiler(
        tokenizer.hf, vocab_size, stop, disable_any_whitespace=settings.disable_any_whitespace
    )
    rollback = max(1, spec.num_speculative_tokens) if spec is not None else 1
    return StructuredOutputManager(compiler, max_rollback=rollback)


def open_draft(spec: SpecSettings, arch: ModelArch, config: EngineConfig) -> ModelFiles | None:
    """The draft model's files (method draft_model), checked against the target: one rank,
    the same vocabulary (ValueError otherwise)."""
    if spec.method != "draft_model":
        return None
    if config.parallel.world_size > 1:
        raise ValueError(
            "speculative decoding with a draft model runs on one rank: use method ngram with "
            "tensor/pipeline parallelism"
        )
    files = open_model(resolve_source(spec.model), spec.quantization)
    if files.arch.vocab_size != arch.vocab_size:
        raise ValueError(
            f"the draft model {spec.model} has a vocabulary of {files.arch.vocab_size} tokens, "
            f"the target {arch.vocab_size}: a draft must share the target's tokenizer"
        )
    return files


def check_kv_cache_settings(config: EngineConfig) -> None:
    """--kv-cache-dtype and --calculate-kv-scales, before anything loads (ValueError)."""
    from pagellm.attention.kv_cache import kv_cache_format

    kv_format = kv_cache_format(config.cache.kv_cache_dtype)
    if config.cache.calculate_kv_scales and kv_format.fp8 is None:
        raise ValueError(
            "--calculate-kv-scales needs an FP8 KV cache (--kv-cache-dtype fp8, fp8_e4m3 or "
            "fp8_e5m2)"
        )
