"""A fault of one request costs that request alone: sampling, the engine step, the async front.

Also the bookkeeping that must stay linear under many requests (batched aborts) and bounded
(tenant metric series), and the HTTP app's answer to an unexpected fault (a 500 error object).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from fakes import FakeRunner, FakeTokenizer, make_engine

from pagellm.engine.async_engine import AsyncLLMEngine, RequestFailed
from pagellm.engine.outputs import RunnerOutput, ScheduledRequest, SchedulerOutput
from pagellm.engine.sampling_params import ParamError, SamplingParams
from pagellm.sampling.sampler import Sampler
from pagellm.server.metrics import MAX_TENANT_SERIES, OTHER_TENANTS, bounded_tenants


def _scheduled(rid: str, seed: int, **params) -> ScheduledRequest:
    return ScheduledRequest(rid, [1], 0, [0], True, SamplingParams(**params), seed, [1], [], None)


def test_a_row_that_cannot_sample_fails_alone():
    good = _scheduled("good", 7, temperature=1.0)
    bad = _scheduled("bad", 1 << 70, temperature=1.0)  # slipped past validation
    logits = torch.tensor([[0.0, 5.0, 0.0], [1.0, 1.0, 1.0]])
    out = Sampler().sample(logits, [good, bad])
    assert list(out.failed) == [1] and out.failed[1].startswith("sampling failed")
    assert out.token_ids[0] == Sampler().sample(logits[:1], [good]).token_ids[0]


def test_logit_bias_and_allowed_tokens_shape_the_choice():
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0]])
    biased = _scheduled("b", 0, temperature=0, logit_bias={3: 100.0})
    allowed = _scheduled("a", 0, temperature=1.0, allowed_token_ids=[2])
    assert Sampler().sample(logits, [biased]).token_ids == [3]
    assert Sampler().sample(logits, [allowed]).token_ids == [2]


@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"seed": 1 << 64}, "seed"),
        ({"temperature": float("nan")}, "temperature"),
        ({"presence_penalty": float("inf")}, "presence_penalty"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"stop": ["x"] * 33}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"n": 129}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ],
)
def test_out_of_range_params_name_the_field(params, name):
    with pytest.raises(ParamError) as info:
        SamplingParams(**params)
    assert info.value.param == name


def test_vocabulary_bounds_are_the_engines():
    engine, _ = make_engine()  # vocabulary of 1000
    for params in (
        SamplingParams(top_k=1001),
        SamplingParams(min_tokens=1, stop_token_ids=[99_999_999]),
        SamplingParams(logit_bias={1000: 1.0}),
        SamplingParams(allowed_token_ids=[5, 1000]),
    ):
        with pytest.raises(ParamError):
            engine.add_request("r", [5], params)
    assert not engine.has_unfinished_requests()


def test_allowed_tokens_that_min_tokens_bans_are_refused():
    """min_tokens bans the stop tokens and EOS until it is reached: allowed_token_ids holding
    only those would leave no token to sample (the row all -inf, and token 0 came out)."""
    engine, _ = make_engine()
    eos = engine.tokenizer.eos_token_id
    for params in (
        SamplingParams(min_tokens=3, allowed_token_ids=[40], stop_token_ids=[40]),
        SamplingParams(min_tokens=1, allowed_token_ids=[eos]),
        SamplingParams(min_tokens=2, allowed_token_ids=[eos, 7], stop_token_ids=[7]),
    ):
        with pytest.raises(ParamError, match="min_tokens") as info:
            engine.add_request("r", [5], params)
        assert info.value.param == "allowed_token_ids"
    assert not engine.has_unfinished_requests()
    for i, fine in enumerate((
        SamplingParams(min_tokens=3, allowed_token_ids=[40, 41], stop_token_ids=[40]),
        SamplingParams(min_tokens=0, allowed_token_ids=[eos]),
        SamplingParams(allowed_token_ids=[40], stop_token_ids=[40]),
    )):  # fmt: skip
        engine.add_request(f"fine-{i}", [5], fine)
    assert engine.has_unfinished_requests()


class _FailingRunner(FakeRunner):
    """Reports request ``victim``'s sampling as failed at its ``at``-th token."""

    def __init__(self, victim: str, at: int) -> None:
        super().__init__(num_blocks=64)
        self.victim, self.at, self.count = victim, at, 0

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out = super().execute(sched)
        if self.victim in out.sampled:
            self.count += 1
            if self.count == self.at:
                del out.sampled[self.victim]
                out.failed[self.victim] = "sampling failed: boom"
        return out


def _engine_with(runner):
    from pagellm.config import EngineConfig
    from pagellm.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(), runner, FakeTokenizer(), 128, 1000)


def test_a_failed_request_ends_with_its_error_and_the_batch_runs_on():
    engine = _engine_with(_FailingRunner("bad#1", at=3))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("good", [5], params)
    engine.add_request("bad", [9], SamplingParams(n=2, temperature=0, max_tokens=8))
    finals = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert finals["bad"].error == "sampling failed: boom"
    assert finals["good"].error is None and len(finals["good"].outputs[0].token_ids) == 8
    assert engine.stats.finished.get("error") == 2  # both copies of "bad"
    assert engine.kv_manager.pool.num_used == 0


def test_the_async_front_fails_that_stream_and_stays_healthy():
    front = AsyncLLMEngine(_engine_with(_FailingRunner("bad", at=2)))
    front.start()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        async def collect(rid, prompt):
            return [out async for out in front.generate(rid, prompt, params)]

        bad = asyncio.create_task(collect("bad", [3]))
        good = await collect("good", [4])
        with pytest.raises(RequestFailed, match="boom"):
            await bad
        return good

    try:
        good = asyncio.run(main())
        assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 6
        assert front.is_healthy and front.num_queued_requests == 0
    finally:
        front.shutdown()


def test_a_batch_of_aborts_updates_the_queues_in_one_pass():
    engine, _ = make_engine(num_blocks=600, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(300):
        engine.add_request(f"r{i}", [5, 6], params)
    engine.step()
    passes = []
    drop = engine.scheduler._drop_finished
    engine.scheduler._drop_finished = lambda: (passes.append(1), drop())[1]
    engine.abort_requests([f"r{i}" for i in range(300)])
    assert len(passes) == 1
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.stats.num_waiting == 0 and engine.stats.finished["abort"] == 300
    assert engine.kv_manager.pool.num_used == 0


def test_tenant_series_are_bounded():
    tenants = {f"t{i}": (1, i) for i in range(500)}
    shown = bounded_tenants(tenants)
    assert len(shown) == MAX_TENANT_SERIES + 1
    assert sum(r for r, _ in shown.values()) == 500
    assert sum(w for _, w in shown.values()) == sum(range(500))
    assert OTHER_TENANTS in shown and "t499" in shown  # the busiest by name


def test_an_unexpected_fault_in_a_handler_is_a_500_error_object():
    from fastapi.testclient import TestClient

    from pagellm.server.app import ServerSettings, build_app

    engine, _ = make_engine()
    front = AsyncLLMEngine(engine)

    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")

    front.submit = broken
    app = build_app(front, FakeTokenizer(), ServerSettings("m", 128))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "internal_server_error"
        missing = client.get("/no/such/path")
        assert missing.status_code == 404 and "error" in missing.json()
