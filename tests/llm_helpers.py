"""An offline LLM on the tiny Llama and greedy params, shared by the model-level tests."""

from __future__ import annotations

from pagellm import LLM, SamplingParams


def tiny_llm(tiny_models, **kw) -> LLM:
    settings = dict(dtype="float32", kv_cache_memory=0.02, max_model_len=512)
    settings.update(kw)
    return LLM(str(tiny_models("llama")), **settings)


def greedy(max_tokens: list[int], n: int = 1) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=n) for m in max_tokens]
