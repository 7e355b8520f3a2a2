"""Python face of the quantized linear kernels: integer and FP8 E4M3 codes in the stored form of
``pagellm.quant.formats``, decoded in registers for a few rows (quant_linear.cpp; up to
ten bf16 rows against 4-bit codes and 8-bit ones in Q8_0's form by integer dot products where
the CPU has AVX-512 VNNI, x quantized to int8 per weight group, quant_row.h) and, for bf16 activations on a CPU with
native bf16 products, decoded to bf16 once per call and multiplied on AMX tiles or AVX-512 BF16
dot products for more (quant_tiles.cpp)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pagellm.kernels.cpu_build import build_library
from pagellm.kernels.packed import BoundCall
from pagellm.kernels.quant_int8 import QuantInt8Kernel, load_quant_int8_kernel
from pagellm.quant.formats import QuantizedWeight, quantize_activations_int8

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
TILE_ROWS: dict[int, tuple[int, int | None, bool]] = {
    # AMX: tiles from 5 rows (30 layers of SmolLM2's shapes against the register path, which
    # decodes into an fp32 buffer above 4 rows: 1.17-1.86x at 5-7 rows for int4, Q4_1 and
    # int8; at 3-4 rows 0.82-0.91x for int4 and int8, 1.04-1.14x for Q4_1), bf16 panels for
    # torch's (oneDNN's) GEMM above 256 rows (2048 x 576 x 3072: 2.2 ms that way, 5.1 ms on
    # the tiles, 2.1 ms dense bf16)
    2: (5, 256, True),
    # AVX-512 BF16 (no AMX), measured on a 2-core Zen 4 EPYC over one layer's four SmolLM2
    # shapes (int8, FP8, int4): the dot products beat the register path from 5-6 rows (8 rows:
    # 0.36-0.42 against 0.63-0.77 ms), bf16 panels into torch's GEMM at every size (256 rows:
    # 4.3-4.4 against 4.7-4.9 ms; 2048: 34-35 against 35-37; dense bf16 4.7 and 36) and the
    # float32 panels 2.3-2.5x (an earlier choice measured on a Xeon with oneDNN held to
    # AVX512_CORE_BF16 sent 256 rows there: the formats ran at 0.42-0.49x bf16's throughput)
    1: (5, None, False),
    0: (1 << 30, 0, False),
}
"""path -> (tiles_min_rows, tiles_max_rows or None for no limit, bf16 panels above that). 4-bit
weights of a supported group take quant_row.h's int8 products first, up to the rows its rule
gives (``QuantLinearKernel.int8_row_range``: on AMX 1.06-1.21x the tiles at 5-6 rows, 0.79-0.89x
at 8; on AVX-512 BF16 alone 4-bit codes to 10 rows, see quant_row.h)."""
PANEL_BYTES = 8 << 20
"""The large-batch path decodes this much of a weight (fp32) at a time: a panel that stays in
cache while torch's GEMM reads it."""


