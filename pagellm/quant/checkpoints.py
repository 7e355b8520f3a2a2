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
  int32 [out, in / 8], values + 8, ``weight_scale`` [out, groups]), ``int-quantized`` /
  ``naive-quantized`` int8 (``weight`` int8, ``weight_scale`` [out, 1 or groups]) and
  ``float-quantized`` FP8 (``weight`` float8_e4m3fn, ``weight_scale`` [out, 1] for strategy
  ``channel``, one value for ``tensor``); symmetric weights. W8A8 with dynamic per-token int8
  activations and per-channel (or per-tensor) weights is computed as such: the format's
  ``act_int8``. Other schemes that quantize activations to 8 bits (FP8, FP8_DYNAMIC, static or
  grouped int8) are served weight-only: the weights as stored, activations in the model dtype
  (static ``input_scale`` / ``input_zero_point`` are not read), which is what vLLM does on GPUs
  without FP8 compute.

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

from pagellm.quant.formats import QuantFormat, QuantizedWeight, fp8_nan_codes, pack_nibbles

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Output column c of a group of eight sits in nibble AWQ_REVERSE_ORDER[c] of its word."""

_PARTS = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "ct-pack": ("weight_packed", "weight_scale"),
    "ct-pack-zp": ("weight_packed", "weight_scale", "weight_zero_point"),
    "ct-int": ("weight", "weight_scale"),
    "ct-fp8": ("weight", "weight_scale"),
}
_OPTIONAL = {"ct-pack": ("weight_shape",), "ct-pack-zp": ("weight_shape",)}


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
    per_tensor: bool = False
    """One scale for a whole tensor (compressed-tensors strategy ``tensor``): every row gets it."""
    dropped: tuple[str, ...] = ()
    """Parameters of a quantized layer that are not read (static activation scales)."""
    weight_only_note: str | None = None
    """Said once at start-up when the checkpoint quantizes activations and pagellm does not."""
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
    _check_kv_cache_scheme(qc.get("kv_cache_scheme"))
    scheme = next(iter(groups.values()))
    weights = scheme.get("weights") or {}
    if scheme.get("output_activations"):
        raise ValueError("compressed-tensors with quantized output activations is not supported")
    symmetric = bool(weights.get("symmetric", True))
    bits = int(weights.get("num_bits", 8))
    strategy = str(weights.get("strategy") or "channel").lower()
    group = int(weights.get("group_size") or 0) if strategy == "group" else 0
    activations = scheme.get("input_activations") or None
    act_bits = _activation_bits(activations)
    layout_name = str(scheme.get("format") or qc.get("format") or "").lower()
    kind = str(weights.get("type") or "int").lower()
    if kind == "float":
        if not symmetric:
            raise ValueError("compressed-tensors: asymmetric float weights are not supported")
        fmt, layout = _ct_float(layout_name, bits, group)
    elif kind == "int":
        fmt, layout = _ct_int(
            layout_name, bits, group, act_bits, _int8_tokens(activations), symmetric
        )
    else:
        raise ValueError(f"compressed-tensors {kind!r} weights are not supported")
    if strategy not in ("group", "channel", "tensor"):
        raise ValueError(
            f"compressed-tensors weight strategy {strategy!r} is not supported (FP8_BLOCK's "
            "'block' included); channel, tensor and group scales are"
        )
    return CheckpointQuant(
        "compressed-tensors",
        layout,
        fmt,
        tuple(qc.get("ignore") or ()),
        per_tensor=strategy == "tensor",
        dropped=_ACTIVATION_PARAMS if activations else (),
        weight_only_note=_weight_only_note(fmt, activations),
    )


def _check_kv_cache_scheme(scheme: dict[str, Any] | None) -> None:
    """An FP8 ``kv_cache_scheme`` is read: its per-layer ``self_attn.k_scale`` / ``v_scale`` go
    to the model, which an FP8 KV cache (``--kv-cache-dtype fp8``) uses. Others are refused."""
    if not scheme:
        return
    if str(scheme.get("type", "float")).lower() != "float" or int(scheme.get("num_bits", 8)) != 8:
        raise ValueError(
            "compressed-tensors kv_cache_scheme other than FP8 (8-bit float) is not supported"
        )


_ACTIVATION_PARAMS = ("input_scale", "input_zero_point")
"""A quantized layer's static activation parameters: not read (served weight-only)."""


