"""Quantized linear layers on a GPU: the CUDA counterpart of ``QuantLinearKernel`` (the same
interface: ``supports``, ``applies``, ``__call__``, ``w8a8``), so that a model kept quantized
on the card is computed quantized instead of dequantizing every weight on every call.

- Weight-only forms (int8/int4 online, AWQ, GPTQ, compressed-tensors W4A16, GGUF Q4_0 / Q4_1 /
  Q8_0, and FP8 where the card has no FP8 products): a Triton GEMM that reads the stored codes
  (``pagellm.quant.formats``: 8-bit bytes, or 4-bit in GGUF's nibble order) and decodes each
  ``BLOCK_K`` slice of W in registers by the reference formula, ``(q - zero) * scale + offset``,
  rounds it to x's dtype and multiplies on the tensor cores with float32 accumulation. The
  weight in memory stays 4 or 8 bits a value: a decode step reads that, not a bf16 copy.
- FP8 with one scale per output row (per channel or per tensor) on cards with FP8 products
  (compute capability 8.9 and up): x quantized per token to E4M3 (its absmax onto 448, as
  vLLM's dynamic FP8 activations) and ``torch._scaled_mm`` with the row and column scales.
- W8A8 int8 (compressed-tensors' dynamic per-token scheme): x quantized per token to int8 as on
  the CPU, ``torch._int_mm`` of the codes (rows padded to 32: cuBLASLt takes more than 16) and
  both scales after; outputs not a multiple of 8 take the GEMM above (the codes, exact in fp32).

Triton runs on the CPU under ``TRITON_INTERPRET=1``, and ``torch._scaled_mm`` / ``_int_mm``
have CPU implementations: the tests check every path there without a GPU.
"""

from __future__ import annotations

import torch

from pagellm.quant.formats import FP8_MAX, QuantizedWeight, quantize_activations_int8

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Triton is optional (CUDA installs bring it)
    triton = None
    tl = None

