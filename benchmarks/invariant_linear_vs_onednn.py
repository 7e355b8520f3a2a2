"""The batch-invariant linear kernel against torch's oneDNN GEMM (a weight pre-packed for it, as
pagellm's default bf16 path) over SmolLM2-135M's shapes, per number of rows: milliseconds per
call of each bf16 path this CPU has, summed over one layer's four projections and the LM head.

    python benchmarks/invariant_linear_vs_onednn.py --output-json results/invariant_linear.json
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python benchmarks/invariant_linear_vs_onednn.py
        # oneDNN without AMX: what a Zen 4 / Zen 5 runs, next to the AVX-512 BF16 path
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from pagellm.bench import report as rep
from pagellm.kernels.invariant_linear import PATH_NAMES, load_invariant_linear_kernel, pack_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}  # fmt: skip


def timed(fn, budget_s: float = 0.3) -> float:
    """Milliseconds per call: the median of five timings of enough calls to fill the budget."""
    fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-6)
    reps = max(1, int(budget_s / 5 / once))
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - start) / reps * 1e3)
    return sorted(samples)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,256,2048")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    best = load_invariant_linear_kernel()
    if best is None:
        raise SystemExit("the kernel did not build (no C++ compiler?)")
    kernels = {PATH_NAMES[p]: load_invariant_linear_kernel(p) for p in range(best.path + 1)}
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(n, k, generator=gen).bfloat16() for name, (n, k) in SHAPES.items()}
    onednn = {name: torch.ops.mkldnn._reorder_linear_weight(w, 256) for name, w in weights.items()}
    packed = {name: pack_weight(w) for name, w in weights.items()}
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        row = {"rows": m, "oneDNN": 0.0, **{name: 0.0 for name in kernels}}
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], generator=gen).bfloat16()
            row["oneDNN"] += timed(
                lambda x=x, p=onednn[name]: torch.ops.mkldnn._linear_pointwise(
                    x, p, None, "none", [], ""
                )
            )
            for kname, kernel in kernels.items():
                row[kname] += timed(lambda x=x, k=kernel, p=packed[name]: k(x, p))
        results.append(row)
    env = {**rep.environment(), "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA")}
    headers = [
        "rows",
        "oneDNN ms",
        *(f"{k} ms" for k in kernels),
        *(f"oneDNN/{k}" for k in kernels),
    ]
    table = [[str(r["rows"]), f"{r['oneDNN']:.2f}", *(f"{r[k]:.2f}" for k in kernels),
              *(f"{r['oneDNN'] / r[k]:.2f}" for k in kernels)] for r in results]  # fmt: skip
    print("bf16 linear, one layer's projections + LM head, ms per step")
    print(rep.cpu_line(env) + (f"; ONEDNN_MAX_CPU_ISA={env['onednn_max_cpu_isa']}"
                               if env["onednn_max_cpu_isa"] else ""))  # fmt: skip
    print(rep.format_table(headers, table))
    if args.output_json:
        os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump({"environment": env, "shapes": SHAPES, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
