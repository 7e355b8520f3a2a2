"""AWQ, GPTQ and compressed-tensors checkpoints of the tiny Llama, written in each format's
on-disk layout (packed here as the formats specify; compressed-tensors packed by its own
library, its FP8 / FP8_DYNAMIC / W8A8 presets with llm-compressor's config): every quantized
layer loads to exactly the weights the format defines, and greedy outputs equal transformers
running those dequantized weights, under preemption, chunked prefill and prefix caching."""

from __future__ import annotations

import json
import logging
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


def _ct_w4_asym_parts(w):
    """llm-compressor's AWQ layout: asymmetric 4-bit groups packed by compressed-tensors' own
    compressor (zero points too); the reference is its own fake quantization."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    args = QuantizationArgs(
        num_bits=4, type="int", symmetric=False, strategy="group", group_size=GROUP
    )
    out, n = w.shape
    g = w.reshape(out, n // GROUP, GROUP)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((high - low) / 15).clamp(min=1e-6)
    zero = (-8 - torch.round(low / scale)).clamp(-8, 7).to(torch.int8)
    state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return PackedQuantizationCompressor.compress(state, scheme), fake_quantize(w, scale, zero, args)


def _ct_w8_parts(w):
    s = (w.abs().amax(-1, keepdim=True) / 127).bfloat16()
    q = torch.round(w / s.float()).clamp(-127, 127).to(torch.int8)
    return {"weight": q, "weight_scale": s}, q.float() * s.float()


def _ct_preset_parts(w, preset: str):
    """``w`` compressed by compressed-tensors' own compressor for ``preset``, with scales as
    llm-compressor's observers set them (absmax per row or per tensor, in bf16); a static
    activation scheme also gets its calibrated ``input_scale``."""
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    top = 127 if scheme.weights.type == "int" else 448
    per_row = scheme.weights.strategy == "channel"
    absmax = w.abs().amax(-1, keepdim=True) if per_row else w.abs().amax().reshape(1)
    scale = (absmax / top).bfloat16()
    parts = NaiveQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
    if not scheme.input_activations.dynamic:
        parts["input_scale"] = torch.tensor([0.05], dtype=torch.bfloat16)
    return parts, parts["weight"].float() * parts["weight_scale"].float()


def _ct_preset_config(preset: str, layout: str) -> dict:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=layout,
        ignore=["lm_head"],
        quantization_status="compressed",
    )
    return qc.to_dict()


_PRESETS = {
    "ct-fp8-dynamic": ("FP8_DYNAMIC", "float-quantized"),  # channel scales
    "ct-fp8-static": ("FP8", "float-quantized"),  # one scale a tensor, static input_scale
    "ct-w8a8": ("W8A8", "int-quantized"),
}
WEIGHT_ONLY = set(_PRESETS) - {"ct-w8a8"}
"""Schemes that quantize activations too and are served weight-only (FP8: no FP8 arithmetic on
a CPU); W8A8's dynamic per-token int8 activations are computed as such."""
INT8_ACTIVATIONS = {"ct-w8a8"}


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
    "ct-w4a16-asym": (_ct_w4_asym_parts,
                      {"quant_method": "compressed-tensors", "format": "pack-quantized",
                       "config_groups": {"group_0": {
                           "targets": ["Linear"], "input_activations": None,
                           "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                       "strategy": "group", "group_size": GROUP}}},
                       "ignore": ["lm_head"]}),
    "ct-w8a16": (_ct_w8_parts,
                 {"quant_method": "compressed-tensors", "format": "int-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                    "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                "strategy": "channel"}}},
                  "ignore": ["lm_head"]}),
}  # fmt: skip
SCHEMES.update({
    name: (lambda w, preset=preset: _ct_preset_parts(w, preset),
           lambda preset=preset, layout=layout: _ct_preset_config(preset, layout))
    for name, (preset, layout) in _PRESETS.items()
})  # fmt: skip
FORMAT_NAMES = {
    "ct-w4a16": "compressed-tensors:w4a16",
    "ct-w4a16-asym": "compressed-tensors:w4a16-asym",
    "ct-w8a16": "compressed-tensors:w8a16",
    "ct-w8a8": "compressed-tensors:w8a8",
    "ct-fp8-dynamic": "compressed-tensors:fp8",
    "ct-fp8-static": "compressed-tensors:fp8",
}


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
    config["quantization_config"] = qconfig() if callable(qconfig) else qconfig
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def _quantize_inputs_per_token(hf, dequantized: dict[str, torch.Tensor]) -> None:
    """Each quantized linear layer of ``hf`` sees its input quantized per token to int8 and
    dequantized (compressed-tensors' dynamic per-token scheme)."""
    from pagellm.quant.formats import quantize_activations_int8

    def fake_quant(_module, args):
        codes, scales = quantize_activations_int8(args[0])
        return (codes * scales,)

    for name in dequantized:
        hf.get_submodule(name.removesuffix(".weight")).register_forward_pre_hook(fake_quant)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_checkpoint_loads_exactly_and_greedy_equals_its_dequantized_weights(
    tiny_models, tmp_path, caplog, scheme
):
    import transformers

    caplog.set_level(logging.INFO, logger="pagellm.quant.plan")
    src = tiny_models("llama")
    dequantized = _write(src, tmp_path / scheme, scheme)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in dequantized.items():
            hf.get_parameter(name).copy_(w)
    if scheme in INT8_ACTIVATIONS:  # the reference rounds each quantized layer's input the same
        _quantize_inputs_per_token(hf, dequantized)
    with LLM(str(tmp_path / scheme), **ENGINE) as llm:
        model = llm.engine.executor.model
        parts = [m for m in model.modules() if isinstance(m, QuantPart)]
        assert {p.fmt.name for p in parts} == {FORMAT_NAMES.get(scheme, scheme.split("-")[0])}
        assert {p.fmt.act_int8 for p in parts} == {scheme in INT8_ACTIVATIONS}
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
    said = "activations stay in --dtype" in caplog.text
    assert said == (scheme in WEIGHT_ONLY)


