"""``pagellm bench quant-kernels``: pagellm's quantized linear kernels against torch's own
weight-only CPU ops on the same weights, shape by shape and row count by row count, in one run.

torch ships ``_weight_int8pack_mm`` (per-channel int8 weights, x in its float dtype: gpt-fast's
int8 weight-only op) and ``_weight_int4pack_mm_for_cpu`` (int4 in groups, tinygemm's
``(q - 8) * scale + zero`` form: what torchao's CPU int4 weight-only tensor calls). For each
format, shape and number of rows of bf16 x, every contender multiplies x by ``--layers``
distinct copies of the weight (so weights come from memory, as in a model's step), the
contenders in turn for ``--rounds`` rounds after one round of warm-up; the table gives medians,
and each contender's time as a ratio of pagellm's.

Contenders:
  pagellm  ``QuantLinearKernel`` as a captured decode step runs it (bound once to x's and the
           output's buffers, so no Python between calls), on the route it takes for that many
           rows (register path, int8 activations, AMX or AVX-512 BF16 tiles, bf16 panels).
  pagellm_eager  the same kernel called from Python each time (its route chosen and its output
           allocated per call), as torch's ops are: the fair match for them at few rows, where
           a call's fixed cost is a fair share of its time.
  torch    the same codes in torch's form: int8 codes with their scales in bf16 (the op wants
           x's dtype); int4 codes repacked by ``_convert_weight_to_int4pack_for_cpu`` with bf16
           scales and zeros ``(8 - z) * scale``.
  bf16     torch's linear (oneDNN) on the dequantized weight rounded to bf16, for scale.

Each contender's largest error against the fp32 product of x and the dequantized weight (as a
fraction of that product's largest value) is reported too, so a conversion gone wrong shows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from pagellm.bench import report as rep
from pagellm.quant.formats import QuantizedWeight, unpack
from pagellm.quant.online import int4_format, int8_format, quantize

DEFAULT_SHAPES = "960x576,576x576,3072x576,576x1536"
"""SmolLM2-135M's linear layers as out x in: q/k/v together, o, gate/up together, down."""

CONTENDERS = ("pagellm", "pagellm_eager", "torch", "bf16")
RATIOS = CONTENDERS[1:]  # printed as their time over pagellm's

Call = Callable[[torch.Tensor], torch.Tensor]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "quant-kernels", help="quantized linear kernels against torch's weight-only ops"
    )
    p.add_argument("--formats", default="int8,int4", help="int8 (per channel), int4 (groups)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="OUTxIN,... weight shapes")
    p.add_argument("--rows", default="1,8,32,256", help="rows of x (tokens in the step)")
    p.add_argument("--layers", type=int, default=30, help="distinct weights of each shape")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pagellm.kernels.quant_linear import load_quant_linear_kernel

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in formats if f not in ("int8", "int4")]
    if unknown:
        raise SystemExit(f"--formats: unknown {unknown}; choose from int8, int4")
    shapes = [_shape(s) for s in args.shapes.split(",") if s.strip()]
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if args.layers < 1 or args.rounds < 1 or not rows or min(rows) < 1:
        raise SystemExit("--layers, --rounds and every --rows must be at least 1")
    kernel = load_quant_linear_kernel()
    if kernel is None:
        raise SystemExit("pagellm's quantized kernels did not build here (no C++ compiler?)")
    results: dict[str, Any] = {
        "benchmark": "quant_kernels",
        "environment": rep.environment(),
        "git_sha": rep.git_sha(),
        "layers": args.layers,
        "rounds": args.rounds,
        "cases": [],
    }
    for fmt in formats:
        for out_f, in_f in shapes:
            weights = [_quantized(fmt, _weight(out_f, in_f, seed)) for seed in range(args.layers)]
            calls = {
                name: [_contender(name, fmt, q, kernel) for q in weights] for name in CONTENDERS
            }
            for m in rows:
                x = torch.randn(m, in_f, generator=torch.Generator().manual_seed(m)).bfloat16()
                case = {"format": fmt, "shape": [out_f, in_f], "rows": m}
                case["ms"] = _time(calls, x, args.rounds)
                case["max_rel_err"] = _errors(calls, x, weights[0])
                results["cases"].append(case)
                print(f"{fmt} {out_f}x{in_f} @{m}: done", flush=True)
    print(render(results))
    if args.output_json:
        rep.write_report(args.output_json, results)
    return 0


def _shape(text: str) -> tuple[int, int]:
    try:
        out_f, in_f = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not OUTxIN") from None
    if out_f < 1 or in_f % 32:
        raise SystemExit(f"--shapes: {text!r}: inputs must be a multiple of 32, outputs >= 1")
    return out_f, in_f


def _weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(out_f, in_f, generator=gen) * 0.02


