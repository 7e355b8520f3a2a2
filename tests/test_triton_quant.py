"""The GPU quantized kernel (``pagellm.kernels.triton_quant``): its Triton GEMM under
TRITON_INTERPRET=1 (on the card where there is one) against each format's reference
dequantization, its FP8 and W8A8 products (torch's CPU ``_scaled_mm`` / ``_int_mm`` here)
against the same quantization of x done by hand, and a model computed through it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

pytest.importorskip("triton", reason="Triton is installed by `make test`")

from torch import nn  # noqa: E402

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.kernels.quant_int8 import row_scales  # noqa: E402
from pagellm.kernels.triton_quant import (  # noqa: E402
    TritonQuantLinearKernel,
    load_triton_quant_kernel,
)
from pagellm.layers.quant_linear import QuantPart, use_quant_kernel  # noqa: E402
from pagellm.quant.formats import (  # noqa: E402
    FP8_MAX,
    QuantFormat,
    QuantizedWeight,
    quantize_activations_int8,
)
from pagellm.quant.online import fp8_format, int8_format, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the interpreter computes bf16 wrongly (numpy has no bf16): fp32 and fp16 there
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

FORMATS = {
    "int8": int8_format(),  # W8A16, one scale per row
    "q8_0": QuantFormat("q8_0", bits=8, group_size=32, scale_dtype=torch.float16),
    "q4_0": QuantFormat("q4_0", bits=4, group_size=32, scale_dtype=torch.float16, zero=8),
    "q4_1": QuantFormat("q4_1", bits=4, group_size=32, scale_dtype=torch.float16, offsets=True),
    "int4_g64": QuantFormat("int4", bits=4, group_size=64, zero=None),  # AWQ / GPTQ's form
    "int4_g128": QuantFormat("int4", bits=4, group_size=128, zero=None, scale_dtype=torch.float16),
    "fp8": fp8_format(),
    "fp8_g32": QuantFormat("fp8_g32", bits=8, group_size=32, kind="fp8_e4m3"),
}


def _on_device(w):
    moved = (t.to(DEVICE) if t is not None else None for t in w._tensors())
    return QuantizedWeight(w.fmt, *moved)


def _reference(x: torch.Tensor, w) -> torch.Tensor:
    """x W^T in float64, W dequantized by the reference and rounded to x's dtype (what the
    kernel multiplies)."""
    dense = w.dequantize().to(x.dtype).double()
    return x.double() @ dense.t()


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_the_gemm_matches_the_dequantized_matmul(name, dtype, rows):
    """Rows of a decode step and of a prefill (tiles of 16, 32 and 64 rows), 96 outputs (one
    and a half column blocks), 256 inputs (eight GEMM steps, two groups of 128)."""
    torch.manual_seed(rows)
    w = quantize(torch.randn(96, 256), FORMATS[name])
    x = torch.randn(rows, 256).to(dtype)
    kernel = TritonQuantLinearKernel(DEVICE)
    got = kernel(x.to(DEVICE), _on_device(w)).cpu()
    assert got.dtype == dtype and got.shape == (rows, 96)
    ref = _reference(x, w)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the output's rounding to 16 bits
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("name", ["q4_1", "int4_g64", "q8_0"])
def test_a_shard_of_inputs_reads_its_own_codes_and_groups(name):
    """Tensor parallelism's o_proj / down_proj shard: whole groups of inputs, views whose rows
    stride over the full weight."""
    torch.manual_seed(3)
    w = quantize(torch.randn(40, 256), FORMATS[name])
    shard = w.narrow(1, 64, 128)
    assert not shard.q.is_contiguous()
    x = torch.randn(3, 128)
    got = TritonQuantLinearKernel(DEVICE)(x.to(DEVICE), _on_device(shard)).cpu()
    torch.testing.assert_close(got.double(), _reference(x, shard), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 20])
def test_fp8_products_quantize_x_per_token_onto_448(dtype, rows):
    """Per-row FP8 on FP8 products: x's absmax per token onto E4M3's 448, codes times codes,
    then both scales (vLLM's dynamic FP8 activations)."""
    torch.manual_seed(rows)
    w = quantize(torch.randn(48, 64), fp8_format())
    x = torch.randn(rows, 64).to(dtype)
    kernel = TritonQuantLinearKernel(DEVICE, fp8_products=True)
    got = kernel(x.to(DEVICE), _on_device(w)).cpu()
    assert got.dtype == dtype
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / FP8_MAX
    codes = (xf / scale).to(torch.float8_e4m3fn).double()
    ref = (codes * scale.double()) @ w.dequantize().double().t()
    # row-wise scaled products come out in bf16 (float32 x too), hence bf16's rounding
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    # groups of inputs have a scale per group: the GEMM decodes them instead
    grouped = quantize(torch.randn(48, 64), FORMATS["fp8_g32"])
    got = kernel(x.float().to(DEVICE), _on_device(grouped)).cpu()
    torch.testing.assert_close(got.double(), _reference(x.float(), grouped), rtol=1e-5, atol=1e-4)


def test_every_fp8_code_decodes_as_the_reference():
    """The GEMM decodes E4M3 bytes by arithmetic: each of the 254 codes that are not NaN,
    subnormals and both zeros included, read back through an identity x."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    q = torch.zeros(codes.numel(), 32, dtype=torch.uint8)
    q[:, 0] = codes  # row r holds code r at input 0, zeros (code 0) elsewhere
    w = QuantizedWeight(fp8_format(), q, torch.ones(codes.numel(), 1))
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    got = TritonQuantLinearKernel(DEVICE)(x.to(DEVICE), _on_device(w)).cpu()[0]
    assert torch.equal(got, codes.view(torch.float8_e4m3fn).float())


@pytest.mark.parametrize("rows", [1, 31, 40])
@pytest.mark.parametrize("outputs", [64, 100])
def test_w8a8_multiplies_int8_codes_as_integers(rows, outputs):
    """compressed-tensors' W8A8: x per token to int8 (as the CPU path), integer products
    (rows padded to what cuBLASLt takes; 100 outputs, not a multiple of 8, through the GEMM
    on the codes), then x's scale and the row's."""
    torch.manual_seed(rows)
    fmt = QuantFormat("w8a8", bits=8, group_size=0, act_int8=True)
    w = quantize(torch.randn(outputs, 96), fmt)
    x = torch.randn(rows, 96)
    got = TritonQuantLinearKernel(DEVICE).w8a8(x.to(DEVICE), _on_device(w), row_scales(w))
    codes, scales = quantize_activations_int8(x)
    ref = (codes.double() @ w.dequantize().double().t()) * scales.double()
    torch.testing.assert_close(got.cpu().double(), ref, rtol=1e-5, atol=1e-4)


def test_a_part_takes_the_kernel_only_for_whole_steps_of_its_groups():
    kernel = TritonQuantLinearKernel(DEVICE)
    whole = QuantPart(64, 16, int8_format())  # one group of 64 inputs: two steps
    odd = QuantPart(48, 16, int8_format())  # 48: a step and a half
    for part in (whole, odd):
        part.load(0, torch.randn(16, part.in_features))
    assert use_quant_kernel(nn.Sequential(whole, odd), kernel) == 1
    assert whole.kernel is kernel and odd.kernel is None
    x = torch.randn(2, 48)
    torch.testing.assert_close(odd(x), x @ odd.stored().dequantize().t())  # the reference path


def test_the_loader_gives_fp8_products_to_hopper_cards_only():
    kernel = load_triton_quant_kernel(torch.device("cpu"))
    assert isinstance(kernel, TritonQuantLinearKernel) and not kernel.fp8_products
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability() >= (9, 0) and torch.version.hip is None
        assert load_triton_quant_kernel(torch.device("cuda")).fp8_products == hopper


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_a_model_computed_through_the_kernel_keeps_its_greedy_output(tiny_models, method):
    """Every quantized layer of a tiny model through the Triton GEMM (fp32): the same greedy
    tokens as through the CPU kernel."""
    settings = dict(dtype="float32", max_model_len=64, enforce_eager=True, device=DEVICE)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 7], [11, 3, 8]]
    with LLM(str(tiny_models("llama")), quantization=method, **settings) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        parts = [m for m in llm.engine.executor.model.modules() if isinstance(m, QuantPart)]
        kernel = _Counting(DEVICE)
        for part in parts:
            part.kernel = kernel
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(parts) == 2 * 4
    assert kernel.calls >= 8 * len(parts)  # every part, every step
    assert got == expected


class _Counting(TritonQuantLinearKernel):
    calls = 0

    def __call__(self, x, w):
        self.calls += 1
        return super().__call__(x, w)
