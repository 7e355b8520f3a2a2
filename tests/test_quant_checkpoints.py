"""AWQ, GPTQ and compressed-tensors checkpoints of the tiny Llama, written in each format's
on-disk layout (packed here as the formats specify; compressed-tensors packed by its own
library): every quantized layer loads to exactly the weights the format defines, and greedy
outputs equal transformers running those dequantized weights, under preemption, chunked
prefill and prefix caching."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from llm_helpers import MIXED_PROMPTS
from reference import compare_greedy, hf_greedy
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.layers.quant_linear import QuantPart

GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]
ENGINE = dict(dtype="float32", max_model_len=112, max_num_batched_tokens=32,
              num_gpu_blocks_override=28, block_size=4)  # fmt: skip
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values in 0..15 -> int32 words, value i at bits 4i."""
    out = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for i in range(8):
        out |= nibbles[..., i].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def _asym(w: torch.Tensor, perm: torch.Tensor | None = None):
    """Asymmetric 4-bit groups of the (optionally permuted) inputs: q, zeros (1..15), fp16
    scales, and the dequantized weight (q - z) * s in the checkpoint's input order."""
    wp = w if perm is None else w[:, perm]
    out, n = wp.shape
    g = wp.reshape(out, n // GROUP, GROUP)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    s = ((high - low) / 15).clamp(min=1e-6).half()
    z = torch.round(-low / s.float()).clamp(1, 15)  # GPTQ v1 cannot store a zero of 0
    q = (torch.round(g / s.float().unsqueeze(-1)) + z.unsqueeze(-1)).clamp(0, 15)
    deq = ((q - z.unsqueeze(-1)) * s.float().unsqueeze(-1)).reshape(out, n)
    q = q.reshape(out, n)
    if perm is not None:  # back to checkpoint order
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(n)
        q, deq = q[:, inv], deq[:, inv]
    return q.to(torch.int64), z.to(torch.int64), s, deq


def _awq_parts(w):
    q, z, s, deq = _asym(w)
    out = w.shape[0]
    qt = q.t().numpy().reshape(w.shape[1], out // 8, 8)[..., list(AWQ_ORDER)]
    zt = z.t().numpy().reshape(-1, out // 8, 8)[..., list(AWQ_ORDER)]
    parts = {"qweight": _words(qt), "qzeros": _words(zt), "scales": s.t().contiguous()}
    return {k: torch.as_tensor(v) for k, v in parts.items()}, deq


def _gptq_parts(w, act_order: bool):
    n = w.shape[1]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(n)) if act_order else None
    q, z, s, deq = _asym(w, perm)
    g_idx = torch.arange(n) // GROUP
    if perm is not None:
        g_idx = torch.empty(n, dtype=torch.int64)
        g_idx[perm] = torch.arange(n) // GROUP
    qw = _words(q.t().numpy().reshape(n // 8, 8, -1).transpose(0, 2, 1))  # [in/8, out]
    qz = _words((z - 1).t().numpy().reshape(z.shape[1], -1, 8))  # [groups, out/8]
    parts = {"qweight": qw, "qzeros": qz, "scales": s.t().contiguous(), "g_idx": g_idx.int()}
    return {k: torch.as_tensor(v) for k, v in parts.items()}, deq


def _ct_w4_parts(w):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out, n = w.shape
    g = w.reshape(out, n // GROUP, GROUP)
    s = (g.abs().amax(-1) / 7).clamp(min=1e-6).bfloat16()
    q = torch.round(g / s.float().unsqueeze(-1)).clamp(-8, 7).reshape(out, n).to(torch.int8)
    deq = (q.float().reshape(out, -1, GROUP) * s.float().unsqueeze(-1)).reshape(out, n)
    parts = {
        "weight_packed": pack_to_int32(q, 4),
        "weight_scale": s,
        "weight_shape": torch.tensor([out, n]),
    }
    return parts, deq


def _ct_w8_parts(w):
    s = (w.abs().amax(-1, keepdim=True) / 127).bfloat16()
    q = torch.round(w / s.float()).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": s}, q.float() * s.float()


SCHEMES = {
    "awq": (_awq_parts, {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                         "zero_point": True, "version": "gemm"}),
    "gptq": (lambda w: _gptq_parts(w, False),
             {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
              "sym": False, "checkpoint_format": "gptq"}),
    "gptq-act-order": (lambda w: _gptq_parts(w, True),
                       {"quant_method": "gptq", "bits": 4, "group_size": GROUP,
                        "desc_act": True, "sym": False}),
    "ct-w4a16": (_ct_w4_parts,
                 {"quant_method": "compressed-tensors", "format": "pack-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                    "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                "strategy": "group", "group_size": GROUP}}},
                  "ignore": ["lm_head"]}),
    "ct-w8a16": (_ct_w8_parts,
                 {"quant_method": "compressed-tensors", "format": "int-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                    "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                "strategy": "channel"}}},
                  "ignore": ["lm_head"]}),
}  # fmt: skip


def _write(src: Path, dst: Path, scheme: str) -> dict[str, torch.Tensor]:
    """The tiny model in ``scheme``'s layout at ``dst``; returns the dequantized weights."""
    make, qconfig = SCHEMES[scheme]
    shutil.copytree(src, dst)
    file = next(dst.glob("*.safetensors"))
    tensors = load_file(str(file))
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            parts, deq = make(t)
            prefix = name.removesuffix(".weight")
            out.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
            dequantized[name] = deq
        else:
            out[name] = t
    save_file(out, str(file), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_checkpoint_loads_exactly_and_greedy_equals_its_dequantized_weights(
    tiny_models, tmp_path, scheme
):
    import transformers

    src = tiny_models("llama")
    dequantized = _write(src, tmp_path / scheme, scheme)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in dequantized.items():
            hf.get_parameter(name).copy_(w)
    with LLM(str(tmp_path / scheme), **ENGINE) as llm:
        model = llm.engine.executor.model
        parts = [m for m in model.modules() if isinstance(m, QuantPart)]
        expected = {"ct-w4a16": "compressed-tensors:w4a16", "ct-w8a16": "compressed-tensors:w8a16"}
        assert {p.fmt.name for p in parts} == {expected.get(scheme, scheme.split("-")[0])}
        down = model.layers[1].mlp.down_proj.parts[0]
        ours = down.stored()
        ours.perm = down.perm
        assert torch.equal(ours.dequantize(), dequantized["model.layers.1.mlp.down_proj.weight"])
        ids = [llm.tokenizer.encode(p) for p in MIXED_PROMPTS]
        refs = [hf_greedy(hf, p, 16) for p in ids]
        outs = llm.generate(MIXED_PROMPTS, GREEDY, use_tqdm=False)
        for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
            compare_greedy(out.outputs[0].token_ids, ref, f"{scheme} prompt {i}")
        stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_act_order_gptq_cannot_split_its_inputs_over_ranks(tiny_models, tmp_path):
    _write(tiny_models("llama"), tmp_path / "g", "gptq-act-order")
    with pytest.raises(ValueError, match="desc_act"):
        LLM(str(tmp_path / "g"), tensor_parallel_size=2, **ENGINE)
