"""Tensor and pipeline parallelism on CPU (gloo, worker processes): greedy outputs identical to a
single process (fp32), each rank holding its share of the weights and KV cache, and a worker
rank that dies, raises or hangs failing the engine's requests instead of hanging it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from llm_helpers import MIXED_PROMPTS

from pagellm import LLM
from pagellm.engine.sampling_params import SamplingParams
from pagellm.parallel.comm import RankFailed
from pagellm.parallel.layout import RankLayout, Span

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# small steps and a small cache: chunked prefill, prefix-cache hits and preemption all happen
ENGINE = dict(dtype="float32", max_model_len=96, max_num_batched_tokens=32,
              num_gpu_blocks_override=24, block_size=4)  # fmt: skip


def _greedy(model, **parallel) -> tuple[list[list[int]], list]:
    with LLM(str(model), **ENGINE, **parallel) as llm:
        outs = llm.generate(MIXED_PROMPTS, GREEDY, use_tqdm=False)
        reports = getattr(llm.engine.executor, "reports", None)
        stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the hard paths ran
    return [o.outputs[0].token_ids for o in outs], reports


def test_rank_layout_shards():
    tp2 = RankLayout(tp_size=2, pp_size=2, rank=3)
    assert (tp2.tp_rank, tp2.stage, tp2.is_last_stage) == (1, 1, True)
    assert tp2.split(8, "heads") == Span(4, 4)
    assert tp2.peer_in_stage(0) == 1 and tp2.stage_ranks(0) == [0, 1]
    assert tp2.layers(5) == Span(3, 2)  # 3 + 2: the first stage takes the extra layer
    assert RankLayout(2, 2, 0).layers(5) == Span(0, 3)
    assert [RankLayout(4, 1, r).kv_heads(2) for r in range(4)] == [Span(0, 1), Span(0, 1),
                                                                    Span(1, 1), Span(1, 1)]  # fmt: skip
    assert RankLayout(3, 1, 2).vocab(49153) == Span(32770, 16385)  # padded past the end
    with pytest.raises(ValueError, match="not divisible"):
        RankLayout(3, 1, 0).split(4, "the number of attention heads")
    with pytest.raises(ValueError, match="not a multiple"):
        RankLayout(4, 1, 0).kv_heads(3)
    with pytest.raises(ValueError, match="pipeline stages"):
        RankLayout(1, 3, 0).layers(2)


@pytest.fixture(scope="module")
def reference(tiny_models) -> dict[str, list[list[int]]]:
    return {arch: _greedy(tiny_models(arch))[0] for arch in ("llama", "qwen2")}


@pytest.mark.parametrize(
    ("arch", "tp", "pp"),
    [
        ("llama", 2, 1),
        ("llama", 1, 2),
        ("llama", 4, 1),  # 2 KV heads on 4 ranks: each KV head replicated on two
        ("qwen2", 2, 2),  # q/k/v biases split with their heads; untied LM head
    ],
)
def test_parallel_greedy_equals_one_process(tiny_models, reference, arch, tp, pp):
    out, reports = _greedy(tiny_models(arch), tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert out == reference[arch]
    assert len(reports) == tp * pp


def test_pipeline_with_one_microbatch_per_step(tiny_models, reference):
    out, _ = _greedy(tiny_models("llama"), pipeline_parallel_size=2, pipeline_microbatches=1)
    assert out == reference["llama"]


def test_microbatches_split_the_step_evenly_by_tokens():
    from types import SimpleNamespace

    from pagellm.runner.model_runner import split_batch

    def seq(i: int, n: int) -> SimpleNamespace:  # what split_batch reads of a ScheduledRequest
        return SimpleNamespace(request_id=str(i), num_tokens=n)

    step = [seq(0, 30), seq(1, 1), seq(2, 1), seq(3, 1), seq(4, 27)]
    groups = split_batch(step, 2)
    assert [[s.request_id for s in g] for g in groups] == [["0"], ["1", "2", "3", "4"]]  # 30 + 30
    assert split_batch(step, 1) == [step] and split_batch(step[:1], 4) == [step[:1]]
    assert [len(g) for g in split_batch([seq(i, 1) for i in range(4)], 2)] == [2, 2]


def test_each_rank_holds_its_share(tiny_models):
    model = tiny_models("qwen2")  # untied: every weight is split or per-stage
    with LLM(str(model), **ENGINE) as one:
        whole = one.engine.executor.memory_bytes()
    _, reports = _greedy(model, tensor_parallel_size=2)
    for report in reports:
        assert report.memory["kv_cache"] == whole["kv_cache"] // 2
        # the norms are replicated, everything else split: a little over half
        assert 0.5 <= report.memory["weights"] / whole["weights"] < 0.52
    _, reports = _greedy(model, pipeline_parallel_size=2)
    for report in reports:
        assert report.memory["kv_cache"] == whole["kv_cache"] // 2  # one layer each
    assert sum(r.memory["weights"] for r in reports) == whole["weights"]


def test_tp3_on_the_default_model_equals_tp1():
    """SmolLM2-135M: 9 heads and 3 KV heads over 3 ranks (fp32)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about rain."]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    with LLM(None, **kw) as one:
        ref = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
        whole = one.engine.executor.memory_bytes()
    with LLM(None, tensor_parallel_size=3, **kw) as three:
        out = [o.outputs[0].token_ids for o in three.generate(prompts, params, use_tqdm=False)]
        reports = three.engine.executor.reports
    assert out == ref
    for report in reports:
        assert report.memory["kv_cache"] * 3 == whole["kv_cache"]
        assert abs(report.memory["weights"] * 3 / whole["weights"] - 1) < 0.01


