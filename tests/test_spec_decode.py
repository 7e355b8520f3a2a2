"""Speculative decoding (n-gram prompt lookup): exact outputs, exact sampling, allocator
invariants, settings and metrics.

Greedy outputs with speculation must equal those without it token for token (fp32, tiny random
models whose greedy continuations repeat, so proposals are often accepted and often rejected);
sampling must keep the target's distribution (a total-variation test that a wrong acceptance
rule fails).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from fakes import FakeClock, FakeTokenizer, make_engine, run_to_completion
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from llm_helpers import MIXED_PROMPTS

from pagellm import SamplingParams
from pagellm.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import RunnerOutput, SchedulerOutput
from pagellm.engine.request import RequestStatus
from pagellm.sampling.rejection import accept_greedy, draw, rejection_sample
from pagellm.spec.ngram import NgramIndex
from pagellm.spec.settings import spec_settings


def ngram(k: int, lo: int = 1, hi: int = 3, **extra) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
            "prompt_lookup_max": hi, **extra}  # fmt: skip


def _outputs(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# ----- the proposer and the verification rules ----------------------------------------------


def test_ngram_index_proposes_after_the_latest_longest_match():
    index = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 5, 1, 2, 3]
    assert index.propose(tokens, 3) == [4, 5, 1]
    tokens.append(9)  # the suffix [3, 9] / [2, 3, 9] never occurred before
    assert index.propose(tokens, 3) == []
    tokens += [1, 2, 3]  # [1, 2, 3] ends at 3 and at 8: the latest (8) wins
    assert index.propose(tokens, 5) == [9, 1, 2, 3]
    # the longest n wins over a more recent shorter match
    index = NgramIndex(1, 3)
    tokens = [7, 8, 9, 50, 1, 9, 60, 7, 8, 9]
    assert index.propose(tokens, 1) == [50]
    assert NgramIndex(4, 5).propose([1, 2, 3, 1, 2, 3], 2) == []


def test_accept_greedy():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accept_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept_greedy([5], [4, 0]) == [4]


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def _first_token_law(rule, p, q, proposals_from_q: bool, samples: int = 6000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    counts = torch.zeros(p.shape[-1])
    for _ in range(samples):
        if proposals_from_q:
            d = draw(q[0], gen)
            out = rule(p, [d], gen, q)
        else:
            out = rule(p, [2], gen, None)
        counts[out[0]] += 1
    return counts


def _wrong_rule(target_probs, proposal, generator, draft_probs=None):
    """Accepts with p(d) but redraws from the whole of p on rejection (a classic mistake:
    the proposed token comes out too often)."""
    p = target_probs[0]
    if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(p[proposal[0]]):
        return [proposal[0]]
    return [draw(p, generator)]


@pytest.mark.parametrize("proposals_from_q", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(proposals_from_q):
    p = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15], [0.2] * 5], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.05, 0.4, 0.05, 0.2]], dtype=torch.float64)
    counts = _first_token_law(rejection_sample, p, q, proposals_from_q)
    assert _tv(counts, p[0]) < 0.025
    wrong = _first_token_law(_wrong_rule, p, q, proposals_from_q)
    assert _tv(wrong, p[0]) > 0.06  # the test can tell a wrong rule


def test_rejection_sampling_second_token_law():
    """When the first proposal is accepted, the second token follows the target's second row
    (here: proposals are deterministic, the bonus row is drawn as is)."""
    p = torch.tensor([[0.05, 0.05, 0.9], [0.5, 0.3, 0.2]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(3)
    for _ in range(4000):
        out = rejection_sample(p, [2], gen)
        if len(out) == 2:
            counts[out[1]] += 1
    assert _tv(counts, p[1]) < 0.03


# ----- settings ------------------------------------------------------------------------


def test_settings_take_vllm_forms():
    s = spec_settings(SpeculativeConfig(speculative_config=json.dumps(ngram(4, 2, 5))))
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == (
        "ngram", 4, 2, 5)  # fmt: skip
    legacy = spec_settings(SpeculativeConfig(speculative_model="[ngram]", num_speculative_tokens=3))
    assert (legacy.method, legacy.num_speculative_tokens, legacy.prompt_lookup_min) == (
        "ngram", 3, 5)  # fmt: skip
    only_max = spec_settings(
        SpeculativeConfig(
            speculative_config={
                "model": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 3,
            }
        )  # fmt: skip
    )
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    assert spec_settings(SpeculativeConfig()) is None


@pytest.mark.parametrize(
    "config, message",
    [
        ("{not json", "not valid JSON"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "between 1 and"),
        ({"method": "ngram", "num_speculative_tokens": 2, "speed": 1}, "unknown key"),
        (ngram(2, 4, 3), "prompt_lookup_min (4) > prompt_lookup_max (3)"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"},
            "draft model only",
        ),
    ],
)
def test_bad_settings_name_the_key(config, message):
    with pytest.raises(ValueError, match=None) as info:
        spec_settings(SpeculativeConfig(speculative_config=config))
    assert message in str(info.value)


def test_legacy_flag_must_agree_with_the_json():
    with pytest.raises(ValueError, match="disagrees"):
        spec_settings(SpeculativeConfig(speculative_config=ngram(4), num_speculative_tokens=3))


# ----- the scheduler, on the fake runner ---------------------------------------------------


def test_fake_engine_same_tokens_fewer_steps_and_no_leak():
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3], [7, 7, 7, 5], [40, 41, 42, 43, 44, 45, 40]]
    results = []
    for spec in (None, ngram(4)):
        engine, runner = make_engine(speculative_config=spec)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=17 + i, temperature=0))
        done = run_to_completion(engine)
        results.append(({k: v.outputs[0].token_ids for k, v in done.items()}, len(runner.steps)))
        assert engine.kv_manager.pool.num_free == engine.kv_manager.num_blocks
    (plain, plain_steps), (spec, spec_steps) = results
    assert spec == plain
    assert spec_steps < plain_steps


def test_fake_engine_proposals_respect_limits_and_batch_switch():
    engine, runner = make_engine(
        speculative_config=ngram(5, disable_by_batch_size=1), max_model_len=24
    )
    engine.add_request("a", list(range(1, 15)) + [1, 2], SamplingParams(max_tokens=6))
    run_to_completion(engine)
    for step in runner.steps:
        for s in step.scheduled:
            assert s.start_pos + s.num_tokens <= 24 - 1
    assert max(len(s.spec_token_ids) for st in runner.steps for s in st.scheduled) <= 5
    outs = [s for st in runner.steps for s in st.scheduled]
    assert sum(len(s.spec_token_ids) for s in outs) <= 6 - 1
    # two running requests with disable_by_batch_size=1: no proposals at all
    engine, runner = make_engine(speculative_config=ngram(4, disable_by_batch_size=1))
    for rid in ("x", "y"):
        engine.add_request(rid, [1, 2, 3, 1, 2], SamplingParams(max_tokens=10))
    run_to_completion(engine)
    assert not any(s.spec_token_ids for st in runner.steps[2:] for s in st.scheduled)
    assert engine.stats.spec_num_drafts == 0


def test_fake_engine_stop_token_inside_accepted_proposals():
    """EOS (token 2) reached in the middle of accepted proposals: later tokens are dropped."""
    for spec in (None, ngram(5)):
        engine, _ = make_engine(speculative_config=spec)
        engine.add_request("a", [998, 999, 0, 1, 998, 999], SamplingParams(max_tokens=30))
        out = run_to_completion(engine)["a"].outputs[0]
        assert out.token_ids == [0, 1, 2] and out.finish_reason == "stop"


def test_fake_engine_stop_string_inside_accepted_proposals():
    for spec in (None, ngram(5)):
        engine, _ = make_engine(speculative_config=spec)
        params = SamplingParams(max_tokens=30, stop=["<13>"])
        engine.add_request("a", [10, 11, 12, 13, 14, 10, 11], params)
        out = run_to_completion(engine)["a"].outputs[0]
        assert out.token_ids == [12, 13] and out.text == "<12>"
        assert out.finish_reason == "stop" and out.stop_reason == "<13>"


# ----- the tiny model: exact greedy ------------------------------------------------------
# The tiny Qwen3's greedy continuations repeat themselves, so n-gram proposals are made, and
# both accepted and rejected, on these prompts.

PROMPTS = ["Hello", "Hi", "The", "one two three four five one two three", *MIXED_PROMPTS]


def _qwen3(tiny_models, **kw):
    from pagellm import LLM

    settings = dict(dtype="float32", kv_cache_memory=0.02, max_model_len=512)
    settings.update(kw)
    return LLM(str(tiny_models("qwen3")), **settings)


def _params(i: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=30 + 5 * (i % 4), ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference(tiny_models):
    llm = _qwen3(tiny_models)
    params = [_params(i) for i in range(len(PROMPTS))]
    return params, _outputs(llm, PROMPTS, params)


def _assert_spec_worked(llm, rejected: bool = True) -> None:
    stats = llm.engine.stats
    assert stats.spec_num_accepted_tokens > 0
    if rejected:
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    pool = llm.engine.kv_manager.pool
    assert pool.num_free == pool.num_blocks  # nothing leaked


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_identical_with_ngram_alone(tiny_models, reference, k):
    params, expected = reference
    llm = _qwen3(tiny_models, speculative_config=ngram(k))
    for prompt, p, want in zip(PROMPTS, params, expected, strict=True):
        assert _outputs(llm, [prompt], p) == [want], prompt
    _assert_spec_worked(llm)


def test_n_copies_logprobs_and_penalties_keep_their_meaning(tiny_models):
    prompts = PROMPTS[:4]
    cases = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(
            temperature=0,
            max_tokens=24,
            ignore_eos=True,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
            min_tokens=5,
        ),  # fmt: skip
    ]
    plain = _qwen3(tiny_models)
    spec = _qwen3(tiny_models, speculative_config=ngram(3))
    for params in cases:
        want = plain.generate(prompts, params, use_tqdm=False)
        got = spec.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got, strict=True):
            assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            if params.logprobs:
                for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                    assert lg.token_id == lw.token_id
                    assert lg.logprob == pytest.approx(lw.logprob, abs=1e-4)
                    assert [t for t, _ in lg.top] == [t for t, _ in lw.top]
    _assert_spec_worked(spec, rejected=False)


def test_stop_strings_give_the_same_text(tiny_models, reference):
    params, expected = reference
    plain = _qwen3(tiny_models)
    spec = _qwen3(tiny_models, speculative_config=ngram(5))
    tok = plain.engine.tokenizer
    for prompt, want in zip(PROMPTS[:4], expected, strict=False):
        text = tok.decode(want[:20])
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        if not stop.strip():
            continue
        p = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
        w = plain.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        g = spec.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (
            w.text, w.token_ids, w.finish_reason, w.stop_reason)  # fmt: skip
        assert w.finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_keeps_its_law(tiny_models):
    """The same seed gives the same tokens with speculation on; over many seeds the first
    tokens follow the same law as without speculation (a loose total-variation bound: the
    exactness itself is tested on the sampler with a wrong rule that fails)."""
    # the prompt's own tail repeats, so the likely next tokens are proposed
    prompt = [28659, 44407, 28659, 7918, 45124, 18933, 15451, 34588, 18933, 8805, 33040, 8805]
    base = SamplingParams(temperature=0.7, top_k=3, max_tokens=3, ignore_eos=True)
    spec = _qwen3(tiny_models, speculative_config=ngram(2, lo=1, hi=2, disable_by_batch_size=1024))
    plain = _qwen3(tiny_models)
    seeded = [SamplingParams(**{**_fields(base), "seed": s}) for s in range(300)]
    first = _outputs(spec, [prompt] * 300, seeded)
    assert _outputs(spec, [prompt] * 300, seeded) == first
    other_seeds = [SamplingParams(**{**_fields(base), "seed": 10**6 + s}) for s in range(300)]
    law_plain = _outputs(plain, [prompt] * 300, other_seeds)
    assert spec.engine.stats.spec_num_drafts > 0
    from collections import Counter

    # the second token: the first one verified against a proposal when there was one
    a, b = Counter(t[1] for t in first), Counter(t[1] for t in law_plain)
    tv = 0.5 * sum(abs(a[x] - b[x]) for x in set(a) | set(b)) / 300
    assert tv < 0.2


def _fields(params: SamplingParams) -> dict:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
            if f.init}  # fmt: skip


def test_sampler_verification_keeps_the_target_law_and_a_wrong_rule_fails(monkeypatch):
    """Through Sampler.sample_step (temperature, top-k, the rows' shaping): the law of the first
    token with a proposal equals the target's; a wrong acceptance rule is caught."""
    from pagellm.engine.outputs import ScheduledRequest
    from pagellm.sampling import sampler as sampler_module
    from pagellm.sampling.sampler import Sampler

    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0], [0.0, 0.3, 0.1, 0.0, 0.2]])
    params = SamplingParams(temperature=0.8, top_k=4)
    target = torch.softmax(torch.tensor([2.0, 1.5, 1.0, 0.2]) / 0.8, dim=0)
    target = torch.cat([target, torch.zeros(1)])

    def law() -> torch.Tensor:
        counts = torch.zeros(5)
        for seed in range(5000):
            req = ScheduledRequest(f"r{seed}", [0, 1], 0, [0], True, params, seed, [0], [], None,
                                   spec_token_ids=[1])  # fmt: skip
            out = Sampler().sample_step(logits, [req])
            counts[out.token_ids[0][0]] += 1
        return counts

    assert _tv(law(), target) < 0.025
    monkeypatch.setattr(sampler_module, "rejection_sample", _wrong_rule)
    assert _tv(law(), target) > 0.06


