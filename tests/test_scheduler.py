"""Scheduler and engine behaviour with a scripted fake runner (no model, milliseconds)."""

from __future__ import annotations

import pytest
from fakes import make_engine, run_to_completion

from pagellm.engine.errors import ContextLengthExceeded, RequestRejected
from pagellm.engine.sampling_params import SamplingParams


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _expected(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + i) % 1000 for i in range(1, n + 1)]


def test_continuous_batching_admits_and_retires_every_step():
    engine, runner = make_engine(max_num_seqs=2)
    engine.add_request("a", [10, 11, 12], _greedy(2))
    engine.add_request("b", [20, 21], _greedy(5))
    engine.add_request("c", [30], _greedy(3))
    done = run_to_completion(engine)
    assert done["a"].outputs[0].token_ids == _expected([12], 2)
    assert done["b"].outputs[0].token_ids == _expected([21], 5)
    assert done["c"].outputs[0].token_ids == _expected([30], 3)
    first = runner.steps[0].scheduled
    assert [s.request_id for s in first] == ["a", "b"]  # max_num_seqs caps the batch
    # "c" joins as soon as "a" leaves, while "b" is still decoding
    joined = next(
        i for i, s in enumerate(runner.steps) if any(x.request_id == "c" for x in s.scheduled)
    )
    assert any(x.request_id == "b" for x in runner.steps[joined].scheduled)


def test_chunked_prefill_mixes_with_decodes_under_the_budget():
    engine, runner = make_engine(max_num_batched_tokens=8)
    engine.add_request("short", [1, 5], _greedy(6))
    engine.add_request("long", list(range(100, 130)), _greedy(2))
    done = run_to_completion(engine)
    assert done["long"].outputs[0].token_ids == _expected([129], 2)
    for step in runner.steps:
        assert step.num_batched_tokens <= 8
    mixed = [
        s
        for s in runner.steps
        if {x.request_id for x in s.scheduled} == {"short", "long"} and len(s.scheduled) == 2
    ]
    assert any(next(x for x in s.scheduled if x.request_id == "long").num_tokens > 1 for s in mixed)
    positions = [
        (x.start_pos, x.num_tokens)
        for s in runner.steps
        for x in s.scheduled
        if x.request_id == "long"
    ]
    assert positions[0] == (0, 6) and positions[1][0] == 6  # chunks continue where they ended


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    engine, runner = make_engine(max_num_batched_tokens=16, chunked=False)
    engine.add_request("a", list(range(10)), _greedy(2))
    engine.add_request("b", list(range(10)), _greedy(2))
    run_to_completion(engine)
    assert [s.request_id for s in runner.steps[0].scheduled] == ["a"]


def test_preemption_recomputes_and_output_continues():
    engine, runner = make_engine(num_blocks=8, block_size=4, max_model_len=32)
    engine.add_request("old", [1, 2, 3, 4, 5], _greedy(20))
    engine.add_request("new", [7, 8, 9, 10, 11], _greedy(20))
    done = run_to_completion(engine)
    assert engine.stats.num_preemptions > 0
    assert done["new"].metrics.num_preemptions > 0  # the latest arrival is the victim
    assert done["old"].outputs[0].token_ids == _expected([5], 20)
    assert done["new"].outputs[0].token_ids == _expected([11], 20)
    pool = engine.kv_manager.pool
    assert pool.num_free == pool.num_blocks


def test_priority_decides_the_victim():
    engine, _ = make_engine(num_blocks=8, block_size=4, max_model_len=32, policy="priority")
    engine.add_request("bulk", [7, 8, 9, 10, 11], _greedy(20), priority=5)
    engine.add_request("vip", [1, 2, 3, 4, 5], _greedy(20), priority=0)
    done = run_to_completion(engine)
    assert done["bulk"].metrics.num_preemptions > 0  # arrived first, but less important
    assert done["vip"].metrics.num_preemptions == 0


def test_blocks_grow_one_at_a_time_and_free_on_finish():
    engine, _ = make_engine(block_size=4)
    engine.add_request("a", [1, 2, 3], _greedy(6))
    owned = []
    while engine.has_unfinished_requests():
        engine.step()
        owned.append(len(engine.kv_manager.get_block_ids("a")))
    # 3 prompt tokens -> 1 block; a block is added only when the previous one is full
    assert owned[:-1] == [1, 1, 2, 2, 2, 2][: len(owned) - 1]
    assert engine.kv_manager.pool.num_free == engine.kv_manager.num_blocks


