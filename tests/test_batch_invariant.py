"""Batch-invariant mode (--batch-invariant): a request's token ids and logprobs are bit-identical
alone and in any batch, on the real default model in bf16 — batches of 2 / 8 / 32 / 256 mixed
requests with copies of the request at several places, joining while others decode and decoding
while others join, chunked prefill at several sizes, prefix-cache hits, preemption by recompute
and by swap, tensor parallelism, seeded sampling at temperature 0.8 — and the default mode can
differ (so these tests can fail). The kernels' own invariance is tested row by row."""

from __future__ import annotations

import random

import pytest
import torch
from llm_helpers import tiny_llm
from server_helpers import API_KEY, MODEL_NAME, running_server

from pagellm import LLM, SamplingParams
from pagellm.kernels.invariant_linear import load_invariant_linear_kernel, pack_weight

TARGETS = [
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue, then give one example of Rayleigh scattering.",
]
NEW_TOKENS = 24
SETTINGS = dict(dtype="bfloat16", max_model_len=1024, batch_invariant=True)


def greedy_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)


def seeded_params() -> SamplingParams:
    return SamplingParams(
        temperature=0.8, top_p=0.95, seed=1234, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2
    )


def answer(completion) -> tuple:
    """Everything that must be bit-identical: the ids and every logprob (floats compared
    exactly)."""
    lps = [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in completion.logprobs]
    return tuple(completion.token_ids), tuple(lps)


class Workload:
    """The target prompts (chat-formatted) and filler prompts of mixed lengths."""

    def __init__(self, tokenizer) -> None:
        self.targets = [tokenizer.chat_token_ids([{"role": "user", "content": t}]) for t in TARGETS]
        rng = random.Random(5)
        self.fillers = [
            [rng.randrange(100, 40000) for _ in range(rng.choice([3, 17, 60, 150, 300]))]
            for _ in range(256)
        ]
        self.filler_tokens = [rng.randrange(4, 40) for _ in self.fillers]

    def filler(self, i: int) -> tuple[list[int], SamplingParams]:
        params = SamplingParams(
            temperature=0 if i % 3 else 0.7, seed=i, max_tokens=self.filler_tokens[i],
            ignore_eos=True,
        )  # fmt: skip
        return self.fillers[i], params

    def probes(self) -> list[tuple[str, list[int], SamplingParams]]:
        """(kind, prompt, params) of every target, greedy and seeded."""
        return [
            (f"{kind} {t}", prompt, make())
            for t, prompt in enumerate(self.targets)
            for kind, make in (("greedy", greedy_params), ("seeded", seeded_params))
        ]


def run_engine(llm: LLM, waves: list[list[tuple[str, list[int], SamplingParams]]], steps: int):
    """Add each wave of (request id, prompt, params) ``steps`` engine steps after the previous
    one (so later requests prefill while earlier ones decode); step until all end. Returns the
    finished completions by request id."""
    engine, finished = llm.engine, {}
    for w, wave in enumerate(waves):
        for rid, prompt, params in wave:
            engine.add_request(rid, prompt, params)
        for _ in range(steps if w + 1 < len(waves) else 10_000):
            if not engine.has_unfinished_requests():
                break
            finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished_requests()
    return {rid: out.outputs[0] for rid, out in finished.items()}


def alone_answers(llm: LLM, work: Workload) -> dict[str, tuple]:
    return {
        kind: answer(run_engine(llm, [[("alone", prompt, params)]], 0)["alone"])
        for kind, prompt, params in work.probes()
    }


