"""An offline LLM on the tiny Llama and greedy params, shared by the model-level tests."""

from __future__ import annotations

from pagellm import LLM, SamplingParams

MIXED_PROMPTS = [
    "Hello there, how are",
    "The capital of France",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31",
    "a",
    "Shared system prompt. " * 6 + "first question",
    "Shared system prompt. " * 6 + "second question",
]
"""Short and long prompts, two sharing a prefix: with a small cache and small steps they make
chunked prefill, prefix-cache hits and preemption all happen."""


def tiny_llm(tiny_models, **kw) -> LLM:
    settings = dict(dtype="float32", kv_cache_memory=0.02, max_model_len=512)
    settings.update(kw)
    return LLM(str(tiny_models("llama")), **settings)


def greedy(max_tokens: list[int], n: int = 1) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=n) for m in max_tokens]
