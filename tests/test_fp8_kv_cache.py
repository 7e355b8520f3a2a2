"""The FP8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2, --calculate-kv-scales, checkpoint scales).

The reference is transformers' model with its attention reading K and V rounded as our cache
stores them (x / scale to FP8 and back): greedy must equal it alone, in a batch, under
preemption (recompute and swap), with chunked prefill and with prefix-cache hits, which holds
only if every path reads the same rounded values. Also: the blocks the same budget buys, the
scales, and the start-up errors.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from llm_helpers import greedy, tiny_llm
from reference import compare_greedy, hf_greedy

from pagellm import LLM
from pagellm.attention.kv_cache import K_SCALE_RANGE, V_SCALE_RANGE, kv_cache_format

NUM_PROMPTS = 12


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(11)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    prompts = [
        [rng.randrange(100, 40000) for _ in range(rng.choice([1, 5, 17, 64, 150]))]
        for _ in range(NUM_PROMPTS - 2)
    ]
    prompts += [shared + [101, 102], shared + [103]]  # a prefix-cache hit in one run
    max_tokens = [rng.randrange(4, 24) for _ in range(NUM_PROMPTS)]
    return prompts, max_tokens


def _rounding_attention(kv: str, scales: dict[int, tuple[float, float]]):
    """transformers' SDPA attention over K and V rounded as an FP8 cache holds them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    fmt = kv_cache_format(kv)

    def attention(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, (1.0, 1.0))
        key = fmt.dequantize(fmt.quantize(key, k_scale), k_scale, key.dtype)
        value = fmt.dequantize(fmt.quantize(value, v_scale), v_scale, value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


def _references(model_dir, kv: str, workload, scales=None):
    import transformers
    from transformers import AttentionInterface

    name = f"pagellm_test_{kv}_{len(scales or {})}"
    AttentionInterface.register(name, _rounding_attention(kv, scales or {}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation=name
    ).eval()
    prompts, max_tokens = workload
    return [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens, strict=True)]


def _check(outs, references, label: str) -> None:
    for i, (out, ref) in enumerate(zip(outs, references, strict=True)):
        compare_greedy(out.outputs[0].token_ids, ref, f"{label} prompt {i}")


def _layer_scales(llm: LLM) -> dict[int, tuple[float, float]]:
    return {i: (c.k_scale, c.v_scale) for i, c in enumerate(llm.engine.executor.kv_caches)}


@pytest.fixture(scope="module")
def fp8_references(tiny_models, workload):
    return _references(tiny_models("llama"), "fp8", workload)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_batched_and_alone_equal_the_rounded_reference(tiny_models, workload, kv, request):
    refs = (
        request.getfixturevalue("fp8_references")
        if kv == "fp8"
        else _references(tiny_models("llama"), kv, workload)
    )
    prompts, max_tokens = workload
    with tiny_llm(tiny_models, kv_cache_dtype=kv) as llm:
        assert llm.engine.executor.kv_caches[0].k.dtype == torch.uint8
        _check(llm.generate(prompts, greedy(max_tokens), use_tqdm=False), refs, f"{kv} batch")
        alone = [llm.generate([p], greedy([m]), use_tqdm=False)[0]
                 for p, m in zip(prompts[:3], max_tokens[:3], strict=True)]  # fmt: skip
        _check(alone, refs[:3], f"{kv} alone")


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_gpu_blocks_override=24, max_model_len=256),
        dict(num_gpu_blocks_override=24, max_model_len=256, preemption_mode="swap"),
        dict(max_num_batched_tokens=32),
    ],
    ids=["recompute", "swap", "chunked"],
)
def test_preempted_and_chunked_equal_the_rounded_reference(
    tiny_models, workload, fp8_references, settings
):
    prompts, max_tokens = workload
    with tiny_llm(tiny_models, kv_cache_dtype="fp8", **settings) as llm:
        outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
        if "num_gpu_blocks_override" in settings:
            assert llm.get_stats().num_preemptions > 0
        _check(outs, fp8_references, str(settings))
        # again: the prompts' full blocks are now prefix-cache hits
        outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
        _check(outs, fp8_references, f"{settings} cached")
        pool = llm.engine.kv_manager.pool
        assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize(("dtype", "ratio"), [("bfloat16", 2), ("float32", 4)])
def test_the_same_budget_holds_more_blocks(tiny_models, dtype, ratio):
    blocks = {}
    for kv in ("auto", "fp8"):
        with tiny_llm(tiny_models, dtype=dtype, kv_cache_dtype=kv) as llm:
            runner = llm.engine.executor
            blocks[kv] = runner.num_blocks
            cache_bytes = runner.memory_bytes()["kv_cache"]
    assert blocks["fp8"] == pytest.approx(ratio * blocks["auto"], abs=ratio)
    assert cache_bytes == pytest.approx(0.02 * 2**30, rel=0.01)  # the fp8 one fills the budget


def test_calculated_scales_come_from_the_first_step(tiny_models, workload):
    prompts, max_tokens = workload
    with tiny_llm(tiny_models, kv_cache_dtype="fp8", calculate_kv_scales=True) as llm:
        outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
        caches = llm.engine.executor.kv_caches
        assert not any(c.scales_pending for c in caches)
        scales = _layer_scales(llm)
    for k_scale, v_scale in scales.values():
        assert 0 < k_scale < 1 and 0 < v_scale < 1  # the tiny model's K and V are small
        assert k_scale != pytest.approx(v_scale * V_SCALE_RANGE / K_SCALE_RANGE)
    refs = _references(tiny_models("llama"), "fp8", workload, scales)
    _check(outs, refs, "calculated scales")


