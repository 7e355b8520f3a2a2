"""Quantized Hugging Face checkpoints (a ``quantization_config`` in config.json), read into the
stored form of ``formats`` without dequantizing:

- **AWQ** (AutoAWQ's GEMM layout): ``qweight`` int32 [in, out / 8] (eight 4-bit outputs per
  word, in AWQ's interleaved order), ``qzeros`` int32 [groups, out / 8] (same packing),
  ``scales`` fp16 [groups, out]; ``w = (q - zero) * scale``.
- **GPTQ** (AutoGPTQ / GPTQModel, 4-bit): ``qweight`` int32 [in / 8, out] (eight inputs per word,
  in order), ``qzeros`` int32 [groups, out / 8], ``scales`` fp16 [groups, out], ``g_idx`` [in];
  the format stores each zero minus one (``checkpoint_format: gptq``; ``gptq_v2`` stores it as
  is). With ``desc_act`` the groups are not contiguous in the inputs: the inputs are permuted so
  that they are, and the layer permutes its activations the same way.
- **compressed-tensors** (what llm-compressor writes): ``pack-quantized`` int4 (``weight_packed``
  int32 [out, in / 8], values + 8, ``weight_scale`` [out, groups]) and ``int-quantized`` /
  ``naive-quantized`` int8 (``weight`` int8, ``weight_scale`` [out, 1 or groups]); symmetric,
  weights only (W4A16, W8A16).

``checkpoint_plan`` reads the config into a ``CheckpointQuant`` (the form of each layer, or a
ValueError naming what is not supported); ``assemble`` turns the checkpoint's stream of tensors
into one ``QuantizedWeight`` per quantized layer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.quant.formats import QuantFormat, QuantizedWeight, pack_nibbles

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Output column c of a group of eight sits in nibble AWQ_REVERSE_ORDER[c] of its word."""

_PARTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "ct-pack": ("weight_packed", "weight_scale"),
    "ct-int": ("weight", "weight_scale"),
}
_OPTIONAL = {"ct-pack": ("weight_shape",)}


@dataclass(frozen=True)
class CheckpointQuant:
    """A quantized checkpoint's settings: the layout and the form its layers are kept in."""

    method: str
    """awq, gptq or compressed-tensors."""
    layout: str
    """Which tensors make a layer: awq, gptq, ct-pack, ct-int."""
    fmt: QuantFormat
    ignore: tuple[str, ...] = ()
    """Layer names (or ``re:`` patterns) left unquantized (compressed-tensors)."""
    gptq_zero_offset: int = 0
    """1 for GPTQ's v1 format (zeros stored minus one)."""
    act_order: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def quantizes(self, hf_name: str) -> bool:
        """Whether the checkpoint stores ``hf_name`` (``....weight``) quantized."""
        if not hf_name.startswith("model.layers.") or not hf_name.endswith("_proj.weight"):
            return False
        module = hf_name.removesuffix(".weight")
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return False
            elif module == pattern or module.endswith(f".{pattern}"):
                return False
        return True


def checkpoint_plan(qc: dict[str, Any]) -> CheckpointQuant:
    """The ``quantization_config`` of config.json as a ``CheckpointQuant``."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ValueError(f"checkpoint quantization {method!r} is not supported")


def _bits4(qc: dict[str, Any], method: str) -> int:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits}-bit weights are not supported (4 is)")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if group <= 0:
        raise ValueError(f"{method} without groups (group_size {group}) is not supported")
    return group


def _awq(qc: dict[str, Any]) -> CheckpointQuant:
    group = _bits4(qc, "awq")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"awq version {version!r} is not supported (AutoAWQ's gemm layout is)")
    if qc.get("zero_point") is False:
        raise ValueError("awq without zero points is not supported")
    fmt = QuantFormat("awq", bits=4, group_size=group, scale_dtype=torch.float16, zero=None)
    return CheckpointQuant("awq", "awq", fmt, tuple(qc.get("modules_to_not_convert") or ()))


def _gptq(qc: dict[str, Any]) -> CheckpointQuant:
    group = _bits4(qc, "gptq")
    checkpoint_format = str(qc.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq checkpoint_format {checkpoint_format!r} is not supported")
    act_order = bool(qc.get("desc_act", False))
    fmt = QuantFormat(
        "gptq", bits=4, group_size=group, scale_dtype=torch.float16, zero=None, act_order=act_order
    )
    offset = 1 if checkpoint_format == "gptq" else 0
    return CheckpointQuant("gptq", "gptq", fmt, (), offset, act_order)


def _compressed_tensors(qc: dict[str, Any]) -> CheckpointQuant:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups is not supported")
    scheme = next(iter(groups.values()))
    weights = scheme.get("weights") or {}
    if scheme.get("input_activations"):
        raise ValueError(
            "compressed-tensors with quantized activations (W8A8, FP8) is not supported yet; "
            "weight-only schemes (W4A16, W8A16) are"
        )
    if weights.get("type", "int") != "int" or not weights.get("symmetric", True):
        raise ValueError("compressed-tensors: only symmetric integer weights are supported")
    bits = int(weights.get("num_bits", 8))
    strategy = weights.get("strategy", "channel")
    group = int(weights.get("group_size") or 0) if strategy == "group" else 0
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported")
    layout_name = str(qc.get("format", "")).lower()
    if layout_name == "pack-quantized" and bits in (4, 8):
        zero = 8 if bits == 4 else 0
        fmt = QuantFormat(f"compressed-tensors:w{bits}a16", bits=bits, group_size=group, zero=zero)
        layout = "ct-pack"
    elif layout_name in ("int-quantized", "naive-quantized") and bits == 8:
        fmt = QuantFormat("compressed-tensors:w8a16", bits=8, group_size=group, zero=0)
        layout = "ct-int"
    else:
        raise ValueError(
            f"compressed-tensors format {layout_name!r} with {bits}-bit weights is not supported"
        )
    return CheckpointQuant("compressed-tensors", layout, fmt, tuple(qc.get("ignore") or ()))


def assemble(
    tensors: Iterable[tuple[str, torch.Tensor]], plan: CheckpointQuant
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's tensors with each quantized layer's parts joined into one
    ``QuantizedWeight`` named ``<layer>.weight``; the other tensors as they come."""
    parts = _PARTS[plan.layout]
    optional = _OPTIONAL.get(plan.layout, ())
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and "weight" not in parts and plan.quantizes(name):
            raise ValueError(
                f"{name} is stored unquantized, but the checkpoint's quantization_config says "
                f"{plan.method}"
            )
        if suffix in parts + optional and plan.quantizes(f"{module}.weight"):
            got = pending.setdefault(module, {})
            got[suffix] = tensor
            if all(p in got for p in parts) and (not optional or all(o in got for o in optional)):
                yield f"{module}.weight", _convert(pending.pop(module), plan)
            continue
        yield name, tensor
    for module, got in pending.items():
        if all(p in got for p in parts):  # optional parts absent
            yield f"{module}.weight", _convert(got, plan)
        else:
            missing = [p for p in parts if p not in got]
            raise ValueError(f"checkpoint is missing {module}.{missing[0]}")


