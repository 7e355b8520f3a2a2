"""Greedy outputs are the reference's whatever the batch: alone, 32 mixed prompts, under
preemption, with chunked prefill, and with n = 3 copies sharing the prompt's blocks (fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from llm_helpers import greedy, tiny_llm
from reference import compare_greedy, hf_greedy

from pagellm import LLM

NUM_PROMPTS = 32


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(7)
    lengths = [rng.choice([1, 2, 3, 8, 17, 31, 64, 100, 150, 220]) for _ in range(NUM_PROMPTS)]
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]
    max_tokens = [rng.randrange(4, 40) for _ in range(NUM_PROMPTS)]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def references(tiny_models, workload):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_models("llama")), dtype=torch.float32
    ).eval()
    prompts, max_tokens = workload
    return [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens, strict=True)]


class Recorder:
    """Wraps the executor to watch each step's schedule and the block pool."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.inner = llm.engine.executor
        self.partial_prefills = 0
        self.max_shared_refs = 0
        self.max_batch = 0
        llm.engine.executor = self

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    def execute(self, sched):
        self.max_batch = max(self.max_batch, len(sched.scheduled))
        self.partial_prefills += sum(
            1 for s in sched.scheduled if s.num_tokens > 1 and not s.sample
        )
        pool = self.llm.engine.kv_manager.pool
        self.max_shared_refs = max([self.max_shared_refs] + [b.ref_cnt for b in pool.blocks])
        return self.inner.execute(sched)


def _check_all(outs, references, label):
    for i, (out, ref) in enumerate(zip(outs, references, strict=True)):
        for comp in out.outputs:
            compare_greedy(comp.token_ids, ref, f"{label} prompt {i} copy {comp.index}")


def _assert_all_free(llm: LLM) -> None:
    pool = llm.engine.kv_manager.pool
    pool.check_integrity()
    assert pool.num_free == pool.num_blocks


def test_one_at_a_time(tiny_models, workload, references):
    llm = tiny_llm(tiny_models)
    prompts, max_tokens = workload
    outs = [
        llm.generate([p], greedy([m]), use_tqdm=False)[0]
        for p, m in zip(prompts, max_tokens, strict=True)
    ]
    _check_all(outs, references, "alone")


def test_one_batch_of_32(tiny_models, workload, references):
    llm = tiny_llm(tiny_models)
    rec = Recorder(llm)
    prompts, max_tokens = workload
    outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    assert rec.max_batch == NUM_PROMPTS
    _check_all(outs, references, "batch")
    _assert_all_free(llm)


def test_under_preemption(tiny_models, workload, references):
    llm = tiny_llm(tiny_models, num_gpu_blocks_override=40, max_model_len=400)
    prompts, max_tokens = workload
    outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    _check_all(outs, references, "preempted")
    _assert_all_free(llm)


def test_chunked_prefill(tiny_models, workload, references):
    llm = tiny_llm(tiny_models, max_num_batched_tokens=48)
    rec = Recorder(llm)
    prompts, max_tokens = workload
    outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    assert rec.partial_prefills > 0
    _check_all(outs, references, "chunked")


def test_n3_copies_share_prompt_blocks(tiny_models, workload, references):
    llm = tiny_llm(tiny_models)
    rec = Recorder(llm)
    prompts, max_tokens = workload
    outs = llm.generate(prompts[:8], greedy(max_tokens[:8], n=3), use_tqdm=False)
    assert all(len(o.outputs) == 3 for o in outs)
    assert rec.max_shared_refs >= 3  # a prompt block owned by all three copies
    _check_all(outs, references[:8], "n=3")
    _assert_all_free(llm)