def test_abort_frees_everything_at_once():
    engine, _ = make_engine()
    engine.add_request("a", list(range(20)), _greedy(50))
    engine.add_request("b", list(range(20)), _greedy(50))
    for _ in range(3):
        engine.step()
    assert engine.kv_manager.pool.num_used > 0
    assert engine.abort("a") and engine.abort("b")
    assert engine.kv_manager.pool.num_used == 0
    assert not engine.has_unfinished_requests()
    assert not engine.abort("a")
    engine.step()  # an empty step is fine


def test_prompt_longer_than_max_model_len_is_rejected_not_queued():
    engine, _ = make_engine(max_model_len=16)
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 16"):
        engine.add_request("a", list(range(16)), _greedy(1))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request("b", [], _greedy(1))
    with pytest.raises(RequestRejected, match="token ids"):
        engine.add_request("c", [5, 10_000], _greedy(1))
    assert not engine.has_unfinished_requests()


def test_max_model_len_larger_than_the_cache_is_a_config_error():
    with pytest.raises(ValueError, match="kv-cache-memory"):
        make_engine(num_blocks=2, block_size=4, max_model_len=64)


def test_generation_stops_at_max_model_len():
    engine, _ = make_engine(max_model_len=10)
    engine.add_request("a", list(range(1, 8)), _greedy(100))
    done = run_to_completion(engine)
    assert len(done["a"].outputs[0].token_ids) == 3
    assert done["a"].outputs[0].finish_reason == "length"


def test_stop_token_eos_min_tokens_and_stop_strings():
    engine, _ = make_engine()
    engine.add_request(
        "eos", [0], SamplingParams(temperature=0, max_tokens=10)
    )  # 0 -> 1 -> 2 (EOS)
    engine.add_request("ignore", [0], _greedy(4))
    engine.add_request("stop_id", [10], SamplingParams(temperature=0, stop_token_ids=[13]))
    engine.add_request(
        "min", [0], SamplingParams(temperature=0, max_tokens=10, min_tokens=5, stop_token_ids=[3])
    )
    engine.add_request("text", [40], SamplingParams(temperature=0, max_tokens=10, stop=["<43>"]))
    engine.add_request(
        "min_text", [40], SamplingParams(temperature=0, max_tokens=10, min_tokens=5, stop=["<4"])
    )
    done = run_to_completion(engine)
    assert done["eos"].outputs[0].token_ids == [1, 2]
    assert done["eos"].outputs[0].finish_reason == "stop"
    assert done["eos"].outputs[0].text == "<1><2>"  # the fake tokenizer has no special tokens
    assert done["ignore"].outputs[0].token_ids == [1, 2, 3, 4]
    assert done["stop_id"].outputs[0].token_ids == [11, 12, 13]
    assert done["stop_id"].outputs[0].stop_reason == 13
    assert len(done["min"].outputs[0].token_ids) == 10  # stop id 3 came before min_tokens
    text = done["text"].outputs[0]
    assert text.text == "<41><42>" and text.finish_reason == "stop" and text.stop_reason == "<43>"
    # "<4" is in every token from the first; as vLLM, stop strings count after min_tokens
    late = done["min_text"].outputs[0]
    assert late.text == "<41><42><43><44><45>" and late.stop_reason == "<4"
    assert len(late.token_ids) == 6


def test_n_copies_share_the_prompt_blocks():
    engine, runner = make_engine(block_size=4)
    engine.add_request("g", list(range(1, 11)), _greedy(3, n=3))
    shared_seen = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        shared_seen = max(shared_seen, max(b.ref_cnt for b in engine.kv_manager.pool.blocks))
    assert shared_seen == 3
    assert len(outs) == 1 and len(outs[0].outputs) == 3
    assert all(c.token_ids == [11, 12, 13] for c in outs[0].outputs)
    # copies 2 and 3 recompute only the tail of the prompt (10 tokens, 4-token blocks -> 2 shared)
    child_first = [x for s in runner.steps for x in s.scheduled if x.request_id == "g#1"][0]
    assert child_first.start_pos == 8
    assert engine.kv_manager.pool.num_free == engine.kv_manager.num_blocks


def test_duplicate_request_id_is_rejected():
    engine, _ = make_engine()
    engine.add_request("a", [1], _greedy(3))
    with pytest.raises(RequestRejected):
        engine.add_request("a", [1], _greedy(3))


def test_kv_waste_is_measured_at_peak():
    engine, _ = make_engine(block_size=4, num_blocks=64)
    for i in range(4):
        engine.add_request(str(i), [1, 2, 3, 4, 5], _greedy(3))
    run_to_completion(engine)
    stats = engine.stats
    assert 0 < stats.peak_kv_usage <= 1
    # at peak each request holds 8 tokens in 2 blocks (7 filled + 1 slot for the step) or so
    assert 0 <= stats.kv_waste_at_peak < 0.5
