"""Swap-out preemption: the scheduler moves a victim's blocks to the host pool and back (fake
runner), falls back to recompute when the host pool is full, and the host pool is conserved
(hypothesis); greedy outputs with swapping equal the reference (tiny Llama, fp32)."""

from __future__ import annotations

import random

import pytest
import torch
from fakes import make_engine, run_to_completion
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from reference import compare_greedy, hf_greedy

from pagellm import LLM, SamplingParams
from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.engine.request import Request


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _pressure(num_host_blocks: int):
    engine, runner = make_engine(
        num_blocks=10, block_size=4, max_model_len=40, preemption_mode="swap",
        num_host_blocks=num_host_blocks,
    )  # fmt: skip
    engine.add_request("old", [1, 2, 3, 4, 5], _greedy(20))
    engine.add_request("new", [7, 8, 9, 10, 11], _greedy(20))
    return engine, runner, run_to_completion(engine)


def test_swap_out_and_back_in_keeps_computed_tokens():
    engine, runner, done = _pressure(num_host_blocks=16)
    stats = engine.stats
    assert stats.num_preemptions_swap > 0 and stats.num_preemptions == stats.num_preemptions_swap
    outs = [s for s in runner.steps if s.swap_out]
    ins = [s for s in runner.steps if s.swap_in]
    assert outs and ins
    assert sum(len(s.swap_out) for s in outs) == sum(len(s.swap_in) for s in ins)
    # a swapped request resumes where it stopped: no prompt token is scheduled twice
    new_tokens = sum(
        s.num_tokens for st in runner.steps for s in st.scheduled if s.request_id == "new"
    )
    assert new_tokens == 5 + 19
    assert done["new"].outputs[0].token_ids == list(range(12, 32))
    assert done["old"].outputs[0].token_ids == list(range(6, 26))
    kv = engine.kv_manager
    assert kv.host_pool.num_free == 16 and kv.pool.num_free == kv.pool.num_blocks


def test_full_host_pool_falls_back_to_recompute():
    engine, _, done = _pressure(num_host_blocks=1)
    stats = engine.stats
    assert stats.num_preemptions > 0 and stats.num_preemptions_swap == 0
    assert done["new"].outputs[0].token_ids == list(range(12, 32))


def _until_one_is_swapped():
    engine, runner = make_engine(
        num_blocks=10, block_size=4, max_model_len=40, preemption_mode="swap", num_host_blocks=16
    )
    engine.add_request("old", [1, 2, 3, 4, 5], _greedy(20))
    engine.add_request("new", [7, 8, 9, 10, 11], _greedy(20))
    while not engine.scheduler.swapped:
        engine.step()
    return engine, runner


def test_swapped_requests_resume_before_new_admissions():
    engine, runner = _until_one_is_swapped()
    engine.add_request("later", [20, 21], _greedy(2))
    run_to_completion(engine)
    order = [s.request_id for st in runner.steps for s in st.scheduled]
    resumed = next(i for i, st in enumerate(runner.steps) if st.swap_in)
    first_later = next(
        i for i, st in enumerate(runner.steps) for s in st.scheduled if s.request_id == "later"
    )
    assert resumed <= first_later and "later" in order


def test_abort_of_a_swapped_request_frees_its_host_blocks():
    engine, _ = _until_one_is_swapped()
    victim = engine.scheduler.swapped[0].request_id
    assert engine.kv_manager.host_pool.num_free < 16
    engine.abort(victim)
    assert engine.kv_manager.host_pool.num_free == 16
    run_to_completion(engine)


# ----- hypothesis: device and host pools with swapping --------------------------------------

NUM_BLOCKS, NUM_HOST, BS = 10, 8, 4


class SwapMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_caching=True, num_host_blocks=NUM_HOST)
        self.running: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.counter = 0

    @rule(length=st.integers(1, 20))
    def add(self, length: int) -> None:
        req = Request(f"r{self.counter}", list(range(length)), SamplingParams(), None, 0.0, 999)
        self.counter += 1
        hits = self.kv.find_cached_prefix(req)
        if self.kv.allocate_slots(req, length - len(hits) * BS, hits):
            req.num_computed_tokens = length
            self.kv.cache_full_blocks(req)
            self.running[req.request_id] = req

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running[rid]
        host_free = self.kv.host_pool.num_free
        copies = self.kv.swap_out(req)
        if copies is None:
            assert self.kv.host_pool.num_free == host_free  # nothing taken
            return
        assert len({h for _, h in copies}) == len(copies)
        self.swapped[rid] = self.running.pop(rid)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        req = self.swapped[rid]
        if self.kv.can_swap_in(req, 0):
            copies = self.kv.swap_in(req)
            assert len(copies) == -(-req.num_computed_tokens // BS)
            self.running[rid] = self.swapped.pop(rid)

    @precondition(lambda self: self.running or self.swapped)
    @rule(data=st.data())
    def finish(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted({**self.running, **self.swapped})))
        req = self.running.pop(rid, None) or self.swapped.pop(rid)
        self.kv.free(req)
        self.kv.forget(req)

    @invariant()
    def conserved(self) -> None:
        host = self.kv.host_pool
        host.check_integrity()
        self.kv.pool.check_integrity()
        held = [b for t in self.kv.host_tables.values() for b in t]
        assert len(held) == len(set(held))  # a host block has one owner
        assert host.num_free + len(held) == NUM_HOST  # host pool conserved
        assert set(self.kv.host_tables) == set(self.swapped)
        assert not set(self.kv.block_tables) & set(self.swapped)  # swapped: no device blocks


TestSwap = SwapMachine.TestCase
TestSwap.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


# ----- the real model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(2, 60))] for _ in range(16)]
    return prompts, [rng.randrange(8, 30) for _ in prompts]


def test_greedy_outputs_with_swap_equal_the_reference(tiny_models, workload):
    import transformers

    prompts, max_tokens = workload
    llm = LLM(
        str(tiny_models("llama")), dtype="float32", max_model_len=192,
        num_gpu_blocks_override=12, num_host_blocks_override=64, preemption_mode="swap",
    )  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_preemptions_swap > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_models("llama")), dtype=torch.float32
    ).eval()
    for i, (out, p, m) in enumerate(zip(outs, prompts, max_tokens, strict=True)):
        compare_greedy(out.outputs[0].token_ids, hf_greedy(hf, p, m), f"swap {i}")
    kv = llm.engine.kv_manager
    assert kv.host_pool.num_free == 64 and kv.pool.num_free == kv.pool.num_blocks
