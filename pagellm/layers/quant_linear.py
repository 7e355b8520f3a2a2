"""Layers over weights kept quantized (see ``pagellm.quant.formats``).

``QuantPart`` holds one stored weight as buffers (scales as raw bits in an integer tensor, so
that casting the model to its dtype leaves them alone). ``QuantLinear`` is a linear layer made
of row parts: a fused projection (Q/K/V, gate/up) whose checkpoint shards come in different
forms (a GGUF may store V in Q8_0 and Q in Q4_0, or one of them unquantized) keeps each part
in its own form and concatenates the outputs; parts in the same form are one part.
``QuantEmbedding`` looks rows up in a quantized table (a tied LM head shares its part).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.quant_int8 import row_scales
from pagellm.layers.linear import Linear
from pagellm.quant.formats import QuantFormat, QuantizedWeight, quantize_activations_int8
from pagellm.quant.online import quantize

_BITS_DTYPE = {torch.float16: torch.int16, torch.float32: torch.int32}


class QuantPart(nn.Module):
    """One [out_features, in_features] weight stored in ``fmt``."""

    def __init__(self, in_features: int, out_features: int, fmt: QuantFormat) -> None:
        super().__init__()
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        groups = fmt.groups(in_features)
        bits_dtype = _BITS_DTYPE[fmt.scale_dtype]
        self.register_buffer(
            "q", torch.empty(out_features, fmt.row_bytes(in_features), dtype=torch.uint8)
        )
        self.register_buffer("scale_bits", torch.empty(out_features, groups, dtype=bits_dtype))
        offsets = torch.empty(out_features, groups, dtype=bits_dtype) if fmt.offsets else None
        self.register_buffer("offset_bits", offsets)
        zeros = torch.empty(out_features, groups, dtype=torch.uint8) if fmt.zero is None else None
        self.register_buffer("zeros", zeros)
        perm = torch.empty(in_features, dtype=torch.int64) if fmt.act_order else None
        self.register_buffer("perm", perm)
        self.kernel = None
        self._views: QuantizedWeight | None = None  # stored() for the step path, built once
        self._row_scales: torch.Tensor | None = None  # W8A8: the scales as float32, once

    def _apply(self, fn, recurse=True):  # to(), to_empty(): new buffers, new views
        self._views = None
        self._row_scales = None
        return super()._apply(fn, recurse)

    def stored(self) -> QuantizedWeight:
        """The buffers as a ``QuantizedWeight`` (views, no copies) in their stored input order
        (an act-order part permutes x instead)."""
        dtype = self.fmt.scale_dtype
        offsets = self.offset_bits.view(dtype) if self.offset_bits is not None else None
        return QuantizedWeight(self.fmt, self.q, self.scale_bits.view(dtype), self.zeros, offsets)

    def load(self, row0: int, weight: torch.Tensor | QuantizedWeight) -> None:
        """Rows [row0, row0 + len) from a checkpoint weight: copied when it is stored in this
        part's form, quantized here when it is a float tensor."""
        if isinstance(weight, torch.Tensor):
            weight = quantize(weight, self.fmt)
        elif weight.fmt != self.fmt:
            raise ValueError(f"a {weight.fmt.name} weight cannot load into a {self.fmt.name} layer")
        rows = weight.shape[0]
        if weight.shape[1] != self.in_features or row0 + rows > self.out_features:
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(weight.shape)} vs rows {row0}+ of "
                f"({self.out_features}, {self.in_features})"
            )
        mine = self.stored()
        for dst, src in zip(mine._tensors(), weight._tensors(), strict=True):
            if dst is not None:
                dst.narrow(0, row0, rows).copy_(src)
        if self.perm is not None:
            order = weight.perm if weight.perm is not None else torch.arange(self.in_features)
            if row0 > 0 and not torch.equal(order, self.perm):
                raise ValueError(f"{self.fmt.name}: fused shards with different g_idx orders")
            self.perm.copy_(order)

    def zero_rows(self, start: int) -> None:
        """Rows from ``start`` dequantize to zero (the padding of a vocabulary shard)."""
        self.scale_bits[start:].zero_()
        if self.offset_bits is not None:
            self.offset_bits[start:].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._views is None:
            self._views = self.stored()
        w = self._views
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.fmt.act_int8:
            return self._w8a8(x, w)
        if self.kernel is not None and self.kernel.applies(x):
            return self.kernel(x, w)
        # no kernel (no compiler, no Triton, groups it does not take): the reference
        # dequantization each call
        return F.linear(x, w.dequantize().to(device=x.device, dtype=x.dtype))

    def _w8a8(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        """Activations quantized per token to int8, multiplied with the int8 codes."""
        if self.kernel is not None and self.kernel.applies(x):
            return self.kernel.w8a8(x, w, self.row_scales())
        codes, scales = quantize_activations_int8(x)
        weight = w.dequantize().to(device=x.device)
        return (F.linear(codes.to(x.device), weight) * scales.to(x.device)).to(x.dtype)

    def row_scales(self) -> torch.Tensor:
        """A W8A8 weight's scales as float32 [out] (kept: the int8 kernel reads them)."""
        if self._row_scales is None:
            self._row_scales = row_scales(self.stored())
        return self._row_scales

    def extra_repr(self) -> str:
        act = ", int8 activations" if self.fmt.act_int8 else ""
        return f"{self.in_features}, {self.out_features}, {self.fmt.name}{act}"


class QuantLinear(nn.Module):
    """A linear layer over row parts, some kept quantized; ``shard_sizes`` are the rows of the
    checkpoint tensors fused into it (one entry for an unfused layer)."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: Sequence[int],
        formats: Sequence[QuantFormat | None],
        bias: bool,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(shard_sizes)
        parts: list[nn.Module] = []
        self.shard_place: list[tuple[int, int]] = []  # shard -> (part index, first row in it)
        run_fmt: object = object()
        for size, fmt in zip(shard_sizes, formats, strict=True):
            if parts and fmt == run_fmt and not (fmt is not None and fmt.act_order):
                self.shard_place.append((len(parts) - 1, parts[-1].out_features))
                parts[-1] = _grown(parts[-1], in_features, size)
            else:
                self.shard_place.append((len(parts), 0))
                parts.append(_part(in_features, size, fmt))
            run_fmt = fmt
        self.parts = nn.ModuleList(parts)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    @classmethod
    def over(cls, part: QuantPart) -> QuantLinear:
        """A linear layer sharing ``part`` (a tied LM head over a quantized embedding)."""
        layer = cls(part.in_features, [part.out_features], [None], bias=False)
        layer.parts = nn.ModuleList([part])
        return layer

    def quantize_shard(
        self, shard: int | None, weight: torch.Tensor
    ) -> torch.Tensor | QuantizedWeight:
        """A whole float checkpoint tensor in the form of the part it loads into (quantized
        before it is split over ranks, so that every rank has the scales one process has)."""
        part = self.parts[self.shard_place[shard or 0][0]]
        return quantize(weight, part.fmt) if isinstance(part, QuantPart) else weight

    def load_shard(
        self, shard: int | None, weight: torch.Tensor | QuantizedWeight, rows: int | None = None
    ) -> None:
        index, row0 = self.shard_place[shard or 0]
        part = self.parts[index]
        if isinstance(part, QuantPart):
            part.load(row0, weight)
            return
        if not isinstance(weight, torch.Tensor):
            weight = weight.dequantize()
        dst = part.weight.data.narrow(0, row0, weight.shape[0] if rows is None else rows)
        if tuple(dst.shape) != tuple(weight.shape):
            raise ValueError(
                f"shape mismatch: checkpoint {tuple(weight.shape)} vs {tuple(dst.shape)}"
            )
        dst.copy_(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [part(x) for part in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias


def _part(in_features: int, rows: int, fmt: QuantFormat | None) -> nn.Module:
    return (
        Linear(in_features, rows, bias=False) if fmt is None else QuantPart(in_features, rows, fmt)
    )


def _grown(part: nn.Module, in_features: int, extra: int) -> nn.Module:
    fmt = part.fmt if isinstance(part, QuantPart) else None
    return _part(in_features, part.out_features + extra, fmt)


class QuantEmbedding(nn.Module):
    """Rows of a quantized table (this rank's vocabulary rows), dequantized when looked up."""

    def __init__(self, rows: int, hidden_size: int, fmt: QuantFormat, start: int, comm) -> None:
        super().__init__()
        self.part = QuantPart(hidden_size, rows, fmt)
        self.start, self.count, self.comm = start, rows, comm
        self.out_dtype = torch.float32

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.count)
        ids = local.masked_fill(outside, 0) if self.comm.tp is not None else input_ids
        w = self.part.stored()
        picked = QuantizedWeight(
            w.fmt, *(t.index_select(0, ids) if t is not None else None for t in w._tensors())
        )
        out = picked.dequantize().to(self.out_dtype)
        if self.comm.tp is None:
            return out
        return self.comm.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def use_quant_kernel(model: nn.Module, kernel) -> int:
    """Give every quantized part of ``model`` the kernel of its device (the C++ one on a CPU,
    the Triton one on a GPU) where it supports the part's groups; returns how many parts."""
    if kernel is None:
        return 0
    parts = {id(m): m for m in model.modules() if isinstance(m, QuantPart)}
    for part in parts.values():
        if kernel.supports(part.fmt.group(part.in_features)):
            part.kernel = kernel
    return sum(1 for p in parts.values() if p.kernel is not None)


def quant_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The stored tensors of every quantized part of ``model`` (for memory accounting)."""
    return [b for m in model.modules() if isinstance(m, QuantPart) for b in m.buffers()]
