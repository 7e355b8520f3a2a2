"""Greedy outputs with prefix caching equal the reference (tiny Llama, fp32): requests sharing a
system prompt, multi-turn chats resending their history, under preemption and chunked prefill,
and n > 1. Each test asserts that cached blocks were really reused."""

from __future__ import annotations

import random

import pytest
import torch
from llm_helpers import greedy, tiny_llm
from reference import compare_greedy, hf_greedy

SYSTEM_LEN = 70


@pytest.fixture(scope="module")
def hf(tiny_models):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_models("llama")), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def shared_prompts():
    rng = random.Random(5)
    system = [rng.randrange(100, 40000) for _ in range(SYSTEM_LEN)]
    prompts = [system + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 30))]]
    prompts += [system + [rng.randrange(100, 40000) for _ in range(n)] for n in range(1, 40, 3)]
    max_tokens = [rng.randrange(4, 20) for _ in prompts]
    return prompts, max_tokens


def _check(outs, hf, prompts, max_tokens, label):
    for i, (out, p, m) in enumerate(zip(outs, prompts, max_tokens, strict=True)):
        ref = hf_greedy(hf, p, m)
        for comp in out.outputs:
            compare_greedy(comp.token_ids, ref, f"{label} prompt {i} copy {comp.index}")


def test_shared_system_prompt_hits_and_matches(tiny_models, hf, shared_prompts):
    prompts, max_tokens = shared_prompts
    llm = tiny_llm(tiny_models)
    first = llm.generate(prompts[:1], greedy(max_tokens[:1]), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(max_tokens[1:]), use_tqdm=False)
    stats = llm.get_stats()
    # every later prompt reuses the system prompt's 4 full blocks (block size 16)
    assert stats.prefix_cache_hits >= (len(prompts) - 1) * (SYSTEM_LEN // 16) * 16
    _check(first + rest, hf, prompts, max_tokens, "cached")
    llm.engine.kv_manager.pool.check_integrity()


def test_caching_on_and_off_agree(tiny_models, hf, shared_prompts):
    prompts, max_tokens = shared_prompts
    off = tiny_llm(tiny_models, enable_prefix_caching=False)
    outs = off.generate(prompts, greedy(max_tokens), use_tqdm=False)
    assert off.get_stats().prefix_cache_hits == 0
    _check(outs, hf, prompts, max_tokens, "uncached")


def test_multi_turn_reuses_generated_tokens(tiny_models, hf, shared_prompts):
    prompts, _ = shared_prompts
    llm = tiny_llm(tiny_models)
    turn1 = llm.generate(prompts[:4], greedy([12] * 4), use_tqdm=False)
    follow = [
        p + list(o.outputs[0].token_ids) + [1234, 4321]
        for p, o in zip(prompts[:4], turn1, strict=True)
    ]
    before = llm.get_stats().prefix_cache_hits
    turn2 = llm.generate(follow, greedy([8] * 4), use_tqdm=False)
    hits = llm.get_stats().prefix_cache_hits - before
    # each history's full blocks (generated tokens included) come from the cache
    assert hits == sum(((len(f) - 1) // 16) * 16 for f in follow)
    _check(turn2, hf, follow, [8] * 4, "turn 2")


def test_under_preemption_and_chunked_prefill(tiny_models, hf, shared_prompts):
    prompts, max_tokens = shared_prompts
    llm = tiny_llm(  # no cut of long prompts while others decode: the cache must run short
        tiny_models, num_gpu_blocks_override=30, max_num_batched_tokens=48, max_model_len=200,
        long_prefill_decode_budget=0,
    )  # fmt: skip
    llm.generate(prompts[:1], greedy([2]), use_tqdm=False)  # warm the cache
    outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    _check(outs, hf, prompts, max_tokens, "preempted+chunked")
    pool = llm.engine.kv_manager.pool
    pool.check_integrity()
    assert pool.num_free == pool.num_blocks


def test_n_copies_with_caching(tiny_models, hf, shared_prompts):
    prompts, max_tokens = shared_prompts
    llm = tiny_llm(tiny_models)
    llm.generate(prompts[:1], greedy([2]), use_tqdm=False)
    outs = llm.generate(prompts[:5], greedy(max_tokens[:5], n=3), use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits > 0
    assert all(len(o.outputs) == 3 for o in outs)
    _check(outs, hf, prompts[:5], max_tokens[:5], "n=3 cached")
