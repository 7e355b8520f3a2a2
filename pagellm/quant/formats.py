"""The one stored form of a quantized weight, and its reference dequantization.

Every format pagellm keeps quantized is held as codes in groups along the input dimension::

    w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g] + offset[n, g]      g = k // group_size

``q`` is signed 8-bit, or unsigned 4-bit packed two to a byte in blocks of 32 inputs (GGUF's
order: byte j of a block holds input j in its low nibble, input j + 16 in its high one).
``zero`` is one byte per group or a constant; ``offset`` is optional. GGUF Q8_0 is (8 bits,
zero 0), Q4_0 (4 bits, zero 8), Q4_1 (4 bits, zero 0, offset = the block minimum); AWQ/GPTQ-style
asymmetric int4 has per-group zeros. The reference dequantization multiplies, then adds: the
order the formats' own reference code uses, so it is bit-exact with theirs.

FP8 weights (``kind="fp8_e4m3"``) are the same form with float codes: each byte is an OCP
E4M3 ``float8_e4m3fn`` (sign, 4 exponent bits of bias 7, 3 mantissa bits; largest 448; 0x7F and
0xFF are NaN, which no loader accepts), zero 0, no offset: ``w = float(q) * scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """How one weight (or one shard of a fused weight) is stored."""

    name: str
    """What it came from, for logs and errors: ``gguf:Q4_1``, ``int8``, ``int4``."""
    bits: int
    group_size: int
    """Inputs per group; 0 = one group per output row (per-channel scales)."""
    scale_dtype: torch.dtype = torch.float32
    """float16 (GGUF, AWQ, GPTQ store scales so) or float32."""
    zero: int | None = 0
    """Constant zero point, or None for one zero per group (stored)."""
    offsets: bool = False
    act_order: bool = False
    """The inputs are stored permuted (GPTQ ``desc_act``): the layer permutes x to match."""
    kind: str = "int"
    """What a code is: ``int`` (an integer), or ``fp8_e4m3`` (an E4M3 float byte; 8 bits,
    zero 0, no offsets)."""
    act_int8: bool = False
    """Activations are quantized per token to int8 (dynamic, symmetric: see
    ``quantize_activations_int8``) and multiplied with the codes as integers, compressed-tensors'
    W8A8: 8-bit integer codes, zero 0, no offsets, one scale per row."""

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"{self.name}: {self.bits}-bit weights are not supported")
        if self.scale_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"{self.name}: scales must be float16 or float32")
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: element kind {self.kind!r} is not one of {KINDS}")
        if self.fp8 and (self.bits != 8 or self.zero != 0 or self.offsets or self.act_order):
            raise ValueError(f"{self.name}: fp8 weights are 8 bits, zero 0, with no offsets")
        if self.act_int8 and (
            self.bits != 8 or self.kind != "int" or self.zero != 0 or self.offsets
            or self.group_size != 0 or self.act_order
        ):  # fmt: skip
            raise ValueError(
                f"{self.name}: int8 activations need 8-bit integer weights with one scale per "
                "row, zero 0 and no offsets"
            )

    @property
    def fp8(self) -> bool:
        return self.kind == "fp8_e4m3"

    def groups(self, in_features: int) -> int:
        group = self.group(in_features)
        if in_features % group:
            raise ValueError(
                f"{self.name}: {in_features} inputs are not a whole number of groups of {group}"
            )
        return in_features // group

    def group(self, in_features: int) -> int:
        return self.group_size or in_features

    def row_bytes(self, in_features: int) -> int:
        return in_features * self.bits // 8


@dataclass(slots=True)
class QuantizedWeight:
    """A quantized [out_features, in_features] weight in ``fmt``'s stored form."""

    fmt: QuantFormat
    q: torch.Tensor
    """uint8 [out, in * bits / 8]."""
    scales: torch.Tensor
    """[out, groups] in ``fmt.scale_dtype``."""
    zeros: torch.Tensor | None = None
    """uint8 [out, groups] when ``fmt.zero`` is None."""
    offsets: torch.Tensor | None = None
    """[out, groups] like ``scales`` when ``fmt.offsets``."""
    perm: torch.Tensor | None = None
    """int64 [in]: stored input j is checkpoint input perm[j] (None: in order)."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * 8 // self.fmt.bits

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Rows (dim 0) or whole groups of inputs (dim 1) of this weight, as ``Tensor.narrow``."""
        if dim == 0:
            rows = (_narrow(t, 0, start, length) for t in self._tensors())
            return QuantizedWeight(self.fmt, *rows, self.perm)
        if self.perm is not None:
            raise ValueError(
                f"{self.fmt.name}: a weight whose inputs are stored permuted (desc_act) cannot "
                "be split over its inputs (tensor parallelism of o_proj/down_proj)"
            )
        if self.fmt.bits == 4 and (start % NIBBLE_BLOCK or length % NIBBLE_BLOCK):
            raise ValueError(
                f"{self.fmt.name}: inputs [{start}, {start + length}) cut a block of "
                f"{NIBBLE_BLOCK} packed 4-bit inputs (a shard must hold whole blocks)"
            )
        if self.fmt.group_size == 0:  # one scale per row holds for any of its inputs
            per_byte = 8 // self.fmt.bits
            q = self.q.narrow(1, start // per_byte, length // per_byte)
            return QuantizedWeight(self.fmt, q, self.scales, self.zeros, self.offsets)
        group = self.fmt.group(self.shape[1])
        if start % group or length % group:
            raise ValueError(
                f"{self.fmt.name}: inputs [{start}, {start + length}) of a weight quantized in "
                f"groups of {group} cannot be split off (a shard must hold whole groups)"
            )
        per_byte = 8 // self.fmt.bits
        q = self.q.narrow(1, start // per_byte, length // per_byte)
        rest = (_narrow(t, 1, start // group, length // group) for t in self._tensors()[1:])
        return QuantizedWeight(self.fmt, q, *rest)

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return self.q, self.scales, self.zeros, self.offsets

    def dequantize(self) -> torch.Tensor:
        """The float32 weight in the checkpoint's input order, by the reference formula
        (multiply, then add the offset)."""
        w = self.dequantize_stored()
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def dequantize_stored(self) -> torch.Tensor:
        """The float32 weight in its stored input order."""
        out_features, in_features = self.shape
        group = self.fmt.group(in_features)
        if self.fmt.fp8:
            codes = self.q.view(torch.float8_e4m3fn).float()
            return codes * self.scales.float().repeat_interleave(group, dim=1)
        values = unpack(self.q, self.fmt.bits).to(torch.int32)
        zeros = self.zeros if self.zeros is not None else None
        if zeros is not None:
            values = values - zeros.to(torch.int32).repeat_interleave(group, dim=1)
        elif self.fmt.zero:
            values = values - self.fmt.zero
        w = values.to(torch.float32) * self.scales.float().repeat_interleave(group, dim=1)
        if self.offsets is not None:
            w = w + self.offsets.float().repeat_interleave(group, dim=1)
        return w


KINDS = ("int", "fp8_e4m3")
FP8_MAX = 448.0
"""The largest finite E4M3 (``float8_e4m3fn``) value."""


def quantize_activations_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., k] per token (row) to int8 codes, held as float32, and float32 scales [..., 1]:
    ``s = max|x| / 127`` (1 for an all-zero row), codes ``round-half-even(x / s)`` clamped to
    [-128, 127] (compressed-tensors' dynamic per-token scheme, as vLLM quantizes W8A8 inputs)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(xf / s).clamp(-128, 127), s


def fp8_nan_codes(q: torch.Tensor) -> int:
    """How many bytes of ``q`` are E4M3 NaNs (0x7F, 0xFF): loaders refuse weights with any (the
    kernel decodes them as +-480)."""
    return int(((q & 0x7F) == 0x7F).sum())


def _narrow(t: torch.Tensor | None, dim: int, start: int, length: int) -> torch.Tensor | None:
    return None if t is None else t.narrow(dim, start, length)


NIBBLE_BLOCK = 32
"""4-bit rows are packed in blocks of this many inputs (16 bytes)."""


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[rows, k] integers in 0..15 -> uint8 [rows, k / 2] in blocks of 32 inputs: byte j of a
    block holds input j (low nibble) and j + 16 (high nibble)."""
    rows, k = values.shape
    if k % NIBBLE_BLOCK:
        raise ValueError(f"4-bit weights need a multiple of {NIBBLE_BLOCK} inputs, not {k}")
    v = values.to(torch.uint8).reshape(rows, k // NIBBLE_BLOCK, 2, NIBBLE_BLOCK // 2)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(rows, k // 2).contiguous()


def unpack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The stored integers: int8 for 8 bits, 0..15 (as uint8) for 4 bits, [rows, k]."""
    if bits == 8:
        return q.view(torch.int8)
    rows, half = q.shape
    blocks = q.reshape(rows, half * 2 // NIBBLE_BLOCK, NIBBLE_BLOCK // 2)
    return torch.stack((blocks & 15, blocks >> 4), dim=2).reshape(rows, half * 2)
