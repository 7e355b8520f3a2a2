"""Allocator invariants under random operation sequences (hypothesis state machine)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.engine.request import Request
from pagellm.engine.sampling_params import SamplingParams

NUM_BLOCKS = 12
BLOCK_SIZE = 4


def _request(rid: str, prompt_len: int) -> Request:
    return Request(rid, list(range(prompt_len)), SamplingParams(), None, 0.0, 10_000)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.live: dict[str, Request] = {}
        self.counter = 0

    @rule(prompt_len=st.integers(1, 30))
    def add(self, prompt_len: int) -> None:
        req = _request(f"r{self.counter}", prompt_len)
        self.counter += 1
        if self.kv.allocate_slots(req, prompt_len):
            req.num_computed_tokens = prompt_len
            self.live[req.request_id] = req
        else:
            assert (
                req.request_id not in self.kv.block_tables
                or not self.kv.block_tables[req.request_id]
            )

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.integers(1, 9))
    def grow(self, data, tokens: int) -> None:
        req = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.request_id)))
        before = len(self.kv.get_block_ids(req.request_id))
        free_before = self.kv.pool.num_free
        if self.kv.allocate_slots(req, tokens):
            req.num_computed_tokens += tokens
            needed = -(-req.num_computed_tokens // BLOCK_SIZE)
            assert len(self.kv.get_block_ids(req.request_id)) == needed
        else:  # nothing is taken when the allocation fails
            assert len(self.kv.get_block_ids(req.request_id)) == before
            assert self.kv.pool.num_free == free_before

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.request_id)))
        child = _request(f"r{self.counter}", parent.num_computed_tokens)
        self.counter += 1
        child.num_computed_tokens = self.kv.share_prefix(child, parent, parent.num_computed_tokens)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))
        assert rid not in self.kv.block_tables

    @invariant()
    def pool_is_consistent(self) -> None:
        pool = self.kv.pool
        pool.check_integrity()
        assert pool.num_free + pool.num_used == NUM_BLOCKS
        owners: dict[int, int] = {}
        for table in self.kv.block_tables.values():
            for block_id in table:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            # a block is owned by exactly as many tables as its reference count says
            assert owners.get(block.block_id, 0) == block.ref_cnt

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.kv.free(req)
        assert self.kv.pool.num_free == NUM_BLOCKS


TestKVCache = KVCacheMachine.TestCase
TestKVCache.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