def _worker_pids(llm: LLM) -> list[int]:
    return llm.engine.executor.ranks.pids()


def test_a_killed_worker_fails_the_step_and_the_engine_reports_it(tiny_models):
    llm = LLM(str(tiny_models("llama")), **ENGINE, tensor_parallel_size=2)
    try:
        assert llm.generate(["hi"], GREEDY, use_tqdm=False)
        assert llm.engine.executor_healthy()
        os.kill(_worker_pids(llm)[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.engine.executor_healthy() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.engine.executor_healthy()  # seen while idle, before any request
        with pytest.raises(RankFailed, match="rank1"):
            llm.generate(["hi"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("worker_cls", "expected"),
    [
        ("parallel_faults:RaisingRunner", "injected worker failure"),
        ("parallel_faults:HangingRunner", "all-reduce failed"),  # the collective timed out
    ],
)
def test_a_worker_that_raises_or_hangs_fails_the_request(tiny_models, worker_cls, expected):
    llm = LLM(str(tiny_models("llama")), **ENGINE, tensor_parallel_size=2,
              worker_cls=worker_cls, distributed_timeout=3.0)  # fmt: skip
    try:
        with pytest.raises(RankFailed, match=expected):  # rank 0 waits 3 s, not forever
            llm.generate(["hello", "world"], GREEDY, use_tqdm=False)
        assert not llm.engine.executor_healthy()
        with pytest.raises(RankFailed):
            llm.generate(["again"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def _spawned_children(pid: int) -> list[int]:
    """The worker ranks a server process spawned (not multiprocessing's resource tracker)."""
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:
            out.append(int(child))
    return out


def test_a_server_with_tensor_parallelism_reports_a_dead_worker(tiny_models):
    import httpx
    from server_helpers import AUTH, MODEL_NAME, running_server, wait_until

    with running_server(tiny_models("llama"), "--tensor-parallel-size", "2") as (proc, base):
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4}
        assert httpx.post(f"{base}/v1/completions", json=body, headers=AUTH).status_code == 200
        (worker,) = _spawned_children(proc.pid)
        os.kill(worker, signal.SIGKILL)
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 503, what="unhealthy")
        late = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH)
        assert late.status_code == 503 and "worker" in late.json()["error"]["message"]
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # still exits cleanly