# ----- allocator invariants under accept / reject / preempt / abort (hypothesis) ------------


class _RandomVerifier:
    """Accepts a random number of each request's proposals; tokens from a 6-token vocabulary,
    so n-gram proposals are frequent."""

    def __init__(self, num_blocks: int, num_host_blocks: int) -> None:
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.rng = None

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        out, proposed = {}, {}
        for s in sched.scheduled:
            if not s.sample:
                continue
            # a draft model's proposals (num_draft_slots) or the scheduler's (n-gram)
            spec = s.spec_token_ids or [self.rng.randrange(6) for _ in range(s.num_draft_slots)]
            if s.num_draft_slots:
                proposed[s.request_id] = len(spec)
            accepted = self.rng.randint(0, len(spec))
            out[s.request_id] = [*spec[:accepted], self.rng.randrange(6)]
        return RunnerOutput(out, num_proposed=proposed)


class SpecAllocatorMachine(RuleBasedStateMachine):
    SPEC = ngram(4, disable_by_batch_size=4)

    def __init__(self) -> None:
        super().__init__()
        self.runner = _RandomVerifier(14, 10)
        self.runner.rng = random.Random(0)
        config = EngineConfig(
            ModelConfig(),
            CacheConfig(block_size=4, enable_prefix_caching=True),
            SchedulerConfig(6, 24, True, preemption_mode="swap"),
            speculative=SpeculativeConfig(speculative_config=self.SPEC),
        )
        self.engine = LLMEngine(config, self.runner, FakeTokenizer(), 40, 1000, clock=FakeClock())
        self.counter = 0

    @rule(length=st.integers(1, 14), max_tokens=st.integers(1, 25), seed=st.integers(0, 99))
    def add(self, length: int, max_tokens: int, seed: int) -> None:
        prompt = [(seed + i * i) % 6 for i in range(length)]
        self.engine.add_request(f"r{self.counter}", prompt, SamplingParams(max_tokens=max_tokens))
        self.counter += 1

    @precondition(lambda self: self.engine.has_unfinished_requests())
    @rule(seed=st.integers(0, 10**6))
    def step(self, seed: int) -> None:
        self.runner.rng.seed(seed)
        self.engine.step()

    @precondition(lambda self: self.engine.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.engine._groups)))
        self.engine.abort(rid)

    @invariant()
    def blocks_conserved_and_none_past_the_accepted_length(self) -> None:
        kv = self.engine.kv_manager
        kv.pool.check_integrity()
        kv.host_pool.check_integrity()
        owners: dict[int, int] = {}
        requests = self.engine.scheduler.requests
        for rid, table in kv.block_tables.items():
            if not table:  # a waiting request's table that allocation could not fill yet
                continue
            req = requests[rid]
            assert req.status == RequestStatus.RUNNING
            assert len(table) == -(-req.num_computed_tokens // kv.block_size), rid
            for b in table:
                owners[b] = owners.get(b, 0) + 1
        for block in kv.pool.blocks:
            assert block.ref_cnt == owners.get(block.block_id, 0)
        held = [b for t in kv.host_tables.values() for b in t]
        assert len(held) == len(set(held))
        assert kv.host_pool.num_free + len(held) == kv.host_pool.num_blocks
        for rid in kv.host_tables:
            assert requests[rid].status == RequestStatus.SWAPPED

    def teardown(self) -> None:
        self.engine.abort_requests(sorted(self.engine._groups))
        kv = self.engine.kv_manager
        assert kv.pool.num_free == kv.pool.num_blocks
        assert kv.host_pool.num_free == kv.host_pool.num_blocks


class DraftSlotsAllocatorMachine(SpecAllocatorMachine):
    """The same with draft-model slots: the runner fills them (here: random proposals)."""

    SPEC = {"method": "draft_model", "model": "/unused", "num_speculative_tokens": 3,
            "disable_by_batch_size": 4}  # fmt: skip


TestSpecAllocator = SpecAllocatorMachine.TestCase
TestSpecAllocator.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestDraftSlotsAllocator = DraftSlotsAllocatorMachine.TestCase
TestDraftSlotsAllocator.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)