def _activation_bits(activations: dict[str, Any] | None) -> int:
    """16 for unquantized activations; 8-bit ones are served weight-only, others refused."""
    if not activations:
        return 16
    bits = int(activations.get("num_bits", 8))
    if bits != 8:
        raise ValueError(
            f"compressed-tensors with {bits}-bit activations is not supported (8-bit activations "
            "are served weight-only)"
        )
    return bits


def _ct_float(layout_name: str, bits: int, group: int) -> tuple[QuantFormat, str]:
    if bits != 8:
        raise ValueError(
            f"compressed-tensors {bits}-bit float weights (NVFP4, MXFP4) are not supported; "
            "8-bit (FP8 E4M3) are"
        )
    if layout_name not in ("float-quantized", "naive-quantized"):
        raise ValueError(
            f"compressed-tensors format {layout_name!r} with fp8 weights is not supported"
        )
    fmt = QuantFormat("compressed-tensors:fp8", bits=8, group_size=group, kind="fp8_e4m3")
    return fmt, "ct-fp8"


def _int8_tokens(activations: dict[str, Any] | None) -> bool:
    """Whether activations are int8, dynamic, symmetric, per token: computed as such."""
    if not activations:
        return False
    return (
        str(activations.get("type") or "int").lower() == "int"
        and int(activations.get("num_bits", 8)) == 8
        and bool(activations.get("dynamic"))
        and activations.get("symmetric", True)
        and str(activations.get("strategy") or "token").lower() == "token"
    )


def _ct_int(
    layout_name: str, bits: int, group: int, act_bits: int, int8_tokens: bool, symmetric: bool
) -> tuple[QuantFormat, str]:
    name = f"compressed-tensors:w{bits}a{act_bits}"
    if not symmetric:  # llm-compressor's AWQ: 4-bit codes and a zero point per group
        if layout_name == "pack-quantized" and bits == 4:
            return QuantFormat(f"{name}-asym", bits=4, group_size=group, zero=None), "ct-pack-zp"
        raise ValueError(
            "compressed-tensors: asymmetric weights are supported as 4-bit pack-quantized only"
        )
    if layout_name == "pack-quantized" and bits in (4, 8):
        zero = 8 if bits == 4 else 0
        return QuantFormat(name, bits=bits, group_size=group, zero=zero), "ct-pack"
    if layout_name in ("int-quantized", "naive-quantized") and bits == 8:
        act_int8 = int8_tokens and group == 0  # per-channel weights: one scale a row
        fmt = QuantFormat(name, bits=8, group_size=group, zero=0, act_int8=act_int8)
        return fmt, "ct-int"
    raise ValueError(
        f"compressed-tensors format {layout_name!r} with {bits}-bit weights is not supported"
    )


def _weight_only_note(fmt: QuantFormat, activations: dict[str, Any] | None) -> str | None:
    if not activations or fmt.act_int8:
        return None
    how = "dynamic" if activations.get("dynamic") else "static"
    kind = "fp8" if str(activations.get("type") or "int").lower() == "float" else "int8"
    return (
        f"{fmt.name} weights are served weight-only (W{fmt.bits}A16): the checkpoint's {how} "
        f"{kind} activation quantization is not applied, activations stay in --dtype"
    )


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
        if suffix in plan.dropped and plan.quantizes(f"{module}.weight"):
            continue
        if suffix == "weight" and "weight" not in parts and plan.quantizes(name):
            raise ValueError(
                f"{name} is stored unquantized, but the checkpoint's quantization_config says "
                f"{plan.method}"
            )
        if suffix in parts + optional and plan.quantizes(f"{module}.weight"):
            got = pending.setdefault(module, {})
            got[suffix] = tensor
            if all(p in got for p in parts) and (not optional or all(o in got for o in optional)):
                yield f"{module}.weight", _convert(module, pending.pop(module), plan)
            continue
        yield name, tensor
    for module, got in pending.items():
        if all(p in got for p in parts):  # optional parts absent
            yield f"{module}.weight", _convert(module, got, plan)
        else:
            missing = [p for p in parts if p not in got]
            raise ValueError(f"checkpoint is missing {module}.{missing[0]}")


def _convert(module: str, t: dict[str, torch.Tensor], plan: CheckpointQuant) -> QuantizedWeight:
    try:
        return _convert_parts(t, plan)
    except ValueError as exc:
        raise ValueError(f"{module}: {exc}") from exc