def batch_answers(llm: LLM, work: Workload, size: int, places: int = 3) -> dict[str, list[tuple]]:
    """Every probe in a batch of ``size`` requests: copies at ``places`` spread positions of
    the first wave, and one more joining three steps later while the first wave decodes."""
    probes = work.probes()
    n_fill = max(0, size - len(probes) * (places + 1))
    first = [(f"f{i}", *work.filler(i)) for i in range(n_fill // 2)]
    later = [(f"f{i}", *work.filler(i)) for i in range(n_fill // 2, n_fill)]
    for p, (kind, prompt, params) in enumerate(probes):
        for c in range(places):
            at = (c * len(first)) // max(1, places - 1) if places > 1 else 0
            first.insert(min(at + p, len(first)), (f"{kind}#{c}", prompt, params))
        later.append((f"{kind}#late", prompt, params))
    done = run_engine(llm, [first, later], steps=3)
    found: dict[str, list[tuple]] = {}
    for rid, completion in done.items():
        if "#" in rid:
            found.setdefault(rid.split("#")[0], []).append(answer(completion))
    return found


def assert_all_alone(found: dict[str, list[tuple]], alone: dict[str, tuple], label: str) -> None:
    assert set(found) == set(alone), label
    for kind, answers in found.items():
        for i, got in enumerate(answers):
            assert got == alone[kind], f"{label}: {kind} copy {i} differs from alone"


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=1.0, max_num_batched_tokens=512, **SETTINGS)


@pytest.fixture(scope="module")
def work(llm):
    return Workload(llm.tokenizer)


@pytest.fixture(scope="module")
def alone(work):
    """Each probe alone on an instance with no prefix cache: computed fresh, never a hit."""
    fresh = LLM(kv_cache_memory=0.25, enable_prefix_caching=False, **SETTINGS)
    return alone_answers(fresh, work)


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 8, 32, 256])
def test_bit_identical_alone_and_in_batches(llm, work, alone, size):
    places = 1 if size < 16 else 3
    found = batch_answers(llm, work, size, places)
    assert_all_alone(found, alone, f"batch of {size}")


@pytest.mark.slow
def test_prefix_cache_hits_change_nothing(llm, work, alone):
    hits = llm.get_stats().prefix_cache_hits
    for kind, prompt, params in work.probes():  # the same prompt again: its blocks are cached
        got = answer(run_engine(llm, [[("again", prompt, params)]], 0)["again"])
        assert got == alone[kind], kind
    # a prompt sharing the chat template's prefix with the targets hits the cache too
    shared = work.targets[0][:-4] + work.fillers[0][:4]
    run_engine(llm, [[("shared", shared, greedy_params())]], 0)
    assert llm.get_stats().prefix_cache_hits > hits


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 96])
def test_chunked_prefill_sizes_change_nothing(work, alone, chunk):
    chunked = LLM(kv_cache_memory=0.25, max_num_batched_tokens=chunk, **SETTINGS)
    assert_all_alone(batch_answers(chunked, work, 12, places=1), alone, f"chunks of {chunk}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_changes_nothing(work, alone, mode):
    small = LLM(num_gpu_blocks_override=28, preemption_mode=mode, swap_space=0.5,
                max_num_batched_tokens=256, **{**SETTINGS, "max_model_len": 448})  # fmt: skip
    found = batch_answers(small, work, 12, places=1)
    stats = small.get_stats()
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_preemptions_swap > 0
    assert_all_alone(found, alone, f"preemption by {mode}")


@pytest.mark.slow
def test_tensor_parallel_3_alone_equals_batches(work):
    with LLM(kv_cache_memory=0.25, tensor_parallel_size=3, **SETTINGS) as tp:
        mine = alone_answers(tp, work)
        assert_all_alone(batch_answers(tp, work, 16, places=2), mine, "TP 3")


def test_tensor_parallel_2_alone_equals_batches(tiny_models):
    """The default model's 9 heads do not split over 2 ranks: a tiny random model does."""
    prompts = [[5 + i * 7 % 900 for i in range(n)] for n in (3, 40, 90, 7, 130, 11)]
    params = [seeded_params() if i % 2 else greedy_params() for i in range(len(prompts))]
    with tiny_llm(tiny_models, dtype="bfloat16", batch_invariant=True,
                  tensor_parallel_size=2) as tp:  # fmt: skip
        alone = [answer(tp.generate([p], q, use_tqdm=False)[0].outputs[0])
                 for p, q in zip(prompts, params, strict=True)]  # fmt: skip
        batch = tp.generate(prompts * 4, params * 4, use_tqdm=False)
    for i, out in enumerate(batch):
        assert answer(out.outputs[0]) == alone[i % len(prompts)], i


@pytest.mark.slow
def test_default_mode_can_differ(work):
    """Without the flag a batch of 64 gives other bits here (else the tests above prove
    nothing on this CPU)."""
    settings = {**SETTINGS, "batch_invariant": False}
    plain = LLM(kv_cache_memory=1.0, max_num_batched_tokens=512, **settings)
    mine = alone_answers(plain, work)
    found = batch_answers(plain, work, 64)
    differing = [kind for kind, answers in found.items() if any(a != mine[kind] for a in answers)]
    assert differing, "the default mode gave identical bits in a batch of 256"


def test_quantized_weights_are_refused(tiny_models):
    with pytest.raises(ValueError, match="batch-invariant"):
        tiny_llm(tiny_models, dtype="bfloat16", batch_invariant=True, quantization="int8")


def test_speculation_is_not_switched_off_by_the_batch_size(tiny_models):
    """A seeded request draws differently in the speculative and the plain sampler, so a step
    that stopped speculating past disable_by_batch_size changed it with the batch."""
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
             "disable_by_batch_size": 2}  # fmt: skip
    llm = tiny_llm(tiny_models, dtype="bfloat16", batch_invariant=True, speculative_config=ngram)
    assert (
        llm.engine.scheduler.spec.disable_by_batch_size > llm.engine.config.scheduler.max_num_seqs
    )
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]  # repetitive: the n-gram proposer proposes
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([prompt] + [[9, 10, 11 + i] for i in range(5)], seeded, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone


@pytest.mark.slow
def test_default_gguf_is_served_dense():
    llm = LLM(kv_cache_memory=0.05, **{**SETTINGS, "max_model_len": 256})
    runner = llm.engine.executor
    assert runner.batch_invariant and runner.captured is not None
    assert runner.memory_bytes()["weights"] > 200e6  # bf16, not ~4.5 bits per weight


# ----- the kernels, row by row -------------------------------------------------------------


def kernel_paths() -> list[int]:
    best = load_invariant_linear_kernel()
    assert best is not None
    return list(range(best.path + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(40, 70), (96, 64), (200, 576)])
def test_linear_kernel_rows_equal_alone_for_every_count_and_place(dtype, n, k):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    x = torch.randn(70, k, generator=gen).to(dtype)
    expected = (x.double() @ w.double().T + b.double()).float()
    for path in kernel_paths() if dtype == torch.bfloat16 else [0]:
        kernel = load_invariant_linear_kernel(path)
        packed = pack_weight(w, b)
        alone = [kernel(x[i : i + 1], packed) for i in range(70)]
        for rows in (1, 2, 3, 5, 16, 17, 31, 32, 33, 64, 70):
            for start in (0, 70 - rows):
                out = kernel(x[start : start + rows], packed)
                for i in range(rows):
                    assert torch.equal(out[i : i + 1], alone[start + i]), (path, rows, start, i)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(kernel(x, packed).float(), expected, rtol=tol, atol=tol * k)


def test_linear_kernel_ignores_the_thread_count():
    kernel = load_invariant_linear_kernel()
    w = torch.randn(300, 128).bfloat16()
    x = torch.randn(9, 128).bfloat16()
    packed = pack_weight(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, packed)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(one, kernel(x, packed))
    finally:
        torch.set_num_threads(threads)


def test_decode_kernel_fixed_split_depends_on_context_alone():
    """The AVX2 build splits a long context over threads by the batch unless ``fixed_split``."""
    from pagellm.kernels.paged_attention import load_paged_decode_kernel

    kernel = load_paged_decode_kernel(("-mno-avx512f",))
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    hkv, group, d, bs, blocks = 2, 3, 64, 16, 160
    k_cache = torch.randn(hkv, blocks, bs, d, generator=gen)
    v_cache = torch.randn(hkv, blocks, bs, d, generator=gen)
    batch = 6
    q = torch.randn(batch, hkv * group, d, generator=gen)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:80] for _ in range(batch)])
    tables = tables.to(torch.int32).contiguous()
    lens = torch.tensor([1200, 900, 17, 1279, 600, 300], dtype=torch.int32)

    def attend(rows: slice) -> torch.Tensor:
        out = torch.empty_like(q[rows])
        kernel(q[rows].contiguous(), k_cache, v_cache, tables[rows].contiguous(),
               lens[rows].contiguous(), out, d**-0.5, fixed_split=True)  # fmt: skip
        return out

    together = attend(slice(0, batch))
    for i in range(batch):
        assert torch.equal(attend(slice(i, i + 1)), together[i : i + 1]), i


