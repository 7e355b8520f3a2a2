"""Quantized weights: the stored form against each format's reference dequantization, the
kernel against the dequantized matmul, and whole models kept quantized (GGUF Q8_0/Q4_0/Q4_1,
online int8/int4/fp8) whose greedy outputs equal a float reference run on the dequantized
weights, alone, batched, under preemption, chunked prefill, prefix caching and tensor
parallelism."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from llm_helpers import MIXED_PROMPTS
from reference import compare_greedy, hf_greedy

from pagellm import LLM, SamplingParams
from pagellm.fetch import require_default_model
from pagellm.kernels.quant_linear import load_quant_linear_kernel
from pagellm.layers.quant_linear import QuantPart
from pagellm.quant.formats import QuantFormat, QuantizedWeight
from pagellm.quant.gguf_blocks import from_blocks
from pagellm.quant.online import fp8_format, int4_format, int8_format, quantize

FORMATS = {
    "int8": int8_format(),
    "int4": QuantFormat("int4", bits=4, group_size=64, zero=None),
    # half a 32-input block a group: the one-row AVX2 decoder's fallback
    "int4_g16": QuantFormat("int4_g16", bits=4, group_size=16, zero=None),
    "q4_0": QuantFormat("q4_0", bits=4, group_size=32, scale_dtype=torch.float16, zero=8),
    "q4_1": QuantFormat("q4_1", bits=4, group_size=32, scale_dtype=torch.float16, offsets=True),
    "q8_0": QuantFormat("q8_0", bits=8, group_size=32, scale_dtype=torch.float16),
    "fp8": fp8_format(),
    "fp8_g32": QuantFormat("fp8_g32", bits=8, group_size=32, kind="fp8_e4m3"),
}
INT_FORMATS = sorted(n for n, f in FORMATS.items() if not f.fp8)
ONLINE_FORMATS = {
    "int8": lambda k: int8_format(),
    "int4": int4_format,
    "fp8": lambda k: fp8_format(),
}
# small steps and a small cache: chunked prefill, prefix-cache hits and preemption all happen
ENGINE = dict(dtype="float32", max_model_len=112, max_num_batched_tokens=32,
              num_gpu_blocks_override=28, block_size=4)  # fmt: skip
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(
    scope="module",
    params=[(None, ()), (16, ()), (None, ("-mno-avx2",))],
    ids=["native", "16-lanes", "portable"],
)
def kernel(request):
    k = load_quant_linear_kernel(*request.param)
    if k is None:
        pytest.skip("no C++ compiler")
    return k


def _int8_per_group(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as quant_row.h multiplies it: int8 per group of inputs, symmetric, scale max|x| / 127,
    rounded to nearest even."""
    g = x.float().reshape(x.shape[0], -1, group)
    top = g.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.full_like(top, 127.0) / top, 0.0)  # (127 / top: 1 / top * 127)
    return (torch.round(g * inv) * (top / 127.0)).reshape(x.shape)


def _int8_x_product(x: torch.Tensor, w) -> torch.Tensor:
    """x W^T as the kernel computes it where it quantizes x: the codes' share against x in int8,
    the offsets' share against x itself (float64)."""
    group = w.fmt.group(x.shape[1])
    dense = w.dequantize().double()
    offsets = torch.zeros_like(dense)
    if w.offsets is not None:
        offsets = w.offsets.double().repeat_interleave(group, dim=1)
    return _int8_per_group(x, group).double() @ (dense - offsets).t() + x.double() @ offsets.t()


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 32, 33, 300])
def test_kernel_matches_the_dequantized_matmul(kernel, name, rows):
    torch.manual_seed(rows)
    w = quantize(torch.randn(72, 192), FORMATS[name])
    x = torch.randn(rows, 192)
    ref = x @ w.dequantize().t()
    torch.testing.assert_close(kernel(x, w), ref, rtol=1e-4, atol=1e-4)
    xb = x.bfloat16()
    wb = w.dequantize()
    if kernel.rounds_weights_to_bf16(xb, w):  # bf16 steps of many rows: bf16 weights
        wb = wb.bfloat16().float()
    ref_b = (xb.float() @ wb.t()).bfloat16()
    if kernel.quantizes_x(xb, w):  # a few rows against 4-bit codes: x in int8
        ref_b = _int8_x_product(xb, w).bfloat16()
    torch.testing.assert_close(kernel(xb, w), ref_b, rtol=2e-2, atol=5e-2)


