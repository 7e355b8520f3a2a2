"""Automatic prefix caching: block hashes, LRU eviction, allocator invariants (hypothesis), and
the scheduler reusing cached blocks (fake runner, milliseconds)."""

from __future__ import annotations

from fakes import make_engine, run_to_completion
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagellm.engine.block_hash import extend_block_hashes, root_hash
from pagellm.engine.block_pool import BlockPool
from pagellm.engine.kv_cache_manager import KVCacheManager
from pagellm.engine.request import Request
from pagellm.engine.sampling_params import SamplingParams

BS = 4


def _request(rid: str, tokens: list[int], extra: tuple = ()) -> Request:
    req = Request(rid, list(tokens), SamplingParams(), None, 0.0, 10_000)
    req.cache_extra_keys = extra
    return req


# ----- hashes -----------------------------------------------------------------------------


def test_block_hashes_chain_the_whole_prefix():
    a = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8, 9], BS, 10)
    b = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], BS, 10)
    c = extend_block_hashes([], [0, 2, 3, 4, 5, 6, 7, 8], BS, 10)
    assert len(a) == 2 and a == b  # only full blocks are hashed
    assert c[1] != a[1]  # same tokens in block 1, different prefix
    assert extend_block_hashes([], [1, 2, 3, 4], BS, 10, ("adapter", 1))[0] != a[0]
    assert root_hash(()) != root_hash(("x",))
    grown = extend_block_hashes(list(a[:1]), [1, 2, 3, 4, 5, 6, 7, 8], BS, 10)
    assert grown == a  # extending reuses what is there


# ----- pool -------------------------------------------------------------------------------


def test_freed_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.release([b])
    pool.release([a])
    pool.release([c])
    assert pool.num_free == 3 and pool.num_cached_free == 2
    assert pool.allocate(1) == [b]  # freed first, evicted first
    assert pool.lookup(b"hb") is None and pool.lookup(b"ha") == a
    pool.touch([a])  # a hit takes it out of the free queue
    assert pool.num_free == 1 and pool.blocks[a].ref_cnt == 1
    assert pool.allocate(1) == [c]
    pool.check_integrity()


def test_same_content_twice_keeps_the_first_block_cached():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")
    assert pool.lookup(b"h") == a and pool.blocks[b].block_hash is None
    pool.check_integrity()


# ----- hypothesis: the manager with caching -------------------------------------------------