# ----- the server --------------------------------------------------------------------------

SERVER_PROMPTS = [
    "Write a haiku about the ocean.",
    "What is the capital of France?",
    "Give me three tips for a job interview.",
    "Explain what a hash table is.",
]


async def _chat_stream(client, question: str) -> tuple[str, tuple[float, ...]]:
    stream = await client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=32, stream=True, logprobs=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text, logprobs = "", []
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                logprobs += [t.logprob for t in choice.logprobs.content]
    return text, tuple(logprobs)


@pytest.mark.slow
def test_server_32_concurrent_streams_equal_their_sequential_answers():
    import asyncio

    import openai

    from pagellm.fetch import require_default_model

    model = require_default_model()
    flags = ("--dtype", "bfloat16", "--kv-cache-memory", "0.5", "--batch-invariant")
    with running_server(model, *flags) as (_, base):
        client_args = dict(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def sequential():
            client = openai.AsyncOpenAI(**client_args)
            return [await _chat_stream(client, q) for q in SERVER_PROMPTS]

        async def concurrent():
            client = openai.AsyncOpenAI(**client_args)
            jobs = [_chat_stream(client, q) for _ in range(8) for q in SERVER_PROMPTS]
            return await asyncio.gather(*jobs)

        alone = asyncio.run(sequential())
        together = asyncio.run(concurrent())
    assert all(len(lps) == 32 for _, lps in alone)
    for i, got in enumerate(together):
        assert got == alone[i % len(SERVER_PROMPTS)], (
            f"stream {i} differs from its sequential answer"
        )


def test_cluster_file_and_cli_take_the_setting(tmp_path):
    from pagellm.cli import build_parser
    from pagellm.cluster.config import load_cluster_config
    from pagellm.config import EngineConfig

    path = tmp_path / "cluster.yaml"
    path.write_text(
        "deployment_config:\n  served_model_name: x\nengine_args:\n  batch_invariant: true\n",
        encoding="utf-8",
    )
    engine_args = load_cluster_config(path).engine_args
    assert EngineConfig.from_flat(**engine_args).model.batch_invariant is True
    args = build_parser().parse_args(["serve", "--batch-invariant"])
    assert args.batch_invariant is True