ONE_ROW_FORMATS = {
    # the few-rows int8 path (quant_row.h) scales groups of 32 and 64 per lane, larger ones once
    "q4_1_g32": FORMATS["q4_1"],
    "q4_0_g32": FORMATS["q4_0"],
    "int4_g64": FORMATS["int4"],
    "int4_g128": QuantFormat("int4", bits=4, group_size=128, zero=None),
    "int4_g256": QuantFormat("int4", bits=4, group_size=256, zero=None),
    # 8-bit codes in Q8_0's form: 64 inputs a chunk, two groups of 32 per chunk
    "q8_0_g32": FORMATS["q8_0"],
    # per-channel FP8: one row sums groups of 64+ inputs four vectors at a time, then the rest
    "fp8": FORMATS["fp8"],
}


@pytest.mark.parametrize("name", sorted(ONE_ROW_FORMATS))
@pytest.mark.parametrize("k", [256, 288, 320, 768])
@pytest.mark.parametrize("rows", [1, 2, 3, 6, 9])
def test_few_bf16_rows_match_the_dequantized_matmul(kernel, name, k, rows):
    """A decode step's few rows of bf16 x. Where the kernel quantizes x (int8 per weight group,
    integer products; the offsets' share from x itself): within one bf16 rounding of that
    product, and near the exact one; elsewhere within one bf16 rounding of the exact product.
    Weight rows that end mid-chunk (320: two and a half 128-input chunks; 288: four and a half
    64-input chunks of 8-bit codes) and a count of them
    that leaves a remainder of every row block; zero-mean data, so that x's rounding shows."""
    fmt = ONE_ROW_FORMATS[name]
    if fmt.group_size and k % fmt.group_size:
        pytest.skip("the group does not divide the inputs")
    torch.manual_seed(k + rows)
    w = quantize(torch.randn(37, k), fmt)
    x = torch.randn(rows, k).bfloat16()
    dense = w.dequantize().double()
    exact = x.double() @ dense.t()
    got = kernel(x, w).double()
    if kernel.quantizes_x(x, w):
        ref = _int8_x_product(x, w)
        torch.testing.assert_close(got, ref, rtol=4e-3, atol=1e-3 * ref.abs().max().item())
        assert (got - exact).abs().max() <= 3e-2 * exact.abs().max()
        return
    if kernel.rounds_weights_to_bf16(x, w):
        exact = x.double() @ dense.bfloat16().double().t()
    torch.testing.assert_close(got, exact, rtol=8e-3, atol=1e-3 * exact.abs().max().item())


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_kernel_dequantization_is_the_reference_bit_for_bit(kernel, name):
    w = quantize(torch.randn(40, 128) * 3, FORMATS[name])
    assert torch.equal(kernel.dequantize(w, 8, 20), w.dequantize()[8:28])


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_dequantize_exactly_as_the_gguf_package(type_name):
    qtype = gguf.GGMLQuantizationType[type_name]
    data = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    raw = gguf.quants.quantize(data, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    ours = from_blocks(raw, type_name, 24, 96)
    assert ours.fmt.name == f"gguf:{type_name}"
    assert torch.equal(ours.dequantize(), reference)
    assert ours.q.numel() == 24 * 96 * ours.fmt.bits // 8  # kept at 8 or 4 bits a weight


@pytest.mark.parametrize(("type_name", "block_bytes"), [("Q4_K", 144), ("Q6_K", 210)])
def test_k_quant_super_blocks_dequantize_exactly_as_the_gguf_package(
    kernel, type_name, block_bytes
):
    """Random super-blocks (every bit pattern of scales, mins and values; finite fp16 d)."""
    rng = np.random.default_rng(1)
    rows, cols = 6, 512
    blocks = rng.integers(0, 256, (rows * cols // 256, block_bytes), dtype=np.uint8)
    halves = [(0, 2), (2, 4)] if type_name == "Q4_K" else [(208, 210)]
    for a, b in halves:
        d = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, a:b] = d.view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(rows, -1)
    qtype = gguf.GGMLQuantizationType[type_name]
    reference = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    ours = from_blocks(raw, type_name, rows, cols)
    assert torch.equal(ours.dequantize(), reference)
    x = torch.randn(3, cols)
    torch.testing.assert_close(kernel(x, ours), x @ reference.t(), rtol=1e-4, atol=1e-3)


def _every_fp8_code(rows: int, cols: int, fmt: QuantFormat) -> QuantizedWeight:
    """Random E4M3 bytes (each of the 254 non-NaN codes: subnormals, zeros of both signs, +-448)
    with random fp32 scales."""
    gen = torch.Generator().manual_seed(rows * cols)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    q = torch.cat([codes, codes[torch.randint(0, len(codes), (rows * cols - 254,), generator=gen)]])
    spread = torch.logspace(-4, 1, rows).unsqueeze(1)  # row scales from 1e-4 to 10
    scales = (torch.rand(rows, fmt.groups(cols), generator=gen) + 0.05) * spread
    return QuantizedWeight(fmt, q.reshape(rows, cols).contiguous(), scales.contiguous())


@pytest.mark.parametrize("name", ["fp8", "fp8_g32"])
def test_kernel_decodes_every_fp8_code_as_the_reference(kernel, name):
    w = _every_fp8_code(40, 128, FORMATS[name])
    ref = w.dequantize()
    assert torch.equal(
        ref,
        w.q.view(torch.float8_e4m3fn).float()
        * w.scales.repeat_interleave(FORMATS[name].group(128), dim=1),
    )
    assert torch.equal(kernel.dequantize(w, 0, 40), ref)
    for rows in (1, 3, 33):
        x = torch.randn(rows, 128)
        torch.testing.assert_close(kernel(x, w), x @ ref.t(), rtol=1e-4, atol=1e-3)
    # one row of bf16 x: the exact weights, each row's sum scaled once (per-channel codes)
    xb = torch.randn(1, 128).bfloat16()
    exact = xb.double() @ ref.double().t()
    tol = 1e-3 * exact.abs().max().item()
    torch.testing.assert_close(kernel(xb, w).double(), exact, rtol=8e-3, atol=tol)


def test_online_fp8_is_per_channel_absmax_onto_448():
    w = torch.randn(16, 256) * torch.logspace(-3, 1, 16).unsqueeze(1)
    w[3] = 0.0  # a zero row keeps a finite scale
    q = quantize(w, fp8_format())
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    assert torch.equal(q.scales[torch.arange(16) != 3], scale[torch.arange(16) != 3])
    codes = (w / q.scales).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.q, codes.view(torch.uint8))
    assert q.q.view(torch.float8_e4m3fn).float().abs().amax() == 448  # the row maxima
    # E4M3 keeps 3 mantissa bits: half a step is 1/16 of |w|, or half the smallest subnormal
    err = (q.dequantize() - w).abs()
    assert (err <= w.abs() * (1 / 16 + 1e-6) + q.scales * 2.0**-10).all()
    assert torch.equal(q.dequantize()[3], torch.zeros(256))


def test_fp8_formats_take_no_zero_points_or_offsets():
    with pytest.raises(ValueError, match="fp8 weights are 8 bits"):
        QuantFormat("bad", bits=4, group_size=32, kind="fp8_e4m3")
    with pytest.raises(ValueError, match="fp8 weights are 8 bits"):
        QuantFormat("bad", bits=8, group_size=32, zero=None, kind="fp8_e4m3")
    with pytest.raises(ValueError, match="element kind"):
        QuantFormat("bad", bits=8, group_size=0, kind="fp4")


@pytest.mark.parametrize("name", INT_FORMATS)
def test_online_quantization_error_is_within_half_a_step(name):
    w = torch.randn(16, 256)
    q = quantize(w, FORMATS[name])
    step = q.scales.float().repeat_interleave(q.fmt.group(256), dim=1)
    assert ((q.dequantize() - w).abs() <= step * 0.5 + 1e-5).all()


def test_a_shard_of_inputs_keeps_whole_groups():
    w = quantize(torch.randn(8, 256), int4_format(256))  # groups of 128
    part = w.narrow(1, 128, 128)
    assert torch.equal(part.dequantize(), w.dequantize()[:, 128:])
    assert torch.equal(w.narrow(0, 2, 3).dequantize(), w.dequantize()[2:5])
    with pytest.raises(ValueError, match="whole groups"):
        w.narrow(1, 64, 128)


def test_int4_picks_the_largest_group_that_divides_the_inputs():
    assert int4_format(1536).group_size == 128
    assert int4_format(576).group_size == 64
    with pytest.raises(ValueError, match="int4"):
        int4_format(100)


# ----- whole models ------------------------------------------------------------------------


def _dequantized_hf(model_dir, method: str):
    """transformers' model with each decoder linear weight replaced by its ``method``
    quantization, dequantized: the float model a quantized engine should agree with."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    fmt_for = ONLINE_FORMATS[method]
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                w = module.weight
                module.weight.copy_(quantize(w, fmt_for(w.shape[1])).dequantize())
    return hf.eval()


def _quant_parts(llm: LLM) -> list[QuantPart]:
    return [m for m in llm.engine.executor.model.modules() if isinstance(m, QuantPart)]


def _check_against(hf, llm: LLM, tokenizer_prompts: list[str]) -> None:
    ids = [llm.tokenizer.encode(p) for p in tokenizer_prompts]
    refs = [hf_greedy(hf, p, 16) for p in ids]
    batched = llm.generate(tokenizer_prompts, GREEDY, use_tqdm=False)
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in tokenizer_prompts]
    for i, ref in enumerate(refs):
        compare_greedy(batched[i].outputs[0].token_ids, ref, f"batched prompt {i}")
        compare_greedy(alone[i].outputs[0].token_ids, ref, f"alone prompt {i}")


@pytest.mark.parametrize("method", sorted(ONLINE_FORMATS))
def test_online_quantized_greedy_equals_the_dequantized_reference(tiny_models, method):
    model = tiny_models("llama")
    with LLM(str(model), quantization=method, **ENGINE) as llm:
        parts = _quant_parts(llm)
        assert len(parts) == 2 * 4  # two layers: qkv, o, gate/up, down (embeddings stay float)
        assert {p.fmt.name for p in parts} == {method}
        _check_against(_dequantized_hf(model, method), llm, MIXED_PROMPTS)
        stats = llm.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the hard paths ran


@pytest.fixture(scope="module")
def tiny_gguf(tiny_models, tmp_path_factory):
    from test_gguf import write_gguf

    path = tmp_path_factory.mktemp("qgguf") / "tiny-mixed.gguf"
    write_gguf(tiny_models("llama"), path)  # Q8_0 / Q4_0 / Q4_1 / F16 tensors, mixed in Q/K/V
    return path


def test_gguf_is_kept_quantized_and_greedy_equals_transformers(tiny_gguf):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    with LLM(str(tiny_gguf), **ENGINE) as llm:
        names = {p.fmt.name for p in _quant_parts(llm)}
        assert names == {"gguf:Q8_0", "gguf:Q4_0", "gguf:Q4_1"}
        qkv = llm.engine.executor.model.layers[0].self_attn.qkv_proj
        assert len(qkv.parts) == 3  # Q4_0 q, Q4_1 k, Q8_0 v: each kept in its own form
        _check_against(hf, llm, MIXED_PROMPTS)
        quantized = llm.engine.executor.memory_bytes()["weights"]
    with LLM(str(tiny_gguf), quantization="none", **ENGINE) as dense:
        assert not _quant_parts(dense)
        assert quantized < 0.5 * dense.engine.executor.memory_bytes()["weights"]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_tensor_parallel_quantized_equals_one_process(tiny_models, method):
    """Per-channel int8 / fp8: every rank quantizes the whole tensor, then keeps its share (the
    grouped forms under TP run on the default model's Q4_1 in test_parallel's TP 3 test)."""
    model = str(tiny_models("llama"))
    outs = {}
    for tp in (1, 2):
        with LLM(model, quantization=method, tensor_parallel_size=tp, **ENGINE) as llm:
            res = llm.generate(MIXED_PROMPTS, GREEDY, use_tqdm=False)
        outs[tp] = [o.outputs[0].token_ids for o in res]
    assert outs[2] == outs[1]


def test_tensor_parallel_cannot_split_an_int4_group(tiny_models):
    # int4 groups of 64 over o_proj's 64 inputs: a rank's 32 would split a group
    with pytest.raises(ValueError, match="not a whole number of groups of 64"):
        LLM(str(tiny_models("llama")), quantization="int4", tensor_parallel_size=2, **ENGINE)


def test_weight_bytes_shrink_with_the_format(tiny_models):
    model = str(tiny_models("llama"))
    per_weight, total = {}, {}
    for method in ("none", "int8", "int4", "fp8"):
        with LLM(model, quantization=method, **ENGINE) as llm:
            parts = _quant_parts(llm)
            stored = sum(b.numel() * b.element_size() for p in parts for b in p.buffers())
            weights = sum(p.in_features * p.out_features for p in parts)
            per_weight[method] = stored / weights if parts else 4.0
            total[method] = llm.engine.executor.memory_bytes()["weights"]
    assert 1.0 < per_weight["int8"] < 1.1  # a byte, plus a float scale per row of 64-128
    assert per_weight["fp8"] == per_weight["int8"]
    assert 0.5 < per_weight["int4"] < 0.6  # half a byte, plus a scale and zero per 64
    assert total["int4"] < total["int8"] < total["none"]


# ----- bad settings ------------------------------------------------------------------------


def test_bad_quantization_settings_fail_at_start_up(tiny_models, tiny_gguf, tmp_path):
    import json
    import shutil

    model = tiny_models("llama")
    with pytest.raises(ValueError, match="--quantization 'fp4' is not supported"):
        LLM(str(model), quantization="fp4", **ENGINE)
    with pytest.raises(ValueError, match="needs a .gguf file"):
        LLM(str(model), quantization="gguf", **ENGINE)
    for method in ("int8", "fp8"):
        with pytest.raises(ValueError, match=f"--quantization {method} quantizes a float"):
            LLM(str(tiny_gguf), quantization=method, **ENGINE)
    awq = tmp_path / "awq"
    shutil.copytree(model, awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (awq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="stored unquantized"):  # float weights, awq config
        LLM(str(awq), **ENGINE)
    with pytest.raises(ValueError, match="--quantization gptq contradicts"):
        LLM(str(awq), quantization="gptq", **ENGINE)
    with pytest.raises(ValueError, match="needs a checkpoint quantized so"):
        LLM(str(model), quantization="awq", **ENGINE)
    refused = [("FP8_BLOCK", "float-quantized", "strategy 'block'"),
               ("W4A4", "pack-quantized", "4-bit activations"),
               ("NVFP4A16", "nvfp4-pack-quantized", "4-bit float weights")]  # fmt: skip
    for scheme, layout, refusal in refused:
        config["quantization_config"] = _ct_config(scheme, layout)
        (awq / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=f"quantized with 'compressed-tensors': .*{refusal}"):
            LLM(str(awq), **ENGINE)
        with pytest.raises(ValueError, match="--quantization fp8 contradicts"):
            LLM(str(awq), quantization="fp8", **ENGINE)


def _ct_config(preset: str, layout: str) -> dict:
    """compressed-tensors' own quantization_config for one of its preset schemes."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(preset, ["Linear"])
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=layout, ignore=["lm_head"])
    return qc.to_dict()