# ----- the server ---------------------------------------------------------------------------


def test_server_streams_the_same_text_and_exports_the_counters(tiny_models):
    import openai
    from server_helpers import API_KEY, MODEL_NAME, metrics, running_server

    spec = json.dumps(ngram(4))
    with running_server(tiny_models("qwen3"), "--speculative-config", spec) as (_, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        for prompt in PROMPTS[:4]:
            kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=40, temperature=0, logprobs=1)
            full = client.completions.create(**kw, extra_body={"ignore_eos": True})
            chunks = list(
                client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True})
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert text == full.choices[0].text
            streamed = [t for c in chunks if c.choices for t in c.choices[0].logprobs.tokens]
            assert streamed == full.choices[0].logprobs.tokens
            assert len(streamed) == 40
        messages = [{"role": "user", "content": PROMPTS[3]}]
        kw = dict(model=MODEL_NAME, messages=messages, max_tokens=30, temperature=0)
        full = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        values = metrics(base)
        accepted = values['pagellm:spec_decode_num_accepted_tokens_total{model_name="tiny-llama"}']
        drafted = values['pagellm:spec_decode_num_draft_tokens_total{model_name="tiny-llama"}']
        assert 0 < accepted < drafted
        first = 'pagellm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-llama",position="0"}'
        assert values[first] > 0


