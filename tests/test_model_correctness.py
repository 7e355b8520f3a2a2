"""Our models against Hugging Face transformers (fp32, CPU) on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from reference import compare_greedy, hf_greedy

from pagellm import LLM, SamplingParams
from pagellm.attention.backend import SeqLayout

ARCHS = ["llama", "llama3", "qwen2", "qwen3"]


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _our_logits(llm: LLM, ids: list[int], split: int | None = None) -> torch.Tensor:
    """Prompt logits from our runner; with ``split`` the second part attends to cached KV."""
    runner = llm.engine.executor
    bs = runner.block_size
    blocks = list(range(-(-len(ids) // bs)))
    parts = [(0, len(ids))] if split is None else [(0, split), (split, len(ids))]
    outs = []
    with torch.inference_mode():
        for start, end in parts:
            layout = SeqLayout(end - start, start, blocks)
            meta = runner.backend.build_metadata([layout], runner.num_blocks)
            hidden = runner.model(
                torch.tensor(ids[start:end]), torch.arange(start, end), runner.kv_caches, meta
            )
            outs.append(runner.model.compute_logits(hidden))
    return torch.cat(outs)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_models, arch):
    path = tiny_models(arch)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=512)
    ids = torch.randint(100, 40000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = _hf(path)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_our_logits(llm, ids), ref, rtol=1e-4, atol=1e-4)
    # the same logits when the second half attends to the first half through the paged cache
    torch.testing.assert_close(_our_logits(llm, ids, split=77), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(tiny_models, arch):
    path = tiny_models(arch)
    hf = _hf(path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=512)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (5, 40, 130)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        compare_greedy(out.outputs[0].token_ids, hf_greedy(hf, prompt, 24), f"{arch}#{i}")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_packed_linears_match_plain_linear(tiny_models, arch):
    """bf16 runs through oneDNN-packed weights (with qkv bias for Qwen2) where the CPU has
    native bf16, else through F.linear: the same answer either way."""
    from pagellm.layers.linear import Linear

    llm = LLM(str(tiny_models(arch)), dtype="bfloat16", kv_cache_memory=0.01, max_model_len=512)
    linears = [m for m in llm.engine.executor.model.modules() if isinstance(m, Linear)]
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert linears and all((m.packed is not None) == native for m in linears)
    x = torch.randn(5, linears[0].in_features, dtype=torch.bfloat16)
    layer = linears[0]
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias).float()
    torch.testing.assert_close(layer(x).float(), expected, rtol=2e-2, atol=2e-2)
    prompt = list(range(300, 340))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fp32 = LLM(str(tiny_models(arch)), dtype="float32", kv_cache_memory=0.01, max_model_len=512)
    a = fp32.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(b) == 8
    assert a[0] == b[0]
