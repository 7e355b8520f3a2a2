"""Long prompts next to decoding streams: vLLM's long-prefill threshold and partial-prefill
limits, and pagellm's cut of a long prompt's chunk while others decode (fake runner)."""

from __future__ import annotations

import pytest
from fakes import FakeRunner, make_engine, run_to_completion

from pagellm.config import SchedulerConfig
from pagellm.engine.chunking import ChunkPolicy
from pagellm.engine.outputs import RunnerOutput, SchedulerOutput
from pagellm.engine.sampling_params import SamplingParams


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _chunks(runner, request_id: str) -> list[tuple[int, int]]:
    return [
        (x.start_pos, x.num_tokens)
        for step in runner.steps
        for x in step.scheduled
        if x.request_id == request_id
    ]


def _expected(last: int, n: int) -> list[int]:
    return [(last + 1 + i) % 1000 for i in range(n)]


def test_a_long_prompt_alone_takes_the_whole_budget():
    engine, runner = make_engine(
        num_blocks=256, max_num_batched_tokens=64, max_model_len=1024,
        long_prefill_token_threshold=16, long_prefill_decode_budget=8,
    )  # fmt: skip
    engine.add_request("long", list(range(100, 300)), _greedy(2))
    run_to_completion(engine)
    assert [n for _, n in _chunks(runner, "long")][:4] == [64, 64, 64, 8]


def test_streams_decoding_cut_a_long_prompt_into_small_chunks():
    engine, runner = make_engine(
        num_blocks=256, max_num_batched_tokens=64, max_model_len=1024,
        long_prefill_token_threshold=16, long_prefill_decode_budget=8,
    )  # fmt: skip
    for i in range(3):
        engine.add_request(f"s{i}", [10 + i, 11 + i], _greedy(60))
    engine.step()  # the streams' prompts; from now on they decode
    engine.add_request("long", list(range(100, 200)), _greedy(3))
    done = run_to_completion(engine)
    chunks = _chunks(runner, "long")
    assert all(n <= 8 for _, n in chunks[:-1])
    assert chunks[0] == (0, 8) and chunks[1] == (8, 8)  # continues where it ended
    assert sum(n for _, n in chunks) == 100 + 2  # the prompt, then two decode steps
    assert done["long"].outputs[0].token_ids == _expected(199, 3)
    for i in range(3):  # every stream got a token in every step
        assert len(_chunks(runner, f"s{i}")) == 60


def test_chunks_shrink_as_the_prompt_deepens():
    engine, runner = make_engine(
        num_blocks=512, max_num_batched_tokens=256, max_model_len=2048,
        long_prefill_token_threshold=16, long_prefill_decode_budget=32, attention_crossover=64,
    )  # fmt: skip
    engine.add_request("s", [5, 6], _greedy(400))
    engine.step()
    engine.add_request("long", list(range(100, 400)), _greedy(1))
    run_to_completion(engine)
    chunks = _chunks(runner, "long")
    assert chunks[0] == (0, 32)  # cost 32 at position 0
    assert chunks[1] == (32, 21)  # 32 / (1 + 32 / 64)
    sizes = [n for _, n in chunks]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] >= 1
    assert sum(sizes) == 300


def test_short_prompts_are_not_cut_while_others_decode():
    engine, runner = make_engine(
        num_blocks=256, max_num_batched_tokens=64, max_model_len=1024,
        long_prefill_token_threshold=40, long_prefill_decode_budget=4,
    )  # fmt: skip
    engine.add_request("s", [5, 6], _greedy(20))
    engine.step()
    engine.add_request("short", list(range(100, 140)), _greedy(2))
    run_to_completion(engine)
    assert _chunks(runner, "short")[0] == (0, 40)


def test_one_partial_prefill_at_a_time_by_default():
    engine, runner = make_engine(
        num_blocks=256, max_num_batched_tokens=64, max_model_len=1024,
        long_prefill_token_threshold=16,
    )  # fmt: skip
    engine.add_request("a", list(range(100, 200)), _greedy(1))
    engine.add_request("b", list(range(300, 400)), _greedy(1))
    done = run_to_completion(engine)
    first = runner.steps[0]
    assert [(x.request_id, x.num_tokens) for x in first.scheduled] == [("a", 64)]
    b_start = next(
        i for i, s in enumerate(runner.steps) if "b" in {x.request_id for x in s.scheduled}
    )
    assert b_start == 1  # b starts in the step where a's prefill completes
    assert done["b"].outputs[0].token_ids == _expected(399, 1)