def test_cluster_file_takes_quantization():
    from pagellm.cluster.config import ClusterConfigError, parse_cluster_config

    plan = parse_cluster_config({"engine_args": {"quantization": "int8"}}).plan()
    assert plan["engine_args"]["model"]["quantization"] == "int8"
    with pytest.raises(ClusterConfigError, match="quantization='fp4'"):
        parse_cluster_config({"engine_args": {"quantization": "fp4"}})


def _random_k_blocks(rng, rows: int, cols: int, type_name: str) -> np.ndarray:
    """Raw super-blocks with random values, scales and mins, and small fp16 d / dmin."""
    block_bytes = {"Q4_K": 144, "Q6_K": 210}[type_name]
    blocks = rng.integers(0, 256, (rows * cols // 256, block_bytes), dtype=np.uint8)
    d_at = [(0, 2), (2, 4)] if type_name == "Q4_K" else [(208, 210)]
    for a, b in d_at:
        d = (np.abs(rng.standard_normal(blocks.shape[0])) * 2e-3).astype(np.float16)
        blocks[:, a:b] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def test_k_quant_gguf_is_kept_quantized_and_greedy_equals_transformers(tmp_path):
    """A one-layer Llama of 256-wide layers written in Q4_K / Q6_K (llama.cpp's Q4_K_M mix)."""
    import transformers
    from test_gguf import _copy_tokenizer

    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(3)
    path = tmp_path / "tiny-k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(64)
    _copy_tokenizer(writer)
    vocab = len(gguf.GGUFReader(str(require_default_model())).fields["tokenizer.ggml.tokens"].data)
    embed = (rng.standard_normal((vocab, 256)) * 0.5).astype(np.float32)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(embed, Q.Q8_0), raw_dtype=Q.Q8_0)
    shapes = {"attn_q": (256, 256, "Q4_K"), "attn_k": (128, 256, "Q4_K"),
              "attn_v": (128, 256, "Q6_K"), "attn_output": (256, 256, "Q6_K"),
              "ffn_gate": (512, 256, "Q4_K"), "ffn_up": (512, 256, "Q4_K"),
              "ffn_down": (256, 512, "Q6_K")}  # fmt: skip
    for kind, (rows, cols, type_name) in shapes.items():
        raw = _random_k_blocks(rng, rows, cols, type_name)
        writer.add_tensor(f"blk.0.{kind}.weight", raw, raw_dtype=Q[type_name])
    for norm in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(norm, np.ones(256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with LLM(str(path), **ENGINE) as llm:
        names = {p.fmt.name for p in _quant_parts(llm)}
        assert names == {"gguf:Q4_K", "gguf:Q6_K", "gguf:Q8_0"}
        _check_against(hf, llm, MIXED_PROMPTS[:4])


def test_a_group_the_kernel_cannot_take_keeps_the_reference_path(kernel):
    from torch import nn

    from pagellm.layers.quant_linear import use_quant_kernel

    part = QuantPart(40, 24, int8_format())  # one group of 40 inputs: not whole vectors
    w = torch.randn(24, 40)
    part.load(0, w)
    assert use_quant_kernel(nn.Sequential(part), kernel) == 0
    x = torch.randn(3, 40)
    torch.testing.assert_close(part(x), x @ quantize(w, int8_format()).dequantize().t())