class QuantTilesKernel:
    """``x @ W^T`` for bf16 x of any number of rows, W decoded to bf16 one 16-feature block at a
    time and multiplied on AMX tiles (path 2) or AVX-512 BF16 dot products (path 1)."""

    def __init__(self, lib: ctypes.CDLL, path: int | None = None) -> None:
        ptr, i = ctypes.c_void_p, ctypes.c_int
        self._lib = lib
        self._linear = lib.quant_tiles_linear
        self._linear.restype = i
        self._linear.argtypes = [i, ptr, ptr, ptr, ptr, ptr, i, i, i, i, i, ptr, i, i, i, i]
        best = int(lib.quant_tiles_best_path())
        if path is not None and not 1 <= path <= best:
            raise ValueError(f"quant tiles path {path} is not available here (best: {best})")
        self.path = best if path is None else path
        self._dequant = lib.quant_tiles_dequantize
        self._dequant.restype = i
        self._dequant.argtypes = [ptr, ptr, ptr, ptr, i, i, i, i, i, i, i, i, ptr, i]
        self._panel = torch.empty(0, dtype=torch.bfloat16)

    def dequantize(self, w: QuantizedWeight, row0: int, rows: int) -> torch.Tensor:
        """Rows [row0, row0 + rows) of ``w`` in bf16, the reference dequantization rounded
        (every format, scales included), in the shared panel buffer (valid until the next
        call)."""
        k = w.shape[1]
        if self._panel.numel() < rows * k:
            self._panel = torch.empty(rows * k, dtype=torch.bfloat16)
        out = self._panel[: rows * k].view(rows, k)
        rc = self._dequant(
            *_layout(w), w.fmt.group(k), row0, rows, k, out.data_ptr(), torch.get_num_threads()
        )
        if rc != 0:
            raise RuntimeError(f"quant_tiles_dequantize failed with code {rc} ({w.fmt.name})")
        return out

    def panels(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        """``x @ W^T`` by torch's bf16 GEMM over cache-sized panels of W decoded as above."""
        n, k = w.shape
        rows = max(16, min(n, PANEL_BYTES // (2 * k)) // 16 * 16)
        return by_panels(x, n, rows, lambda row0, count: self.dequantize(w, row0, count))

    @staticmethod
    def supports(w: QuantizedWeight) -> bool:
        k = w.shape[1]
        return k % 32 == 0 and w.fmt.group(k) % 16 == 0

    @staticmethod
    def scales_sums(w: QuantizedWeight) -> bool:
        """8-bit codes with one scale a row and no zero point or offset (per-channel int8, FP8):
        the tiles multiply the codes (exact in bf16) and scale each sum, so the weights are not
        rounded; other formats' decoded weights are the reference rounded to bf16."""
        fmt = w.fmt
        return (
            fmt.bits == 8
            and fmt.group(w.shape[1]) == w.shape[1]
            and fmt.zero == 0
            and (not fmt.offsets)
        )

    def __call__(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        rc = self.bind(x, w, out)()
        if rc != 0:
            raise RuntimeError(f"quant_tiles_linear failed with code {rc} ({w.fmt.name})")
        return out

    def bind(self, x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor) -> Callable[[], int]:
        """A call computing ``out = x @ W^T`` with these very buffers; it returns the kernel's
        status (0: done)."""
        m, k = x.shape
        assert x.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
        assert x.is_contiguous() and out.is_contiguous() and out.shape == (m, w.shape[0])
        args = (self.path, x.data_ptr(), *_layout(w), w.fmt.group(k), out.data_ptr(), m,
                w.shape[0], k, torch.get_num_threads())  # fmt: skip
        return BoundCall(self._lib, self._linear, args)


class QuantLinearKernel:
    """``x @ W^T`` with W kept quantized: decoded in registers for at most ``max_rows`` rows of
    x, decoded a cache-sized panel at a time into fp32 for torch's GEMM above that. Where the
    CPU has bf16 products, bf16 x of ``tiles_min_rows`` to ``tiles_max_rows`` rows goes to the
    tile kernel, and more rows to its bf16 panels: those paths multiply W rounded to bf16, as a
    bf16 model of the dequantized weights would."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        tiles: QuantTilesKernel | None = None,
        int8: QuantInt8Kernel | None = None,
    ) -> None:
        ptr, i = ctypes.c_void_p, ctypes.c_int
        self._lib = lib
        self._linear = lib.quant_linear
        self._linear.restype = i
        self._linear.argtypes = [i, ptr, ptr, ptr, ptr, ptr, i, i, i, i, i, ptr, ptr, i, i, i, i]
        self._dequant = lib.quant_dequantize
        self._dequant.restype = i
        self._dequant.argtypes = [ptr, ptr, ptr, ptr, i, i, i, i, i, i, i, i, ptr, i]
        self.max_rows = int(lib.quant_linear_max_rows())
        self.int8_rows = int(lib.quant_linear_int8_rows())
        """The most rows of bf16 x that can go to the weights as int8 (0: none here)."""
        self._int8_applies = lib.quant_linear_int8_applies
        self._int8_applies.restype = i
        self._int8_applies.argtypes = [i, i, i, i, ctypes.POINTER(i)]
        self._int8_forms: dict[tuple[int, bool, int, bool], tuple[int, int]] = {}
        """The C rule's answer (the fewest and the most rows it takes, (0, 0): none) per
        (bits, fp8, group, symmetric), asked once each."""
        self._panel = torch.empty(0)
        self.tiles = tiles
        self.int8 = int8
        # the rows each route is for, measured per path (see TILE_ROWS)
        self.tiles_min_rows, self.tiles_max_rows, self.bf16_panels = TILE_ROWS[
            tiles.path if tiles is not None else 0
        ]

    @staticmethod
    def supports(group: int) -> bool:
        """Whether a group of this many inputs is whole vectors at every width it builds for
        (8 or 16 lanes); other layers keep the reference path."""
        return group % 16 == 0

    def applies(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype in _DTYPE_CODES and x.device.type == "cpu"

    def w8a8(self, x: torch.Tensor, w: QuantizedWeight, row_scales: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` of a W8A8 weight (``fmt.act_int8``): x quantized per token to int8 and
        multiplied as integers (AMX-INT8 tiles, or AVX2 dot products for a few rows); elsewhere
        the same codes (exact in float32) times the weight by the weight-only paths, then the
        token's scale."""
        x = x.contiguous()
        path = self.int8.path(x, w) if self.int8 is not None else None
        if path is not None:
            return self.int8(x, w, row_scales, path)
        codes, scales = (
            self.int8.quantize(x) if self.int8 is not None else quantize_activations_int8(x)
        )
        return (self(codes.float(), w) * scales).to(x.dtype)

    def quantizes_x(self, x: torch.Tensor, w: QuantizedWeight) -> bool:
        """Whether this call multiplies bf16 x quantized to int8 (symmetric, per weight group,
        max|x| / 127, rounded to nearest even) by W's codes as integers: a decode step's few
        rows against 4-bit codes (1-6 rows; 1-10 where the tiles are AVX-512 BF16 dot
        products), as vLLM's CPU AWQ / GPTQ path (IPEX's WoqLowpMode.INT8) and llama.cpp's Q8_0
        activations do, or against 8-bit codes in Q8_0's form (symmetric, groups of 32; 2-6
        rows), as llama.cpp's Q8_0 x Q8_0 product."""
        if x.dtype != torch.bfloat16:
            return False
        fewest, most = self.int8_row_range(w)
        return 0 < fewest <= x.shape[0] <= most

    def int8_row_range(self, w: QuantizedWeight) -> tuple[int, int]:
        """The fewest and the most rows of bf16 x that ``w`` multiplies as int8 ((0, 0):
        none), the C rule's answer for its form, asked once a form."""
        fmt = w.fmt
        symmetric = fmt.zero == 0 and not fmt.offsets
        form = (fmt.bits, bool(fmt.fp8), fmt.group(w.shape[1]), symmetric)
        rows = self._int8_forms.get(form)
        if rows is None:
            most = ctypes.c_int(0)
            fewest = int(self._int8_applies(*form, ctypes.byref(most)))
            rows = self._int8_forms[form] = (fewest, most.value if fewest else 0)
        return rows

    def rounds_weights_to_bf16(self, x: torch.Tensor, w: QuantizedWeight) -> bool:
        """Whether this call multiplies x by W rounded to bf16 (else by W exactly)."""
        route = self.bf16_route(x, w)
        return route == "panels" or (route == "tiles" and not self.tiles.scales_sums(w))

    def bf16_route(self, x: torch.Tensor, w: QuantizedWeight) -> str | None:
        """``"tiles"`` or ``"panels"`` where this call multiplies W rounded to bf16 (bf16 x on a
        CPU with bf16 products), None where it takes the exact-weight paths."""
        if self.tiles is None or x.dtype != torch.bfloat16 or not self.tiles.supports(w):
            return None
        if self.quantizes_x(x, w):
            return None
        m = x.shape[0]
        if m < self.tiles_min_rows:
            return None
        if self.tiles_max_rows is None or m <= self.tiles_max_rows:
            return "tiles"
        return "panels" if self.bf16_panels else None

    def __call__(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        x = x.contiguous()
        route = self.bf16_route(x, w)
        if route == "tiles":
            return self.tiles(x, w)
        if route == "panels":
            return self.tiles.panels(x, w)
        if x.shape[0] <= self.max_rows:
            return self._skinny(x, w)
        return self._panels(x, w)

    def _skinny(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        m, k = x.shape
        n = w.shape[0]
        out = torch.empty(m, n, dtype=x.dtype)
        fmt = w.fmt
        rc = self._linear(
            _DTYPE_CODES[x.dtype],
            x.data_ptr(),
            *_layout(w),
            fmt.group(k),
            None,
            out.data_ptr(),
            m,
            n,
            k,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"quant_linear failed with code {rc} ({fmt.name}, {n}x{k})")
        return out

    def bind(self, x: torch.Tensor, w: QuantizedWeight, out: torch.Tensor) -> Callable[[], int]:
        """A call computing ``out = x @ W^T`` with these very buffers (captured decode steps:
        the arguments are converted once) on the route ``__call__`` takes, which for the
        register path needs at most ``max_rows`` rows; it returns the kernel's status (0:
        done)."""
        route = self.bf16_route(x, w)
        if route == "tiles":
            return self.tiles.bind(x, w, out)
        if route == "panels":
            tiles = self.tiles

            def panels() -> int:
                out.copy_(tiles.panels(x, w))
                return 0

            return panels
        m, k = x.shape
        assert x.is_contiguous() and out.is_contiguous() and m <= self.max_rows
        assert out.shape == (m, w.shape[0]) and out.dtype == x.dtype
        args = (_DTYPE_CODES[x.dtype], x.data_ptr(), *_layout(w), w.fmt.group(k), None,
                out.data_ptr(), m, w.shape[0], k, torch.get_num_threads())  # fmt: skip
        return BoundCall(self._lib, self._linear, args)

    def _panels(self, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
        n, k = w.shape
        # the exact weights in an fp32 GEMM whatever x is (bf16 x on a CPU with bf16 products
        # takes the tiles' bf16 panels instead, see bf16_route)
        rows = max(1, min(n, PANEL_BYTES // (4 * k)))
        out = by_panels(x.float(), n, rows, lambda row0, count: self.dequantize(w, row0, count))
        return out.to(x.dtype)

    def dequantize(self, w: QuantizedWeight, row0: int, rows: int) -> torch.Tensor:
        """Rows [row0, row0 + rows) of ``w`` in fp32, in the shared panel buffer (valid until
        the next call)."""
        k = w.shape[1]
        if self._panel.numel() < rows * k:
            self._panel = torch.empty(rows * k, dtype=torch.float32)
        out = self._panel[: rows * k].view(rows, k)
        fmt = w.fmt
        rc = self._dequant(
            *_layout(w),
            fmt.group(k),
            row0,
            rows,
            k,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"quant_dequantize failed with code {rc} ({fmt.name})")
        return out


def by_panels(
    x: torch.Tensor, n: int, rows: int, panel: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """``x @ W^T`` (W: n rows) ``rows`` rows of W at a time; ``panel(row0, count)`` gives those
    rows in x's dtype (a shared buffer, used before the next call)."""
    if rows >= n:
        return torch.nn.functional.linear(x, panel(0, n))
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for row0 in range(0, n, rows):
        count = min(rows, n - row0)
        torch.matmul(x, panel(row0, count).t(), out=out[:, row0 : row0 + count])
    return out


def _layout(w: QuantizedWeight) -> tuple:
    """q, scales, offsets, zeros, scale_half, zero_const, bits, fp8: the C layout's arguments."""
    for t in (w.q, w.scales, w.zeros, w.offsets):
        if t is not None and not t.is_contiguous():
            raise ValueError("quantized weights must be contiguous")
    return (
        w.q.data_ptr(),
        w.scales.data_ptr(),
        w.offsets.data_ptr() if w.offsets is not None else None,
        w.zeros.data_ptr() if w.zeros is not None else None,
        int(w.scales.dtype == torch.float16),
        w.fmt.zero or 0,
        w.fmt.bits,
        int(w.fmt.fp8),
    )


def load_quant_linear_kernel(
    vector_width: int | None = None,
    extra_flags: tuple[str, ...] = (),
    tiles: bool = True,
    tiles_path: int | None = None,
) -> QuantLinearKernel | None:
    """The kernel built for this CPU (``vector_width`` 8 or 16 forces the lanes, ``extra_flags``
    e.g. ``-mno-avx2`` the portable decoder, ``tiles=False`` no bf16 tile path, ``tiles_path``
    1 the AVX-512 BF16 one on an AMX machine: tests, benchmarks)."""
    flags: tuple[str, ...] = ("-fopenmp", *extra_flags)
    if vector_width is not None:
        flags += (f"-DPAGELLM_VEC_WIDTH={vector_width}", "-Wno-psabi")
    lib = build_library("quant_linear.cpp", flags)
    if lib is None:
        return None
    tile_kernel = load_quant_tiles_kernel(tiles_path) if tiles else None
    return QuantLinearKernel(lib, tile_kernel, load_quant_int8_kernel())


def load_quant_tiles_kernel(path: int | None = None) -> QuantTilesKernel | None:
    """The bf16 tile kernel, or None where this CPU (or compiler) has no bf16 products."""
    # no contraction: a decoded weight is the reference dequantization's own two roundings
    lib = build_library(
        "quant_tiles.cpp", ("-fopenmp", "-ffp-contract=off", "-fno-associative-math")
    )
    if lib is None or int(lib.quant_tiles_best_path()) == 0:
        return None
    return QuantTilesKernel(lib, path)