@pytest.mark.parametrize("partials", [1, 2])
def test_partial_prefills_per_step_follow_the_limit(partials):
    engine, runner = make_engine(
        num_blocks=256, max_num_batched_tokens=64, max_model_len=1024,
        long_prefill_token_threshold=16, long_prefill_decode_budget=8,
        max_num_partial_prefills=partials, max_long_partial_prefills=partials,
    )  # fmt: skip
    engine.add_request("s", [5, 6], _greedy(80))
    engine.step()
    engine.add_request("b", list(range(300, 400)), _greedy(1))
    engine.add_request("c", list(range(500, 600)), _greedy(1))
    engine.step()
    engine.step()
    for step in runner.steps[1:]:
        prefilling = [x.request_id for x in step.scheduled if x.num_tokens > 1]
        assert prefilling == ["b", "c"][:partials]
    done = run_to_completion(engine)
    assert done["c"].outputs[0].token_ids == _expected(599, 1)


def test_long_prompts_wait_for_the_long_partial_limit():
    engine, runner = make_engine(
        num_blocks=256, max_num_batched_tokens=64, max_model_len=1024,
        long_prefill_token_threshold=50, max_num_partial_prefills=2, max_long_partial_prefills=1,
    )  # fmt: skip
    engine.add_request("long1", list(range(100, 300)), _greedy(1))
    engine.add_request("long2", list(range(300, 500)), _greedy(1))
    engine.step()
    assert [x.request_id for x in runner.steps[0].scheduled] == ["long1"]  # one long at a time
    engine.add_request("mid", list(range(600, 645)), _greedy(1))
    engine.step()
    scheduled = [x.request_id for x in runner.steps[1].scheduled]
    assert "long2" not in scheduled


def test_policy_defaults():
    policy = ChunkPolicy.from_config(SchedulerConfig(), None)
    assert policy.long_threshold == 2048  # the step's budget: a prompt needing several steps
    assert (policy.max_partial, policy.max_long_partial) == (1, 1)
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        ChunkPolicy.from_config(SchedulerConfig(max_num_partial_prefills=0), None)


def test_chunks_deep_in_a_prompt_fill_the_prefill_kernels_items():
    config = SchedulerConfig(long_prefill_decode_budget=16, long_prefill_layer_parts=1)
    plain = ChunkPolicy.from_config(config, 64.0)
    items = ChunkPolicy.from_config(config, 64.0, quantum=5)
    assert [plain.chunk_while_decoding(p) for p in (0, 32, 64, 192, 640)] == [16, 10, 8, 4, 1]
    # attention counted per item begun; from the crossover on whole items, at least one even
    # where its attention alone passes the budget
    assert [items.chunk_while_decoding(p) for p in (0, 32, 64, 192, 640)] == [16, 10, 5, 5, 5]
    wide = ChunkPolicy.from_config(
        SchedulerConfig(long_prefill_decode_budget=40, long_prefill_layer_parts=1), 64.0, 5
    )
    assert [wide.chunk_while_decoding(p) for p in (0, 64, 128, 192)] == [40, 20, 10, 10]


