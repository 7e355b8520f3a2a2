"""Hugging Face transformers baselines on the same model, dtype and prompts as the engine.

Two ways to serve without paging: one request at a time, and static left-padded batches that
run until the longest request in the batch is done. Only each request's own ``output_len``
counts as output; the extra tokens a static batch makes for shorter requests are waste.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pagellm.bench.datasets import BenchRequest
from pagellm.bench.report import PhaseResult


def load_hf_model(source: Path, dtype: torch.dtype) -> Any:
    """A GGUF file (dequantized by transformers) or an HF directory, in eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    if source.is_file():
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    return model.eval()


def pad_token_id(model: Any) -> int:
    """The model's pad id, else its (first) EOS id, else 0."""
    cfg = model.generation_config
    for candidate in (cfg.pad_token_id, cfg.eos_token_id, model.config.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), prompts right-aligned so generation continues each one."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def _generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> int:
    """Greedy decode exactly ``new_tokens`` per row; returns the number of new tokens per row."""
    ids, mask = left_pad(prompts, pad_id)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return out.shape[1] - ids.shape[1]


def run_single(model: Any, requests: list[BenchRequest], pad_id: int) -> PhaseResult:
    """One request at a time: no batching at all."""
    output = 0
    start = time.perf_counter()
    for req in requests:
        made = _generate(model, [req.prompt_token_ids], req.output_len, pad_id)
        output += min(made, req.output_len)
    elapsed = time.perf_counter() - start
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    return PhaseResult(len(requests), prompt, output, elapsed)


def run_static(
    model: Any, requests: list[BenchRequest], batch_size: int, pad_id: int
) -> PhaseResult:
    """Fixed batches in arrival order; each batch decodes to its longest ``output_len``."""
    output = generated = padding = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        longest = max(r.output_len for r in batch)
        made = _generate(model, [r.prompt_token_ids for r in batch], longest, pad_id)
        output += sum(min(made, r.output_len) for r in batch)
        generated += made * len(batch)
        width = max(len(r.prompt_token_ids) for r in batch)
        padding += sum(width - len(r.prompt_token_ids) for r in batch)
    elapsed = time.perf_counter() - start
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    extra = {
        "batch_size": batch_size,
        "generated_tokens": generated,
        "wasted_output_tokens": generated - output,
        "prompt_pad_tokens": padding,
    }
    return PhaseResult(len(requests), prompt, output, elapsed, extra)


def run_hf_baseline(
    source: Path,
    dtype: torch.dtype,
    requests: list[BenchRequest],
    single_prompts: int,
    static_prompts: int,
    batch_size: int,
) -> dict[str, dict[str, Any] | None]:
    """Both baselines over prompt prefixes; a phase given 0 prompts is skipped (None)."""
    model = load_hf_model(source, dtype)
    pad_id = pad_token_id(model)
    _generate(model, [requests[0].prompt_token_ids[:16]], 2, pad_id)  # warm-up, not timed
    single = requests[:single_prompts]
    static = requests[:static_prompts]
    return {
        "hf_single": run_single(model, single, pad_id).to_dict() if single else None,
        "hf_static": run_static(model, static, batch_size, pad_id).to_dict() if static else None,
    }