def test_act_order_gptq_cannot_split_its_inputs_over_ranks(tiny_models, tmp_path):
    _write(tiny_models("llama"), tmp_path / "g", "gptq-act-order")
    with pytest.raises(ValueError, match="desc_act"):
        LLM(str(tmp_path / "g"), tensor_parallel_size=2, **ENGINE)


def test_fp8_checkpoint_weights_are_their_codes_times_their_scales(tiny_models, tmp_path):
    """The stored bytes are the checkpoint's float8 bytes; a per-tensor scale is every row's."""
    from pagellm.quant.checkpoints import assemble, checkpoint_plan

    dst = tmp_path / "fp8"
    _write(tiny_models("llama"), dst, "ct-fp8-static")
    tensors = load_file(str(next(dst.glob("*.safetensors"))))
    plan = checkpoint_plan(json.loads((dst / "config.json").read_text())["quantization_config"])
    assert plan.per_tensor and plan.fmt.fp8 and plan.weight_only_note
    out = dict(assemble(tensors.items(), plan))
    name = "model.layers.0.self_attn.k_proj"
    assert f"{name}.input_scale" in tensors
    assert f"{name}.input_scale" not in out  # static activation scales are not read
    w = out[f"{name}.weight"]
    assert torch.equal(w.q, tensors[f"{name}.weight"].view(torch.uint8))
    assert w.scales.shape == (w.shape[0], 1)
    expected = tensors[f"{name}.weight"].float() * tensors[f"{name}.weight_scale"].float()
    assert torch.equal(w.dequantize(), expected)


def test_unreadable_fp8_weights_are_refused_naming_the_layer(tiny_models, tmp_path):
    from pagellm.quant.checkpoints import assemble, checkpoint_plan

    plan = checkpoint_plan(_ct_preset_config("FP8_DYNAMIC", "float-quantized"))
    name = "model.layers.0.mlp.up_proj"
    weight = torch.full((4, 32), 1.0).to(torch.float8_e4m3fn)
    scale = torch.ones(4, 1)
    nan = weight.clone()
    nan.view(torch.uint8)[1, 2] = 0x7F
    with pytest.raises(ValueError, match=f"{name}: .*1 weights are NaN"):
        list(assemble([(f"{name}.weight", nan), (f"{name}.weight_scale", scale)], plan))
    e5m2 = weight.to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="not float8_e4m3fn"):
        list(assemble([(f"{name}.weight", e5m2), (f"{name}.weight_scale", scale)], plan))
    with pytest.raises(ValueError, match="has 3 rows for 4 outputs"):
        list(assemble([(f"{name}.weight", weight), (f"{name}.weight_scale", scale[:3])], plan))