def test_a_chunk_does_not_begin_an_item_it_cannot_pay_for():
    # SmolLM2's shapes on AVX-512: budget 24, crossover ~3072, items of 10 tokens. 2000 deep,
    # 13 tokens (24 / 1.65) were two items, 13 + 2 x 10 x 0.65 = 26 > 24: now one item of 10.
    one_step = SchedulerConfig(long_prefill_decode_budget=24, long_prefill_layer_parts=1)
    policy = ChunkPolicy.from_config(one_step, 3072.0, 10)
    assert policy.chunk_while_decoding(2000) == 10
    assert policy.chunk_while_decoding(1000) == 17  # two items fit: 17 + 2 x 10 x 0.33 < 24
    assert policy.chunk_while_decoding(0) == 24
    small = ChunkPolicy.from_config(
        SchedulerConfig(long_prefill_decode_budget=4, long_prefill_layer_parts=1), 3072.0, 10
    )
    assert small.chunk_while_decoding(0) == 4  # no attention at position 0: no item to fill
    assert policy.chunk_while_decoding(7000) == 10
    for pos in range(0, 8000, 50):
        n = policy.chunk_while_decoding(pos)
        items = -(-n // 10)
        assert n == 10 or n + items * 10 * pos / 3072 <= 24


def test_layer_parts_spread_what_one_item_costs_past_the_budget():
    # SmolLM2 on AVX-512: 7000 deep, one item of 10 tokens costs 10 + 10 x 7000 / 3072 = 32.8
    # tokens' worth against a budget of 24: two steps of half the layers each
    config = SchedulerConfig(long_prefill_decode_budget=24)
    policy = ChunkPolicy.from_config(config, 3072.0, 10, layered_rows=512)
    assert [policy.layer_parts(p, 10) for p in (0, 4000, 4400, 7000, 12000, 40000)] == [
        1, 1, 2, 2, 3, 4,
    ]  # fmt: skip
    assert policy.layer_parts(0, 24) == 1 and policy.layer_parts(1000, 17) == 1
    assert ChunkPolicy.from_config(config, 3072.0, 1, 512).layer_parts(7000, 10) == 1  # no kernel
    assert ChunkPolicy.from_config(config, 3072.0, 10).layer_parts(7000, 10) == 1  # eager steps
    one = ChunkPolicy.from_config(SchedulerConfig(long_prefill_layer_parts=1), 3072.0, 10, 512)
    assert one.layer_parts(40000, 10) == 1
    with pytest.raises(ValueError, match="long_prefill_layer_parts"):
        ChunkPolicy.from_config(SchedulerConfig(long_prefill_layer_parts=0), None, 10)


def test_layered_chunks_take_the_most_tokens_a_step_within_the_budget():
    # 7000 deep an item of 10 costs 32.8: 2 items over 3 steps (21.9 a step, 6.7 tokens)
    # beat 1 over 2 (5 tokens); 5000 deep (26.3 an item) 3 items over 4 steps; where one
    # item fits, one item in one step
    config = SchedulerConfig(long_prefill_decode_budget=24)
    policy = ChunkPolicy.from_config(config, 3072.0, 10, layered_rows=512)
    for pos, tokens, parts in ((7000, 20, 3), (5000, 30, 4), (4000, 10, 1), (2000, 10, 1)):
        assert policy.chunk_while_decoding(pos) == tokens
        assert policy.layer_parts(pos, tokens) == parts
    for pos in range(0, 12000, 50):
        n = policy.chunk_while_decoding(pos)
        parts = policy.layer_parts(pos, n)
        cost = n + -(-n // 10) * 10 * pos / 3072
        assert cost / parts <= 24 or (n == 10 and parts == 4)  # past 4 parts: one item
    two = ChunkPolicy.from_config(SchedulerConfig(long_prefill_layer_parts=2), 3072.0, 10, 512)
    assert two.chunk_while_decoding(7000) == 10 and two.layer_parts(7000, 10) == 2
    # the step's other rows leave room for one item only (captured steps of at most 24 rows)
    narrow = ChunkPolicy.from_config(config, 3072.0, 10, layered_rows=24)
    assert narrow.chunk_while_decoding(7000, others=8) == 10
    assert narrow.chunk_while_decoding(7000, others=4) == 20


class LayeredRunner(FakeRunner):
    """Runs a chunk with ``layer_parts`` over that many steps, as the captured runner does:
    unfinished until its last share."""

    prefill_chunk_quantum = 4
    layered_prefill_rows = 1024

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.shares: dict[tuple[str, int, int], int] = {}

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.steps.append(sched)
        unfinished = set()
        for s in sched.scheduled:
            key = (s.request_id, s.start_pos, s.num_tokens)
            done = self.shares.pop(key, 0) + 1
            if done < s.layer_parts:
                self.shares[key] = done
                unfinished.add(s.request_id)
        sampled = {
            s.request_id: self._tokens(s)
            for s in sched.scheduled
            if s.sample and s.request_id not in unfinished
        }
        return RunnerOutput(sampled, unfinished=unfinished)


@pytest.mark.parametrize("max_parts", [4, 1])
def test_a_chunk_spread_over_steps_is_scheduled_again_until_whole(max_parts):
    engine, runner = make_engine(
        num_blocks=1024, max_num_batched_tokens=64, max_model_len=1024, attention_crossover=64,
        long_prefill_token_threshold=16, long_prefill_decode_budget=8,
        long_prefill_layer_parts=max_parts, runner=LayeredRunner(1024),
    )  # fmt: skip
    for i in range(3):
        engine.add_request(f"s{i}", [10 + i, 11 + i], _greedy(400))
    engine.step()
    engine.add_request("long", list(range(100, 600)), _greedy(3))
    done = run_to_completion(engine)
    scheduled = [x for step in runner.steps for x in step.scheduled if x.request_id == "long"]
    # each chunk as often as its layer parts, in a row, then the next where it ended
    pos = 0
    i = 0
    while pos < 500:
        x = scheduled[i]
        assert x.start_pos == pos
        assert [(y.start_pos, y.num_tokens) for y in scheduled[i : i + x.layer_parts]] == [
            (pos, x.num_tokens)
        ] * x.layer_parts
        pos += x.num_tokens
        i += x.layer_parts
    parts = [x.layer_parts for x in scheduled]
    assert max(parts) == max_parts and (max_parts == 1 or 2 in parts)
    assert done["long"].outputs[0].token_ids == _expected(599, 3)
    for i in range(3):  # every stream got a token in every step
        assert done[f"s{i}"].outputs[0].token_ids == _expected(11 + i, 400)
        assert len(_chunks(runner, f"s{i}")) == 400