NUM_BLOCKS = 10
BASE = list(range(100, 140))  # prompts share prefixes of this


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_caching=True)
        self.live: dict[str, Request] = {}
        self.content: dict[int, tuple[int, ...]] = {}
        """Block id -> the whole token prefix whose KV the block holds (model of the cache)."""
        self.counter = 0
        self.hit_tokens = 0

    def _fill(self, req: Request) -> None:
        """The runner computed req's tokens: record what each full block now holds."""
        table = self.kv.get_block_ids(req.request_id)
        for i in range(req.num_computed_tokens // BS):
            self.content[table[i]] = tuple(req.all_token_ids[: (i + 1) * BS])
        self.kv.cache_full_blocks(req)

    @rule(shared=st.integers(0, 24), tail=st.lists(st.integers(0, 3), max_size=8))
    def add(self, shared: int, tail: list[int]) -> None:
        tokens = BASE[:shared] + tail or [0]
        req = _request(f"r{self.counter}", tokens)
        self.counter += 1
        hits = self.kv.find_cached_prefix(req)
        assert len(hits) * BS < len(tokens)  # at least one token is always computed
        for i, block_id in enumerate(hits):  # a hit holds exactly this request's prefix
            assert self.content[block_id] == tuple(tokens[: (i + 1) * BS])
        new = len(tokens) - len(hits) * BS
        free_before = self.kv.pool.num_free
        if self.kv.allocate_slots(req, new, hits):
            req.num_computed_tokens = len(tokens)
            self.hit_tokens += len(hits) * BS
            self.live[req.request_id] = req
            self._fill(req)
        else:
            assert self.kv.pool.num_free == free_before
            assert not self.kv.get_block_ids(req.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def grow(self, data, tokens: list[int]) -> None:
        req = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.request_id)))
        if self.kv.allocate_slots(req, len(tokens)):
            for t in tokens:
                req.append_token(t)
            req.num_computed_tokens += len(tokens)
            self._fill(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.live.values(), key=lambda r: r.request_id)))
        child = _request(f"r{self.counter}", parent.all_token_ids)
        self.counter += 1
        child.num_computed_tokens = self.kv.share_prefix(child, parent, parent.num_computed_tokens)
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data(), finished=st.booleans())
    def free(self, data, finished: bool) -> None:
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(req)  # finished or preempted: the blocks stay cached either way
        if finished:
            self.kv.forget(req)

    @invariant()
    def consistent(self) -> None:
        pool = self.kv.pool
        pool.check_integrity()
        assert pool.num_free + pool.num_used == NUM_BLOCKS
        assert pool.num_cached_free <= pool.num_free
        owners: dict[int, int] = {}
        for table in self.kv.block_tables.values():
            for block_id in table:
                owners[block_id] = owners.get(block_id, 0) + 1
        for block in pool.blocks:  # no block has two owners unless counted (forks, hits)
            assert owners.get(block.block_id, 0) == block.ref_cnt
        for block_hash, block_id in pool.cached.items():
            # a cached hash names the tokens its block holds
            prefix = self.content[block_id]
            assert extend_block_hashes([], list(prefix), BS, len(prefix) // BS)[-1] == block_hash

    def teardown(self) -> None:
        for req in list(self.live.values()):
            self.kv.free(req)
        assert self.kv.pool.num_free == NUM_BLOCKS


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ----- the scheduler ----------------------------------------------------------------------


def _prompt(text_ids: list[int]) -> str:
    return " ".join(str(t) for t in text_ids)


def test_second_request_with_the_same_prefix_computes_only_the_rest():
    engine, runner = make_engine(block_size=4, max_num_batched_tokens=64)
    shared = list(range(10, 30))  # 20 tokens = 5 full blocks
    engine.add_request("a", shared + [1, 1], SamplingParams(max_tokens=3, ignore_eos=True))
    run_to_completion(engine)
    runner.steps.clear()
    engine.add_request("b", shared + [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    run_to_completion(engine)
    first = next(s for s in runner.steps[0].scheduled if s.request_id == "b")
    assert first.start_pos == 20 and first.token_ids == [5, 6, 7]
    stats = engine.stats
    assert stats.prefix_cache_hits == 20
    assert stats.prefix_cache_queries == 22 + 23


def test_a_fully_cached_prompt_still_computes_its_last_token():
    engine, runner = make_engine(block_size=4)
    prompt = list(range(10, 26))  # exactly 4 blocks
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        outs = run_to_completion(engine)
    first_b = [s for step in runner.steps for s in step.scheduled if s.request_id == "b"][0]
    assert first_b.start_pos == 12 and len(first_b.token_ids) == 4  # last block recomputed
    assert outs["b"].outputs[0].token_ids == [26, 27]


def test_caching_off_computes_everything_again():
    engine, runner = make_engine(block_size=4, prefix_caching=False)
    prompt = list(range(10, 30))
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        run_to_completion(engine)
    first_b = [s for step in runner.steps for s in step.scheduled if s.request_id == "b"][0]
    assert first_b.start_pos == 0
    assert engine.stats.prefix_cache_hits == 0 and engine.stats.prefix_cache_queries == 0


def test_generated_tokens_are_cached_for_the_next_turn():
    engine, runner = make_engine(block_size=4)
    prompt = list(range(10, 18))
    engine.add_request("turn1", prompt, SamplingParams(max_tokens=9, ignore_eos=True))
    answer = run_to_completion(engine)["turn1"].outputs[0].token_ids
    runner.steps.clear()
    history = prompt + answer + [3, 3]  # the chat resends its history
    engine.add_request("turn2", history, SamplingParams(max_tokens=1, ignore_eos=True))
    run_to_completion(engine)
    first = runner.steps[0].scheduled[0]
    # 8 prompt + 9 generated = 17 tokens; the KV of the first 16 (4 blocks) was computed
    assert first.start_pos == 16


def test_preempted_request_reuses_its_own_cached_blocks():
    engine, runner = make_engine(
        num_blocks=12, block_size=4, max_num_batched_tokens=64, max_model_len=40
    )
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    engine.add_request("a", list(range(10, 26)), params)
    engine.add_request("b", list(range(40, 56)), params)
    outs = run_to_completion(engine)
    assert engine.stats.num_preemptions > 0
    assert engine.stats.prefix_cache_hits > 0
    for rid, start in (("a", 10), ("b", 40)):  # outputs are unchanged: t -> t + 1
        assert outs[rid].outputs[0].token_ids == list(range(start + 16, start + 30))
