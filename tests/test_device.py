"""Choosing where a replica computes, on a machine without a GPU: ``auto`` is the CPU, asking
for CUDA is a clear error (from Python and from ``pagellm serve``), and a cluster file must give
each rank a whole GPU. (What runs on a GPU is in test_gpu.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from llm_helpers import greedy, tiny_llm

from pagellm.runner.device import resolve_device
from pagellm.runner.loader import resolve_dtype

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@no_gpu
def test_auto_is_the_cpu_without_a_gpu(tiny_models):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_dtype("float32", "cpu") is torch.float32
    llm = tiny_llm(tiny_models, device="auto")
    assert llm.engine.executor.device == torch.device("cpu")
    assert llm.generate(["hi"], greedy([4]), use_tqdm=False)[0].outputs[0].token_ids


@no_gpu
def test_asking_for_cuda_without_a_gpu_is_a_clear_error(tiny_models):
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="device must be one of"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="use --device cpu"):
        tiny_llm(tiny_models, device="cuda")


@no_gpu
def test_serve_with_cuda_without_a_gpu_exits_with_the_reason(tiny_models):
    cmd = [sys.executable, "-m", "pagellm.cli", "serve", "--model", str(tiny_models("llama")),
           "--device", "cuda", "--port", "0"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "pagellm serve: device cuda was asked for" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_profile_step_leaves_the_kv_cache_alone(tiny_models):
    """The step a GPU rank measures its activation peak with runs on a throwaway cache."""
    from pagellm.config import StepLimits

    llm = tiny_llm(tiny_models)
    before = llm.generate(["hello world"], greedy([6]), use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.engine.executor
    saved = [t.clone() for layer in runner.kv_caches for t in layer]
    runner.profile_step(StepLimits(max_tokens=64, max_seqs=8, max_model_len=600))  # > 512
    now = [t for layer in runner.kv_caches for t in layer]
    assert all(torch.equal(a, b) for a, b in zip(saved, now, strict=True))
    after = llm.generate(["hello world"], greedy([6]), use_tqdm=False)[0].outputs[0].token_ids
    assert after == before


def test_the_gpu_kv_budget_is_the_share_less_the_peak(monkeypatch):
    """gpu_kv_budget's arithmetic with torch.cuda's memory figures stood in for."""
    from pagellm.runner import device as dev

    gib = 1 << 30
    figures = {"peak": 0}
    fake = {
        "synchronize": lambda d=None: None,
        "reset_peak_memory_stats": lambda d=None: None,
        "empty_cache": lambda: None,
        "max_memory_allocated": lambda d=None: figures["peak"],
        "memory_reserved": lambda d=None: figures["peak"] + gib,
        "mem_get_info": lambda d=None: (70 * gib, 80 * gib),  # 10 GiB in use: 1 outside torch
    }
    for name, fn in fake.items():
        monkeypatch.setattr(dev.torch.cuda, name, fn)

    def profile():
        figures["peak"] = 8 * gib  # weights + the largest step

    budget = dev.gpu_kv_budget(torch.device("cuda", 0), 0.5, profile)
    assert budget == 40 * gib - 8 * gib - 1 * gib
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        dev.gpu_kv_budget(torch.device("cuda", 0), 0.1, profile)
    with pytest.raises(ValueError, match="must be in"):
        dev.gpu_kv_budget(torch.device("cuda", 0), 1.5, profile)