def _quantized(fmt: str, w: torch.Tensor) -> QuantizedWeight:
    return quantize(w, int8_format() if fmt == "int8" else int4_format(w.shape[1]))


def _contender(name: str, fmt: str, q: QuantizedWeight, kernel) -> Call:
    if name == "pagellm":
        return _bound(kernel, q)
    if name == "pagellm_eager":
        return lambda x: kernel(x, q)
    if name == "bf16":
        dense = q.dequantize().bfloat16()
        return lambda x: torch.nn.functional.linear(x, dense)
    return _torch_int8(q) if fmt == "int8" else _torch_int4(q)


def _bound(kernel, q: QuantizedWeight) -> Call:
    """The kernel as a captured decode step runs it: its call bound once to x's and the
    output's buffers (the route chosen then), so no Python runs between kernels."""
    bound: dict[tuple, tuple[torch.Tensor, torch.Tensor, Callable[[], int]]] = {}

    def call(x: torch.Tensor) -> torch.Tensor:
        key = (x.data_ptr(), tuple(x.shape))  # x is kept below: its address stays its own
        if key not in bound:
            out = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype)
            bound[key] = (x, out, kernel.bind(x, q, out))
        _, out, run = bound[key]
        if run() != 0:
            raise RuntimeError(f"quantized kernel failed ({q.fmt.name}, {q.shape})")
        return out

    return call


def _torch_int8(q: QuantizedWeight) -> Call:
    codes = unpack(q.q, 8).contiguous()
    scales = q.scales.float().reshape(-1).bfloat16()
    return lambda x: torch._weight_int8pack_mm(x, codes, scales)


def _torch_int4(q: QuantizedWeight) -> Call:
    """tinygemm's form of an asymmetric int4 weight: w = (c - z) * s = (c - 8) * s + (8 - z) * s."""
    out_f, in_f = q.shape
    group = q.fmt.group(in_f)
    codes = unpack(q.q, 4).to(torch.int32).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    s = q.scales.float()
    zeros = (8 - q.zeros.float()) * s
    scale_zero = torch.stack([s, zeros], dim=-1).transpose(0, 1).contiguous().bfloat16()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_zero)


def _time(calls: dict[str, list[Call]], x: torch.Tensor, rounds: int) -> dict[str, float]:
    """Median ms for one pass of each contender over its layers, the contenders in turn."""
    seen: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds + 1):
        for name, layer_calls in calls.items():
            start = time.perf_counter()
            for call in layer_calls:
                call(x)
            if r:  # round 0 warms up
                seen[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(ms) for name, ms in seen.items()}


def _errors(calls: dict[str, list[Call]], x: torch.Tensor, q: QuantizedWeight) -> dict:
    """Each contender's largest error on the first layer (``q``), as a fraction of the
    reference's largest value (fp32 x times the dequantized weight)."""
    ref = x.float() @ q.dequantize().t()
    top = ref.abs().max().item() or 1.0
    return {n: (c[0](x).float() - ref).abs().max().item() / top for n, c in calls.items()}


def render(results: dict[str, Any]) -> str:
    headers = ["format", "shape", "rows", "pagellm ms", "eager ms", "torch ms", "bf16 ms",
               "max err p/e/t/b"]  # fmt: skip
    lines = [rep.cpu_line(results["environment"]),
             f"{results['layers']} weights of each shape, medians of {results['rounds']} rounds"]  # fmt: skip
    table = []
    for case in results["cases"]:
        ms, err = case["ms"], case["max_rel_err"]
        table.append([
            case["format"], "x".join(str(v) for v in case["shape"]), str(case["rows"]),
            f"{ms['pagellm']:.2f}", *_ratio_cells(ms),
            "/".join(f"{err[n]:.0e}" for n in CONTENDERS),
        ])  # fmt: skip
    table += _totals(results["cases"])
    lines += ["", rep.format_table(headers, table),
              "(ratios: the contender's time over pagellm's; above 1: pagellm is faster)"]  # fmt: skip
    return "\n".join(lines)


def _totals(cases: list[dict[str, Any]]) -> list[list[str]]:
    """One row per format and row count: the shapes' times summed (a model's linear layers)."""
    sums: dict[tuple[str, int], dict[str, float]] = {}
    for case in cases:
        acc = sums.setdefault((case["format"], case["rows"]), dict.fromkeys(CONTENDERS, 0.0))
        for name in CONTENDERS:
            acc[name] += case["ms"][name]
    rows = []
    for (fmt, m), ms in sums.items():
        rows.append([fmt, "all", str(m), f"{ms['pagellm']:.2f}", *_ratio_cells(ms), ""])
    return rows


def _ratio_cells(ms: dict[str, float]) -> list[str]:
    """Each of RATIOS' times with its ratio to pagellm's (bound) time."""
    return [f"{ms[n]:.2f} ({ms[n] / ms['pagellm']:.2f}x)" for n in RATIOS]
