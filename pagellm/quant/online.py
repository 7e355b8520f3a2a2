"""Quantize a float weight at load (``--quantization int8|int4|fp8``, and any dense tensor that
meets a quantized layer): symmetric per-channel int8 (W8A16), asymmetric int4 in groups (W4A16,
an integer zero per group, as AWQ and GPTQ store it), per-channel FP8 E4M3 (W8A16 with float
codes: vLLM's online ``fp8``, its absmax onto 448)."""

from __future__ import annotations

import torch

from pagellm.quant.formats import FP8_MAX, QuantFormat, QuantizedWeight, pack_nibbles

INT4_GROUPS = (128, 64, 32)
"""Group sizes tried for online int4, largest first: the first that divides the inputs."""


def int8_format() -> QuantFormat:
    return QuantFormat("int8", bits=8, group_size=0)


def fp8_format() -> QuantFormat:
    return QuantFormat("fp8", bits=8, group_size=0, kind="fp8_e4m3")


def int4_format(in_features: int) -> QuantFormat:
    for group in INT4_GROUPS:
        if in_features % group == 0:
            return QuantFormat("int4", bits=4, group_size=group, zero=None)
    raise ValueError(
        f"int4: {in_features} inputs are not a multiple of any group size in {INT4_GROUPS}"
    )


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> QuantizedWeight:
    """``weight`` [out, in] in ``fmt`` (symmetric when ``fmt.zero`` is a constant, else with a
    zero per group); round to nearest."""
    if fmt.fp8:
        return _quantize_fp8(weight, fmt)
    if fmt.zero is None and fmt.bits != 4:
        raise ValueError(f"{fmt.name}: zeros per group are supported for 4-bit weights only")
    w = weight.detach().to(torch.float32)
    out_features, in_features = w.shape
    group = fmt.group(in_features)
    groups = fmt.groups(in_features)
    g = w.reshape(out_features, groups, group)
    top = 2 ** (fmt.bits - 1) - 1 if fmt.bits == 8 else 15
    offsets = None
    if fmt.offsets:  # GGUF Q4_1's form: [min, max] of each group onto 0..15, offset = min
        if fmt.bits != 4 or fmt.zero != 0:
            raise ValueError(f"{fmt.name}: offsets are supported for 4-bit, zero-0 weights only")
        low, high = g.amin(dim=-1), g.amax(dim=-1)
        scales = ((high - low) / top).clamp(min=1e-10).to(fmt.scale_dtype)
        offsets = low.to(fmt.scale_dtype)
        q = torch.round((g - offsets.float().unsqueeze(-1)) / scales.float().unsqueeze(-1))
        q = q.clamp(0, top).reshape(out_features, in_features)
        zeros_u8 = None
    elif fmt.zero is None:  # asymmetric: [min, max] of each group (with 0 in it) onto 0..top
        low = g.amin(dim=-1).clamp(max=0)
        high = g.amax(dim=-1).clamp(min=0)
        scales = ((high - low) / top).clamp(min=1e-10).to(fmt.scale_dtype)
        s = scales.float()
        zeros = torch.round(-low / s).clamp(0, top)
        q = torch.round(g / s.unsqueeze(-1)) + zeros.unsqueeze(-1)
        q = q.clamp(0, top).reshape(out_features, in_features)
        zeros_u8 = zeros.to(torch.uint8)
    else:  # symmetric about fmt.zero: |w| <= half the range
        if fmt.bits == 4 and fmt.zero != 8:
            raise ValueError(f"{fmt.name}: symmetric 4-bit weights have zero point 8")
        half = top if fmt.bits == 8 else 7
        scales = (g.abs().amax(dim=-1) / half).clamp(min=1e-10).to(fmt.scale_dtype)
        s = scales.float()
        q = torch.round(g / s.unsqueeze(-1)).clamp(-half, half) + fmt.zero
        q = q.reshape(out_features, in_features)
        zeros_u8 = None
    if fmt.bits == 8:
        stored = q.to(torch.int8).view(torch.uint8)
    else:
        stored = pack_nibbles(q.to(torch.uint8))
    if offsets is not None:
        offsets = offsets.contiguous()
    return QuantizedWeight(fmt, stored.contiguous(), scales.contiguous(), zeros_u8, offsets)


def _quantize_fp8(weight: torch.Tensor, fmt: QuantFormat) -> QuantizedWeight:
    """Each group's absmax onto E4M3's 448 (round to nearest even; never a NaN code)."""
    w = weight.detach().to(torch.float32)
    out_features, in_features = w.shape
    g = w.reshape(out_features, fmt.groups(in_features), fmt.group(in_features))
    scales = (g.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-10).to(fmt.scale_dtype)
    codes = (g / scales.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    stored = codes.reshape(out_features, in_features).view(torch.uint8).contiguous()
    return QuantizedWeight(fmt, stored, scales.contiguous())