def test_flags_and_a_yaml_mapping_reach_the_engine_config(tmp_path):
    from pagellm.cli import build_parser, config_defaults, engine_kwargs

    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--speculative-model", "[ngram]", "--num-speculative-tokens", "3"]
    )
    config = EngineConfig.from_flat(**engine_kwargs(args))
    assert spec_settings(config.speculative).num_speculative_tokens == 3
    yaml_file = tmp_path / "serve.yaml"
    yaml_file.write_text(
        "speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n"
        "  prompt_lookup_max: 4\n"
    )
    args = parser.parse_args(["serve", "--config", str(yaml_file)])
    args.subparser.set_defaults(**config_defaults(args.subparser, args.config))
    args = parser.parse_args(["serve", "--config", str(yaml_file)])
    settings = spec_settings(EngineConfig.from_flat(**engine_kwargs(args)).speculative)
    assert (settings.num_speculative_tokens, settings.prompt_lookup_max) == (2, 4)


# ----- the draft model ----------------------------------------------------------------------
# The tiny Qwen3 as its own draft proposes exactly what the target would choose, so every
# rejection would mean its KV fell out of step with the target's; the tiny Llama (same
# vocabulary, other weights) is a draft that is nearly always wrong.


def draft(tiny_models, arch: str, k: int, **extra) -> dict:
    return {"method": "draft_model", "model": str(tiny_models(arch)), "num_speculative_tokens": k,
            "disable_by_batch_size": 64, **extra}  # fmt: skip


