"""What runs on CUDA GPUs: greedy outputs on a GPU equal the CPU's (fp32) with chunked prefill,
prefix-cache hits and both kinds of preemption (swap copies blocks between the card and pinned
host memory), with dense weights and with int4 / int8 ones kept quantized; the KV cache is
sized from --gpu-memory-utilization; with two GPUs or more, tensor and pipeline parallelism
over NCCL equal one GPU, and a rank that is killed, raises or hangs fails the step without
taking rank 0 down.
Skipped on machines without a GPU (CI); run with ``pytest -m gpu`` where one is."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
import torch
from llm_helpers import MIXED_PROMPTS

from pagellm import LLM, SamplingParams
from pagellm.parallel.comm import RankFailed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=96, max_num_batched_tokens=32,
              num_gpu_blocks_override=24, num_host_blocks_override=64, block_size=4)  # fmt: skip


def _greedy(model, **kw) -> list[list[int]]:
    with LLM(str(model), **{**ENGINE, **kw}) as llm:
        outs = llm.generate(MIXED_PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the hard paths ran
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_on_the_gpu_equals_the_cpu(tiny_models, preemption_mode):
    model = tiny_models("llama")
    cpu = _greedy(model, device="cpu", preemption_mode=preemption_mode)
    assert _greedy(model, device="cuda", preemption_mode=preemption_mode) == cpu


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantized_greedy_on_the_gpu_equals_the_cpu(tiny_models, method):
    """Weights kept quantized on the card, computed by the Triton GEMM (fp32 products):
    the CPU kernel's greedy tokens."""
    model = tiny_models("llama")
    cpu = _greedy(model, device="cpu", quantization=method)
    assert _greedy(model, device="cuda", quantization=method) == cpu


def _blocks_within(model, share: float) -> int:
    """The KV blocks a share of the card gives; a long-context, many-sequence run (the
    padded decode buffers, prefix chunks) stays inside the share."""
    total = torch.cuda.mem_get_info()[1]
    settings = dict(device="cuda", max_model_len=512, gpu_memory_utilization=share)
    with LLM(str(model), **settings) as llm:
        blocks = llm.engine.executor.num_blocks
        torch.cuda.reset_peak_memory_stats()
        long = ["word " * 350, *(["short one"] * 63)]
        params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        assert all(o.outputs[0].token_ids for o in llm.generate(long, params, use_tqdm=False))
        assert torch.cuda.max_memory_reserved() <= share * total
    del llm
    gc.collect()
    torch.cuda.empty_cache()  # the next engine must not count this one's cache
    return blocks


def test_the_kv_cache_takes_what_gpu_memory_utilization_leaves(tiny_models):
    small = _blocks_within(tiny_models("llama"), 0.02)
    large = _blocks_within(tiny_models("llama"), 0.04)
    assert large > 1.5 * small  # the fixed part (weights, a step, the CUDA context) is small


@two_gpus
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_parallel_over_nccl_equals_one_gpu(tiny_models, tp, pp):
    model = tiny_models("llama")
    one = _greedy(model, device="cuda")
    assert _greedy(model, device="cuda", tensor_parallel_size=tp, pipeline_parallel_size=pp) == one


@two_gpus
def test_a_killed_gpu_rank_fails_the_step(tiny_models):
    llm = LLM(str(tiny_models("llama")), **ENGINE, device="cuda", tensor_parallel_size=2,
              distributed_timeout=10.0)  # fmt: skip
    try:
        assert llm.generate(["hi"], GREEDY, use_tqdm=False)
        os.kill(llm.engine.executor.ranks.pids()[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.engine.executor_healthy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.engine.executor_healthy()
        with pytest.raises(RankFailed):
            llm.generate(["hi"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


@two_gpus
@pytest.mark.parametrize(
    ("worker_cls", "expected"),
    [
        ("parallel_faults:RaisingRunner", "injected worker failure"),
        ("parallel_faults:HangingRunner", "all-reduce failed"),  # NCCL's blocking wait timed out
    ],
)
def test_a_gpu_rank_that_raises_or_hangs_fails_the_request(tiny_models, worker_cls, expected):
    """Over NCCL too, rank 0 raises RankFailed (and lives on) instead of hanging or being torn
    down by NCCL's watchdog."""
    llm = LLM(str(tiny_models("llama")), **ENGINE, device="cuda", tensor_parallel_size=2,
              worker_cls=worker_cls, distributed_timeout=5.0)  # fmt: skip
    try:
        with pytest.raises(RankFailed, match=expected):
            llm.generate(["hello", "world"], GREEDY, use_tqdm=False)
        assert not llm.engine.executor_healthy()
        time.sleep(10)  # past the watchdog's own timeout: this process is still here
        with pytest.raises(RankFailed):
            llm.generate(["again"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_batch_invariant_mode_on_the_gpu(tiny_models):
    """--batch-invariant on CUDA (Triton linear layers and norm, every token through the
    Triton prefill kernel): each request's ids and logprobs alone equal those in a batch of
    mixed requests with chunked prefill, prefix hits and preemption."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    settings = {**ENGINE, "dtype": "bfloat16", "device": "cuda", "batch_invariant": True}

    def answer(out):
        comp = out.outputs[0]
        return comp.token_ids, [(lp.logprob, tuple(lp.top)) for lp in comp.logprobs]

    with LLM(str(tiny_models("llama")), **settings) as llm:
        alone = [answer(llm.generate([p], params, use_tqdm=False)[0]) for p in MIXED_PROMPTS]
        batch = llm.generate(MIXED_PROMPTS * 4, params, use_tqdm=False)
        stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    for i, out in enumerate(batch):
        assert answer(out) == alone[i % len(MIXED_PROMPTS)], i