BLOCK_K = 32
"""The fewest inputs per step of the GEMM (a 4-bit block): a group holds whole steps."""
WIDEST_K = 128
"""The most inputs per step (the largest of 128 / 64 / 32 that divides the group)."""
INT_MM_MIN_ROWS = 32
"""Rows ``torch._int_mm`` gets at least (cuBLASLt's int8 GEMM takes more than 16)."""


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _e4m3(b):
        # an E4M3 byte's value by arithmetic (no FP8 type: cards before sm_89 have none):
        # subnormal m / 8 * 2^-6, normal (8 + m) * 2^(e - 10) with the power of two made from
        # its exponent bits (exact; exp2 may be approximate); 0x7F / 0xFF (NaN, which no loader
        # accepts) come out as +-480
        e = (b >> 3) & 15
        m = (b & 7).to(tl.float32)
        power = ((e + 117) << 23).to(tl.float32, bitcast=True)
        magnitude = tl.where(e == 0, m * 0.001953125, (m + 8.0) * power)
        return tl.where(b >= 128, -magnitude, magnitude)

    @triton.jit
    def _dequant_matmul(
        x_ptr, q_ptr, s_ptr, z_ptr, o_ptr, y_ptr, M, N, K,
        stride_xm, stride_qn, stride_sn, stride_zn, stride_on, stride_ym,
        BITS: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, ZERO: tl.constexpr,
        ZEROS: tl.constexpr, OFFSETS: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # y[m, n] = sum_k x[m, k] w[n, k], w decoded from its codes a BLOCK_K slice at a time;
        # GROUP is a multiple of BLOCK_K, so a slice lies in one group and its scale (zero,
        # offset) is one value per row n.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=m_ok[:, None],
                other=0.0,
            )
            if BITS == 8:
                byte = tl.load(
                    q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=n_ok[:, None]
                )
                if FP8:
                    codes = _e4m3(byte.to(tl.int32))
                else:
                    codes = byte.to(tl.int8, bitcast=True).to(tl.float32)
            else:
                # input k: byte (k // 32) * 16 + k % 16 of the row, low nibble for k % 32 < 16
                at = (offs_k // 32) * 16 + offs_k % 16
                shift = ((offs_k % 32) // 16) * 4
                byte = tl.load(
                    q_ptr + offs_n[:, None] * stride_qn + at[None, :], mask=n_ok[:, None]
                )
                codes = ((byte.to(tl.int32) >> shift[None, :]) & 15).to(tl.float32)
            g = k0 // GROUP
            scale = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
            if ZEROS:
                zero = tl.load(z_ptr + offs_n * stride_zn + g, mask=n_ok, other=0).to(tl.float32)
                codes = codes - zero[:, None]
            elif ZERO != 0:
                codes = codes - ZERO
            w = codes * scale[:, None]
            if OFFSETS:
                offset = tl.load(o_ptr + offs_n * stride_on + g, mask=n_ok, other=0.0)
                w = w + offset.to(tl.float32)[:, None]
            if IEEE:  # float32 x: exact products, not the tensor cores' TF32
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        tl.store(
            y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )


def _block_k(group: int) -> int:
    """Inputs per GEMM step: as many as a group holds, up to WIDEST_K (fewer steps, wider
    loads; a step must lie in one group)."""
    k = WIDEST_K
    while group % k:
        k //= 2
    return k


def _block_sizes(m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): decode steps' few rows take the smallest tile tl.dot has (16) and
    wide column blocks; prefill's many rows square ones."""
    if m <= 16:
        return 16, 64
    if m <= 32:
        return 32, 64
    return 64, 64


class TritonQuantLinearKernel:
    """``x @ W^T`` for weights kept quantized on a GPU (see the module docstring).
    ``device_type`` is the device whose tensors it takes ("cuda"; "cpu" in the tests, under
    the Triton interpreter); ``fp8_products``: send per-row FP8 to ``torch._scaled_mm`` (a
    Hopper card: row-wise scales)."""

    def __init__(self, device_type: str = "cuda", fp8_products: bool = False) -> None:
        if triton is None:
            raise RuntimeError("the GPU quantized kernel needs Triton")
        self.device_type = device_type
        self.fp8_products = fp8_products

    @staticmethod
    def supports(group: int) -> bool:
        """Groups of whole GEMM steps (multiples of 32 inputs); other layers keep the
        reference path (dequantize, then multiply)."""
        return group % BLOCK_K == 0

    def applies(self, x: torch.Tensor) -> bool:
        return (
            x.dim() == 2
            and x.device.type == self.device_type
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        )

    def __call__(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        if w.fmt.fp8 and self.fp8_products and w.scales.shape[1] == 1:
            return self.fp8_scaled_mm(x, w)
        return self.dequant_matmul(x, w)

    def dequant_matmul(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        """The Triton GEMM, W decoded in registers (every form)."""
        x = x.contiguous()
        m, k = x.shape
        n = w.shape[0]
        fmt = w.fmt
        group = fmt.group(k)
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        if m == 0:
            return y
        block_m, block_n = _block_sizes(m)
        zeros = w.zeros if w.zeros is not None else w.scales  # unread unless ZEROS
        offsets = w.offsets if w.offsets is not None else w.scales  # unread unless OFFSETS
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _dequant_matmul[grid](
            x, w.q, w.scales, zeros, offsets, y, m, n, k,
            x.stride(0), w.q.stride(0), w.scales.stride(0), zeros.stride(0), offsets.stride(0),
            y.stride(0),
            BITS=fmt.bits, FP8=fmt.fp8, GROUP=group, ZERO=fmt.zero or 0,
            ZEROS=w.zeros is not None, OFFSETS=w.offsets is not None,
            IEEE=x.dtype == torch.float32,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_block_k(group),
        )  # fmt: skip
        return y

    def fp8_scaled_mm(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        """Per-row FP8 W times x quantized per token to E4M3, on FP8 products."""
        xf = x.float()
        x_scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        codes = (xf / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        weight = w.q.view(torch.float8_e4m3fn)
        w_scale = w.scales.float().view(1, -1)
        out_dtype = x.dtype if x.dtype != torch.float32 else torch.bfloat16
        y = torch._scaled_mm(
            codes, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype
        )
        return y.to(x.dtype)

    def w8a8(self, x: torch.Tensor, w: QuantizedWeight, row_scales: torch.Tensor) -> torch.Tensor:
        """A W8A8 weight (``fmt.act_int8``): x's per-token int8 codes times W's codes as
        integers, then the token's scale and the row's."""
        codes, scales = quantize_activations_int8(x)
        if w.shape[0] % 8:  # cuBLASLt's int8 GEMM takes multiples of 8 (the inputs are: groups)
            return (self.dequant_matmul(codes, w) * scales).to(x.dtype)
        m = codes.shape[0]
        rows = max(m, INT_MM_MIN_ROWS)
        a = torch.zeros(rows, codes.shape[1], device=x.device, dtype=torch.int8)
        a[:m] = codes.to(torch.int8)
        products = torch._int_mm(a, w.q.view(torch.int8).t())[:m]
        return (products.float() * scales * row_scales.to(x.device).view(1, -1)).to(x.dtype)


def load_triton_quant_kernel(device: torch.device) -> TritonQuantLinearKernel | None:
    """The kernel for ``device`` (a CUDA card), or None without Triton (quantized layers then
    dequantize their weights on each call). FP8 goes to ``torch._scaled_mm`` on NVIDIA cards of
    compute capability 9.0 and up (Hopper: row-wise scales), to the Triton GEMM elsewhere."""
    if triton is None:
        return None
    fp8 = (
        device.type == "cuda"
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )
    return TritonQuantLinearKernel(device.type, fp8_products=fp8)