def _acceptance(llm) -> float:
    stats = llm.engine.stats
    return stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_draft_model_greedy_identical_alone_and_in_step_with_the_target(tiny_models, reference, k):
    params, expected = reference
    llm = _qwen3(tiny_models, speculative_config=draft(tiny_models, "qwen3", k))
    for prompt, p, want in zip(PROMPTS, params, expected, strict=True):
        assert _outputs(llm, [prompt], p) == [want], prompt
    assert _acceptance(llm) > 0.97
    _assert_spec_worked(llm, rejected=False)


def test_a_wrong_draft_changes_nothing_but_acceptance(tiny_models, reference):
    params, expected = reference
    llm = _qwen3(tiny_models, speculative_config=draft(tiny_models, "llama", 3))
    assert _outputs(llm, PROMPTS, params) == expected
    assert llm.engine.stats.spec_num_draft_tokens > 0 and _acceptance(llm) < 0.2


def _method(tiny_models, method: str, k: int) -> dict:
    """n-gram, or the tiny Qwen3 as its own draft (always switched on)."""
    if method == "ngram":
        return ngram(k, disable_by_batch_size=64)
    return draft(tiny_models, "qwen3", k)


def _check_method(llm, method: str) -> None:
    if method == "draft":
        assert _acceptance(llm) > 0.97  # the draft's KV followed the target's
    _assert_spec_worked(llm, rejected=False)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_in_a_mixed_batch_of_32_with_chunks_and_prefix_hits(tiny_models, method):
    prompts = [PROMPTS[i % len(PROMPTS)] + " x" * (i // len(PROMPTS)) for i in range(32)]
    params = [_params(i) for i in range(32)]
    settings = dict(max_num_batched_tokens=48, max_num_seqs=32, block_size=4)
    expected = _outputs(_qwen3(tiny_models, **settings), prompts, params)
    llm = _qwen3(tiny_models, speculative_config=_method(tiny_models, method, 3), **settings)
    assert _outputs(llm, prompts, params) == expected
    assert llm.engine.stats.prefix_cache_hits > 0
    _check_method(llm, method)


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_identical_under_preemption(tiny_models, reference, mode, method):
    params, _ = reference
    expected = _outputs(_qwen3(tiny_models, max_model_len=112), PROMPTS, params)
    settings = dict(
        num_gpu_blocks_override=14, block_size=8, max_num_seqs=16, preemption_mode=mode,
        num_host_blocks_override=64, max_model_len=112,
    )  # fmt: skip
    llm = _qwen3(tiny_models, speculative_config=_method(tiny_models, method, 4), **settings)
    assert _outputs(llm, PROMPTS, params) == expected
    stats = llm.engine.stats
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_preemptions_swap > 0
    _check_method(llm, method)


def test_draft_model_sampling_is_seeded_and_stop_strings_hold(tiny_models, reference):
    params, expected = reference
    spec = _qwen3(tiny_models, speculative_config=draft(tiny_models, "qwen3", 3))
    copies = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2)
    for out, want in zip(
        spec.generate(PROMPTS[:4], copies, use_tqdm=False), expected, strict=False
    ):
        assert [c.token_ids for c in out.outputs] == [want[:30]] * 2
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=s) for s in range(6)]
    first = _outputs(spec, PROMPTS[:6], seeded)
    assert _outputs(spec, PROMPTS[:6], seeded) == first
    assert spec.engine.stats.spec_num_accepted_tokens > 0
    plain = _qwen3(tiny_models)
    tok = plain.engine.tokenizer
    text = tok.decode(expected[0][:20])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    p = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
    w = plain.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0]
    g = spec.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0]
    assert (g.text, g.token_ids, g.finish_reason) == (w.text, w.token_ids, "stop")


def test_a_draft_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    import transformers

    from pagellm import LLM

    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    spec = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        LLM(str(tiny_models("qwen3")), dtype="float32", speculative_config=spec)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_ngram_with_tensor_and_pipeline_parallelism(tiny_models, reference, tp, pp):
    params, expected = reference
    with _qwen3(
        tiny_models, speculative_config=ngram(3, disable_by_batch_size=64),
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
    ) as llm:  # fmt: skip
        assert _outputs(llm, PROMPTS, params) == expected
        assert llm.engine.stats.spec_num_accepted_tokens > 0


def test_a_draft_model_with_tensor_parallelism_is_refused(tiny_models):
    with pytest.raises(ValueError, match="one rank"):
        _qwen3(tiny_models, speculative_config=draft(tiny_models, "qwen3", 2),
               tensor_parallel_size=2)  # fmt: skip
