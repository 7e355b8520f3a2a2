"""Linear layers: reduced-precision weights pre-packed for oneDNN once, after loading, and
float32 decode steps on the few-rows kernel.

``F.linear`` on bf16 CPU tensors re-lays the weight out for oneDNN on every call; packing it once
(the path torch's own inductor takes when freezing a model) saves that work each step: ~6% on
this model's GEMMs. In float32 a step of at most 32 tokens goes to ``SkinnyLinearKernel``,
which streams each weight on every core (torch's GEMM reads it on one: 1.6-5x slower here);
larger steps keep ``F.linear``. On a CPU with AMX a bf16 step of at most 32 tokens goes to
``Bf16TilesKernel``, which reads the weight as stored straight into tiles (oneDNN's packed
GEMM reaches 11-20 GB/s of weight on so few rows; the tiles 19-26). With AVX-512 BF16 and no AMX
(Zen 4 / Zen 5) a bf16 step of at most 3 tokens goes to the few-rows kernel's bf16 dot products
(oneDNN read the weights at ~19 GB/s there, the kernel ~27-29). On a CPU without bf16 products (AVX2) oneDNN emulates bf16
GEMMs, 3-5x slower than fp32 ones: there bf16 weights are not packed, at most 32 tokens go to
the same few-rows kernel (bf16 read, fp32 arithmetic) and more to torch's fp32 GEMM over
cache-sized panels of the weight widened to fp32. In batch-invariant mode every step goes to
``InvariantLinearKernel`` over a weight packed for it (the plain weight is then released).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.kernels.bf16_tiles import Bf16TilesKernel
from pagellm.kernels.quant_linear import PANEL_BYTES, by_panels
from pagellm.kernels.skinny_linear import SkinnyLinearKernel


class Linear(nn.Linear):
    packed: torch.Tensor | None = None
    skinny: SkinnyLinearKernel | None = None
    tiles: Bf16TilesKernel | None = None
    """Few-rows bf16 steps on AMX (``use_tile_linears``)."""
    fp32_panels: bool = False
    """bf16 on a CPU without bf16 products: steps the few-rows kernel does not take run as fp32
    GEMMs over panels of the weight widened to fp32."""
    invariant: tuple[Any, Any] | None = None
    """(kernel, its packed weight) in batch-invariant mode (``pagellm.runner.batch_invariant``)."""

    def use_invariant(self, kernel: Any, release_weight: bool) -> None:
        """Compute with a batch-invariant kernel from now on (``kernel.pack`` lays the weight
        out for it); ``release_weight`` frees the plain weight (not when another module shares
        it, as a tied embedding)."""
        packed = kernel.pack(self.weight, self.bias)
        self.invariant = (kernel, packed)
        self.register_buffer("invariant_weight", packed.data, persistent=False)
        self.packed = self.skinny = self.tiles = None
        if release_weight:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def pack(self, batch_hint: int = 256) -> bool:
        """Pack the weight for oneDNN; returns False where packing does not apply."""
        if (
            self.weight.dtype != torch.bfloat16
            or self.weight.device.type != "cpu"
            or not torch.backends.mkldnn.is_available()
        ):
            return False
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
        except (RuntimeError, AttributeError):
            self.packed = None
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant is not None:
            kernel, packed = self.invariant
            return kernel(x, packed)
        if self.skinny is not None and self.skinny.applies(x, self.weight):
            return self.skinny(x, self.weight, self.bias)
        if self.tiles is not None and self.tiles.applies(x, self.weight):
            return self.tiles(x, self.weight, self.bias)
        if self.fp32_panels:
            return self._fp32_panels(x)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _fp32_panels(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.weight.shape
        rows = max(1, min(n, PANEL_BYTES // (4 * k)))
        x2 = x.detach().reshape(-1, k).float()
        weight = self.weight.detach()
        out = by_panels(x2, n, rows, lambda row0, count: weight[row0 : row0 + count].float())
        if self.bias is not None:
            out += self.bias.detach().float()
        return out.to(x.dtype).reshape(*x.shape[:-1], n)


def pack_linears(model: nn.Module) -> int:
    """Pack every ``Linear`` of ``model``; returns how many were packed."""
    return sum(1 for m in model.modules() if isinstance(m, Linear) and m.pack())


def use_skinny_linears(
    model: nn.Module,
    kernel: SkinnyLinearKernel | None,
    native_bf16: bool = True,
    bf16_dot: bool = False,
) -> int:
    """Give every float32 ``Linear`` of ``model`` the few-rows kernel, and every bf16 one too
    where the CPU has no bf16 products (``native_bf16`` False: those drop their oneDNN packing
    and take fp32 panels for larger steps) or where ``bf16_dot`` (the caller has no AMX tiles
    for them) and the kernel has AVX-512 BF16 dot products (those keep their packing for larger
    steps); returns how many."""
    if kernel is None:
        return 0
    count = 0
    for m in model.modules():
        if not isinstance(m, Linear) or not m.weight.is_cpu:
            continue
        if m.weight.dtype == torch.bfloat16 and not native_bf16:
            m.packed = None
            m.fp32_panels = True
        elif m.weight.dtype == torch.bfloat16:
            if not (bf16_dot and kernel.bf16_dot_rows):
                continue
        elif m.weight.dtype != torch.float32:
            continue
        m.skinny = kernel
        count += 1
    return count


def use_tile_linears(model: nn.Module, kernel: Bf16TilesKernel | None) -> int:
    """Give every bf16 CPU ``Linear`` of ``model`` the AMX few-rows kernel (None: this CPU has
    no AMX or no compiler); returns how many."""
    if kernel is None:
        return 0
    count = 0
    for m in model.modules():
        if isinstance(m, Linear) and m.weight.is_cpu and m.weight.dtype == torch.bfloat16:
            m.tiles = kernel
            count += 1
    return count
