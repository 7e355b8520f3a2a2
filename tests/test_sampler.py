"""Sampler maths on crafted logits, and seeded sampling independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.engine.outputs import ScheduledRequest
from pagellm.engine.sampling_params import ParamError
from pagellm.sampling.sampler import Sampler, generator_seed


def _req(rid="r", seed=0, prompt=(1,), output=(), eos=None, **params) -> ScheduledRequest:
    return ScheduledRequest(
        rid, [1], 0, [0], True, SamplingParams(**params), seed, list(prompt), list(output), eos
    )


def _logits(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_greedy_takes_the_argmax():
    out = Sampler().sample(_logits([0.1, 3.0, 1.0], [5.0, 0.0, 0.0]), [_req(temperature=0)] * 2)
    assert out.token_ids == [1, 0]


def test_top_k_and_top_p_only_keep_the_head():
    logits = _logits([4.0, 3.9, 0.0, -1.0, 2.0])
    sampler = Sampler()
    top_k = {
        sampler.sample(logits, [_req(f"k{i}", seed=i, top_k=2)]).token_ids[0] for i in range(60)
    }
    assert top_k == {0, 1}
    # probabilities ~ [0.49, 0.44, 0.01, 0.003, 0.066]: top_p=0.9 keeps tokens 0 and 1 only
    top_p = {
        sampler.sample(logits, [_req(f"p{i}", seed=i, top_p=0.9)]).token_ids[0] for i in range(60)
    }
    assert top_p == {0, 1}
    min_p = {
        sampler.sample(logits, [_req(f"m{i}", seed=i, min_p=0.5)]).token_ids[0] for i in range(60)
    }
    assert min_p == {0, 1}


def test_temperature_sampling_follows_the_distribution():
    logits = _logits([math.log(0.7), math.log(0.3)])
    sampler = Sampler()
    picks = [sampler.sample(logits, [_req(f"t{i}", seed=i)]).token_ids[0] for i in range(400)]
    assert 0.6 < picks.count(0) / 400 < 0.8


def test_penalties():
    sampler = Sampler()
    logits = _logits([2.0, 1.9, -1.0])
    # repetition penalty divides a seen positive logit (token 0 is in the prompt)
    assert sampler.sample(
        logits, [_req(prompt=[0], temperature=0, repetition_penalty=2.0)]
    ).token_ids == [1]
    # frequency penalty grows with the count of output occurrences
    out = sampler.sample(logits, [_req(output=[0, 0], temperature=0, frequency_penalty=0.1)])
    assert out.token_ids == [1]
    out = sampler.sample(logits, [_req(output=[1], temperature=0, presence_penalty=0.2)])
    assert out.token_ids == [0]


def test_min_tokens_bans_eos_and_stop_ids():
    logits = _logits([5.0, 1.0, 4.0])
    req = _req(eos=0, temperature=0, min_tokens=2, stop_token_ids=[2])
    assert Sampler().sample(logits, [req]).token_ids == [1]


def test_logprobs_are_the_raw_distribution():
    logits = _logits([1.0, 2.0, 3.0])
    out = Sampler().sample(logits, [_req(temperature=0, logprobs=2)])
    lp = torch.log_softmax(logits[0], -1)
    got = out.logprobs[0]
    assert got.token_id == 2 and got.logprob == pytest.approx(float(lp[2]))
    assert [t for t, _ in got.top] == [2, 1]
    assert got.top[1][1] == pytest.approx(float(lp[1]))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(n=0),
        dict(max_tokens=0),
        dict(min_p=2),
        dict(min_tokens=5, max_tokens=2),
        dict(presence_penalty=3),
        dict(stop=[""]),
    ],
)
def test_bad_params_raise(kwargs):
    with pytest.raises(ParamError):
        SamplingParams(**kwargs)


def test_seeded_requests_ignore_batch_composition(tiny_models):
    llm = LLM(str(tiny_models("llama")), dtype="float32", kv_cache_memory=0.01, max_model_len=512)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[500, 501, 502]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    batch = llm.generate(
        [[7, 8], [500, 501, 502], list(range(100, 160))], [others, seeded, others], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == alone
    copies = llm.generate(
        [[500, 501, 502]],
        SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len({tuple(c.token_ids) for c in copies.outputs}) > 1  # copies are independent


def test_seeds_differing_only_in_their_high_bits_draw_different_streams():
    def draws(seed: int) -> list[int]:
        logits = torch.zeros(1, 1000)
        req = _req(seed=seed, temperature=1.0)
        sampler = Sampler()
        return [sampler.sample(logits, [req]).token_ids[0] for _ in range(4)]

    assert draws(5) != draws(5 + (1 << 32))
    assert draws(-1) != draws((1 << 63) - 1)
    assert draws(-1) == draws((1 << 64) - 1)  # the same seed, as int64 and as uint64
    # seeds below 2**32 keep the streams they had
    assert generator_seed(5) == 5 and generator_seed((1 << 32) - 1) == (1 << 32) - 1