def _convert(t: dict[str, torch.Tensor], plan: CheckpointQuant) -> QuantizedWeight:
    if plan.layout == "awq":
        return awq_weight(t["qweight"], t["qzeros"], t["scales"], plan.fmt)
    if plan.layout == "gptq":
        return gptq_weight(
            t["qweight"], t["qzeros"], t["scales"], t["g_idx"], plan.fmt, plan.gptq_zero_offset
        )
    if plan.layout == "ct-pack":
        return ct_packed_weight(t["weight_packed"], t["weight_scale"], plan.fmt)
    return ct_int_weight(t["weight"], t["weight_scale"], plan.fmt)


def unpack_int32(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [rows, cols] -> the 32 / bits values of each word (bits * i first), unsigned,
    [rows, cols * 32 / bits]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(words.shape[0], -1).to(torch.uint8)


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ-packed int32 [rows, cols / 8] -> values [rows, cols] in column order."""
    values = unpack_int32(words)
    rows, cols = values.shape
    order = torch.tensor(AWQ_REVERSE_ORDER)
    return values.reshape(rows, cols // 8, 8)[:, :, order].reshape(rows, cols)


def awq_weight(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat
) -> QuantizedWeight:
    q = _awq_columns(qweight).t()  # [out, in]
    zeros = _awq_columns(qzeros).t().contiguous()  # [out, groups]
    _check_groups(fmt, q.shape[1], zeros.shape[1], "awq")
    return QuantizedWeight(fmt, pack_nibbles(q), scales.to(torch.float16).t().contiguous(), zeros)


def gptq_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    fmt: QuantFormat,
    zero_offset: int,
) -> QuantizedWeight:
    q = unpack_int32(qweight.t()).contiguous()  # [out, in]: eight inputs per word, in order
    zeros = (unpack_int32(qzeros).to(torch.int32) + zero_offset).t()  # [out, groups]
    if (zeros > 15).any():
        raise ValueError("gptq: a zero point is outside 0..15 (wrong checkpoint_format?)")
    in_features = q.shape[1]
    _check_groups(fmt, in_features, zeros.shape[1], "gptq")
    g_idx = g_idx.to(torch.int64)
    contiguous = torch.arange(in_features) // fmt.group_size
    perm = None
    if not torch.equal(g_idx, contiguous):
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], contiguous):
            raise ValueError("gptq: g_idx does not give every group group_size inputs")
        q = q[:, perm]
    return QuantizedWeight(
        fmt,
        pack_nibbles(q),
        scales.to(torch.float16).t().contiguous(),
        zeros.to(torch.uint8).contiguous(),
        None,
        perm,
    )


def ct_packed_weight(
    packed: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat
) -> QuantizedWeight:
    """compressed-tensors pack-quantized: int32 [out, in * bits / 32], each value stored plus
    2 ** (bits - 1) (4 bits: the +8 is our zero point; 8 bits: back to signed)."""
    q = unpack_int32(packed, fmt.bits)
    if fmt.bits == 8:
        stored = (q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    else:
        stored = pack_nibbles(q)
    return QuantizedWeight(fmt, stored.contiguous(), _ct_scales(scale, fmt, q.shape[1]))


def ct_int_weight(weight: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat) -> QuantizedWeight:
    q = weight.to(torch.int8).contiguous().view(torch.uint8)
    return QuantizedWeight(fmt, q, _ct_scales(scale, fmt, q.shape[1]))


def _ct_scales(scale: torch.Tensor, fmt: QuantFormat, in_features: int) -> torch.Tensor:
    scales = scale.to(torch.float32).reshape(scale.shape[0], -1).contiguous()
    _check_groups(fmt, in_features, scales.shape[1], fmt.name)
    return scales


def _check_groups(fmt: QuantFormat, in_features: int, groups: int, what: str) -> None:
    if fmt.groups(in_features) != groups:
        raise ValueError(
            f"{what}: {groups} groups of scales for {in_features} inputs (group size "
            f"{fmt.group(in_features)})"
        )
