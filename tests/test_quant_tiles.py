"""The bf16 tile kernel for quantized weights (quant_tiles.cpp): every path this CPU has decodes
each format's weights to exactly the reference dequantization rounded to bf16, multiplies any
number of rows (partial tiles, features not a multiple of 16), and is what bf16 steps of
``tiles_min_rows`` rows or more use, eager and captured."""

from __future__ import annotations

import pytest
import torch
from test_quantization import FORMATS

from pagellm.kernels.quant_linear import load_quant_linear_kernel, load_quant_tiles_kernel
from pagellm.layers.quant_linear import QuantPart
from pagellm.quant.formats import QuantFormat
from pagellm.quant.online import quantize

TILE_FORMATS = {
    **FORMATS,
    # GPTQ / AWQ-like: a byte of zero point per group of 64; K-quant-like groups of 16
    "int4_g128_zeros": QuantFormat(
        "int4_g128_zeros", bits=4, group_size=128, scale_dtype=torch.float16, zero=None
    ),
    "int8_g16": QuantFormat("int8_g16", bits=8, group_size=16, scale_dtype=torch.float16),
    "int4_g16": QuantFormat("int4_g16", bits=4, group_size=16, scale_dtype=torch.float16, zero=8),
}


def _paths() -> list[int]:
    best = load_quant_tiles_kernel()
    return list(range(1, best.path + 1)) if best is not None else []


PATHS = _paths()
pytestmark = pytest.mark.skipif(not PATHS, reason="this CPU has no bf16 products (or no compiler)")


@pytest.fixture(scope="module", params=PATHS, ids=lambda p: {1: "avx512bf16", 2: "amx"}[p])
def tiles(request):
    return load_quant_tiles_kernel(request.param)


def _weight(name: str, n: int, k: int, seed: int = 0):
    torch.manual_seed(seed)
    return quantize(torch.randn(n, k) * 2, TILE_FORMATS[name])


@pytest.mark.parametrize("name", sorted(TILE_FORMATS))
@pytest.mark.parametrize("k", [128, 320, 384])
def test_decoded_weights_are_the_reference_rounded_to_bf16(tiles, name, k):
    """x = the identity: each output is one exact product, so out^T is the decoded weight (4-bit
    rows go in 128-input chunks: 320 ends with half a chunk)."""
    if k % TILE_FORMATS[name].group(k):
        pytest.skip("the group does not divide the inputs")
    n = 40
    w = _weight(name, n, k)
    eye = torch.eye(k, dtype=torch.bfloat16)
    assert torch.equal(tiles(eye, w).t(), w.dequantize().bfloat16())