def test_checkpoint_scales_are_used(tiny_models, workload, tmp_path):
    from safetensors.torch import save_file

    model = tmp_path / "with_scales"
    shutil.copytree(tiny_models("llama"), model)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    scales = {i: (0.01 * (i + 1), 0.02 / (i + 1)) for i in range(layers)}
    tensors = {}
    for i, (k, v) in scales.items():
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, str(model / "kv_scales.safetensors"))
    prompts, max_tokens = workload
    with LLM(str(model), dtype="float32", kv_cache_memory=0.02, kv_cache_dtype="fp8") as llm:
        got = _layer_scales(llm)
        outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    for i, pair in scales.items():
        assert got[i] == pytest.approx(pair, rel=1e-6)
    _check(outs, _references(model, "fp8", workload, scales), "checkpoint scales")
    with LLM(str(model), dtype="float32", kv_cache_memory=0.02) as llm:  # auto: not used
        assert all(s == (1.0, 1.0) for s in _layer_scales(llm).values())


def test_tensor_parallel_fp8_cache_equals_one_process(tiny_models, workload):
    prompts, max_tokens = workload
    outs = {}
    for tp in (1, 2):
        with tiny_llm(tiny_models, kv_cache_dtype="fp8", tensor_parallel_size=tp) as llm:
            res = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
        outs[tp] = [o.outputs[0].token_ids for o in res]
    assert outs[2] == outs[1]


def test_bad_kv_cache_settings_fail_at_start_up(tiny_models):
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int8' is not one of auto, fp8"):
        tiny_llm(tiny_models, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="--calculate-kv-scales needs an FP8 KV cache"):
        tiny_llm(tiny_models, calculate_kv_scales=True)


def test_the_rounding_changes_the_reference(tiny_models, workload, fp8_references):
    """The tests above can fail: FP8 rounding moves the reference's logits, and its greedy."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_models("llama")), dtype=torch.float32
    ).eval()
    prompts, max_tokens = workload
    plain = [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    first_logits = [
        (a.logits[0] - b.logits[0]).abs().max() for a, b in zip(plain, fp8_references, strict=True)
    ]
    assert min(first_logits) > 1e-4
    assert any(a.tokens != b.tokens for a, b in zip(plain, fp8_references, strict=True))


def test_a_compressed_tensors_kv_cache_scheme_is_read_when_fp8():
    from pagellm.quant.checkpoints import checkpoint_plan

    scheme = {"weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
              "targets": ["Linear"], "format": "int-quantized"}  # fmt: skip
    config = {"quant_method": "compressed-tensors", "format": "int-quantized",
              "config_groups": {"group_0": scheme}}  # fmt: skip
    fp8_kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    assert checkpoint_plan({**config, "kv_cache_scheme": fp8_kv}).method == "compressed-tensors"
    with pytest.raises(ValueError, match="kv_cache_scheme other than FP8"):
        checkpoint_plan({**config, "kv_cache_scheme": {**fp8_kv, "type": "int"}})


def test_the_quantization_bench_measures_fp8_formats(tiny_models, tmp_path):
    """`pagellm bench quantization` with FP8 weights and an FP8 KV cache, on the tiny model."""
    import argparse

    from pagellm.bench import quantization

    chats = [
        {"conversations": [{"from": "human", "value": f"question {i} " * (5 + i)},
                           {"from": "gpt", "value": f"answer {i} " * (9 + 2 * i)}]}
        for i in range(6)
    ]  # fmt: skip
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(chats))
    out = tmp_path / "q.json"
    parser = argparse.ArgumentParser()
    quantization.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["quantization", "--model", str(tiny_models("llama")), "--formats",
         "fp32,fp8,fp32+kv_fp8,bf16+kv_fp8_e5m2", "--num-chats", "4", "--skip-chats", "0",
         "--agree-tokens", "6", "--agree-batch-size", "3", "--batch-sizes", "1,3", "--input-len", "8", "--output-len", "4",
         "--dataset-path", str(data), "--kv-cache-memory", "0.02", "--kv-budget-gib", "0.001",
         "--max-model-len", "512", "--checkpoints", f"ckpt={tiny_models('llama')}",
         "--rounds", "2", "--output-json", str(out)]
    )  # fmt: skip
    assert args.func(args) == 0
    report = json.loads(out.read_text())
    formats = report["formats"]
    assert set(formats) == {"fp32", "fp8", "fp32+kv_fp8", "bf16+kv_fp8_e5m2", "ckpt"}
    assert formats["ckpt"]["perplexity"] == pytest.approx(formats["fp32"]["perplexity"])
    # the chats decoded three and one at a time, each against the fp32 run's own
    assert report["agree_batch_size"] == 3
    assert formats["ckpt"]["identical_chats"] == 1.0
    assert formats["fp32+kv_fp8"]["kv_blocks"] == pytest.approx(
        4 * formats["fp32"]["kv_blocks"], abs=4
    )
    at_once = {name: f["sharegpt_seqs_at_once"] for name, f in formats.items()}
    assert at_once["fp32+kv_fp8"] > 3 * at_once["fp32"] > 0
    for f in formats.values():
        assert f["perplexity"] > 1 and f["speed"]["3"]["output_tok_per_s"] > 0
        rounds = [r["3"]["output_tok_per_s"] for r in f["speed_rounds"]]
        assert len(rounds) == 2 and f["speed"]["3"]["output_tok_per_s"] == max(rounds)
    assert formats["fp8"]["weight_bytes"] < formats["fp32"]["weight_bytes"]
