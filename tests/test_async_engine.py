"""The asyncio front: streams, concurrency, abort on early exit, and a dying engine loop."""

from __future__ import annotations

import asyncio

import pytest
from fakes import make_engine

from pagellm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagellm.engine.errors import ContextLengthExceeded
from pagellm.engine.sampling_params import SamplingParams


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture
def async_engine():
    engine, runner = make_engine(num_blocks=600, max_num_seqs=16, max_model_len=2048)
    front = AsyncLLMEngine(engine)
    front.start()
    yield front, runner
    front.shutdown()


async def _collect(front, rid, prompt, params):
    outs = [out async for out in front.generate(rid, prompt, params)]
    return outs


def test_streams_growing_outputs_until_finished(async_engine):
    front, _ = async_engine
    outs = asyncio.run(_collect(front, "a", [5, 6, 7], _greedy(5)))
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 5  # cumulative, never repeated
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [8, 9, 10, 11, 12]
    assert [o.finished for o in outs].count(True) == 1


def test_a_stalled_reader_holds_only_the_newest_output(async_engine):
    """The engine runs on while nobody reads; the stream keeps one output, not one per step."""
    front, _ = async_engine

    async def main():
        stream = front.submit("slow", [5], _greedy(40))
        for _ in range(400):  # bounded: the engine finishes 40 tokens in far fewer polls
            if not front.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return [out async for out in stream]

    outs = asyncio.run(main())
    assert len(outs) == 1 and outs[0].finished
    assert len(outs[0].outputs[0].token_ids) == 40
    assert front.num_queued_requests == 0 and not front._streams


def test_many_concurrent_streams_complete(async_engine):
    front, _ = async_engine

    async def main():
        jobs = [_collect(front, f"r{i}", [i + 10], _greedy(3 + i % 5)) for i in range(40)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    for i, outs in enumerate(results):
        assert outs[-1].outputs[0].token_ids == [i + 11 + k for k in range(3 + i % 5)]


def test_leaving_a_stream_aborts_and_frees_blocks(async_engine):
    front, _ = async_engine
    pool = front.engine.kv_manager.pool

    async def main():
        async for out in front.generate("long", list(range(1, 40)), _greedy(100_000)):
            if len(out.outputs[0].token_ids) >= 3:
                break
        for _ in range(200):  # bounded: the abort is applied before the next step
            if pool.num_used == 0 and not front.engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.005)
        return False

    assert asyncio.run(main())


def test_rejected_request_raises_at_once_and_others_run(async_engine):
    front, _ = async_engine

    async def main():
        ok = asyncio.create_task(_collect(front, "ok", [3], _greedy(4)))
        with pytest.raises(ContextLengthExceeded):
            await _collect(front, "bad", [5] * 3000, _greedy(1))
        return await ok

    assert asyncio.run(main())[-1].finished


def test_engine_error_reaches_every_stream_and_marks_unhealthy():
    engine, runner = make_engine(max_model_len=128)
    front = AsyncLLMEngine(engine)
    calls = {"n": 0}
    execute = runner.execute

    def failing(sched):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("boom in forward")
        return execute(sched)

    runner.execute = failing
    front.start()

    async def main():
        jobs = [_collect(front, f"r{i}", [1, 2], _greedy(100)) for i in range(3)]
        return await asyncio.gather(*jobs, return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(main(), timeout=10))
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert not front.is_healthy

    async def after():
        await _collect(front, "late", [1], _greedy(1))

    with pytest.raises(EngineDeadError):
        asyncio.run(after())
    front.shutdown()


def test_releasing_the_openmp_pool_keeps_parallel_work_running():
    """The server frees its loading thread's OpenMP pool before the engine thread steps;
    parallel ops on either thread still run (libgomp builds a new pool when one is needed)."""
    import threading

    import torch

    from pagellm.openmp_env import release_thread_pool

    x = torch.randn(512, 512)
    expected = x @ x
    assert release_thread_pool()  # torch's CPU wheels use libgomp
    assert torch.allclose(x @ x, expected)
    results = []
    worker = threading.Thread(target=lambda: results.append(torch.allclose(x @ x, expected)))
    worker.start()
    worker.join(60)
    assert results == [True]