def test_every_fp8_code_decodes_exactly(tiles):
    """Every finite E4M3 code (both signs, subnormals, zero) in per-channel rows scaled by 1: the
    decoded weight is the code's value (bits moved into place, exponent 0 looked up)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)]
    values = torch.cat([finite, torch.zeros(-finite.numel() % 127)]).view(-1, 127)
    w = quantize(
        torch.cat([torch.full((values.shape[0], 1), 448.0), values], dim=1), FORMATS["fp8"]
    )
    assert torch.equal(w.dequantize()[:, 1:], values)
    eye = torch.eye(128, dtype=torch.bfloat16)
    assert torch.equal(tiles(eye, w).t().float(), w.dequantize())


@pytest.mark.parametrize("name", sorted(TILE_FORMATS))
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 300])
def test_tiles_match_the_bf16_matmul_of_the_decoded_weights(tiles, name, rows):
    w = _weight(name, 72, 256, seed=rows)
    x = torch.randn(rows, 256).bfloat16()
    weight = w.dequantize() if tiles.scales_sums(w) else w.dequantize().bfloat16().float()
    ref = x.float() @ weight.t()
    got = tiles(x, w).float()
    # exact products, fp32 sums in another order, one bf16 rounding of the result
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


def test_per_channel_8_bit_weights_scale_the_sums():
    tiles = load_quant_tiles_kernel()
    for name in ("int8", "fp8"):
        w = _weight(name, 72, 256)
        assert tiles.scales_sums(w)
        x = torch.randn(64, 256).bfloat16()
        exact = (x.float() @ w.dequantize().t()).bfloat16().float()
        rounded = (x.float() @ w.dequantize().bfloat16().float().t()).bfloat16().float()
        got = tiles(x, w).float()
        # the exact weights' result (fp32 sums, one final rounding), not the rounded weights'
        assert (got - exact).abs().mean() < 0.2 * (got - rounded).abs().mean()
    assert not any(tiles.scales_sums(_weight(n, 72, 256)) for n in ("q8_0", "q4_1", "fp8_g32"))


def test_paths_agree_with_each_other():
    if len(PATHS) < 2:
        pytest.skip("one path on this CPU")
    w = _weight("q4_1", 96, 256)
    x = torch.randn(40, 256).bfloat16()
    a, b = load_quant_tiles_kernel(1)(x, w).float(), load_quant_tiles_kernel(2)(x, w).float()
    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("path", PATHS, ids=lambda p: {1: "avx512bf16", 2: "amx"}[p])
def test_each_route_takes_its_rows_and_computes_its_reference(path):
    kernel = load_quant_linear_kernel(tiles_path=path)
    assert kernel is not None and kernel.tiles is not None and kernel.tiles.path == path
    lo, hi = kernel.tiles_min_rows, kernel.tiles_max_rows
    w = _weight("int8_g16", 64, 128)  # 8-bit, groups of 16: no int8 products of x (see below)
    exact, rounded = w.dequantize(), w.dequantize().bfloat16().float()
    above = "panels" if kernel.bf16_panels else None
    cases = [(lo - 1, None), (lo, "tiles")]
    cases += [(hi, "tiles"), (hi + 1, above)] if hi is not None else [(300, "tiles")]
    for rows, route in cases:
        x = torch.randn(rows, 128).bfloat16()
        assert kernel.bf16_route(x, w) == route, rows
        assert kernel.bf16_route(x.float(), w) is None  # fp32 keeps the exact paths
        assert kernel.rounds_weights_to_bf16(x, w) == (route is not None)
        ref = x.float() @ (exact if route is None else rounded).t()
        torch.testing.assert_close(kernel(x, w).float(), ref, rtol=1e-2, atol=1e-2)
        if route is not None:  # the captured steps' bound call computes the same
            out = torch.empty(rows, 64, dtype=torch.bfloat16)
            assert kernel.bind(x, w, out)() == 0
            torch.testing.assert_close(out, kernel(x, w))
    # inputs not a multiple of 32 stay on the other paths
    odd = quantize(torch.randn(64, 48), QuantFormat("q8_16", bits=8, group_size=16))
    assert kernel.bf16_route(torch.randn(lo, 48).bfloat16(), odd) is None
    # 4-bit weights: x quantized to int8 up to the rule's most rows, then the tiles
    w4 = _weight("q4_0", 64, 128)
    most = kernel.int8_row_range(w4)[1]
    assert most <= kernel.int8_rows
    for rows in (1, most, most + 1, max(lo, most + 1)):
        x = torch.randn(rows, 128).bfloat16()
        quantized = 0 < rows <= most
        assert kernel.quantizes_x(x, w4) == quantized, rows
        if quantized:
            assert kernel.bf16_route(x, w4) is None
        elif rows >= lo:
            assert kernel.bf16_route(x, w4) == "tiles"
    # forms the C rule leaves out: per-channel 8-bit codes, 8- and 4-bit groups of 16; Q8_0's
    # form (8-bit, groups of 32, symmetric) it takes
    one = torch.randn(1, 128).bfloat16()
    assert not kernel.quantizes_x(one, w) and not kernel.quantizes_x(
        one, _weight("int4_g16", 64, 128)
    )
    assert not kernel.quantizes_x(one, _weight("int8_g16", 64, 128))
    q8 = _weight("q8_0", 64, 128)
    assert not kernel.quantizes_x(one, q8)  # one row keeps the exact register path
    two = torch.randn(2, 128).bfloat16()
    assert kernel.quantizes_x(two, q8) == (kernel.int8_rows >= 2)
    fewest, most = kernel.int8_row_range(q8)
    if fewest:  # and up to its most rows only (more: the tiles)
        assert kernel.quantizes_x(torch.randn(most, 128).bfloat16(), q8)
        more = torch.randn(max(most + 1, lo), 128).bfloat16()
        assert not kernel.quantizes_x(more, q8) and kernel.bf16_route(more, q8) == "tiles"


@pytest.mark.parametrize("name", sorted(TILE_FORMATS))
def test_bf16_panels_are_the_reference_rounded_to_bf16(name):
    tiles = load_quant_tiles_kernel()
    w = _weight(name, 72, 256)
    assert torch.equal(tiles.dequantize(w, 16, 40), w.dequantize()[16:56].bfloat16())
    x = torch.randn(20, 256).bfloat16()
    ref = torch.nn.functional.linear(x, w.dequantize().bfloat16())
    torch.testing.assert_close(tiles.panels(x, w), ref)


def test_a_quantized_bf16_model_computes_the_same_with_and_without_tiles(tiny_models):
    """Logits of a tiny int4 model in bf16 over a prompt of many tokens (its linear layers
    through the tiles) are those of the register/panel paths within bf16 noise, and a batch of
    requests runs (decode steps of 8+ rows through the tiles, captured)."""
    from test_model_correctness import _our_logits

    from pagellm import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = list(range(3, 60))
    with LLM(
        str(tiny_models("llama")), dtype="bfloat16", quantization="int4", max_model_len=256
    ) as llm:
        kernels = {
            id(m.kernel): m.kernel
            for m in llm.engine.executor.model.modules()
            if isinstance(m, QuantPart) and m.kernel is not None
        }
        assert kernels and all(k.tiles is not None for k in kernels.values())
        with_tiles = _our_logits(llm, ids)
        saved = {i: (k.tiles_min_rows, k.bf16_panels) for i, k in kernels.items()}
        for k in kernels.values():
            k.tiles_min_rows, k.bf16_panels = 1 << 30, False
        without = _our_logits(llm, ids)
        for i, k in kernels.items():
            k.tiles_min_rows, k.bf16_panels = saved[i]
        rel = ((with_tiles - without).norm(dim=-1) / without.norm(dim=-1)).mean()
        assert rel < 0.02, rel
        prompts = [f"request {i}: " + "many words " * (1 + i % 5) for i in range(12)]
        batch = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in batch)