def _convert_parts(t: dict[str, torch.Tensor], plan: CheckpointQuant) -> QuantizedWeight:
    if plan.layout == "awq":
        return awq_weight(t["qweight"], t["qzeros"], t["scales"], plan.fmt)
    if plan.layout == "gptq":
        return gptq_weight(
            t["qweight"], t["qzeros"], t["scales"], t["g_idx"], plan.fmt, plan.gptq_zero_offset
        )
    if plan.layout == "ct-pack":
        return ct_packed_weight(t["weight_packed"], t["weight_scale"], plan.fmt, plan.per_tensor)
    if plan.layout == "ct-pack-zp":
        return ct_packed_weight(
            t["weight_packed"], t["weight_scale"], plan.fmt, zero_point=t["weight_zero_point"]
        )
    if plan.layout == "ct-fp8":
        return ct_fp8_weight(t["weight"], t["weight_scale"], plan.fmt, plan.per_tensor)
    return ct_int_weight(t["weight"], t["weight_scale"], plan.fmt, plan.per_tensor)


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
    packed: torch.Tensor,
    scale: torch.Tensor,
    fmt: QuantFormat,
    per_tensor: bool = False,
    zero_point: torch.Tensor | None = None,
) -> QuantizedWeight:
    """compressed-tensors pack-quantized: int32 [out, in * bits / 32], each value stored plus
    2 ** (bits - 1) (4 bits: the +8 is our zero point; 8 bits: back to signed). Asymmetric
    4-bit weights add ``weight_zero_point`` int32 [out / 8, groups]: signed zero points plus 8,
    eight outputs to a word along dim 0; ``w = (q - zp) * scale`` is then our nibble minus
    the stored zero (both carry the +8)."""
    q = unpack_int32(packed, fmt.bits)
    if fmt.bits == 8:
        stored = (q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    else:
        stored = pack_nibbles(q)
    scales = _ct_scales(scale, fmt, *q.shape, per_tensor)
    zeros = None
    if zero_point is not None:
        zeros = unpack_int32(zero_point.t().contiguous(), 4).t()[: q.shape[0]].contiguous()
        _check_groups(fmt, q.shape[1], zeros.shape[1], "compressed-tensors")
    return QuantizedWeight(fmt, stored.contiguous(), scales, zeros)


def ct_int_weight(
    weight: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat, per_tensor: bool = False
) -> QuantizedWeight:
    if weight.dtype != torch.int8:
        raise ValueError(f"{fmt.name}: the weight is {weight.dtype}, not int8")
    q = weight.contiguous().view(torch.uint8)
    return QuantizedWeight(fmt, q, _ct_scales(scale, fmt, *q.shape, per_tensor))


def ct_fp8_weight(
    weight: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat, per_tensor: bool = False
) -> QuantizedWeight:
    """compressed-tensors float-quantized: ``weight`` float8_e4m3fn [out, in], kept as its
    bytes; ``weight_scale`` [out, 1] (channel), [out, groups] or one value (tensor)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{fmt.name}: the weight is {weight.dtype}, not float8_e4m3fn")
    q = weight.contiguous().view(torch.uint8)
    nans = fp8_nan_codes(q)
    if nans:
        raise ValueError(f"{fmt.name}: {nans} weights are NaN")
    return QuantizedWeight(fmt, q, _ct_scales(scale, fmt, *q.shape, per_tensor))


def _ct_scales(
    scale: torch.Tensor, fmt: QuantFormat, rows: int, in_features: int, per_tensor: bool
) -> torch.Tensor:
    """``weight_scale`` as fp32 [out, groups]; a per-tensor scale is given to every row."""
    if per_tensor:
        if scale.numel() != 1:
            raise ValueError(f"a per-tensor weight_scale has {scale.numel()} values")
        return scale.to(torch.float32).reshape(1, 1).expand(rows, 1).contiguous()
    scales = scale.to(torch.float32).reshape(scale.shape[0] if scale.dim() else 1, -1)
    if scales.shape[0] != rows:
        raise ValueError(f"weight_scale has {scales.shape[0]} rows for {rows} outputs")
    _check_groups(fmt, in_features, scales.shape[1], fmt.name)
    return scales.contiguous()


def _check_groups(fmt: QuantFormat, in_features: int, groups: int, what: str) -> None:
    if fmt.groups(in_features) != groups:
        raise ValueError(
            f"{what}: {groups} groups of scales for {in_features} inputs (group size "
            f"{fmt.group(in_features)})"
        )
